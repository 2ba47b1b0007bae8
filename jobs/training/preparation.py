"""What graphs go through before a metanetwork reads them: batch norms as the affine maps they
compute, scale canonicalisation (or balancing), signed-log values, and the training-only changes (rescaling, noise, dropout).
"""
from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections import OrderedDict

import numpy as np

from jobs.config import DataConfig
from jobs.training.data import cache_size
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


class _Memo:
    """Symmetry-removed graphs already computed in this process, by (kind, content digest), least
    recently used first out past ``budget`` bytes. A run reads each model's balanced graph for the
    layer statistics, the stream and the blend's StatNN, and its rescaled test copies twice more
    (metanetwork and StatNN): balancing a ResNet-18 graph takes about two seconds, hashing it a fraction of
    a second. The graphs are deterministic functions of their content, and no caller changes the
    arrays of a graph it is given."""

    def __init__(self, budget: int = 1 << 30):
        self.budget, self.used = budget, 0
        self.items: OrderedDict = OrderedDict()
        self.lock = threading.Lock()

    @staticmethod
    def digest(graph) -> bytes:
        h = hashlib.blake2b(digest_size=20)
        for a in (graph.weight, graph.bias, graph.extra, graph.src, graph.dst, graph.relation, graph.edge_op,
                  graph.node_layer, graph.node_type):
            h.update(str(a.shape).encode())
            h.update(np.ascontiguousarray(a).data)
        h.update(repr((graph.layer_activation, graph.kernel_shape)).encode())
        return h.digest()

    def get(self, kind: str, graph, make):
        key = (kind, self.digest(graph))
        with self.lock:
            if key in self.items:
                self.items.move_to_end(key)
                return self.items[key][0]
        out = make()
        size = cache_size(out)
        with self.lock:
            if key not in self.items and size <= self.budget:
                self.items[key] = (out, size)
                self.used += size
                while self.used > self.budget:
                    _, (_, freed) = self.items.popitem(last=False)
                    self.used -= freed
        return out


_MEMO = _Memo()


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
            graph = _MEMO.get("balanced", graph, lambda: balanced_graph(graph, steps))
        elif canonical:
            graph = _MEMO.get("canonical", graph, lambda: canonical_graph(graph, steps))
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
    True}`` or ``{"canonical": True}``), or None; the blend's statistics and the trust profile read
    their graphs after it. ``cfg``: a DataConfig, or a saved run's ``train`` dict."""
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=False: getattr(cfg, k)
    if get("balanced", False):
        return {"balanced": True}
    return {"canonical": True} if get("canonical", False) else None


def prepared_graphs(con, model_ids, graphs, flags) -> list:
    """In-memory graphs of catalog models (e.g. rescaled copies) through the preparation ``flags``
    (a dict of preparation flags, a DataConfig, or a saved run's ``train`` dict)."""
    from pipeline.graph_codec import read_plans

    prepare = run_preparation(flags)
    if prepare is None:
        return list(graphs)
    arch, plans = read_plans(con, list(model_ids))
    return [prepare(g, plans[arch[m]].steps) for m, g in zip(model_ids, graphs)]


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
