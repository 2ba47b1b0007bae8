"""The metanetworks a run can train (jobs.predictors' ``metanetwork`` entries), by the name
recorded in its manifest (``metanet.json``).

Both read the same batched DGL heterographs and share node/edge encodings, readout and head:
``ngnn`` propagates with relational PNA message passing (jobs.metanets.ngnn), ``ngt`` with relational
attention (jobs.metanets.ngt). A saved run names its metanetwork in ``model.kind``; runs saved before the
name was recorded are NG-GNN.

Adding a metanetwork is one module (a subclass of ``jobs.metanets.ngnn.NGGNN`` that overrides
``propagate``, as NG-T does) and one entry in jobs.predictors.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from jobs.predictors import PREDICTORS, predictor_class

if TYPE_CHECKING:
    from jobs.metanets.ngnn import NGGNN, NGGNNConfig

METANETWORKS = {n: e.path for n, e in PREDICTORS.items() if e.family == "metanetwork"}


def metanetwork_class(kind: str) -> type:
    """The class registered under ``kind``."""
    if kind not in METANETWORKS:
        raise ValueError(f"unknown metanetwork {kind!r}; known: {', '.join(METANETWORKS)}")
    return predictor_class(kind)


def build_metanetwork(cfg: "NGGNNConfig") -> "NGGNN":
    """A fresh metanetwork of kind ``cfg.kind``."""
    return metanetwork_class(cfg.kind)(cfg)
