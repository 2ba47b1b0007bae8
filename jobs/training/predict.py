"""``jobs predict``: a run's trained predictor applied to (new) models of the catalog.
"""
from __future__ import annotations

import uuid

import numpy as np
import torch

from graphstore import duck
from graphstore.catalog import Catalog
from jobs.analysis.probing import node_prober
from jobs.metanets.probes import check_probe_graph
from jobs.predictors.stacking import read_stack
from jobs.training.artifacts import load_metanetwork
from jobs.training.data import GraphStream, Selection, select_models
from jobs.training.inference import infer_ensemble
from jobs.training.preparation import run_preparation
from jobs.training.run_weights import read_predictor, require_run
from jobs.training.runs import PredictReport, write_back, write_run
from jobs.training.tasks import task_named
from jobs.training.trust import warning_line
from zoocore.errors import JobError


def predict(catalog: Catalog | str, run_id: str, where: str | None = None, device: str = "cpu", store=None,
            batch_size: int = 64) -> PredictReport:
    """Apply a run's trained predictor to the models matching ``where`` (targets need not be known):
    its metanetwork (blended with its baseline when the run blended them) or its fitted predictor."""
    catalog = (catalog if isinstance(catalog, Catalog) else Catalog(catalog)).require()
    require_run(catalog, run_id)
    if catalog.read_artifact(run_id, "metanet.json") is None:
        tabular = read_predictor(catalog, run_id, "predictor")
        if tabular is not None:
            return _predict_tabular(catalog, run_id, tabular, where, store)
    models, manifest = load_metanetwork(catalog, run_id, device)
    stack = read_stack(catalog, run_id)
    model, task = models[0], manifest.task_kind
    con = duck.connect(catalog)
    sel = select_models(con, manifest.target, where, manifest.task, classes=manifest.classes or None,
                        require_target=False, catalog=catalog)
    frame = manifest.frame
    if sel.frame[0] > frame[0] or sel.frame[1] > frame[1]:
        raise JobError(f"these models have kernels up to {sel.frame}, the metanetwork was trained on {frame}")
    unknown = set(sel.etypes) - set(model.cfg.etypes)
    if unknown:
        raise JobError(f"these models have edge types the metanetwork never saw: {sorted(unknown)}")
    sel.frame, sel.etypes = frame, list(model.cfg.etypes)
    if model.cfg.probes:
        check_probe_graph(sel.etypes)
    stream = GraphStream(con, sel, manifest.stats, raw=bool(model.cfg.probes),
                         prepare=run_preparation(manifest.train),
                         probe=node_prober(con, model.cfg.fixed_probes, inputs=model.cfg.probe_inputs) if model.cfg.fixed_probes else None)
    if model.cfg.statistics_dim:
        if manifest.head is None or manifest.head.width != model.cfg.statistics_dim:
            raise JobError(f"run {run_id}: its metanetwork reads statistics its manifest does not describe")
        stream.side = manifest.head.of_models(con, sel.model_ids)
    out, emb = infer_ensemble(models, stream, np.arange(len(sel.model_ids)), batch_size, torch.device(device), task)
    kind = manifest.model.kind
    results = {kind: task.decode(out, manifest.scale)}
    if stack is not None:
        blended = stack.predict(con, sel.model_ids, results[kind])     # a residual run's metanetwork row too
        results = {**blended, **{k: v for k, v in results.items() if k not in blended}}
    flags = manifest.trust.judge_catalog(con, sel.model_ids) if manifest.trust is not None else None
    con.close()
    return _write_predictions(catalog, run_id, where, sel, results, emb, store, flags)


def _predict_tabular(catalog: Catalog, run_id: str, predictor, where: str | None, store) -> PredictReport:
    con = duck.connect(catalog)
    try:
        sel = select_models(con, predictor.target, where, predictor.task, classes=predictor.classes or None,
                            require_target=False, catalog=catalog)
        pred, _ = predictor.predict(con, sel.model_ids)
    finally:
        con.close()
    return _write_predictions(catalog, run_id, where, sel, {predictor.name: pred},
                              np.zeros((len(sel.model_ids), 0), np.float32), store)


def _write_predictions(catalog: Catalog, run_id: str, where, sel: Selection, results: dict[str, np.ndarray],
                       emb: np.ndarray, store, flags: np.ndarray | None = None) -> PredictReport:
    """A prediction run's rows (the first of ``results`` is its answer, ``flags`` whether each input
    lies within the training models' weight scales), and the answer into the store."""
    task = task_named(sel.task)
    method, pred = next(iter(results.items()))
    known = task.known(sel.targets)
    metrics = {m: (task.metrics(sel.targets[known & np.isfinite(p)], p[known & np.isfinite(p)])
                   if (known & np.isfinite(p)).sum() >= 2 else {}) for m, p in results.items()}
    new_run = f"{run_id}-predict-{uuid.uuid4().hex[:6]}"
    write_run(catalog, new_run, {"where": where, "source_run": run_id}, sel, results, emb, metrics,
              catalog.location("artifacts", run_id), splits=np.array(["predict"] * len(sel.model_ids)), method=method,
              in_distribution=flags)
    if store is not None:
        write_back(catalog, store, sel, pred, run_id)
    return PredictReport(run_id, len(sel.model_ids), sel.target, metrics[method],
                         warning_line(flags) if flags is not None else None)
