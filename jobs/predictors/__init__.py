"""Everything that maps a model to a prediction, by the name a run records (``runs.method``).

- ``metanetwork``: trained on streamed neural graphs by jobs.training.train (jobs.metanets builds them).
- ``tabular``: one feature row per model into a learner tuned on validation (jobs.predictors.tabular).
- ``weightspace``: a network trained on the weights of one parameter shape (jobs.predictors.nfn;
  the optional extra ``peers``).
- ``function``: a network trained on what the models compute, each run through its own checked
  program on learned probes (jobs.predictors.probegen).

The tabular and weight-space ones share one interface: ``fit(con, sel)``, ``predict(con, ids)``,
``save()`` / ``load(state, arrays)`` (JSON plus safetensors, nothing pickled).
``jobs train-heterognn --model NAME`` trains any of them as the run's answer; the tabular ones
also run beside every metanetwork as its baselines; ``jobs predict`` rebuilds any of them from
the run; ``benchmarks/bench_accuracy.py`` iterates over this table. Adding a predictor is one
class and one entry here. Entries name ``module:class`` so that listing them imports neither
torch nor DGL (the CLI reads the names).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    family: str          # metanetwork | tabular | weightspace | function
    path: str            # module:class
    summary: str         # one line for --help
    stack: bool = False  # a blend partner: the mean of these (those not collapsed on val) joins a metanetwork's answer
    reads: str = "weights"   # weights: statistics of the weights | function: what the network computes on probes |
    #                          data: what it computes on unlabelled inputs of its data set (fitted only when asked for)


PREDICTORS = {
    "ngnn": Entry("metanetwork", "jobs.metanets.ngnn:NGGNN", "NG-GNN: relational PNA message passing on the neural graph"),
    "ngt": Entry("metanetwork", "jobs.metanets.ngt:NGT", "NG-T: a relational-attention transformer on the neural graph"),
    "statnn": Entry("tabular", "jobs.predictors.tabular:StatNN", "StatNN: weight statistics into gradient boosting",
                    stack=True),
    "statnn_mlp": Entry("tabular", "jobs.predictors.tabular:StatNNMLP", "StatNN: weight statistics into an MLP", stack=True),
    "statnn_spectral": Entry("tabular", "jobs.predictors.tabular:SpectralStatNN",
                             "StatNN plus each weight matrix's spectral descriptors into gradient boosting", stack=True),
    "probe": Entry("tabular", "jobs.predictors.probe:Probe",
                   "each model's answers on 64 fixed probe inputs (run through its program) into gradient boosting",
                   stack=True, reads="function"),
    "probe_data": Entry("tabular", "jobs.predictors.probe:ProbeData",
                        "probe on unlabelled inputs of each model's data set (not data-free; only when asked for)",
                        reads="data"),
    "flat_mlp": Entry("tabular", "jobs.predictors.tabular:FlatMLP", "an MLP on all weights (one parameter shape only)"),
    "statnn_ridge": Entry("tabular", "jobs.predictors.statnn_ridge:StatNNRidge", "StatNN: weight statistics into ridge regression"),
    "probegen": Entry("function", "jobs.predictors.probegen:ProbeGen",
                      "ProbeGen: learned probes from a shared deep linear generator, answers into an MLP",
                      stack=True, reads="function"),
    "nfn_np": Entry("weightspace", "jobs.predictors.nfn:NFNNP", "NFN with NP layers (one parameter shape; extra 'peers')"),
    "nfn_hnp": Entry("weightspace", "jobs.predictors.nfn:NFNHNP", "NFN with HNP layers (one parameter shape; extra 'peers')"),
}


def names(family: str | None = None) -> list[str]:
    """The registered names (of one family)."""
    return [n for n, e in PREDICTORS.items() if family is None or e.family == family]


def entry(name: str) -> Entry:
    try:
        return PREDICTORS[name]
    except KeyError:
        raise ValueError(f"unknown predictor {name!r}; known: {', '.join(PREDICTORS)}") from None


def predictor_class(name: str) -> type:
    """The class registered under ``name``."""
    module, cls = entry(name).path.split(":")
    return getattr(importlib.import_module(module), cls)


def fitted_predictor(name: str, seed: int = 0):
    """A fresh, unfitted predictor that is fitted on a split (a tabular or weight-space one)."""
    if entry(name).family == "metanetwork":
        raise ValueError(f"{name!r} is a metanetwork, not a predictor fitted on a split")
    return predictor_class(name)(seed)


def baseline_names() -> list[str]:
    """What a run fits beside its own predictor: every tabular predictor, and every other blend
    partner (the probing ones read the models' function, not a feature table); nothing that reads
    the zoo's data (data-free by default)."""
    return [n for n, e in PREDICTORS.items()
            if e.reads != "data" and (e.family == "tabular" or (e.stack and e.family != "metanetwork"))]


def answer_name(metanetwork: str) -> str:
    """The name of a run's answer when every blend partner is a candidate: the metanetwork and the
    partners, in registry order (jobs.predictors.stacking.Stack.name)."""
    return "+".join([metanetwork, *(n for n, e in PREDICTORS.items() if e.stack)])


def help_text() -> str:
    """One line per predictor, for --model's help."""
    return "; ".join(f"{n}: {e.summary}" for n, e in PREDICTORS.items())
