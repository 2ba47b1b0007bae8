"""Plan + state dict -> NeuralGraph, and NeuralGraph -> state dict (the exact inverse).

Both directions are vectorised per operation: one broadcast index computation and one scatter,
never a Python loop over weights.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from pipeline.neural_graph.concat import source_nodes
from pipeline.neural_graph.graph import NeuralGraph
from pipeline.neural_graph.ops import Op
from pipeline.neural_graph.ops.base import as_numpy
from pipeline.neural_graph.plan import Plan
from pipeline.neural_graph.vocabulary import NODE_TYPES, RELATIONS
from zoocore.errors import SpecError


def graph_nodes(plan: Plan, state: Mapping[str, torch.Tensor]) -> NeuralGraph:
    """The neural graph's nodes (types, layers, positions, biases, batch-norm statistics) with no
    edges yet; ``op_edges`` gives the edges operation by operation."""
    missing = [k for k in plan.state_keys if k not in state]
    if missing:
        raise SpecError(f"state dict lacks {len(missing)} entries the architecture needs, e.g. {missing[:3]}")
    sizes = np.array([layer.size for layer in plan.layers], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    n = int(sizes.sum())
    node_layer = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
    node_position = (np.arange(n) - offsets[node_layer]).astype(np.int32)
    node_type = np.full(n, NODE_TYPES.index("hidden"), dtype=np.int8)
    node_type[node_layer == plan.output_layer] = NODE_TYPES.index("output")
    for i, layer in enumerate(plan.layers):
        if layer.kind == "input":
            node_type[node_layer == i] = NODE_TYPES.index("input")
    bias = np.zeros(n, dtype=np.float32)
    extra = np.full((n, 2), np.nan, dtype=np.float32)
    Kh, Kw = plan.kernel_shape
    for op in plan.ops:
        do = offsets[op.dst_layer]
        b = op.bias_values(state)
        if b is not None:
            bias[do:do + b.shape[0]] = b
        op.node_stats(state, extra, do, sizes[op.dst_layer])
    buffers = {k: int(as_numpy(state[k])) for k in plan.buffer_keys}
    empty = np.zeros(0, np.int64)
    return NeuralGraph(
        node_type=node_type, node_layer=node_layer, node_position=node_position, bias=bias, extra=extra,
        layer_activation=[layer.activation for layer in plan.layers], src=empty, dst=empty.copy(),
        relation=np.zeros(0, np.int8), edge_op=np.zeros(0, np.int32), weight=np.zeros((0, Kh * Kw), np.float32),
        kernel_shape=(Kh, Kw), ops=plan.ops, buffers=buffers)


def op_edges(plan: Plan, state: Mapping[str, torch.Tensor], i: int):
    """Edges of operation ``i``: (src, dst) int64 node indices, relation int8, edge_op int32 and
    weight (E_i, Kh*Kw) float32, in the order graph_from_plan stores them."""
    sizes = np.array([layer.size for layer in plan.layers], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    Kh, Kw = plan.kernel_shape
    op = plan.ops[i]
    do = offsets[op.dst_layer]
    inputs = source_nodes(op, offsets, sizes)
    src, dst, w = op.edges(inputs, state, do, int(sizes[op.dst_layer]), (Kh, Kw), i)
    return (src.astype(np.int64, copy=False), dst.astype(np.int64, copy=False),
            np.full(src.shape[0], RELATIONS.index(op.relation), np.int8), np.full(src.shape[0], i, np.int32), w)


def graph_from_plan(plan: Plan, state: Mapping[str, torch.Tensor]) -> NeuralGraph:
    """Build the neural graph of one checkpoint of the plan's architecture.

    Args:
        plan: the traced architecture.
        state: its state dict (parameters and buffers).
    Shapes:
        nodes N = sum of neuron-layer sizes; edges E = sum over ops of their edge counts;
        edge features Kh*Kw with (Kh, Kw) = plan.kernel_shape.
    """
    graph = graph_nodes(plan, state)
    counts = [expected_edges(plan, op) for op in plan.ops]
    total = int(sum(counts))
    Kh, Kw = plan.kernel_shape
    graph.src, graph.dst = np.empty(total, np.int64), np.empty(total, np.int64)
    graph.relation, graph.edge_op = np.empty(total, np.int8), np.empty(total, np.int32)
    graph.weight = np.empty((total, Kh * Kw), np.float32)
    at = 0
    for i in range(len(plan.ops)):                       # filled in place: no second copy of the edges
        parts = op_edges(plan, state, i)
        k = parts[0].shape[0]
        if k != counts[i]:
            raise SpecError(f"op {i} ({plan.ops[i].kind}) makes {k} edges, expected {counts[i]}")
        for name, arr in zip(("src", "dst", "relation", "edge_op", "weight"), parts):
            getattr(graph, name)[at:at + k] = arr
        at += k
    return graph.validate()


def expected_edges(plan: Plan, op: Op) -> int:
    """Number of edges an operation makes: one per destination neuron for a diagonal relation,
    one per (output, input-per-group) pair of its weight otherwise."""
    return op.expected_edges([layer.size for layer in plan.layers])


def state_dict_from_graph(graph: NeuralGraph) -> dict[str, torch.Tensor]:
    """Invert a neural graph into the state dict it came from (bit-exact for float32 weights).

    Works on any edge order and on node orders permuted within layers (see NeuralGraph.permuted):
    the tensor index of a neuron is its index within its layer.
    """
    offsets = graph.layer_offsets()
    sizes = graph.layer_sizes()
    Kh, Kw = graph.kernel_shape
    order = np.argsort(graph.edge_op, kind="stable")
    starts = np.searchsorted(graph.edge_op[order], np.arange(len(graph.ops) + 1))
    out: dict[str, torch.Tensor] = {}
    local = np.full(graph.num_nodes, -1, np.int64)      # node -> index among the current op's inputs
    for i, op in enumerate(graph.ops):
        e = order[starts[i]:starts[i + 1]]
        do = offsets[op.dst_layer]
        w = graph.weight[e].reshape(-1, Kh, Kw)
        dst = graph.dst[e] - do
        c = int(sizes[op.dst_layer])
        inputs = None if op.diagonal else source_nodes(op, offsets, sizes)
        op.invert(out, w, dst, c, graph=graph, e=e, do=do, inputs=inputs, local=local, frame=(Kh, Kw), i=i)
        op.invert_bias(out, torch.from_numpy(graph.bias[do:do + c].copy()))
        op.invert_buffers(out)
    return out
