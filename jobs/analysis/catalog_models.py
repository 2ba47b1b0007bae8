"""A model rebuilt from the catalog alone: neural graph, state dict, runnable module.

Parquet is the source of truth: the nodes and edges of a model, its architecture's plan (the
operations the exact inverse needs) and its buffers give back the checkpoint bit for bit, and
``pipeline.neural_graph.runnable`` gives back the network that runs it (the architecture's exported
graph: from its JSON spec, or the program kept at ingest for torch.export archives), so jobs that
need the network itself (merging, evaluation, layerwise equivariance) never go looking for the
original file, whatever format it came in.

A model's plan, spec and program are its own: read from the architectures row of the part its
``models`` row comes from, or, where that part kept no program (an ingest keeps each
architecture's program once), from its own zoo's rows of that architecture when their programs
are one program by content hash. Never from another zoo: architectures are shared by signature,
so one zoo's ``.pt2`` archive would otherwise become the network of every model of its
architecture, other zoos' included. The program is checked again before it runs
(``runnable.program_from_catalog``, ``runnable.Network``).
"""
from __future__ import annotations

import hashlib
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

MODEL_ROW = ("SELECT m.model_id, m.architecture_id, m.checkpoint, m.metadata_json, a.plan_json, p.zoo, p.part "
             "FROM models m JOIN architectures a USING (architecture_id) JOIN _model_parts p USING (model_id) "
             "WHERE m.model_id = ?")
# the architecture's rows in the model's own zoo (graphstore.duck: one per part that wrote it)
OWN_ZOO_ROWS = ("SELECT part, plan_json, spec_json, program_json, program_tensors FROM _architecture_rows "
                "WHERE architecture_id = ? AND zoo = ? ORDER BY part")
# (architecture id, content hash of its spec or program) -> the exported graph, the newest
# EXPORTED_CACHE kept: the signature leaves parameter names out, so two catalogs' programs of one
# architecture may name them apart, and two zoos' programs may differ in their tensors
_EXPORTED: OrderedDict[tuple[str, str], Any] = OrderedDict()
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
        key = (self.architecture_id, program_hash(*self.program) if self.program[0] is not None
               else json.dumps(self.spec, sort_keys=True))
        exported = _EXPORTED.get(key)
        if exported is None:
            if self.spec is not None:
                exported = exported_from_spec(self.spec)
            elif self.program[0] is not None:
                exported = program_from_catalog(*self.program, state, f"model {self.model_id}")
            else:
                raise JobError(f"model {self.model_id}'s network cannot be rebuilt: it has no JSON spec and its "
                               "zoo kept no program of its architecture (ingested before programs were kept: "
                               "ingest its zoo again into a new catalog)")
            _EXPORTED[key] = exported
            while len(_EXPORTED) > EXPORTED_CACHE:
                _EXPORTED.popitem(last=False)
        _EXPORTED.move_to_end(key)
        return Network(exported, state, f"model {self.model_id}").eval()


def program_hash(program_json: str | None, program_tensors: bytes | None) -> str:
    """sha256 over a kept program's JSON and its tensors: two rows keep one program when equal."""
    h = hashlib.sha256((program_json or "").encode())
    h.update(b"|tensors|" + (program_tensors or b""))
    return h.hexdigest()


def own_architecture(con, model_id: str, architecture_id: str, zoo: str, part: str) -> tuple:
    """(plan JSON or None, spec JSON or None, (program JSON, program tensors)) of ``model_id``: its own
    part's architectures row, a program from its own zoo's other rows only when they keep one
    program by content hash (see the module docstring)."""
    rows = con.execute(OWN_ZOO_ROWS, [architecture_id, zoo]).fetchall()
    own = next((r for r in rows if r[0] == part), None)
    plan_json, spec_json = (own[1], own[2]) if own else (None, None)
    if spec_json is None:
        spec_json = next((r[2] for r in rows if r[2]), None)
    if spec_json is not None:                   # the spec's own module runs: no program is read
        return plan_json, spec_json, (None, None)
    if own is not None and own[3] is not None:
        return plan_json, spec_json, (own[3], own[4])
    kept = {program_hash(r[3], r[4]): (r[3], r[4]) for r in rows if r[3] is not None}
    if len(kept) > 1:
        raise JobError(f"model {model_id}: its zoo {zoo!r} keeps {len(kept)} different programs of architecture "
                       f"{architecture_id} and its own part none; which one is its network is not known (ingest "
                       "the zoo again into a new catalog)")
    return plan_json, spec_json, next(iter(kept.values()), (None, None))


def load_model(con, model_id: str) -> CatalogModel:
    """Rebuild ``model_id`` from the catalog's models, its own architectures rows, nodes and edges."""
    row = con.execute(MODEL_ROW, [model_id]).fetchone()
    if row is None:
        raise JobError(f"no model {model_id!r} in the catalog")
    _, arch, checkpoint, metadata_json, shared_plan, zoo, part = row
    plan_json, spec_json, program = own_architecture(con, model_id, arch, zoo, part)
    plan = Plan.from_json(plan_json or shared_plan)
    graph, = read_graphs(con, [model_id], plans={arch: plan})
    return CatalogModel(model_id, arch, checkpoint, plan, json.loads(spec_json) if spec_json else None,
                        graph.validate(), json.loads(metadata_json or "{}"), program)


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
