"""Rebuild the graph store from the Parquet catalog, the source of truth, or repair it for some models.

``sync_store`` never leaves a half-built graph: it reads and checks everything first, then clears
and writes inside one store transaction, so a failure at any point (a bad value, a lost connection,
a full disk) leaves the graph as it was. ``reconcile_models`` writes the models of a list that the
graph lacks (ingest and training call it, so a re-run repairs a graph write that was lost).
"""
from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from graphstore import duck
from graphstore.catalog import Catalog
from graphstore.metadata.base import _SKIP_MODEL, MetadataStore, batches, check_property
from zoocore.errors import StoreError

# what the graph store's Architecture nodes are made of (the plan and a kept program stay in Parquet)
ARCHITECTURE_COLUMNS = "* EXCLUDE (plan_json, spec_json, program_json, program_tensors)"
ONE_MODEL_PER_ARCHITECTURE = (
    "SELECT l.*, r.architecture_id FROM layers l JOIN "
    "(SELECT architecture_id, min(model_id) AS model_id FROM models GROUP BY architecture_id) r USING (model_id)")
# Per model and target, the newest run's own answer: the predictions of the method the run names
# (``runs.method``), a label where the task gives one, else the number. Runs saved before the column
# existed name their metanetwork in their configuration (``model``), NG-GNN before that.
LATEST_PREDICTIONS = (
    "SELECT p.target, p.model_id, arg_max(p.predicted_label, r.created_at), arg_max(p.predicted, r.created_at), "
    "arg_max(p.run_id, r.created_at) FROM predictions p JOIN runs r USING (run_id) "
    "WHERE p.method = coalesce(r.method, json_extract_string(r.config_json, '$.model'), 'ngnn') "
    "AND (p.predicted IS NOT NULL OR p.predicted_label IS NOT NULL) "
    "GROUP BY p.target, p.model_id ORDER BY p.target, p.model_id")


LATEST_LAYER_EQUIVARIANCE = (  # per model, transform and layer, the error of the newest analysis
    "SELECT transform, model_id, layer, arg_max(error, created_at), arg_max(analysis_id, created_at) "
    "FROM layer_equivariance GROUP BY ALL ORDER BY transform, model_id, layer")
SIMILAR_EDGES = "SELECT query_id, neighbour_id, score, run_id FROM similarities ORDER BY run_id, query_id, rank"


@dataclass
class SyncReport:
    store: str
    models: int
    architectures: int
    predictions: int
    layer_equivariance: int = 0

    def __str__(self) -> str:
        return (f"synced {self.store}: {self.models} models, {self.architectures} architectures, "
                f"{self.predictions} predictions"
                + (f", {self.layer_equivariance} layer-equivariance errors" if self.layer_equivariance else ""))


def sync_store(catalog: Catalog | str, store: MetadataStore, clear: bool = True, batch: int = 2000) -> SyncReport:
    """Rebuild ``store`` from the catalog (``clear=False``: merge into what it holds), atomically:
    on any failure the store keeps the graph it had and StoreError says why."""
    catalog = catalog if isinstance(catalog, Catalog) else Catalog(catalog)
    catalog.require()
    con = duck.connect(catalog)
    try:
        # everything is read and checked before the store is touched
        bad = [c for c in con.sql("SELECT * FROM models LIMIT 0").columns
               if c not in _SKIP_MODEL and not _valid_property(c)]
        if bad:
            raise StoreError(f"the catalog's models have columns that cannot be graph properties: {', '.join(bad)} "
                             "(lower-case letters, digits and _, not starting with a digit); the graph store "
                             "was left unchanged")
        architectures = con.sql(f"SELECT {ARCHITECTURE_COLUMNS} FROM architectures").arrow().read_all().to_pylist()
        layers = con.sql(ONE_MODEL_PER_ARCHITECTURE).arrow().read_all().to_pylist()
        preds = con.sql(LATEST_PREDICTIONS).fetchall()
        equivariance = con.execute(LATEST_LAYER_EQUIVARIANCE).fetchall()
        by_analysis: dict[tuple[str, str], list] = {}
        for transform, model_id, layer, error, analysis_id in equivariance:
            by_analysis.setdefault((transform, analysis_id), []).append((model_id, layer, error))
        similar: dict[str, list] = {}
        for a, b, score, run_id in con.execute(SIMILAR_EDGES).fetchall():
            similar.setdefault(run_id, []).append((a, b, score))
        by_target: dict[tuple[str, str], list] = {}
        for target, model_id, label, number, run_id in preds:
            value = label if label is not None else number
            if value is not None:
                by_target.setdefault((target, run_id), []).append((model_id, value))
        n_models = 0

        def write(target: MetadataStore) -> None:
            nonlocal n_models
            target.write_models([], architectures, layers)
            for rb in duck.stream(con, "SELECT * FROM models ORDER BY model_id", batch_size=batch):
                rows = rb.to_pylist()
                target.write_models(rows, [], [])
                n_models += len(rows)
            for (target_name, run_id), rows in by_target.items():
                target.write_predictions(target_name, rows, run_id)
            for run_id, pairs in similar.items():
                target.write_similar(pairs, run_id)
            for (transform, analysis_id), rows in by_analysis.items():
                target.write_layer_equivariance(transform, rows, analysis_id)

        try:
            rebuild = getattr(store, "rebuild", None)
            if clear and rebuild is not None:          # a fresh database, swapped in whole (the embedded store)
                rebuild(write)
            else:
                with store.transaction():
                    if clear:
                        store.clear()
                    write(store)
        except StoreError as exc:
            raise StoreError(f"{exc} (the graph store was left as it was)") from exc
    finally:
        con.close()
    return SyncReport(store.describe(), n_models, len(architectures), len(preds), len(equivariance))


def _valid_property(name: str) -> bool:
    try:
        check_property(name)
        return True
    except StoreError:
        return False


PRESENT = ("MATCH (:Zoo)-[:CONTAINS]->(m:Model)-[:HAS_ARCHITECTURE]->(:Architecture) "
           "WHERE m.model_id IN $ids RETURN DISTINCT m.model_id AS model_id")


def missing_models(store: MetadataStore, model_ids) -> list[str]:
    """The models of ``model_ids`` the graph store lacks, or holds without their zoo or architecture."""
    ids = list(dict.fromkeys(model_ids))
    store.ensure_schema()
    present: set[str] = set()
    for chunk in batches(ids):
        present.update(r[0] for r in store.run(PRESENT, {"ids": chunk}).rows)
    return [i for i in ids if i not in present]


def reconcile_models(catalog: Catalog | str, store: MetadataStore, model_ids) -> int:
    """Write the models of ``model_ids`` that the graph store lacks (with their architectures and
    layers) from Parquet; returns how many were written."""
    missing = missing_models(store, model_ids)
    if not missing:
        return 0
    catalog = catalog if isinstance(catalog, Catalog) else Catalog(catalog)
    con = duck.connect(catalog, ["models", "architectures", "layers"])
    try:
        con.register("_ids", pa.table({"model_id": missing}))
        con.execute("CREATE TEMP TABLE _wanted AS SELECT m.* FROM models m JOIN _ids USING (model_id)")
        models = con.sql("SELECT * FROM _wanted ORDER BY model_id").arrow().read_all().to_pylist()
        archs = con.sql(f"SELECT {ARCHITECTURE_COLUMNS} FROM architectures WHERE architecture_id IN "
                        "(SELECT architecture_id FROM _wanted)").arrow().read_all().to_pylist()
        layers = con.sql("SELECT l.*, w.architecture_id FROM layers l JOIN (SELECT architecture_id, "
                         "min(model_id) AS model_id FROM _wanted GROUP BY 1) w USING (model_id)"
                         ).arrow().read_all().to_pylist()
    finally:
        con.close()
    store.write_models([], archs, layers)
    for chunk in batches(models, 2000):
        store.write_models(chunk, [], [])
    return len(models)
