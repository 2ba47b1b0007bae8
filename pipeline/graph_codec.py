"""The one codec between an in-memory neural graph and the catalog's ``nodes`` and ``edges`` relations.

Writing (``graph_tables``): NeuralGraphs -> the Arrow tables of schema.NODES and schema.EDGES.
Reading (``read_graphs``): model ids -> NeuralGraphs, streamed out of DuckDB in record batches, with
what the exact inverse and the symmetry transforms need besides nodes and edges (the architecture's
operations and layer activations from its plan, the model's kernel frame and buffers).

``read_graphs(graph_tables(g))`` gives ``g`` back exactly (tests/graphstore/test_graph_codec.py).
"""
from __future__ import annotations

import json
from typing import Sequence

import numpy as np
import pyarrow as pa

from graphstore import duck
from graphstore.schema import EDGES, NODES
from pipeline.neural_graph.graph import NeuralGraph
from pipeline.neural_graph.plan import Plan
from pipeline.neural_graph.vocabulary import ACTIVATIONS, NODE_TYPES, RELATIONS
from zoocore.errors import CatalogError

NODES_QUERY = ("SELECT model_id, node, node_type, layer, position, bias, running_mean, running_var FROM nodes "
               "WHERE model_id IN (SELECT model_id FROM {ids}) ORDER BY model_id, node")
EDGES_QUERY = ("SELECT model_id, src, dst, relation, layer, weight FROM edges "
               "WHERE model_id IN (SELECT model_id FROM {ids}) ORDER BY model_id, layer, dst, src")
MODELS_QUERY = ("SELECT m.model_id, m.architecture_id, m.kernel_h, m.kernel_w, m.buffers_json FROM models m "
                "WHERE m.model_id IN (SELECT model_id FROM {ids})")
PLANS_QUERY = ("SELECT architecture_id, plan_json FROM architectures WHERE architecture_id IN "
               "(SELECT DISTINCT architecture_id FROM models WHERE model_id IN (SELECT model_id FROM {ids}))")


# --------------------------------------------------------------------------- writing
def _dict_codes(codes: np.ndarray, names: Sequence[str]) -> pa.Array:
    return pa.DictionaryArray.from_arrays(pa.array(np.asarray(codes).astype(np.int8)),
                                          pa.array(list(names), pa.string()))


def _repeat_strings(values: Sequence[str], counts: Sequence[int]) -> pa.Array:
    idx = np.repeat(np.arange(len(values), dtype=np.int32), counts)
    return pa.DictionaryArray.from_arrays(pa.array(idx), pa.array(list(values), pa.string())).cast(pa.string())


def graph_tables(ids: Sequence[str], graphs: Sequence[NeuralGraph]) -> dict[str, pa.Table]:
    """The ``nodes`` and ``edges`` tables of ``graphs`` (one per model id), in the catalog's schema."""
    n_counts = [g.num_nodes for g in graphs]
    e_counts = [g.num_edges for g in graphs]
    extra = np.concatenate([g.extra for g in graphs])
    nodes = pa.table({
        "model_id": _repeat_strings(ids, n_counts),
        "node": pa.array(np.concatenate([np.arange(n, dtype=np.int64) for n in n_counts])),
        "node_type": _dict_codes(np.concatenate([g.node_type for g in graphs]), NODE_TYPES),
        "layer": pa.array(np.concatenate([g.node_layer for g in graphs]).astype(np.int32)),
        "position": pa.array(np.concatenate([g.node_position for g in graphs]).astype(np.int32)),
        "bias": pa.array(np.concatenate([g.bias for g in graphs]), pa.float32()),
        "activation": _dict_codes(np.concatenate([g.node_activation_codes() for g in graphs]), ACTIVATIONS),
        "running_mean": pa.array(extra[:, 0], pa.float32(), from_pandas=True),
        "running_var": pa.array(extra[:, 1], pa.float32(), from_pandas=True),
    }, schema=NODES)
    lengths = np.concatenate([np.full(g.num_edges, g.weight.shape[1], np.int64) for g in graphs])
    edges = _edges_table(_repeat_strings(ids, e_counts), np.concatenate([g.src for g in graphs]),
                         np.concatenate([g.dst for g in graphs]), np.concatenate([g.relation for g in graphs]),
                         np.concatenate([g.edge_op for g in graphs]), lengths,
                         np.concatenate([g.weight.reshape(-1) for g in graphs]))
    return {"nodes": nodes, "edges": edges}


def _edges_table(model_ids: pa.Array, src, dst, relation, layer, lengths, values) -> pa.Table:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.table({
        "model_id": model_ids, "src": pa.array(src), "dst": pa.array(dst),
        "relation": _dict_codes(relation, RELATIONS), "layer": pa.array(np.asarray(layer).astype(np.int32)),
        "weight": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.float32())),
    }, schema=EDGES)


def edges_batch(model_id: str, src: np.ndarray, dst: np.ndarray, relation: np.ndarray, layer: np.ndarray,
                weight: np.ndarray) -> pa.Table:
    """The ``edges`` rows of one block of one model's edges (e.g. one operation), for writers that
    stream a graph op by op instead of holding it whole (pipeline.neural_graph.stream)."""
    n = src.shape[0]
    return _edges_table(_repeat_strings([model_id], [n]), src, dst, relation, layer,
                        np.full(n, weight.shape[1], np.int64), weight.reshape(-1))


# --------------------------------------------------------------------------- reading
def dictionary_codes(col: pa.ChunkedArray | pa.Array, names: Sequence[str]) -> np.ndarray:
    """Dictionary or string column -> codes into ``names``."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if pa.types.is_dictionary(arr.type):
        lut = np.array([names.index(v) for v in arr.dictionary.to_pylist()], dtype=np.int64)
        return lut[arr.indices.to_numpy(zero_copy_only=False)]
    index = {n: i for i, n in enumerate(names)}
    return np.array([index[v] for v in arr.to_pylist()], dtype=np.int64)


def ids_table(con, ids: Sequence[str], name: str = "_ids") -> str:
    """Register ``ids`` on ``con`` (a cursor) as a one-column table ``name``; returns the name."""
    con.register(name, pa.table({"model_id": pa.array(list(ids), pa.string())}))
    return name


def _split_by_model(table: pa.Table) -> dict[str, pa.Table]:
    ids = table.column("model_id").to_numpy(zero_copy_only=False)
    if len(ids) == 0:
        return {}
    change = np.nonzero(ids[1:] != ids[:-1])[0] + 1
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change, [len(ids)]])
    return {ids[s]: table.slice(s, e - s) for s, e in zip(starts, ends)}


def _table(cur, query: str, batch_size: int) -> pa.Table:
    batches = list(duck.stream(cur, query, batch_size=batch_size, private_cursor=False))
    return pa.Table.from_batches(batches) if batches else cur.sql(query).to_arrow_table()


def read_plans(con, ids: Sequence[str]) -> tuple[dict[str, str], dict[str, Plan]]:
    """(architecture id per model, Plan per architecture) of ``ids``."""
    cur = con.cursor()
    try:
        name = ids_table(cur, ids, "_plan_ids")
        arch = dict(cur.execute(f"SELECT model_id, architecture_id FROM models WHERE model_id IN "
                                f"(SELECT model_id FROM {name})").fetchall())
        plans = {a: Plan.from_json(p) for a, p in cur.execute(PLANS_QUERY.format(ids=name)).fetchall()}
    finally:
        cur.close()
    return arch, plans


def read_graphs(con, ids: Sequence[str], batch_size: int = 262_144,
                plans: dict[str, Plan] | None = None) -> list[NeuralGraph]:
    """The NeuralGraphs of ``ids`` (in that order), nodes and edges streamed out of DuckDB.

    ``plans`` (architecture id -> Plan) is a cache the caller may keep between calls; plans missing
    from it are read and added.
    """
    plans = {} if plans is None else plans
    cur = con.cursor()
    try:
        name = ids_table(cur, ids, "_chunk")
        rows = {r[0]: r[1:] for r in cur.execute(MODELS_QUERY.format(ids=name)).fetchall()}
        unknown = [m for m in ids if m not in rows]
        if unknown:
            raise CatalogError(f"{len(unknown)} model(s) not in the catalog: {', '.join(map(str, unknown[:5]))}")
        missing = {a for a, *_ in rows.values()} - set(plans)
        if missing:
            for a, p in cur.execute(PLANS_QUERY.format(ids=name)).fetchall():
                plans.setdefault(a, Plan.from_json(p))
        nodes = _table(cur, NODES_QUERY.format(ids=name), batch_size)
        edges = _table(cur, EDGES_QUERY.format(ids=name), batch_size)
    finally:
        cur.close()
    by_nodes, by_edges = _split_by_model(nodes), _split_by_model(edges)
    out = []
    for mid in ids:
        n, e = by_nodes.get(mid), by_edges.get(mid)
        if n is None or e is None:
            raise CatalogError(f"model {mid} has no nodes or edges in the catalog")
        arch, kh, kw, buffers_json = rows[mid]
        plan = plans[arch]
        values = e.column("weight").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        extra = np.stack([n.column("running_mean").to_numpy(zero_copy_only=False),
                          n.column("running_var").to_numpy(zero_copy_only=False)], 1)
        out.append(NeuralGraph(
            node_type=dictionary_codes(n.column("node_type"), NODE_TYPES).astype(np.int8),
            node_layer=n.column("layer").to_numpy().astype(np.int32),
            node_position=n.column("position").to_numpy().astype(np.int32),
            bias=n.column("bias").to_numpy().astype(np.float32), extra=extra.astype(np.float32),
            layer_activation=[layer.activation for layer in plan.layers],
            src=e.column("src").to_numpy().astype(np.int64), dst=e.column("dst").to_numpy().astype(np.int64),
            relation=dictionary_codes(e.column("relation"), RELATIONS).astype(np.int8),
            edge_op=e.column("layer").to_numpy().astype(np.int32),
            weight=values.astype(np.float32).reshape(e.num_rows, int(kh) * int(kw)),
            kernel_shape=(int(kh), int(kw)), ops=plan.ops, buffers=json.loads(buffers_json or "{}")))
    return out
