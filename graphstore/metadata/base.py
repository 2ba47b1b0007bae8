"""The metadata-store interface shared by the Neo4j and Ladybug backends.

Graph schema::

    (:Zoo)-[:CONTAINS]->(:Model)-[:HAS_ARCHITECTURE]->(:Architecture)-[:HAS_LAYER {position}]->(:Layer)
    (:Layer)-[:FEEDS]->(:Layer)            wiring between operations, residuals included
    (:Model)-[:TRAINED_ON]->(:Dataset)
    (:Model)-[:SIMILAR_TO {score, run_id}]->(:Model)

Public methods validate and batch; backends implement the ``_`` methods. All values travel as
query parameters; the only names put into query text are property names, which must match
``PROPERTY_NAME`` (they come from the catalog schema, never from a user's value).
"""
from __future__ import annotations

import contextlib
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from graphstore.metadata import queries as Q
from zoocore.errors import StoreError

PROPERTY_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
BATCH = 500
# Model properties every store has, so queries that name them work on an empty or partial graph.
# The metadata ones among them (test_accuracy, optimizer, label, ...) are defaults: where a zoo's
# column has another type, the catalog's type (graphstore.column_types: the first zoo that gives a
# column values decides it, later misfits are recorded as null) replaces the default.
BASE_MODEL_PROPERTIES: dict[str, str] = {
    "zoo": "STRING", "source_path": "STRING", "checkpoint": "STRING", "architecture_id": "STRING",
    "num_params": "INT64", "num_nodes": "INT64", "num_edges": "INT64", "metadata_json": "STRING",
    "test_accuracy": "DOUBLE", "train_accuracy": "DOUBLE", "optimizer": "STRING", "dataset": "STRING",
    "activation": "STRING", "label": "DOUBLE",
}
_SKIP_MODEL = {"model_id", "kernel_h", "kernel_w", "buffers_json", "ingested_at"}


@dataclass
class QueryResult:
    columns: list[str]
    rows: list[list[Any]]
    notices: list[str] = field(default_factory=list)   # warnings from the database (unknown label...)
    query_type: str | None = None          # the server's kind of statement where it says: r, rw, w, s

    def records(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, r)) for r in self.rows]


def check_property(name: str) -> str:
    if not PROPERTY_NAME.match(name):
        raise StoreError(f"invalid property name {name!r} (lower-case letters, digits and _ only)")
    return name


def property_type(value: Any) -> str:
    if isinstance(value, bool):
        return "BOOLEAN"
    if isinstance(value, int):
        return "INT64"
    if isinstance(value, float):
        return "DOUBLE"
    return "STRING"


def layer_rows(layers: Sequence[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """Layer nodes, HAS_LAYER and FEEDS rows, one set per architecture (not per model).

    ``layers`` rows are per model (the catalog's layers relation) with their ``architecture_id``;
    the first model seen of an architecture supplies its layers. FEEDS joins operation i to j when
    j reads the neuron layer that i writes.
    """
    by_arch: dict[str, list[dict]] = {}
    for row in layers:
        arch = row.get("architecture_id")
        if arch is None:
            continue
        bucket = by_arch.setdefault(arch, [])
        if bucket and bucket[0]["model_id"] != row["model_id"]:
            continue
        bucket.append(row)
    nodes, has, feeds = [], [], []
    for arch, rows in by_arch.items():
        rows = sorted(rows, key=lambda r: r["layer"])
        writers: dict[int, list[str]] = {}
        for r in rows:
            lid = f"{arch}:{r['layer']}"
            nodes.append({"layer_id": lid, "architecture_id": arch, "position": int(r["layer"]), "kind": r["kind"],
                          "relation": r["relation"], "in_size": int(r["in_size"]), "out_size": int(r["out_size"]),
                          "kernel_h": int(r["kernel_h"]), "kernel_w": int(r["kernel_w"]),
                          "groups": int(r["groups"] or 1), "activation": r["activation"]})
            has.append({"architecture_id": arch, "layer_id": lid, "position": int(r["layer"])})
            writers.setdefault(int(r["dst_layer"]), []).append(lid)
        for r in rows:
            for src in writers.get(int(r["src_layer"]), []):
                if src != f"{arch}:{r['layer']}":
                    feeds.append({"src": src, "dst": f"{arch}:{r['layer']}"})
    return nodes, has, feeds


def architecture_rows(architectures: Sequence[dict], layer_nodes: Sequence[dict]) -> list[dict]:
    """Architecture properties, with layer-kind counts from ``layer_rows``' layer nodes."""
    counts: dict[str, dict[str, int]] = {}
    for n in layer_nodes:
        c = counts.setdefault(n["architecture_id"], {})
        c[n["kind"]] = c.get(n["kind"], 0) + 1
    out = []
    for a in architectures:
        c = counts.get(a["architecture_id"], {})
        out.append({"architecture_id": a["architecture_id"], "summary": a.get("summary"),
                    "num_params": int(a["num_params"]), "num_nodes": int(a["num_nodes"]),
                    "num_edges": int(a["num_edges"]), "num_layers": int(a["num_ops"]),
                    "num_conv": c.get("conv", 0), "num_linear": c.get("linear", 0),
                    "has_batchnorm": c.get("batch_norm", 0) > 0, "has_residual": c.get("residual", 0) > 0})
    return out


class MetadataStore(ABC):
    """A Cypher property-graph store of architecture metadata."""

    backend: str = "?"
    query_timeout: float | None = None     # seconds a user's query (``run``) may take; None: no limit

    def __init__(self, read_only: bool = False):
        self._model_props: dict[str, str] = {}
        self.read_only = read_only

    # -------------------------------------------------------------- public API
    def write_models(self, models: Sequence[dict], architectures: Sequence[dict], layers: Sequence[dict]) -> None:
        """MERGE zoos, models, datasets, architectures and layers (idempotent, batched)."""
        self.ensure_schema()
        arch_of = {m["model_id"]: m["architecture_id"] for m in models}
        layers = [dict(r, architecture_id=arch_of.get(r["model_id"], r.get("architecture_id"))) for r in layers]
        lnodes, has, feeds = layer_rows(layers)
        self._merge("architectures", architecture_rows(architectures, lnodes))
        self._merge("layers", lnodes)
        self._merge("has_layer", has)
        self._merge("feeds", feeds)
        rows = []
        for m in models:
            props = {}
            for k, v in m.items():
                if k in _SKIP_MODEL or v is None:
                    continue
                name = check_property(k)
                props[name] = float(v) if isinstance(v, int) and not isinstance(v, bool) and \
                    self._model_props.get(name, BASE_MODEL_PROPERTIES.get(name)) == "DOUBLE" else v
            rows.append({"model_id": m["model_id"], "zoo": m["zoo"], "architecture_id": m["architecture_id"],
                         "dataset": m.get("dataset"), "props": props})
        self._ensure_model_properties({k: property_type(v) for r in rows for k, v in r["props"].items()})
        self._merge("zoos", [{"name": z} for z in sorted({r["zoo"] for r in rows})])
        self._merge("datasets", [{"name": d} for d in sorted({r["dataset"] for r in rows if r["dataset"]})])
        self._merge("models", rows)

    def write_predictions(self, target: str, rows: Iterable[tuple[str, Any]], run_id: str) -> None:
        """Set ``predicted_<target>`` (a number for regression, the class label for classification)
        and ``predicted_<target>_run`` on models."""
        rows = [(m, v) for m, v in rows if v is not None]
        prop = check_property("predicted_" + target.lower())
        kind = "STRING" if any(isinstance(v, str) for _, v in rows) else "DOUBLE"
        self.ensure_schema()
        self._ensure_model_properties({prop: kind, prop + "_run": "STRING"})
        payload = [{"model_id": m, "value": str(v) if kind == "STRING" else float(v), "run_id": run_id}
                   for m, v in rows]
        self._set_model_property(prop, payload)

    def write_layer_equivariance(self, transform: str, rows: Iterable[tuple[str, int, float]], analysis_id: str) -> None:
        """Set ``equivariance_<transform>_f<layer>`` (the median relative error of ``jobs
        layer-equivariance``, e.g. ``equivariance_mirror_lr_f1``) and its ``..._run`` on models;
        ``rows`` are (model_id, layer, error)."""
        base = "equivariance_" + "".join(c if c.isalnum() else "_" for c in transform.lower())
        by_layer: dict[int, list[dict]] = {}
        for model_id, layer, error in rows:
            if error is not None:
                by_layer.setdefault(int(layer), []).append({"model_id": model_id, "value": float(error),
                                                            "run_id": analysis_id})
        if not by_layer:
            return
        self.ensure_schema()
        for layer, payload in sorted(by_layer.items()):
            prop = check_property(f"{base}_f{layer}")
            self._ensure_model_properties({prop: "DOUBLE", prop + "_run": "STRING"})
            self._set_model_property(prop, payload)

    def write_similar(self, pairs: Iterable[tuple[str, str, float]], run_id: str) -> None:
        """MERGE ``(a)-[:SIMILAR_TO {run_id}]->(b)`` with its score."""
        self.ensure_schema()
        self._merge("similar", [{"a": a, "b": b, "score": float(s), "run_id": run_id} for a, b, s in pairs])

    def run(self, query: str, params: dict[str, Any] | None = None) -> QueryResult:
        """Run a Cypher query with parameters; errors become StoreError with the database's message.
        On a read-only store, anything but one read-only statement raises CypherRefused."""
        if self.read_only:
            from graphstore.metadata.read_only import check_read_only

            check_read_only(query)
            self._check_plan(query, params or {})
        return self._run(query, params or {})

    def _check_plan(self, query: str, params: dict[str, Any]) -> None:
        """A backend whose server can tell a query's kind without running it refuses here what is
        not read-only (Neo4j: EXPLAIN's query type)."""

    def ensure_schema(self) -> None:
        if self.read_only:
            raise StoreError(f"{self.describe()} was opened read-only")
        if not getattr(self, "_schema_ready", False):
            self._ensure_schema()
            self._schema_ready = True
            # defaults only where the store has no such property: a type the catalog gave wins
            missing = {k: t for k, t in BASE_MODEL_PROPERTIES.items() if k not in self._model_props}
            self._ensure_model_properties(missing)

    def clear(self) -> None:
        """Delete every node and relationship (schema kept)."""
        self._clear()

    @contextlib.contextmanager
    def transaction(self):
        """Everything written inside is committed together when the block ends, or not at all
        when it raises: the store keeps what it held before."""
        self.ensure_schema()
        self._begin()
        try:
            yield self
        except BaseException:
            self._rollback()
            self._schema_ready = False          # property types added inside are undone too
            self._model_props = {}
            raise
        self._commit()

    # -------------------------------------------------------------- merging (shared)
    _MERGES = {"zoos": (Q.MERGE_ZOOS,), "datasets": (Q.MERGE_DATASETS,),
               "architectures": (Q.MERGE_ARCHITECTURES,), "layers": (Q.MERGE_LAYERS,),
               "has_layer": (Q.MERGE_HAS_LAYER,), "feeds": (Q.MERGE_FEEDS,), "similar": (Q.MERGE_SIMILAR,)}

    def _merge(self, what: str, rows: list[dict]) -> None:
        if not rows:
            return
        if what == "models":
            return self._merge_models(rows)
        for chunk in batches(rows):
            for q in self._MERGES[what]:
                self._write(q, chunk)

    def _merge_models(self, rows: list[dict]) -> None:
        keys = sorted({k for r in rows for k in r["props"]})
        flat = [{"model_id": r["model_id"], **{k: r["props"].get(k) for k in keys}} for r in rows]
        for chunk in batches(flat):
            self._write(Q.set_model_props(keys), chunk)
        rel = [{k: r[k] for k in ("model_id", "zoo", "architecture_id")} for r in rows]
        for chunk in batches(rel):
            self._write(Q.MERGE_CONTAINS, chunk)
            self._write(Q.MERGE_HAS_ARCHITECTURE, chunk)
        trained = [{"model_id": r["model_id"], "dataset": r["dataset"]} for r in rows if r["dataset"]]
        for chunk in batches(trained):
            self._write(Q.MERGE_TRAINED_ON, chunk)

    def _set_model_property(self, prop: str, rows: list[dict]) -> None:
        for chunk in batches(rows):
            self._write(Q.set_model_property(prop), chunk)

    # -------------------------------------------------------------- backend hooks
    @abstractmethod
    def _ensure_schema(self) -> None: ...

    @abstractmethod
    def _ensure_model_properties(self, props: dict[str, str]) -> None: ...

    @abstractmethod
    def _write(self, query: str, rows: list[dict]) -> None:
        """Run one parametrised write with ``$rows`` bound to ``rows``."""

    @abstractmethod
    def _run(self, query: str, params: dict[str, Any]) -> QueryResult: ...

    @abstractmethod
    def _clear(self) -> None: ...

    @abstractmethod
    def _begin(self) -> None: ...

    @abstractmethod
    def _commit(self) -> None: ...

    @abstractmethod
    def _rollback(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def batches(rows: list[dict], size: int = BATCH):
    for i in range(0, len(rows), size):
        yield rows[i:i + size]
