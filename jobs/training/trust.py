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
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pipeline.neural_graph.vocabulary import NODE_TYPES, RELATIONS, UNIT_RELATIONS

SLOTS = ("first", "middle", "last")
FEATURES = [f"{slot}_{stat}" for slot in SLOTS for stat in ("mean_log_ratio", "spread_log_ratio")]


def scale_profile(graph) -> np.ndarray:
    """(len(FEATURES),) the model's scale profile: for its first, middle (mean) and last hidden neuron
    layer, the mean and the spread across neurons of ``log10(incoming norm / outgoing norm)``
    (NaN where it has no such layer). Rescaling a neuron by ``a`` moves its log ratio by
    ``2 log10 a``; training leaves the two norms close (gradient descent keeps their squared
    difference nearly where initialisation put it)."""
    unit = np.isin(graph.relation, [RELATIONS.index(r) for r in UNIT_RELATIONS])
    sq = np.where(unit, 0.0, np.square(graph.weight.astype(np.float64)).sum(1))
    n = len(graph.node_type)
    inc = np.sqrt(np.bincount(graph.dst, weights=sq, minlength=n))
    out = np.sqrt(np.bincount(graph.src, weights=sq, minlength=n))
    hidden = (graph.node_type == NODE_TYPES.index("hidden")) & (inc > 0) & (out > 0)
    ratio = np.log10(inc[hidden]) - np.log10(out[hidden])
    layers = graph.node_layer[hidden]
    per_layer = [(float(ratio[layers == k].mean()), float(ratio[layers == k].std())) for k in np.unique(layers)]
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
    of those rescaled by U[1, 10] (docs/metanetworks.md)."""
    low: list[float]
    high: list[float]

    QUANTILE = 0.5                     # percent, each side
    MARGIN = 0.5                       # of the inter-quantile width, each side

    @classmethod
    def fit(cls, profiles: np.ndarray) -> "TrustProfile":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)       # a feature no training model has
            lo = np.nanpercentile(profiles, cls.QUANTILE, 0)
            hi = np.nanpercentile(profiles, 100 - cls.QUANTILE, 0)
        width = hi - lo
        return cls([_num(v) for v in lo - cls.MARGIN * width], [_num(v) for v in hi + cls.MARGIN * width])

    def in_distribution(self, profiles: np.ndarray) -> np.ndarray:
        """(n,) bool: every feature the input and the training models have lies inside the envelope."""
        p = np.asarray(profiles, float).reshape(-1, len(FEATURES))
        lo, hi = np.array(self.low, float), np.array(self.high, float)
        with np.errstate(invalid="ignore"):
            outside = (p < lo) | (p > hi)          # NaN on either side compares False: no evidence
        return ~outside.any(1)

    def to_dict(self) -> dict:
        return {"features": FEATURES, "low": self.low, "high": self.high}

    @classmethod
    def from_dict(cls, d: dict) -> "TrustProfile":
        if list(d.get("features", [])) != FEATURES:
            raise ValueError("a scale profile of other features")
        return cls([float(v) for v in d["low"]], [float(v) for v in d["high"]])


def _num(v: float) -> float:
    return float(v) if np.isfinite(v) else float("nan")


def warning_line(flags: np.ndarray) -> str | None:
    """One line naming how many inputs lie outside the training distribution, or None."""
    n = int((~flags).sum())
    if not n:
        return None
    return (f"warning: {n} of {len(flags)} models lie outside the training models' per-layer weight scales "
            "(a rescaled copy, another export convention?): their predictions have in_distribution = false")


def profiles_of(con, model_ids: Sequence[str], chunk: int = 256) -> np.ndarray:
    """The scale profiles of catalog models, read ``chunk`` graphs at a time."""
    from pipeline.graph_codec import read_graphs

    ids = list(model_ids)
    parts = [scale_profiles(read_graphs(con, ids[i:i + chunk])) for i in range(0, len(ids), chunk)]
    return np.concatenate(parts) if parts else np.zeros((0, len(FEATURES)))
