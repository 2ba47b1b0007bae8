"""Rebuild the graph store from the Parquet catalog, the source of truth."""
from __future__ import annotations

from dataclasses import dataclass

from graphstore import duck
from graphstore.catalog import Catalog
from graphstore.metadata.base import MetadataStore

ONE_MODEL_PER_ARCHITECTURE = (
    "SELECT l.*, r.architecture_id FROM layers l JOIN "
    "(SELECT architecture_id, min(model_id) AS model_id FROM models GROUP BY architecture_id) r USING (model_id)")
LATEST_PREDICTIONS = (  # per model and target, the NG-GNN prediction of the newest run (label for classification)
    "SELECT p.target, p.model_id, "
    "arg_max(CASE WHEN r.task = 'regression' THEN CAST(p.predicted AS VARCHAR) ELSE p.predicted_label END, "
    "r.created_at), arg_max(p.run_id, r.created_at), arg_max(r.task, r.created_at) "
    "FROM predictions p JOIN runs r USING (run_id) "
    "WHERE p.method = 'ngnn' AND (p.predicted IS NOT NULL OR p.predicted_label IS NOT NULL) "
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
    """Clear ``store`` (unless ``clear=False``) and write everything the catalog knows into it."""
    catalog = catalog if isinstance(catalog, Catalog) else Catalog(catalog)
    catalog.require()
    con = duck.connect(catalog)
    if clear:
        store.clear()
    store.ensure_schema()
    architectures = con.sql("SELECT * FROM architectures").arrow().read_all().to_pylist()
    layers = con.sql(ONE_MODEL_PER_ARCHITECTURE).arrow().read_all().to_pylist()
    store.write_models([], architectures, layers)
    n_models = 0
    for rb in duck.stream(con, "SELECT * FROM models ORDER BY model_id", batch_size=batch):
        rows = rb.to_pylist()
        store.write_models(rows, [], [])
        n_models += len(rows)
    preds = con.sql(LATEST_PREDICTIONS).fetchall()
    by_target: dict[tuple[str, str], list] = {}
    for target, model_id, value, run_id, task in preds:
        if value is not None:
            by_target.setdefault((target, run_id), []).append(
                (model_id, float(value) if task == "regression" else value))
    for (target, run_id), rows in by_target.items():
        store.write_predictions(target, rows, run_id)
    similar: dict[str, list] = {}
    for a, b, score, run_id in con.execute(SIMILAR_EDGES).fetchall():
        similar.setdefault(run_id, []).append((a, b, score))
    for run_id, pairs in similar.items():
        store.write_similar(pairs, run_id)
    equivariance = con.execute(LATEST_LAYER_EQUIVARIANCE).fetchall()
    by_analysis: dict[tuple[str, str], list] = {}
    for transform, model_id, layer, error, analysis_id in equivariance:
        by_analysis.setdefault((transform, analysis_id), []).append((model_id, layer, error))
    for (transform, analysis_id), rows in by_analysis.items():
        store.write_layer_equivariance(transform, rows, analysis_id)
    con.close()
    return SyncReport(store.describe(), n_models, len(architectures), len(preds), len(equivariance))
