"""The metanetworks a run can train, by the name recorded in its manifest (``metanet.json``).

Both read the same batched DGL heterographs and share node/edge encodings, readout and head:
``ngnn`` propagates with relational PNA message passing (jobs.ngnn), ``ngt`` with relational
attention (jobs.ngt). A saved run names its metanetwork in ``model.kind``; runs saved before the
name was recorded are NG-GNN.
"""
from __future__ import annotations

from jobs.ngnn import NGGNN, NGGNNConfig
from jobs.ngt import NGT

METANETWORKS = {"ngnn": NGGNN, "ngt": NGT}


def build_metanetwork(cfg: NGGNNConfig) -> NGGNN:
    """A fresh metanetwork of kind ``cfg.kind``."""
    try:
        cls = METANETWORKS[cfg.kind]
    except KeyError:
        raise ValueError(f"unknown metanetwork {cfg.kind!r}; known: {', '.join(METANETWORKS)}") from None
    return cls(cfg)
