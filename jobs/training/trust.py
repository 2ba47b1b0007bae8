"""A trust signal for predictions: does an input's per-layer weight scale look like the training
models'?

A network can be rewritten without changing its function: each hidden ReLU neuron's incoming
weights multiplied by ``a``, its outgoing ones divided by ``a`` (weight normalisation, batch-norm
folding, pruning and merging tools and some export conventions all do this). A predictor trained
on one zoo has never seen such inputs and may be far off on them. The *scale profile* of a model
says where it sits: for the first, the middle and the last hidden layer, the mean and the spread
across neurons of ``log10(incoming weight norm / outgoing weight norm)``. A run saves the
envelope of the training models' profiles (``TrustProfile``); ``jobs predict`` flags an input
whose profile lies outside (``in_distribution = false`` in ``predictions``, and one warning
line naming how many).

A run whose metanetwork reads balanced (or canonical) graphs predicts the same for every
rescaling of a network, so a rescaled copy is no reason to doubt it: its profile is read from the
graphs the run reads (``TrustProfile.prepare``), where the log ratios are those of the orbit's
representative, and the per-layer log norms (the geometric mean of each neuron's incoming and
outgoing norm) say whether the network's weights are as large as the training models'.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from pipeline.neural_graph.vocabulary import NODE_TYPES, RELATIONS, UNIT_RELATIONS

SLOTS = ("first", "middle", "last")
FEATURES = ([f"{slot}_{stat}" for slot in SLOTS for stat in ("mean_log_ratio", "spread_log_ratio")]
            + [f"{slot}_{stat}" for slot in SLOTS for stat in ("mean_log_norm", "spread_log_norm")])


def scale_profile(graph) -> np.ndarray:
    """(len(FEATURES),) the model's scale profile: for its first, middle (mean) and last hidden neuron
    layer, the mean and the spread across neurons of ``log10(incoming norm / outgoing norm)``, then
    of ``log10 sqrt(incoming norm * outgoing norm)`` (NaN where it has no such layer). Rescaling a
    neuron by ``a`` moves its log ratio by ``2 log10 a``; training leaves the two norms close
    (gradient descent keeps their squared difference nearly where initialisation put it)."""
    unit = np.isin(graph.relation, [RELATIONS.index(r) for r in UNIT_RELATIONS])
    sq = np.where(unit, 0.0, np.square(graph.weight.astype(np.float64)).sum(1))
    n = len(graph.node_type)
    inc = np.sqrt(np.bincount(graph.dst, weights=sq, minlength=n))
    out = np.sqrt(np.bincount(graph.src, weights=sq, minlength=n))
    hidden = (graph.node_type == NODE_TYPES.index("hidden")) & (inc > 0) & (out > 0)
    li, lo = np.log10(inc[hidden]), np.log10(out[hidden])
    layers = graph.node_layer[hidden]
    return np.concatenate([_by_slot(li - lo, layers), _by_slot((li + lo) / 2, layers)])


def _by_slot(values: np.ndarray, layers: np.ndarray) -> np.ndarray:
    """(2 * len(SLOTS),) mean and spread of ``values`` in the first, middle (mean) and last layer."""
    per_layer = [(float(values[layers == k].mean()), float(values[layers == k].std())) for k in np.unique(layers)]
    prof = np.full((len(SLOTS), 2), np.nan)
    if per_layer:
        prof[0], prof[2] = per_layer[0], per_layer[-1]
        if len(per_layer) > 2:
            prof[1] = np.mean(per_layer[1:-1], axis=0)
    return prof.ravel()


def scale_profiles(graphs: Sequence) -> np.ndarray:
    return np.array([scale_profile(g) for g in graphs]).reshape(len(graphs), len(FEATURES))


@dataclass
class TrustProfile:
    """The training models' scale profiles as an envelope per feature: from the 0.5% quantile minus
    half the inter-quantile width to the 99.5% quantile plus half of it. An input with a feature
    outside is flagged. On the development zoos (3 folds each, ``cnn`` and ``cnn-fixed``) this
    flagged 0-2.5% of clean test models, 89-100% of their copies rescaled by U[1, 1000] and 0-9%
    of those rescaled by U[1, 10] (docs/metanetworks.md). ``prepare``: the symmetry preparation
    (``{"balanced": True}``...) the profiles are read after, that of the run's metanetwork; runs
    saved before the log-norm features judge by the features they saved."""
    low: list[float]
    high: list[float]
    features: list[str] = field(default_factory=lambda: list(FEATURES))
    prepare: dict | None = None

    QUANTILE = 0.5                     # percent, each side
    MARGIN = 0.5                       # of the inter-quantile width, each side
    FLOOR = 0.05                       # log10 units, each side: balanced log ratios are all ~0

    @classmethod
    def fit(cls, profiles: np.ndarray, prepare: dict | None = None) -> "TrustProfile":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)       # a feature no training model has
            lo = np.nanpercentile(profiles, cls.QUANTILE, 0)
            hi = np.nanpercentile(profiles, 100 - cls.QUANTILE, 0)
        pad = np.maximum(cls.MARGIN * (hi - lo), cls.FLOOR)
        return cls([_num(v) for v in lo - pad], [_num(v) for v in hi + pad],
                   prepare=dict(prepare) if prepare else None)

    @classmethod
    def of_catalog(cls, con, model_ids: Sequence[str], prepare: dict | None = None) -> "TrustProfile":
        """The envelope of these catalog models' profiles, read after ``prepare``."""
        return cls.fit(profiles_of(con, model_ids, prepare), prepare)

    @classmethod
    def judged(cls, con, model_ids: Sequence[str], train: np.ndarray,
               prepare: dict | None = None) -> tuple["TrustProfile", np.ndarray]:
        """The envelope of the models ``train`` marks among ``model_ids``, and its judgement of every
        one of them: each model's profile read once."""
        profiles = profiles_of(con, model_ids, prepare)
        profile = cls.fit(profiles[np.asarray(train, bool)], prepare)
        return profile, profile.in_distribution(profiles)

    def in_distribution(self, profiles: np.ndarray) -> np.ndarray:
        """(n,) bool: every feature the input and the training models have lies inside the envelope
        (``profiles``: rows of every one of FEATURES, as scale_profiles gives them)."""
        p = np.asarray(profiles, float).reshape(-1, len(FEATURES))[:, [FEATURES.index(f) for f in self.features]]
        lo, hi = np.array(self.low, float), np.array(self.high, float)
        with np.errstate(invalid="ignore"):
            outside = (p < lo) | (p > hi)          # NaN on either side compares False: no evidence
        return ~outside.any(1)

    def judge_catalog(self, con, model_ids: Sequence[str]) -> np.ndarray:
        """(n,) bool: catalog models inside the envelope, read as the training models were."""
        return self.in_distribution(profiles_of(con, model_ids, self.prepare))

    def judge_graphs(self, con, model_ids: Sequence[str], graphs: Sequence) -> np.ndarray:
        """(n,) bool: in-memory graphs of ``model_ids`` (e.g. rescaled copies) inside the envelope."""
        if self.prepare:
            from jobs.training.preparation import prepared_graphs

            graphs = prepared_graphs(con, model_ids, graphs, self.prepare)
        return self.in_distribution(scale_profiles(graphs))

    def to_dict(self) -> dict:
        return {"features": list(self.features), "low": self.low, "high": self.high,
                **({"prepare": self.prepare} if self.prepare else {})}

    @classmethod
    def from_dict(cls, d: dict) -> "TrustProfile":
        features = list(d.get("features", []))
        if not features or set(features) - set(FEATURES) or len(d["low"]) != len(features):
            raise ValueError("a scale profile of other features")
        return cls([float(v) for v in d["low"]], [float(v) for v in d["high"]], features, d.get("prepare") or None)


def _num(v: float) -> float:
    return float(v) if np.isfinite(v) else float("nan")


def warning_line(flags: np.ndarray) -> str | None:
    """One line naming how many inputs lie outside the training distribution, or None."""
    n = int((~flags).sum())
    if not n:
        return None
    return (f"warning: {n} of {len(flags)} models lie outside the training models' per-layer weight scales "
            "(a rescaled copy, another export convention?): their predictions have in_distribution = false")


def profiles_of(con, model_ids: Sequence[str], prepare: dict | None = None, chunk: int = 256) -> np.ndarray:
    """The scale profiles of catalog models, read ``chunk`` graphs at a time, after the preparation
    ``prepare`` (flags, e.g. ``{"balanced": True}``; None: the checkpoints' own weights)."""
    from jobs.training.preparation import read_prepared, run_preparation

    ids = list(model_ids)
    step = run_preparation(prepare) if prepare else None
    parts = [scale_profiles(read_prepared(con, ids[i:i + chunk], step)) for i in range(0, len(ids), chunk)]
    return np.concatenate(parts) if parts else np.zeros((0, len(FEATURES)))
