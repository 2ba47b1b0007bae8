"""Weight-space augmentation for training metanetworks: small changes to a model's weights that
should barely change what a predictor says about it.

``perturb_weights`` adds Gaussian noise scaled per operation (a fraction of the spread of that
operation's weights; per neuron layer for biases) and drops whole edges (their kernel set to 0)
with a small probability. Operations whose weights have no spread (residual identities, layer
scale of ones) are structure, not values, and are left alone, as are the zero-padded entries of
kernel frames. ``augmenter`` turns it into a ``GraphStream`` augment, composable with a rescaling.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from pipeline.neural_graph.graph import NeuralGraph

Augment = Callable[[NeuralGraph, list, np.random.Generator], NeuralGraph]


def perturb_weights(graph: NeuralGraph, rng: np.random.Generator, noise: float = 0.0,
                    dropout: float = 0.0) -> NeuralGraph:
    """A copy of ``graph`` with noise N(0, (noise * sd)^2) on each operation's live weights and each
    layer's biases (sd: their spread in this graph), and each edge of an operation zeroed with
    probability ``dropout``."""
    if noise < 0 or not 0 <= dropout < 1:
        raise ValueError(f"weight noise must be >= 0 and dropout in [0, 1), got {noise} and {dropout}")
    weight = graph.weight.copy()
    bias = graph.bias.copy()
    for i in np.unique(graph.edge_op):
        e = np.flatnonzero(graph.edge_op == i)
        block = weight[e]
        live = (block != 0).any(0)                  # frame entries the kernel occupies
        sd = float(block[:, live].std()) if live.any() else 0.0
        if sd == 0.0:
            continue
        if noise:
            block[:, live] += (noise * sd * rng.standard_normal((len(e), int(live.sum())))).astype(block.dtype)
        if dropout:
            block[rng.random(len(e)) < dropout] = 0.0
        weight[e] = block
    if noise:
        for layer in np.unique(graph.node_layer):
            n = np.flatnonzero(graph.node_layer == layer)
            sd = float(bias[n].std())
            if sd > 0:
                bias[n] += (noise * sd * rng.standard_normal(len(n))).astype(bias.dtype)
    return dataclasses.replace(graph, weight=weight, bias=bias)


def augmenter(*augments: Augment | None, noise: float = 0.0, dropout: float = 0.0) -> Augment | None:
    """One GraphStream augment: ``augments`` in order (None skipped), then weight noise / dropout
    when either is > 0; None when there is nothing to do."""
    chain = [a for a in augments if a is not None]
    if noise or dropout:
        chain.append(lambda graph, steps, rng: perturb_weights(graph, rng, noise, dropout))
    if not chain:
        return None

    def augment(graph: NeuralGraph, steps: list, rng: np.random.Generator) -> NeuralGraph:
        for a in chain:
            graph = a(graph, steps, rng)
        return graph
    return augment
