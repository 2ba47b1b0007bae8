"""The metanetworks a run can train, by the name recorded in its manifest (``metanet.json``).

Both read the same batched DGL heterographs and share node/edge encodings, readout and head:
``ngnn`` propagates with relational PNA message passing (jobs.ngnn), ``ngt`` with relational
attention (jobs.ngt). A saved run names its metanetwork in ``model.kind``; runs saved before the
name was recorded are NG-GNN.

Adding a metanetwork is one module (a subclass of ``jobs.ngnn.NGGNN`` that overrides
``propagate``, as NG-T does) and one entry here; the CLI's ``--model`` choices are read from this
table. Entries name ``module:class`` so that listing them imports neither torch nor DGL.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jobs.ngnn import NGGNN, NGGNNConfig

METANETWORKS = {"ngnn": "jobs.ngnn:NGGNN", "ngt": "jobs.ngt:NGT"}
# what one NG-T attention softmax runs over (jobs.ngt): all edges, per direction, per edge type
ATTENTION_GROUPS = ("all", "direction", "relation")


def metanetwork_class(kind: str) -> type:
    """The class registered under ``kind``."""
    try:
        module, name = METANETWORKS[kind].split(":")
    except KeyError:
        raise ValueError(f"unknown metanetwork {kind!r}; known: {', '.join(METANETWORKS)}") from None
    return getattr(importlib.import_module(module), name)


def build_metanetwork(cfg: "NGGNNConfig") -> "NGGNN":
    """A fresh metanetwork of kind ``cfg.kind``."""
    return metanetwork_class(cfg.kind)(cfg)
