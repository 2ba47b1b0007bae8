"""Which networks convert: the check behind the README's torchvision table and its tests.

For a converted network, the graph must account for every parameter: the native kernel area of
each weight edge sums to the weight count, every output neuron of a parametric layer is a node
carrying its bias, and every residual edge joins two neurons of equal layers. Where the graph is
built, the exact inverse is checked too: ``state_dict_from_graph`` gives back every state-dict
entry bit for bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.neural_graph.build import graph_from_plan, state_dict_from_graph
from pipeline.neural_graph.plan import plan_from_module
from pipeline.neural_graph.vocabulary import DIAGONAL_RELATIONS, RELATIONS
from zoocore.errors import UnsupportedModuleError

MAX_FEATURE_FLOATS = 150_000_000   # larger graphs are counted from the plan, not materialised


@dataclass
class CoverageRow:
    name: str
    status: str                 # converts | unsupported
    params: int
    nodes: int | None = None
    edges: int | None = None
    materialised: bool = False          # graph built, counts and exact inverse checked
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
    params = sum(p.numel() for p in model.parameters())
    size = 224 if name.startswith(("vit", "swin", "maxvit")) else 299 if name == "inception_v3" else image
    try:
        plan = plan_from_module(model, torch.randn(2, 3, size, size))
    except UnsupportedModuleError as exc:
        return CoverageRow(name, "unsupported", params, reason=str(exc))
    state = dict(model.state_dict())
    nodes, edges, weight_entries = expected_counts(plan, state)
    floats = edges * plan.kernel_shape[0] * plan.kernel_shape[1]
    if floats > MAX_FEATURE_FLOATS:
        return CoverageRow(name, "converts", params, nodes, edges, False)
    g = graph_from_plan(plan, state)
    area = np.array([op["kernel"][0] * op["kernel"][1] for op in plan.ops])[g.edge_op]
    param_edges = ~np.isin(g.relation, [RELATIONS.index(r) for r in DIAGONAL_RELATIONS])
    assert (g.num_nodes, g.num_edges) == (nodes, edges), (name, g.num_nodes, nodes, g.num_edges, edges)
    norm_w = sum(int(state[op["weight_key"]].numel()) for op in plan.ops
                 if op["relation"] == "norm" and op.get("weight_key"))
    assert int(area[param_edges].sum()) + norm_w == weight_entries
    check_exact_inverse(g, state, name)
    return CoverageRow(name, "converts", params, g.num_nodes, g.num_edges, True)


def check_exact_inverse(graph, state, name: str = "model") -> None:
    """Assert that the graph inverts into ``state``: the same keys, shapes, dtypes and bits."""
    back = state_dict_from_graph(graph)
    if set(back) != set(state):
        raise AssertionError(f"{name}: inverse keys differ: missing {sorted(set(state) - set(back))[:3]}, "
                             f"extra {sorted(set(back) - set(state))[:3]}")
    for k, v in state.items():
        b = back[k]
        if b.shape != v.shape or b.dtype != v.dtype or not torch.equal(b, v):
            raise AssertionError(f"{name}: inverse of {k} differs ({tuple(b.shape)} {b.dtype} vs "
                                 f"{tuple(v.shape)} {v.dtype})")
