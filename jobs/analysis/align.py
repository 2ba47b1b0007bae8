"""Neuron alignment of two models of one architecture, on their neural graphs.

Hidden neurons can be permuted without changing the function, so two independently trained
networks are compared (and merged) only after B's neurons are put in A's order. Layers tied by
a norm, a residual or a depthwise conv move together (``pipeline.neural_graph.symmetry``); each
such class gets one permutation, found by a Hungarian assignment (scipy) on a similarity matrix:

- ``embeddings``: node embeddings of a trained NG-GNN (equivariant, so a permuted copy gets the
  permuted embeddings) compared by cosine;
- ``activations``: correlation of the neurons' responses to the same inputs (Ainsworth et al.
  2023, "Git Re-Basin", activation matching);
- ``weights``: weight matching (Git Re-Basin): coordinate ascent over the classes, each step
  maximising the inner product of A's weights with B's permuted weights given the other classes.

Every function returns a node permutation for B in ``NeuralGraph.permuted`` form (node i -> perm[i]).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
from scipy.optimize import linear_sum_assignment

from pipeline.neural_graph.graph import NeuralGraph
from pipeline.neural_graph.symmetry import tied_layer_classes
from zoocore.errors import JobError

METHODS = ("embeddings", "activations", "weights")


def permutable_classes(graph: NeuralGraph) -> dict[int, list[int]]:
    """Neuron-layer classes that share one free permutation: {representative: [layers]}."""
    reps, fixed = tied_layer_classes(graph)
    classes: dict[int, list[int]] = {}
    for layer, rep in enumerate(reps):
        if rep not in fixed:
            classes.setdefault(rep, []).append(layer)
    return classes


def check_same_architecture(a: NeuralGraph, b: NeuralGraph) -> None:
    if any(op.get("src_segments") is not None for op in a.ops):
        raise JobError("alignment covers operations that read one neuron layer each; this architecture "
                       "concatenates layers (torch.cat), which alignment does not handle yet")
    if (a.num_layers != b.num_layers or not np.array_equal(a.layer_sizes(), b.layer_sizes())
            or a.kernel_shape != b.kernel_shape or len(a.ops) != len(b.ops)
            or any(x["kind"] != y["kind"] or x["src_layer"] != y["src_layer"] or x["dst_layer"] != y["dst_layer"]
                   for x, y in zip(a.ops, b.ops))):
        raise JobError("the two models do not share one architecture; only such models can be aligned")


def node_permutation(graph: NeuralGraph, assignments: dict[int, np.ndarray]) -> np.ndarray:
    """B's node permutation from per-class assignments ``P`` (A's neuron i matches B's P[i])."""
    sizes, offsets = graph.layer_sizes(), graph.layer_offsets()
    perm = np.arange(graph.num_nodes)
    for rep, layers in permutable_classes(graph).items():
        p = assignments.get(rep)
        if p is None:
            continue
        for layer in layers:
            o = offsets[layer]
            perm[o + p] = o + np.arange(sizes[layer])
    return perm


def _hungarian(similarity: np.ndarray) -> np.ndarray:
    rows, cols = linear_sum_assignment(similarity, maximize=True)
    out = np.empty(similarity.shape[0], dtype=np.int64)
    out[rows] = cols
    return out


def match_features(graph: NeuralGraph, features: Callable[[int], tuple[np.ndarray, np.ndarray] | None]) -> np.ndarray:
    """Assign each class by the summed similarity of per-neuron feature vectors.

    Args:
        features: layer -> (A features (n, d), B features (n, d)) or None for a layer without any.
    """
    assignments = {}
    for rep, layers in permutable_classes(graph).items():
        sim = None
        for layer in layers:
            f = features(layer)
            if f is None:
                continue
            s = f[0] @ f[1].T
            sim = s if sim is None else sim + s
        if sim is not None:
            assignments[rep] = _hungarian(sim)
    return node_permutation(graph, assignments)


def _unit_rows(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def embedding_matching(graph: NeuralGraph, emb_a: np.ndarray, emb_b: np.ndarray) -> np.ndarray:
    """Match by cosine similarity of node embeddings (N, H), rows in graph node order."""
    offsets, sizes = graph.layer_offsets(), graph.layer_sizes()

    def features(layer):
        sl = slice(offsets[layer], offsets[layer] + sizes[layer])
        return _unit_rows(emb_a[sl].astype(np.float64)), _unit_rows(emb_b[sl].astype(np.float64))

    return match_features(graph, features)


def activation_matching(graph: NeuralGraph, acts_a: dict[int, np.ndarray], acts_b: dict[int, np.ndarray]) -> np.ndarray:
    """Match by correlation of activations: ``acts[layer]`` is (neurons, samples)."""

    def features(layer):
        if layer not in acts_a:
            return None
        za, zb = (_standardise(acts[layer]) for acts in (acts_a, acts_b))
        return za, zb / za.shape[1]

    return match_features(graph, features)


def _standardise(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return (x - x.mean(1, keepdims=True)) / np.maximum(x.std(1, keepdims=True), 1e-8)


def _dense_ops(graph: NeuralGraph) -> list[np.ndarray]:
    """Each operation's weights as a dense (n_dst, n_src, K) block, in layer-local indices."""
    sizes, offsets = graph.layer_sizes(), graph.layer_offsets()
    out = []
    for i, op in enumerate(graph.ops):
        e = graph.edge_op == i
        block = np.zeros((sizes[op["dst_layer"]], sizes[op["src_layer"]], graph.weight.shape[1]))
        block[graph.dst[e] - offsets[op["dst_layer"]], graph.src[e] - offsets[op["src_layer"]]] = graph.weight[e]
        out.append(block)
    return out


def _node_features(graph: NeuralGraph) -> np.ndarray:
    """Bias and batch-norm running statistics per node (N, 3); NaN statistics count as 0."""
    return np.nan_to_num(np.concatenate([graph.bias[:, None], graph.extra], 1).astype(np.float64))


def weight_matching(a: NeuralGraph, b: NeuralGraph, max_iter: int = 100, seed: int = 0) -> np.ndarray:
    """Git Re-Basin weight matching on the neural graphs (coordinate ascent over classes)."""
    check_same_architecture(a, b)
    classes = permutable_classes(a)
    cls_of = {layer: rep for rep, layers in classes.items() for layer in layers}
    wa, wb = _dense_ops(a), _dense_ops(b)
    na, nb = _node_features(a), _node_features(b)
    sizes, offsets = a.layer_sizes(), a.layer_offsets()
    perms = {rep: np.arange(sizes[layers[0]]) for rep, layers in classes.items()}
    rng = np.random.default_rng(seed)

    def perm_of(layer):
        rep = cls_of.get(layer)
        return perms[rep] if rep is not None else np.arange(sizes[layer])

    def similarity(rep: int) -> np.ndarray:
        layers = set(classes[rep])
        n = sizes[classes[rep][0]]
        s = np.zeros((n, n))
        for layer in layers:
            sl = slice(offsets[layer], offsets[layer] + sizes[layer])
            s += na[sl] @ nb[sl].T
        for op, xa, xb in zip(a.ops, wa, wb):
            src, dst = op["src_layer"], op["dst_layer"]
            if src in layers and dst in layers and op.channelwise:   # norm, residual, gate, depthwise: c -> c
                s += xa[np.arange(n), np.arange(n)] @ xb[np.arange(n), np.arange(n)].T
                continue
            if dst in layers:
                s += xa.reshape(n, -1) @ xb[:, perm_of(src)].reshape(n, -1).T
            if src in layers:
                ta, tb = xa.transpose(1, 0, 2), xb[perm_of(dst)].transpose(1, 0, 2)
                s += ta.reshape(n, -1) @ tb.reshape(n, -1).T
        return s

    for _ in range(max_iter):
        improved = False
        for rep in rng.permutation(list(classes)):
            s = similarity(rep)
            new = _hungarian(s)
            old = perms[rep]
            if s[np.arange(len(new)), new].sum() > s[np.arange(len(old)), old].sum() + 1e-9:
                perms[rep] = new
                improved = True
        if not improved:
            break
    return node_permutation(a, perms)
