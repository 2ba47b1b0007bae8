"""A model rebuilt from the catalog alone: neural graph, state dict, runnable module.

Parquet is the source of truth: the nodes and edges of a model, its architecture's plan (the
operations the exact inverse needs) and its buffers give back the checkpoint bit for bit, and the
architecture's JSON spec gives back the module, so jobs that need the network itself (merging,
evaluation) never go looking for the original file.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from graphstore import duck
from jobs.data import dictionary_codes
from pipeline.errors import JobError
from pipeline.neural_graph.build import state_dict_from_graph
from pipeline.neural_graph.graph import NODE_TYPES, RELATIONS, NeuralGraph
from pipeline.neural_graph.plan import Plan
from pipeline.spec import build_module

MODEL_ROW = ("SELECT m.model_id, m.architecture_id, m.checkpoint, m.kernel_h, m.kernel_w, m.buffers_json, "
             "m.metadata_json, a.plan_json, a.spec_json FROM models m JOIN architectures a USING (architecture_id) "
             "WHERE m.model_id = ?")
NODES = ("SELECT node_type, layer, position, bias, running_mean, running_var FROM nodes WHERE model_id = ? "
         "ORDER BY node")
EDGES = "SELECT src, dst, relation, layer, weight FROM edges WHERE model_id = ?"


@dataclass
class CatalogModel:
    model_id: str
    architecture_id: str
    checkpoint: str
    plan: Plan
    spec: dict | None
    graph: NeuralGraph
    metadata: dict[str, Any]

    def state_dict(self, graph: NeuralGraph | None = None) -> dict[str, torch.Tensor]:
        """The checkpoint's state dict (of ``graph`` if given: a permuted or merged graph)."""
        return state_dict_from_graph(self.graph if graph is None else graph)

    def module(self, state: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
        """The runnable network (eval mode) with this model's weights, or with ``state``."""
        if self.spec is None:
            raise JobError(f"model {self.model_id} was ingested from a torch.export archive without a JSON "
                           "spec; rebuilding it as a module needs the spec")
        net = build_module(self.spec)
        net.load_state_dict(self.state_dict() if state is None else state)
        return net.eval()


def load_model(con, model_id: str) -> CatalogModel:
    """Rebuild ``model_id`` from the catalog's models, architectures, nodes and edges."""
    row = con.execute(MODEL_ROW, [model_id]).fetchone()
    if row is None:
        raise JobError(f"no model {model_id!r} in the catalog")
    _, arch, checkpoint, kh, kw, buffers_json, metadata_json, plan_json, spec_json = row
    plan = Plan.from_json(plan_json)
    nodes, edges = duck.table(con, NODES, [model_id]), duck.table(con, EDGES, [model_id])
    weight = edges.column("weight").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    extra = np.stack([nodes.column("running_mean").to_numpy(zero_copy_only=False),
                      nodes.column("running_var").to_numpy(zero_copy_only=False)], 1).astype(np.float32)
    graph = NeuralGraph(
        node_type=dictionary_codes(nodes.column("node_type"), NODE_TYPES).astype(np.int8),
        node_layer=nodes.column("layer").to_numpy().astype(np.int32),
        node_position=nodes.column("position").to_numpy().astype(np.int32),
        bias=nodes.column("bias").to_numpy().astype(np.float32), extra=extra,
        layer_activation=[layer.activation for layer in plan.layers],
        src=edges.column("src").to_numpy().astype(np.int64), dst=edges.column("dst").to_numpy().astype(np.int64),
        relation=dictionary_codes(edges.column("relation"), RELATIONS).astype(np.int8),
        edge_op=edges.column("layer").to_numpy().astype(np.int32),
        weight=weight.astype(np.float32).reshape(edges.num_rows, int(kh) * int(kw)),
        kernel_shape=(int(kh), int(kw)), ops=plan.ops, buffers=json.loads(buffers_json or "{}"))
    return CatalogModel(model_id, arch, checkpoint, plan, json.loads(spec_json) if spec_json else None,
                        graph.validate(), json.loads(metadata_json or "{}"))
