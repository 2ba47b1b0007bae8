"""What a run leaves behind in the catalog, whatever predicted: the ``runs``, ``predictions`` and
``embeddings`` relations (committed at once), the graph store's ``predicted_<target>`` properties,
and the reports the CLI prints."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from graphstore.catalog import Catalog, now_utc
from graphstore.schema import EMBEDDINGS, PREDICTIONS, RUNS
from jobs.training.data import Selection
from jobs.training.tasks import task_named


@dataclass
class RunReport:
    run_id: str
    task: str
    target: str
    metrics: dict[str, dict[str, Any]]
    n_models: dict[str, int]
    seconds: float
    epochs_run: int
    store_warning: str | None = None
    artifact: Path | None = None
    history: list[dict[str, float]] = field(default_factory=list)

    def summary(self) -> str:
        lines = [f"run {self.run_id}: {self.task} of {self.target!r} on {self.n_models['train']} train / "
                 f"{self.n_models['val']} val / {self.n_models['test']} test models "
                 f"({self.epochs_run} epochs, {self.seconds:.0f}s)"]
        keys = task_named(self.task).metric_keys
        w = max(10, *map(len, self.metrics))
        lines.append(f"  {'method':{w}s} " + " ".join(f"{k:>12s}" for k in keys) + "   (test split)")
        for method, m in self.metrics.items():
            cells = " ".join(f"{m.get(k, float('nan')):12.4f}" if isinstance(m.get(k), (int, float))
                             else f"{'n/a':>12s}" for k in keys)
            note = f"   {m['note']}" if m.get("note") else ""
            lines.append(f"  {method:{w}s} {cells}{note}")
        if self.store_warning:
            lines.append(f"  graph store not updated: {self.store_warning} (run `graphstore sync` later)")
        return "\n".join(lines)


@dataclass
class PredictReport:
    run_id: str
    n: int
    target: str
    metrics: dict[str, float]
    warning: str | None = None           # how many inputs lie outside the training models' weight scales

    def summary(self) -> str:
        m = ", ".join(f"{k}={v:.4f}" for k, v in self.metrics.items() if isinstance(v, float))
        return f"predicted {self.target!r} for {self.n} models with run {self.run_id}" + (f" ({m} where known)" if m else "")


def write_back(catalog, store, sel: Selection, pred: np.ndarray, run_id: str) -> None:
    """Predictions into the graph store, after writing any of the run's models the store lacks
    (a lost ingest write), so that no prediction is silently dropped."""
    from graphstore.sync import reconcile_models

    reconcile_models(catalog, store, sel.model_ids)
    values = task_named(sel.task).store_values(pred, sel.classes)
    store.write_predictions(sel.target, zip(sel.model_ids, values), run_id)


def run_row(run_id: str, task: str, target: str, config: dict, metrics: dict, artifact: Path | None,
            method: str | None) -> pa.Table:
    """A run's row of the ``runs`` relation, whatever trained it (a predictor, an editor)."""
    return pa.table({"run_id": [run_id], "task": [task], "target": [target], "where_sql": [config.get("where")],
                     "config_json": [json.dumps(config, default=str)], "metrics_json": [json.dumps(metrics)],
                     "model_path": [str(artifact) if artifact else None], "created_at": [now_utc()],
                     "method": [method]}, schema=RUNS)


def write_run(catalog: Catalog, run_id: str, cfg, sel: Selection, results: dict[str, np.ndarray],
              emb: np.ndarray, metrics: dict, artifact: Path | None, splits: np.ndarray | None = None,
              method: str | None = None, in_distribution: np.ndarray | None = None) -> None:
    """The runs, predictions and embeddings relations of one run, committed atomically. ``method``:
    the predictor whose predictions are the run's answer (what `graphstore sync` writes back), by
    default the first of ``results``; ``in_distribution``: per model, whether its weight scales lie
    within the training models' (jobs.training.trust; None: not judged)."""
    config = asdict(cfg) if is_dataclass(cfg) else cfg
    runs = run_row(run_id, sel.task, sel.target, config, metrics, artifact, method or next(iter(results), None))
    splits = sel.splits if splits is None else splits
    cols: dict[str, list] = {k: [] for k in PREDICTIONS.names}
    task = task_named(sel.task)
    trusted = [None] * len(sel.model_ids) if in_distribution is None else [bool(f) for f in in_distribution]
    for method, values in results.items():
        for mid, split, v, lab, ok in zip(sel.model_ids, splits, task.numbers(values),
                                          task.labels(values, sel.classes), trusted):
            for k, val in (("run_id", run_id), ("model_id", mid), ("split", str(split)), ("target", sel.target),
                           ("predicted", v), ("predicted_label", lab), ("method", method),
                           ("in_distribution", ok)):
                cols[k].append(val)
    preds = pa.table(cols, schema=PREDICTIONS)
    if emb.size:
        flat = pa.array(emb.astype(np.float32).reshape(-1))
        offsets = pa.array(np.arange(0, emb.size + 1, emb.shape[1] if emb.ndim == 2 else 1, dtype=np.int32))
        embeddings = pa.table({"run_id": [run_id] * len(sel.model_ids), "model_id": sel.model_ids,
                               "vector": pa.ListArray.from_arrays(offsets, flat)}, schema=EMBEDDINGS)
    else:           # a predictor without embeddings (a tabular one)
        embeddings = EMBEDDINGS.empty_table()
    catalog.commit_results(run_id, {"runs": runs, "predictions": preds, "embeddings": embeddings})
