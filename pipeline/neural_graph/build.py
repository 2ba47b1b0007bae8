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
from pipeline.neural_graph.plan import Plan
from pipeline.neural_graph.vocabulary import DIAGONAL_RELATIONS, NODE_TYPES, RELATIONS
from zoocore.errors import GraphValidationError, SpecError


def _as_numpy(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu()
        if t.dtype != torch.float32 and t.is_floating_point():
            raise SpecError(f"only float32 weights are supported, found {t.dtype}")
        return t.numpy()
    return np.asarray(t)


def _frame(kernel: tuple[int, int], frame: tuple[int, int]) -> tuple[int, int]:
    """Top-left offset that centres a kh x kw kernel in the Kh x Kw frame."""
    return (frame[0] - kernel[0]) // 2, (frame[1] - kernel[1]) // 2


def _dense_blocks(op: dict, state: Mapping, src_size: int):
    """Weight of a linear/conv/embedding op as (Cout, Cin_per_group, kh, kw) and its group count."""
    w = _as_numpy(state[op["weight_key"]])
    if op.get("transposed"):                # GPT-2's Conv1D keeps its weight as (in, out)
        w = w.T
    if "rows" in op:                        # q / k / v: row blocks of one in-projection tensor
        w = w[op["rows"][0]:op["rows"][1]]
    kh, kw = op["kernel"]
    if op["relation"] == "embedding":               # dst = embedding dim, src = token / position / class neuron
        w = w.reshape(op["weight_shape"])
        return w.T.reshape(w.shape[1], w.shape[0], 1, 1), 1
    if op["kind"] == "linear":
        return w.reshape(w.shape[0], src_size, kh, kw), 1
    return w.reshape(w.shape[0], w.shape[1], kh, kw), op["groups"]


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
        do = offsets[op["dst_layer"]]
        if op.get("bias_key"):
            b = _as_numpy(state[op["bias_key"]])
            if "rows" in op:
                b = b[op["rows"][0]:op["rows"][1]]
            bias[do:do + b.shape[0]] = b
        if op["kind"] == "batch_norm":
            c = sizes[op["dst_layer"]]
            extra[do:do + c, 0] = _as_numpy(state[op["mean_key"]])
            extra[do:do + c, 1] = _as_numpy(state[op["var_key"]])
    buffers = {k: int(_as_numpy(state[k])) for k in plan.buffer_keys}
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
    do = offsets[op["dst_layer"]]
    inputs = source_nodes(op, offsets, sizes)
    kh, kw = op["kernel"]
    top, left = _frame((kh, kw), (Kh, Kw))
    if op["relation"] in DIAGONAL_RELATIONS:
        c = sizes[op["dst_layer"]]
        if inputs.shape[0] != c:
            raise SpecError(f"op {i} ({op['kind']}) joins {inputs.shape[0]} neurons to {c}")
        src, dst = inputs, do + np.arange(c)
        vals = np.ones(c, np.float32) if op.get("weight_key") is None else \
            _as_numpy(state[op["weight_key"]]).reshape(c)
        w = np.zeros((c, Kh, Kw), np.float32)
        w[:, top, left] = vals
        w = w.reshape(c, Kh * Kw)
    else:
        blocks, groups = _dense_blocks(op, state, int(inputs.shape[0]))
        cout, cin_g = blocks.shape[:2]
        o = np.arange(cout)[:, None]
        j = np.arange(cin_g)[None, :]
        src = inputs[((o // (cout // groups)) * cin_g + j).reshape(-1)]
        dst = np.broadcast_to(do + o, (cout, cin_g)).reshape(-1)
        w = np.zeros((cout, cin_g, Kh, Kw), np.float32)
        w[:, :, top:top + kh, left:left + kw] = blocks
        w = w.reshape(cout * cin_g, Kh * Kw)
    return (src.astype(np.int64, copy=False), dst.astype(np.int64, copy=False),
            np.full(src.shape[0], RELATIONS.index(op["relation"]), np.int8), np.full(src.shape[0], i, np.int32), w)


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
            raise SpecError(f"op {i} ({plan.ops[i]['kind']}) makes {k} edges, expected {counts[i]}")
        for name, arr in zip(("src", "dst", "relation", "edge_op", "weight"), parts):
            getattr(graph, name)[at:at + k] = arr
        at += k
    return graph.validate()


def expected_edges(plan: Plan, op: dict) -> int:
    """Number of edges an operation makes: one per destination neuron for a diagonal relation,
    one per (output, input-per-group) pair of its weight otherwise."""
    if op["relation"] in DIAGONAL_RELATIONS:
        return int(plan.layers[op["dst_layer"]].size)
    return int(np.prod(op["weight_shape"])) // (op["kernel"][0] * op["kernel"][1])


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
        do = offsets[op["dst_layer"]]
        kh, kw = op["kernel"]
        top, left = _frame((kh, kw), (Kh, Kw))
        w = graph.weight[e].reshape(-1, Kh, Kw)
        dst = graph.dst[e] - do
        c = int(sizes[op["dst_layer"]])
        if op["relation"] in DIAGONAL_RELATIONS:
            if op["relation"] == "norm" and op.get("weight_key"):
                gamma = np.zeros(c, np.float32)
                gamma[dst] = w[:, top, left]
                out[op["weight_key"]] = torch.from_numpy(gamma.reshape(op.get("param_shape", [c])))
            if op["kind"] == "batch_norm":
                out[op["mean_key"]] = torch.from_numpy(graph.extra[do:do + c, 0].copy())
                out[op["var_key"]] = torch.from_numpy(graph.extra[do:do + c, 1].copy())
                if op.get("nbt_key"):
                    out[op["nbt_key"]] = torch.tensor(graph.buffers[op["nbt_key"]], dtype=torch.int64)
        else:
            inputs = source_nodes(op, offsets, sizes)
            local[inputs] = np.arange(inputs.shape[0])
            src = local[graph.src[e]]
            local[inputs] = -1
            if e.shape[0] and src.min() < 0:
                raise GraphValidationError(f"op {i} ({op['kind']}) has an edge from a neuron it does not read")
            cin = int(inputs.shape[0])
            groups = op.get("groups", 1)
            cin_g = cin // groups
            if e.shape[0] != c * cin_g:
                raise GraphValidationError(f"op {i} ({op['kind']}) has {e.shape[0]} edges, expected {c * cin_g}")
            blocks = np.zeros((c, cin_g, kh, kw), np.float32)
            blocks[dst, src - (dst // (c // groups)) * cin_g] = w[:, top:top + kh, left:left + kw]
            shape = op["weight_shape"]
            if op["relation"] == "embedding":
                weight = blocks.reshape(c, cin).T.copy().reshape(op.get("param_shape", shape))
            else:
                weight = blocks.reshape(shape)
            if "rows" in op:                # one row block of a shared in-projection tensor
                r0, r1 = op["rows"]
                full = out.setdefault(op["weight_key"], torch.zeros(op["param_shape"]))
                if op.get("transposed"):
                    full[:, r0:r1] = torch.from_numpy(np.ascontiguousarray(weight.T))
                else:
                    full[r0:r1] = torch.from_numpy(np.ascontiguousarray(weight))
            else:
                weight = weight.T if op.get("transposed") else weight
                out[op["weight_key"]] = torch.from_numpy(np.ascontiguousarray(weight))
        for key, buf in op.get("buffers", {}).items():     # fixed tables kept in the op (position_bias.py)
            out[key] = torch.tensor(buf["values"], dtype=getattr(torch, buf["dtype"])).reshape(buf["shape"])
        if op.get("bias_key"):
            b = torch.from_numpy(graph.bias[do:do + c].copy())
            if "rows" in op:
                r0, r1 = op["rows"]
                rows = op["param_shape"][1 if op.get("transposed") else 0]
                out.setdefault(op["bias_key"], torch.zeros(rows))[r0:r1] = b
            else:
                out[op["bias_key"]] = b
    return out
