"""What graphs go through before a metanetwork reads them: batch norms as the affine maps they
compute, scale canonicalisation (or balancing), signed-log values, and the training-only changes (rescaling, noise, dropout).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jobs.config import DataConfig
from jobs.training.augment import augmenter


def canonical_graph(graph, steps):
    """The scale canonicalisation of a graph (``pipeline.neural_graph.symmetry.canonical_scaling``)."""
    from pipeline.neural_graph.symmetry import canonical_scaling

    return canonical_scaling(graph, steps)[0]


def compressed(graph):
    """The graph with every weight and bias ``w`` as ``sign(w) log(1 + |w|)`` (order kept, tails shortened)."""
    def slog(a):
        return (np.sign(a) * np.log1p(np.abs(a))).astype(a.dtype)
    return dataclasses.replace(graph, weight=slog(graph.weight), bias=slog(graph.bias))


def balanced_graph(graph, steps):
    """The balanced representative of a graph's rescaling orbit (``pipeline.neural_graph.symmetry.balanced_scaling``)."""
    from pipeline.neural_graph.symmetry import balanced_scaling

    return balanced_scaling(graph, steps)


def preparation(canonical: bool = False, bn_stats: bool = False, compress: bool = False, balanced: bool = False):
    """The GraphStream ``prepare`` a run's graphs get (None: none): the scale canonicalisation (or the
    balanced representative, which starts from it), then batch norms as their evaluation-time affine
    maps (pipeline.neural_graph.norm_stats), in that order because the canonicalisation moves
    factors through batch norm's running statistics; then, with ``compress``, signed-log values."""
    if not (canonical or bn_stats or compress or balanced):
        return None
    from pipeline.neural_graph.norm_stats import effective_batch_norms

    def prepare(graph, steps):
        if balanced:
            graph = balanced_graph(graph, steps)
        elif canonical:
            graph = canonical_graph(graph, steps)
        if bn_stats:
            graph = effective_batch_norms(graph)
        return compressed(graph) if compress else graph
    return prepare


def run_preparation(cfg) -> object:
    """The ``prepare`` of a run's configuration (a DataConfig, or a saved run's ``train`` dict)."""
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=False: getattr(cfg, k)
    return preparation(get("canonical", False), get("bn_stats", False), get("compress", False),
                       get("balanced", False))


def symmetry_preparation(cfg) -> dict | None:
    """The part of a run's preparation that removes rescaling and sign symmetries (``{"balanced":
    True}`` or ``{"canonical": True}``), or None; the blend's statistics read their graphs after it."""
    if cfg.balanced:
        return {"balanced": True}
    return {"canonical": True} if cfg.canonical else None


def training_changes(cfg: DataConfig):
    """(prepare, augment) of the training stream: augment is None when the run has no augmentation
    (training then reads the same graphs as validation). Rescalings act on the checkpoint's own
    parameters (batch norm's gamma and running statistics), so with augmentation the batch norms
    become their affine maps last, after each rescaling and noise draw, not once on reading."""
    augment = augmenter(rescaler(cfg.scale_augment) if cfg.scale_augment else None,
                        noise=cfg.weight_noise, dropout=cfg.weight_dropout)
    if augment is None:
        return run_preparation(cfg), None
    if cfg.bn_stats:
        from pipeline.neural_graph.norm_stats import effective_batch_norms

        augment = augmenter(augment, lambda graph, steps, rng: effective_batch_norms(graph))
    if cfg.compress:
        augment = augmenter(augment, lambda graph, steps, rng: compressed(graph))
    return preparation(cfg.canonical, balanced=cfg.balanced), augment


def rescaler(max_scale: float):
    """An ``augment`` for GraphStream: a random function-preserving rescaling (and sign flip where the
    activation allows it) of every hidden neuron, magnitudes U[1, max_scale]."""
    from pipeline.neural_graph.symmetry import random_rescaling

    def augment(graph, steps, rng):
        return random_rescaling(graph, rng, max_scale, steps=steps)
    return augment


def read_prepared(con, ids, prepare=None, chunk: int = 256) -> list:
    """The NeuralGraphs of ``ids`` from the catalog, with ``prepare(graph, steps)`` applied."""
    from pipeline.graph_codec import read_graphs, read_plans

    arch, plans = read_plans(con, ids)
    out = []
    for start in range(0, len(ids), chunk):
        part = list(ids[start:start + chunk])
        graphs = read_graphs(con, part, plans=plans)
        out += graphs if prepare is None else [prepare(g, plans[arch[m]].steps) for m, g in zip(part, graphs)]
    return out
