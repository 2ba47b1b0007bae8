"""Which networks convert: the check behind the README's torchvision table and its tests.

For a converted network, the graph must account for every parameter: the native kernel area of
each weight edge sums to the weight count, every output neuron of a parametric layer is a node
carrying its bias, and every residual edge joins two neurons of equal layers. Where the graph is
built, the exact inverse is checked too: ``state_dict_from_graph`` gives back every state-dict
entry bit for bit.

The memory budget (BUDGET_RULE): every edge is stored in the model's Kh x Kw kernel frame (the
largest kernel, e.g. 7 x 7 for a ResNet stem: 49 floats per edge), so the graph is built and
inverted in parts, runs of operations of at most MAX_FEATURE_FLOATS edge features each; a model
with one operation larger than that on its own is counted from the plan and not inverted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from pipeline.neural_graph.build import (expected_edges, graph_from_plan, graph_nodes, op_edges,
                                         state_dict_from_graph)
from pipeline.neural_graph.plan import plan_from_module
from pipeline.neural_graph.vocabulary import DIAGONAL_RELATIONS, RELATIONS
from zoocore.errors import UnsupportedModuleError

MAX_FEATURE_FLOATS = 150_000_000   # edge features (floats) of one part of the checked graph
BUDGET_RULE = (f"the exact inverse is checked on every model whose largest operation fits {MAX_FEATURE_FLOATS:,} "
               "edge features in the model's kernel frame (edges x Kh x Kw floats); the graph is built and "
               "inverted in parts of at most that size")


@dataclass
class CoverageRow:
    name: str
    status: str                 # converts | unsupported
    params: int
    nodes: int | None = None
    edges: int | None = None
    materialised: bool = False          # graph built (in parts), counts and exact inverse checked
    parts: int = 0                      # how many parts the graph was built in
    unread: list[str] = field(default_factory=list)   # state entries the evaluated network never reads
    reason: str = ""


def expected_counts(plan, state) -> tuple[int, int, int]:
    """(nodes, edges, weight entries) that the parameters imply for a traced plan."""
    nodes = sum(layer.size for layer in plan.layers)
    edges = 0
    weight_entries = 0
    for op in plan.ops:
        out = plan.layers[op["dst_layer"]].size
        if op["relation"] in DIAGONAL_RELATIONS:
            edges += out
            weight_entries += int(state[op["weight_key"]].numel()) if op.get("weight_key") else 0
            continue
        numel = math.prod(op["weight_shape"])       # this op's share of its parameter (q/k/v rows)
        area = op["kernel"][0] * op["kernel"][1]
        edges += numel // area
        weight_entries += numel
    return nodes, edges, weight_entries


def check_builder(name: str, image: int = 64) -> CoverageRow:
    """Convert torchvision builder ``name`` (random init, nothing downloaded) and check its counts."""
    import torchvision

    model = torchvision.models.get_model(name, weights=None).eval()
    size = 224 if name.startswith(("vit", "swin", "maxvit")) else 299 if name == "inception_v3" else image
    return check_module(name, model, torch.randn(2, 3, size, size))


def check_module(name: str, model: torch.nn.Module, example: torch.Tensor) -> CoverageRow:
    """Convert ``model`` on ``example`` and check its counts and exact inverse (see check_plan)."""
    params = sum(p.numel() for p in model.parameters())
    try:
        plan = plan_from_module(model, example)
    except UnsupportedModuleError as exc:
        return CoverageRow(name, "unsupported", params, reason=str(exc))
    state = dict(model.state_dict())
    # GoogLeNet's and Inception's auxiliary classifiers run in training only: the traced (evaluation)
    # network never reads them, so they are not in its graph, and the inverse gives back the rest
    unread = sorted(set(state) - set(plan.state_keys))
    row = check_plan(name, plan, {k: state[k] for k in plan.state_keys}, params)
    row.unread = unread
    return row


def op_parts(plan, budget: int = MAX_FEATURE_FLOATS) -> list[list[int]] | None:
    """Runs of consecutive operations of at most ``budget`` edge features each (row blocks of one
    parameter stay together), or None when one operation alone is larger."""
    frame = plan.kernel_shape[0] * plan.kernel_shape[1]
    size = [expected_edges(plan, op) * frame for op in plan.ops]
    if max(size, default=0) > budget:
        return None
    parts: list[list[int]] = []
    total = 0
    for i, op in enumerate(plan.ops):
        joined = parts and "rows" in op and plan.ops[parts[-1][-1]].get("weight_key") == op.get("weight_key")
        if not parts or (not joined and total + size[i] > budget):
            parts.append([])
            total = 0
        parts[-1].append(i)
        total += size[i]
    return parts


def check_plan(name: str, plan, state, params: int = 0, budget: int = MAX_FEATURE_FLOATS) -> CoverageRow:
    """Counts and exact inverse of a traced plan, the graph built part by part within ``budget``."""
    nodes, edges, weight_entries = expected_counts(plan, state)
    parts = op_parts(plan, budget)
    if parts is None:
        return CoverageRow(name, "converts", params, nodes, edges, False)
    base = graph_nodes(plan, state)
    back: dict[str, torch.Tensor] = {}
    num_edges = 0
    param_area = 0
    for part in parts:
        if len(parts) == 1:
            g = graph_from_plan(plan, state)
        else:
            pieces = [op_edges(plan, state, i) for i in part]
            g = replace(base, src=np.concatenate([p[0] for p in pieces]), dst=np.concatenate([p[1] for p in pieces]),
                        relation=np.concatenate([p[2] for p in pieces]),
                        edge_op=np.concatenate([np.full(p[0].shape[0], j, np.int32) for j, p in enumerate(pieces)]),
                        weight=np.concatenate([p[4] for p in pieces]), ops=[plan.ops[i] for i in part]).validate()
        area = np.array([op["kernel"][0] * op["kernel"][1] for op in g.ops])[g.edge_op]
        param_edges = ~np.isin(g.relation, [RELATIONS.index(r) for r in DIAGONAL_RELATIONS])
        param_area += int(area[param_edges].sum())
        num_edges += g.num_edges
        got = state_dict_from_graph(g)
        if set(got) & set(back):
            raise AssertionError(f"{name}: entries {sorted(set(got) & set(back))[:3]} come from two parts")
        back.update(got)
        del g
    assert (base.num_nodes, num_edges) == (nodes, edges), (name, base.num_nodes, nodes, num_edges, edges)
    norm_w = sum(int(state[op["weight_key"]].numel()) for op in plan.ops
                 if op["relation"] == "norm" and op.get("weight_key"))
    assert param_area + norm_w == weight_entries
    compare_state(back, state, name)
    return CoverageRow(name, "converts", params, nodes, edges, True, len(parts))


def check_exact_inverse(graph, state, name: str = "model") -> None:
    """Assert that the graph inverts into ``state``: the same keys, shapes, dtypes and bits."""
    compare_state(state_dict_from_graph(graph), state, name)


def compare_state(back, state, name: str = "model") -> None:
    """Assert that ``back`` is ``state``: the same keys, shapes, dtypes and bits."""
    if set(back) != set(state):
        raise AssertionError(f"{name}: inverse keys differ: missing {sorted(set(state) - set(back))[:3]}, "
                             f"extra {sorted(set(back) - set(state))[:3]}")
    for k, v in state.items():
        b = back[k]
        if b.shape != v.shape or b.dtype != v.dtype or not torch.equal(b, v):
            raise AssertionError(f"{name}: inverse of {k} differs ({tuple(b.shape)} {b.dtype} vs "
                                 f"{tuple(v.shape)} {v.dtype})")
