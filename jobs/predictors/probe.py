"""The ``probe`` predictor: what a network answers on fixed probe inputs, into a tuned learner.

Every model runs through its own checked program on the same ``DEFAULT_PROBES`` (64) fixed probes
of its input's shape (jobs.analysis.probing: N(0, 1) values, or uniform token ids), no weight read.
Its features are the eight summaries of its answers that do not depend on which output is which
(``probing.output_summaries``: softmax entropy, top probability, spread across probes, the share
of the modal answer, ...), each output's mean and spread over the probes, then the first 16
probes' answers one by one (models with fewer outputs than the training models' most common
count are padded with NaN, more are cut). On the development wild CNN zoo (seed 3, 500 training
models, 3 folds) every probe's answers one by one (648 columns) were 0.004 of tau ahead of these
188 on average, inside the folds' spread, at four times the fitting time. Gradient boosting reads them, its hyperparameters chosen on validation, as every tabular
predictor's (jobs.predictors.tabular). As cheap as StatNN: one forward pass of 64 inputs per model,
each model's answers cached for the process.

Why: vanilla probing is a strong accuracy predictor on zoos of varied architectures (ProbeGen,
Kahana et al., ICLR 2025; an independent baseline on this project's held-out wild CNN zoo was
0.07 ahead of NG-GNN, issue #54): what a network computes is the signal no statistic of its
weights sees. Data-free: the probes are noise, not the zoo's data.

``probe_data`` is the same predictor on unlabelled training inputs of each model's data set
(``Prober(inputs="data")``): never fitted beside a run, only when asked for (``--model
probe_data``), and its predictions are then not from the network alone.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from jobs.analysis.probing import DEFAULT_PROBES, PROBE_SEED, Prober, output_summaries
from jobs.predictors.tabular import TabularPredictor
from jobs.training.data import Selection
from zoocore.errors import JobError

SUMMARIES = 8
ANSWERED = 16          # probes whose answers are features one by one (all of them feed the summaries)


class Probe(TabularPredictor):
    """Fixed probes' answers and their summaries into gradient boosting (see the module)."""
    name = "probe"
    probes = DEFAULT_PROBES
    inputs = "noise"

    def _prober(self, con) -> Prober:
        s = self.settings
        return Prober(con, int(s["probes"]), int(s["seed"]), inputs=s.get("inputs", "noise"))

    def settle(self, con, sel: Selection) -> dict:
        outs, reasons = Prober(con, self.probes, PROBE_SEED, inputs=self.inputs).outputs(sel.ids("train"))
        widths = [o.shape[1] for o in outs if o is not None]
        if not widths:
            raise JobError(f"{self.name}: no training model can be probed ({'; '.join(reasons[:2]) or 'none given'})")
        width = int(np.bincount(widths).argmax())
        return {"probes": self.probes, "seed": PROBE_SEED, "width": width, "inputs": self.inputs}

    def features(self, con, model_ids: Sequence[str], blocks=None) -> tuple[np.ndarray, np.ndarray]:
        n, width = int(self.settings["probes"]), int(self.settings["width"])
        outs, self.unreadable = self._prober(con).outputs(list(model_ids))
        return self._rows(outs, n, width), np.array([o is not None for o in outs], bool)

    def features_of_graphs(self, con, model_ids, graphs) -> np.ndarray:
        """The features of in-memory graphs of ``model_ids`` (e.g. rescaled copies), each run through
        its model's program: a function-preserving copy gets the model's own answers."""
        n, width = int(self.settings["probes"]), int(self.settings["width"])
        prober = self._prober(con)
        return self._rows([prober.run(m, g).outputs for m, g in zip(model_ids, graphs)], n, width)

    def _rows(self, outs, n: int, width: int) -> np.ndarray:
        """Per model: the summaries, each output's mean and spread over all probes, then the first
        ``ANSWERED`` probes' answers (NaN past the model's own outputs)."""
        shown = min(n, ANSWERED)
        x = np.full((len(outs), SUMMARIES + 2 * width + shown * width), np.nan)
        for i, o in enumerate(outs):
            if o is None:
                continue
            k = min(width, o.shape[1])
            answers = np.full((n, width), np.nan)
            answers[:, :k] = o[:, :k]
            x[i, :SUMMARIES] = output_summaries(o)
            x[i, SUMMARIES:SUMMARIES + width] = answers.mean(0)
            x[i, SUMMARIES + width:SUMMARIES + 2 * width] = answers.std(0)
            x[i, SUMMARIES + 2 * width:] = answers[:shown].reshape(-1)
        return x

    def note(self) -> str:
        kind = "unlabelled data" if self.settings.get("inputs") == "data" else "fixed"
        return f"{self.settings.get('probes')} {kind} probes; " + super().note()


class ProbeData(Probe):
    """``probe`` on unlabelled training inputs of each model's data set (see the module)."""
    name = "probe_data"
    inputs = "data"


__all__ = ["Probe", "ProbeData"]
