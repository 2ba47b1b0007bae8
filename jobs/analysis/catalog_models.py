"""A model rebuilt from the catalog alone: neural graph, state dict, runnable module.

Parquet is the source of truth: the nodes and edges of a model, its architecture's plan (the
operations the exact inverse needs) and its buffers give back the checkpoint bit for bit, and
``pipeline.neural_graph.runnable`` gives back the network that runs it (the architecture's exported
graph: from its JSON spec, or the program kept at ingest for torch.export archives), so jobs that
need the network itself (merging, evaluation, layerwise equivariance) never go looking for the
original file, whatever format it came in.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.graph_codec import read_graphs
from pipeline.neural_graph.build import state_dict_from_graph
from pipeline.neural_graph.graph import NeuralGraph
from pipeline.neural_graph.plan import Plan
from pipeline.neural_graph.runnable import Network, exported_from_spec, program_from_catalog
from pipeline.spec import build_module
from zoocore.errors import JobError

MODEL_ROW = ("SELECT m.model_id, m.architecture_id, m.checkpoint, m.metadata_json, a.plan_json, a.spec_json, "
             "a.program_json, a.program_tensors FROM models m JOIN architectures a USING (architecture_id) "
             "WHERE m.model_id = ?")
# (architecture id, its spec or program) -> the exported graph, the newest EXPORTED_CACHE kept: the
# signature leaves parameter names out, so two catalogs' programs of one architecture may name them apart
_EXPORTED: OrderedDict[tuple[str, int], Any] = OrderedDict()
EXPORTED_CACHE = 64


@dataclass
class CatalogModel:
    model_id: str
    architecture_id: str
    checkpoint: str
    plan: Plan
    spec: dict | None
    graph: NeuralGraph
    metadata: dict[str, Any]
    program: tuple[str | None, bytes | None] = (None, None)

    def state_dict(self, graph: NeuralGraph | None = None) -> dict[str, torch.Tensor]:
        """The checkpoint's state dict (of ``graph`` if given: a permuted or merged graph)."""
        return state_dict_from_graph(self.graph if graph is None else graph)

    def module(self, state: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
        """The runnable network (eval mode) with this model's weights, or with ``state``: the spec's
        own module where there is a spec (trainable, batch norm and all), else :meth:`network`."""
        if self.spec is None:
            return self.network(state)
        net = build_module(self.spec)
        net.load_state_dict(self.state_dict() if state is None else state)
        return net.eval()

    def network(self, state: dict[str, torch.Tensor] | None = None) -> Network:
        """The architecture's exported graph run on this model's weights (or ``state``): every
        converted model has one, and its ``taps`` give each neuron layer's value."""
        state = self.state_dict() if state is None else state
        key = (self.architecture_id, hash(self.program[0] or json.dumps(self.spec, sort_keys=True)))
        exported = _EXPORTED.get(key)
        if exported is None:
            if self.spec is not None:
                exported = exported_from_spec(self.spec)
            elif self.program[0] is not None:
                exported = program_from_catalog(*self.program, state, f"model {self.model_id}")
            else:
                raise JobError(f"model {self.model_id}'s network cannot be rebuilt: it has no JSON spec and its "
                               "architecture was ingested before programs were kept (ingest its zoo again "
                               "into a new catalog)")
            _EXPORTED[key] = exported
            while len(_EXPORTED) > EXPORTED_CACHE:
                _EXPORTED.popitem(last=False)
        _EXPORTED.move_to_end(key)
        return Network(exported, state).eval()


def load_model(con, model_id: str) -> CatalogModel:
    """Rebuild ``model_id`` from the catalog's models, architectures, nodes and edges."""
    row = con.execute(MODEL_ROW, [model_id]).fetchone()
    if row is None:
        raise JobError(f"no model {model_id!r} in the catalog")
    _, arch, checkpoint, metadata_json, plan_json, spec_json, program_json, program_tensors = row
    plan = Plan.from_json(plan_json)
    graph, = read_graphs(con, [model_id], plans={arch: plan})
    return CatalogModel(model_id, arch, checkpoint, plan, json.loads(spec_json) if spec_json else None,
                        graph.validate(), json.loads(metadata_json or "{}"), (program_json, program_tensors))


def plan_of(con, model_id: str) -> Plan:
    """The plan of ``model_id``'s architecture."""
    row = con.execute("SELECT a.plan_json FROM models m JOIN architectures a USING (architecture_id) "
                      "WHERE m.model_id = ?", [model_id]).fetchone()
    if row is None:
        raise JobError(f"no model {model_id!r} in the catalog")
    return Plan.from_json(row[0])


def catalog_state_dicts(con, ids, chunk: int = 256):
    """(model_id, architecture spec or None, state dict) of ``ids`` in order, rebuilt from the catalog's
    nodes and edges (bit-exact for float32 weights), read ``chunk`` models at a time."""
    specs = {a: json.loads(s) if s else None for a, s in con.execute(
        "SELECT architecture_id, spec_json FROM architectures").fetchall()}
    arch_of = dict(con.execute("SELECT model_id, architecture_id FROM models").fetchall())
    plans: dict = {}
    for start in range(0, len(ids), chunk):
        part = list(ids[start:start + chunk])
        for mid, graph in zip(part, read_graphs(con, part, plans=plans)):
            yield mid, specs[arch_of[mid]], state_dict_from_graph(graph)
