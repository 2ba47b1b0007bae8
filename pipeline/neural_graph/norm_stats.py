"""Batch norm as the affine map it computes at evaluation: running statistics into edges and biases.

A batch-norm neuron stores gamma on its diagonal edge, beta as its bias and the running mean and
variance as node extras, which metanetworks do not read. At evaluation it computes
``a * x + c`` with ``a = gamma / sqrt(var + eps)`` and ``c = beta - a * mean``. ``effective_batch_norms``
rewrites each batch-norm neuron so that its edge holds ``a`` and its bias ``c``: the same function,
with the running statistics reaching the features every metanetwork reads.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from pipeline.neural_graph.graph import NeuralGraph


def effective_batch_norms(graph: NeuralGraph, steps=None) -> NeuralGraph:
    """``graph`` with every batch-norm edge scaled by ``1 / sqrt(var + eps)`` and every batch-norm
    bias replaced by ``beta - a * mean``; the extras are kept (they are what the edges now include).
    ``steps`` is accepted so this can be a GraphStream ``prepare``."""
    weight = graph.weight.astype(np.float64)
    bias = graph.bias.astype(np.float64)
    for i, op in enumerate(graph.ops):
        if not op.running_stats:
            continue
        e = np.flatnonzero(graph.edge_op == i)
        dst = graph.dst[e]
        mean, var = graph.extra[dst, 0].astype(np.float64), graph.extra[dst, 1].astype(np.float64)
        if not (np.isfinite(mean).all() and np.isfinite(var).all()):
            continue                           # no running statistics (track_running_stats=False)
        inv = 1.0 / np.sqrt(var + float(op.get("eps", 1e-5)))
        weight[e] *= inv[:, None]
        bias[dst] = bias[dst] - weight[e].sum(1) * mean
    return dataclasses.replace(graph, weight=weight.astype(np.float32), bias=bias.astype(np.float32))
