"""Neural-graph arrays -> DGL heterographs: the one place where DGL graphs are built.

Node types are ``input``, ``hidden`` and ``output``; an edge of relation ``r`` from a node of type
``s`` to one of type ``d`` has the canonical type ``(s, r, d)`` and its reverse ``(d, rev_r, s)``.
Graphs meant to be batched together are built over one shared list of canonical edge types
(missing ones get zero edges) and one shared kernel frame, so ``dgl.batch`` accepts them.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import dgl
import numpy as np
import torch

from pipeline.neural_graph.vocabulary import ACTIVATIONS, NODE_TYPES, RELATIONS

CanonicalEtype = tuple[str, str, str]


def reframe(weight: np.ndarray, kernel: tuple[int, int], frame: tuple[int, int]) -> np.ndarray:
    """Re-centre (E, kh*kw) kernels into a larger (Fh, Fw) frame, zero-padded: (E, Fh*Fw)."""
    kh, kw = kernel
    fh, fw = frame
    if (kh, kw) == (fh, fw):
        return weight
    if kh > fh or kw > fw:
        raise ValueError(f"kernel {kernel} does not fit frame {frame}")
    out = np.zeros((weight.shape[0], fh, fw), dtype=np.float32)
    top, left = (fh - kh) // 2, (fw - kw) // 2
    out[:, top:top + kh, left:left + kw] = weight.reshape(-1, kh, kw)
    return out.reshape(weight.shape[0], fh * fw)


def canonical_etypes_of(node_type: np.ndarray, src: np.ndarray, dst: np.ndarray,
                        relation: np.ndarray) -> set[CanonicalEtype]:
    """Forward canonical edge types present in one graph."""
    if src.shape[0] == 0:
        return set()
    code = (node_type[src].astype(np.int64) * 64 + relation.astype(np.int64)) * 4 + node_type[dst]
    out = set()
    for c in np.unique(code).tolist():
        s, rest = divmod(c, 256)
        r, d = divmod(rest, 4)
        out.add((NODE_TYPES[s], RELATIONS[r], NODE_TYPES[d]))
    return out


def with_reverses(forward: Iterable[CanonicalEtype]) -> list[CanonicalEtype]:
    """Sorted forward types followed by their reverses ``(d, rev_r, s)``."""
    fwd = sorted(set(forward))
    return fwd + [(d, "rev_" + r, s) for (s, r, d) in fwd]


def build_heterograph(node_type: np.ndarray, node_layer: np.ndarray, node_position: np.ndarray,
                      bias: np.ndarray, node_activation: np.ndarray, src: np.ndarray, dst: np.ndarray,
                      relation: np.ndarray, weight: np.ndarray,
                      etypes: Sequence[CanonicalEtype] | None = None, raw_bias: np.ndarray | None = None,
                      raw_weight: np.ndarray | None = None,
                      node_probe: np.ndarray | None = None) -> dgl.DGLHeteroGraph:
    """Build one neural graph as a DGL heterograph.

    Args:
        node_type, node_layer, node_position, bias, node_activation: (N,) node arrays
            (node_activation: codes into ACTIVATIONS).
        src, dst, relation: (E,) edge arrays over global node indices.
        weight: (E, F) edge features, already in the shared frame.
        etypes: the canonical edge types to create (with reverses), default those present.
        raw_bias, raw_weight: (N,), (E,) un-normalised values, stored as ``bias_raw`` / ``w_raw``
            for probe features (which run the network on the graph).
        node_probe: (N, P) per-node values on fixed probes, stored as ``probe``.
    Returns:
        a heterograph; ndata ``bias`` (float), ``layer``, ``position``, ``activation``, ``nid``;
        edata ``w`` (E_t, F) on forward and reverse types alike.
    """
    if etypes is None:
        etypes = with_reverses(canonical_etypes_of(node_type, src, dst, relation))
    local = np.zeros(node_type.shape[0], dtype=np.int64)
    counts = {}
    for code, name in enumerate(NODE_TYPES):
        mask = node_type == code
        local[mask] = np.arange(int(mask.sum()))
        counts[name] = int(mask.sum())
    rel_index = {r: i for i, r in enumerate(RELATIONS)}
    data, feats, raws = {}, {}, {}
    fdim = weight.shape[1]
    for et in etypes:
        s, r, d = et
        rev = r.startswith("rev_")
        base = r[4:] if rev else r
        fs, fd = (d, s) if rev else (s, d)
        mask = ((relation == rel_index[base]) & (node_type[src] == NODE_TYPES.index(fs))
                & (node_type[dst] == NODE_TYPES.index(fd)))
        u, v = local[src[mask]], local[dst[mask]]
        if rev:
            u, v = v, u
        data[et] = (torch.from_numpy(u), torch.from_numpy(v))
        feats[et] = torch.from_numpy(np.ascontiguousarray(weight[mask], dtype=np.float32)).reshape(-1, fdim)
        if raw_weight is not None:
            raws[et] = torch.from_numpy(np.ascontiguousarray(raw_weight[mask], dtype=np.float32))
    missing = canonical_etypes_of(node_type, src, dst, relation) - set(etypes)
    if missing:
        raise ValueError(f"edge types {sorted(missing)} are not in the shared edge-type list")
    g = dgl.heterograph(data, num_nodes_dict=counts)
    for et, f in feats.items():
        g.edges[et].data["w"] = f
        if et in raws:
            g.edges[et].data["w_raw"] = raws[et]
    for code, name in enumerate(NODE_TYPES):
        mask = node_type == code
        g.nodes[name].data["bias"] = torch.from_numpy(bias[mask].astype(np.float32))
        g.nodes[name].data["layer"] = torch.from_numpy(node_layer[mask].astype(np.int64))
        g.nodes[name].data["position"] = torch.from_numpy(node_position[mask].astype(np.int64))
        g.nodes[name].data["activation"] = torch.from_numpy(node_activation[mask].astype(np.int64))
        g.nodes[name].data["nid"] = torch.from_numpy(np.nonzero(mask)[0].astype(np.int64))
        if node_probe is not None:
            g.nodes[name].data["probe"] = torch.from_numpy(np.ascontiguousarray(node_probe[mask], dtype=np.float32))
        if raw_bias is not None:
            g.nodes[name].data["bias_raw"] = torch.from_numpy(raw_bias[mask].astype(np.float32))
    return g


def neural_graph_to_dgl(graph, frame: tuple[int, int] | None = None,
                        etypes: Sequence[CanonicalEtype] | None = None) -> dgl.DGLHeteroGraph:
    """A NeuralGraph as a DGL heterograph (see build_heterograph)."""
    weight = graph.weight if frame is None else reframe(graph.weight, graph.kernel_shape, frame)
    return build_heterograph(graph.node_type, graph.node_layer, graph.node_position, graph.bias,
                             graph.node_activation_codes(), graph.src, graph.dst, graph.relation, weight, etypes)


__all__ = ["ACTIVATIONS", "build_heterograph", "canonical_etypes_of", "neural_graph_to_dgl", "reframe",
           "with_reverses"]
