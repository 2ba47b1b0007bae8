"""``jobs train-heterognn``: select the models, fit the predictor the configuration names (a
metanetwork on streamed graphs with early stopping on validation, or a tabular one), fit the
tabular baselines on the same split, blend (jobs.predictors.stacking), and write the run
(jobs.training.runs, jobs.training.artifacts) and ``predicted_<target>`` in the graph store.

The walk: ``train_heterognn`` -> ``_selection`` -> preparation and statistics -> ``_fit_one`` per
ensemble member -> ``infer_ensemble`` -> calibration -> baselines and blend -> rescaled scoring ->
artifacts and the run's rows.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import asdict, fields

import numpy as np
import torch

from graphstore import duck
from graphstore.catalog import Catalog, now_utc
from jobs.config import DataConfig, MetanetConfig, ModelConfig, TrainConfig
from jobs.metanets import build_metanetwork
from jobs.metanets.ngnn import NGGNNConfig
from jobs.analysis.probing import node_prober
from jobs.metanets.probes import check_probe_graph
from jobs.predictors import baseline_names, entry
from jobs.predictors.stacking import stack_with_statistics, statistics_base
from jobs.predictors.tabular import feature_reads, fit_all, read_once
from jobs.training.artifacts import save_metanetwork
from jobs.training.data import (GraphStream, Selection, auxiliary_targets, layer_stats, layer_stats_of_graphs,
                                select_models)
from jobs.training.distributed import DistContext, barrier, broadcast, init_from_env, local_batch_size, shard
from jobs.training.head_statistics import HeadStatistics
from jobs.training.inference import apply, infer, infer_ensemble
from jobs.training.loop import Schedule, fit
from jobs.training.pretrained import load_pretrained
from jobs.training.preparation import read_prepared, run_preparation, symmetry_preparation, training_changes
from jobs.training.rescaled import score_rescaled
from jobs.training.run_weights import predictor_files
from jobs.training.runs import RunReport, write_back, write_run
from jobs.training.tasks import CALIBRATIONS, TargetScale, Task, task_named
from jobs.training.trust import TrustProfile
from zoocore.errors import JobError


def metanet_config(model: ModelConfig, etypes, frame: tuple[int, int], out_dim: int,
                   statistics_dim: int = 0) -> NGGNNConfig:
    """The metanetwork's configuration: the model part's hyperparameters plus what the selected
    models fix."""
    return NGGNNConfig(etypes=etypes, edge_in=frame[0] * frame[1], out_dim=out_dim, kind=model.model,
                       statistics_dim=statistics_dim,
                       **{f.name: getattr(model, f.name) for f in fields(MetanetConfig)})


def metrics_for(task: str, y: np.ndarray, p: np.ndarray) -> dict[str, float]:
    """The task's test metrics: Kendall tau, R^2, MAE (regression) or accuracy, macro-F1 (classification)."""
    return task_named(task).metrics(y, p)


class PredictionObjective:
    """The task's loss on the training models (a round is an epoch, this rank's shard of it) and
    its score (Kendall tau, accuracy) on the validation models: what the shared loop fits."""

    def __init__(self, task: Task, cfg: TrainConfig, sel: Selection, stream: GraphStream,
                 train_stream: GraphStream, train_idx, val_idx, scale: TargetScale, device, ctx: DistContext,
                 seed: int, aux: np.ndarray | None = None):
        self.task, self.cfg, self.sel, self.stream, self.train_stream = task, cfg, sel, stream, train_stream
        self.train_idx, self.val_idx, self.scale, self.device, self.ctx, self.seed = (
            train_idx, val_idx, scale, device, ctx, seed)
        self.loss_fn = task.loss(cfg.rank_weight)
        self.width = task.output_size(sel.classes)      # the target's outputs; any after them: --aux-targets
        self.aux = None if aux is None or not aux.shape[1] else torch.tensor(aux, dtype=torch.float32)

    def batches(self, epoch: int):
        local = shard(self.train_idx, self.ctx, seed=self.seed + epoch)
        for b, batch in enumerate(self.train_stream.batches(local, local_batch_size(self.cfg.batch_size, self.ctx))):
            if self.cfg.max_train_batches is not None and b >= self.cfg.max_train_batches:
                return
            yield batch

    def loss(self, model, batch):
        idx, graphs = batch
        out, _ = apply(model, self.train_stream, idx, graphs, self.device)
        loss = self.loss_fn(out[:, :self.width], self.task.encode(self.sel.targets[idx], self.scale, self.device))
        if self.aux is not None:          # each auxiliary target's squared error, where the model has a value
            aux = self.aux[torch.as_tensor(idx)].to(self.device)
            known = torch.isfinite(aux)
            if bool(known.any()):
                loss = loss + self.cfg.aux_weight * ((out[:, self.width:] - aux.nan_to_num())[known] ** 2).mean()
        return loss, len(idx)

    def score(self, model) -> float:
        idx = self.val_idx if len(self.val_idx) >= 2 else self.train_idx
        out, _ = infer(model, self.stream, idx, self.cfg.batch_size, self.device, self.ctx)
        return self.task.score(self.task.metrics(self.sel.targets[idx], self.task.decode(out, self.scale)))


def _fit_one(mcfg: NGGNNConfig, cfg: TrainConfig, seed: int, sel: Selection, stream: GraphStream, train_idx, val_idx,
             scale: TargetScale, device, progress: bool, desc: str, ctx: DistContext,
             train_stream: GraphStream | None = None, init: dict | None = None, aux: np.ndarray | None = None):
    """Train one metanetwork on the shared loop (jobs.training.loop) with early stopping on the
    validation split (data-parallel under torchrun: this rank's shard of every global batch,
    gradients all-reduced). Training batches come from ``train_stream`` (e.g. augmented) when
    given, validation from ``stream``; ``init``: a state dict to start from (--init-from); ``aux``: the
    auxiliary targets of every selected model (``auxiliary_targets``), learnt beside the target."""
    objective = PredictionObjective(task_named(sel.task), cfg, sel, stream, train_stream or stream, train_idx,
                                    val_idx, scale, device, ctx, seed, aux)
    torch.manual_seed(seed)
    model = build_metanetwork(mcfg)
    if init is not None:
        model.load_state_dict(init)
    model = model.to(device)
    step_model = model
    if ctx.active:          # some relations are absent from some batches: their parameters get no gradient
        step_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None, find_unused_parameters=True)
    epochs, patience = cfg.schedule_for(len(train_idx))
    fitted = fit(model, objective, Schedule(epochs, cfg.lr, cfg.weight_decay, clip=5.0, patience=patience,
                                            min_delta=1e-4), desc, progress, step_model)
    history = [{"epoch": h["round"], "train_loss": h["train_loss"], "val_score": h["val_score"],
                "train_graphs": h["train_examples"], "train_seconds": h["train_seconds"]} for h in fitted.history]
    return fitted.model, history, fitted.rounds_run


def _selection(con, catalog: Catalog, cfg: DataConfig) -> tuple[Selection, dict[str, int], Task]:
    """The run's models and split, checked: enough to train and test, targets the task can learn."""
    sel = select_models(con, cfg.target, cfg.where, cfg.task, cfg.split_column, catalog=catalog,
                        folds=(cfg.folds, cfg.fold) if cfg.folds else None)
    if cfg.train_size is not None:
        sel = sel.with_training_models(cfg.train_size)
    counts = {s: int(sel.mask(s).sum()) for s in ("train", "val", "test")}
    if counts["train"] < 2 or counts["test"] < 1:
        raise JobError(f"too few models to train and test: {counts}")
    task = task_named(sel.task)
    task.check_training(sel.targets[sel.mask("train")], sel.classes, sel.target)
    return sel, counts, task


def train_heterognn(catalog: Catalog | str, cfg: TrainConfig, store=None, progress: bool = True) -> RunReport:
    """Train the predictor ``cfg.model`` on the catalog's selected models; see the module docstring."""
    started = time.perf_counter()
    catalog = (catalog if isinstance(catalog, Catalog) else Catalog(catalog)).require()
    try:
        family = entry(cfg.model).family
    except ValueError as exc:
        raise JobError(str(exc)) from None
    if family != "metanetwork":
        if cfg.init_from:
            raise JobError(f"--init-from fine-tunes a metanetwork; --model {cfg.model} is not one")
        return train_fitted(catalog, cfg, store)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    ctx, device = init_from_env(cfg.device)
    progress = progress and ctx.is_main
    con = duck.connect(catalog)
    sel, counts, task = _selection(con, catalog, cfg)
    if cfg.calibration not in CALIBRATIONS:
        raise JobError(f"--calibration {cfg.calibration!r}: one of {', '.join(CALIBRATIONS)}")
    if cfg.rank_weight < 0:
        raise JobError("--rank-weight must be >= 0")
    cfg.aux_targets = tuple(cfg.aux_targets or ())
    if cfg.aux_targets and not task.numeric:
        raise JobError("--aux-targets are learnt beside a numeric target; the target here is a class")
    if cfg.aux_targets and cfg.init_from:
        raise JobError("--aux-targets widen the metanetwork's output; a run started --init-from keeps its source's")
    aux = auxiliary_targets(con, sel, cfg.aux_targets)
    if cfg.residual and not (cfg.stack and cfg.baselines and task.numeric):
        raise JobError("--residual trains against the blend's statistics: it needs a numeric target, --stack and "
                       "--baselines")
    cfg.rescale_test = tuple(float(m) for m in (cfg.rescale_test or ()))
    if cfg.canonical:      # two representatives of one orbit: the one asked for by name wins over the default
        cfg.balanced = False
    if cfg.scale_augment and cfg.scale_augment <= 1 or any(m <= 1 for m in cfg.rescale_test):
        raise JobError("--scale-augment and --rescale-test take the largest factor MAX > 1 of U[1, MAX]")
    if cfg.weight_noise < 0 or not 0 <= cfg.weight_dropout < 1:
        raise JobError("--weight-noise must be >= 0 and --weight-dropout in [0, 1)")
    mcfg, pretrained = None, None
    if cfg.init_from:           # fine-tuning: the source's metanetwork, and the run says so in its configuration
        pretrained = load_pretrained(catalog, cfg.init_from, cfg.init_catalog)
        mcfg = pretrained.fit(sel, task.output_size(sel.classes))
        for f in fields(MetanetConfig):
            setattr(cfg, f.name, getattr(mcfg, f.name))
        cfg.model = mcfg.kind
    prepare = run_preparation(cfg)
    stats = (layer_stats_of_graphs(read_prepared(con, sel.ids("train"), prepare)) if prepare is not None
             else layer_stats(con, sel.ids("train")))
    trust = TrustProfile.of_catalog(con, sel.ids("train"), symmetry_preparation(cfg))
    if cfg.probes:
        check_probe_graph(sel.etypes)
    probe = node_prober(con, cfg.fixed_probes, inputs=cfg.probe_inputs) if cfg.fixed_probes else None
    stream = GraphStream(con, sel, stats, chunk=cfg.chunk, workers=cfg.loader_workers, raw=bool(cfg.probes),
                         prepare=prepare, probe=probe)
    train_stream = stream
    train_prepare, augment = training_changes(cfg)
    if augment is not None:
        train_stream = GraphStream(con, sel, stats, chunk=cfg.chunk, workers=cfg.loader_workers,
                                   raw=bool(cfg.probes), prepare=train_prepare, augment=augment, seed=cfg.seed,
                                   probe=probe)
    # StatNN's features of the selection, shared by the head, the baselines and the blend: a pass over each
    # preparation of the graphs reads every block any of them wants
    head, read = None, feature_reads(baseline_names() if cfg.baselines else (), cfg.head_spectral)
    if pretrained is not None and pretrained.head is not None:    # the source's map: its inputs mean the same
        head = pretrained.head
        stream.side = train_stream.side = head.of_models(con, sel.model_ids)
    elif cfg.head_statistics and pretrained is None:    # StatNN's features beside the graph embedding
        head, stream.side = HeadStatistics.fit(con, sel, symmetry_preparation(cfg), read, cfg.head_spectral)
        train_stream.side = stream.side
    train_idx = np.nonzero(sel.mask("train"))[0]
    val_idx = np.nonzero(sel.mask("val"))[0]
    statistics, base, fit_sel = None, None, sel
    if cfg.residual:        # the metanetwork learns what the blend's statistics miss: they are fitted first
        statistics = _statistics(con, sel, cfg, task, read)
        base = statistics_base(task, sel, statistics[1], lambda p: read_once(read, p, con, sel.model_ids))
        if base is None:
            raise JobError("--residual needs a validation split and a statistics predictor that reads every model")
        fit_sel = dataclasses.replace(sel, targets=sel.targets - base)
    scale = task.fit_scale(fit_sel.targets[train_idx])
    mcfg = mcfg or metanet_config(cfg, sel.etypes, sel.frame, task.output_size(sel.classes) + len(cfg.aux_targets),
                                  head.width if head else 0)
    try:
        build_metanetwork(mcfg)        # hyperparameters that do not fit together (NG-T: --hidden 10 --heads 4)
    except ValueError as exc:
        raise JobError(f"--model {cfg.model}: {exc}") from None
    models, history, epochs_run = [], [], 0
    for k in range(cfg.ensemble):
        model, hist, ran = _fit_one(mcfg, cfg, cfg.seed + k, fit_sel, stream, train_idx, val_idx, scale, device,
                                    progress, f"train NG-GNN {k + 1}/{cfg.ensemble}" if cfg.ensemble > 1 else "train NG-GNN",
                                    ctx, train_stream, pretrained.state_for(k) if pretrained is not None else None,
                                    aux)
        models.append(model)
        history += [dict(h, member=k) for h in hist]
        epochs_run = max(epochs_run, ran)
    all_idx = np.arange(len(sel.model_ids))
    out, emb = infer_ensemble(models, stream, all_idx, cfg.batch_size, device, task, ctx)
    if cfg.calibrate and len(val_idx):
        scale = task.calibrate(out[val_idx], fit_sel.targets[val_idx], scale, cfg.calibration)
    pred = task.decode(out, scale)        # with --residual: the targets minus the statistics
    test = sel.mask("test")
    results = {cfg.model: pred}
    metrics = {cfg.model: task.metrics(sel.targets[test], pred[test])}
    if cfg.quasi:
        extra, share = models[0].parameter_overhead()
        metrics[cfg.model]["note"] = f"quasi-equivariant scaling: +{extra} parameters (+{100 * share:.1f}%)"
    run_id = broadcast(ctx, f"run-{now_utc():%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}")
    if not ctx.is_main:      # rank 0 writes the run; the others wait for it and report what they computed
        con.close()
        barrier(ctx)
        return RunReport(run_id, sel.task, sel.target, metrics, counts, time.perf_counter() - started, epochs_run,
                         history=history)
    fitted, partners, gated = statistics or _statistics(con, sel, cfg, task, read)
    _score_tabular(task, sel, fitted, results, metrics)
    blends = cfg.stack and task.numeric        # a class is not a number: no blend
    stack = (stack_with_statistics(task, sel, cfg.model, pred, partners, **gated, residual=base is not None)
             if blends else None)
    answer = cfg.model
    if base is not None:       # the metanetwork's own row: its residual on top of the (fitted) statistics
        results[cfg.model] = stack.residual_row(pred, [partners[n][1].predictions for n in stack.partners])
        notes = [metrics[cfg.model].get("note"), "trained on the residual of " + ", ".join(stack.partners)]
        metrics[cfg.model] = {**task.metrics(sel.targets[test], results[cfg.model][test]),
                              "note": "; ".join(n for n in notes if n)}
    if stack is not None:
        answer = stack.name
        results = {answer: stack.predictions, **results}
        metrics = {answer: {**task.metrics(sel.targets[test], stack.predictions[test]), "note": stack.note}, **metrics}
    for max_scale in cfg.rescale_test:
        metrics.update(score_rescaled(con, models, sel, stats, scale, cfg, device, max_scale,
                                      [p for p, r in fitted.values() if r.applicable.all()], trust, stack, head))
    con.close()
    artifact = save_metanetwork(catalog, run_id, models, sel, stats, scale, cfg, stack, trust, head)
    report = RunReport(run_id, sel.task, sel.target, metrics, counts, time.perf_counter() - started, epochs_run,
                       artifact=artifact, history=history)
    write_run(catalog, run_id, {**asdict(cfg), "world_size": ctx.world}, sel, results, emb, metrics, artifact,
              method=answer)
    _write_back(report, catalog, store, sel, results[answer])
    barrier(ctx)
    return report


def _statistics(con, sel: Selection, cfg: TrainConfig, task: Task, read) -> tuple[dict, dict, dict]:
    """The tabular predictors fitted on the selection (``cfg.baselines``), the blend's partners among
    them, and (balanced inputs with --plain-statistics) the fallback partners, gate and judgement
    ``stack_with_statistics`` takes."""
    fitted = fit_all(con, sel, baseline_names(), cfg.seed, read=read) if cfg.baselines else {}
    partners, invariant, gated = fitted, symmetry_preparation(cfg), {}
    if cfg.stack and task.numeric and invariant and fitted:   # statistics of the same invariant graphs: the blend stays invariant
        balanced = fit_all(con, sel, [n for n in fitted if entry(n).stack and entry(n).reads == "weights"], cfg.seed,
                           prepare=invariant, read=read)
        # what a network computes is already the same for every rescaling of it: the probing partners as fitted
        balanced.update({n: fitted[n] for n in fitted if entry(n).stack and entry(n).reads == "function"})
        if cfg.plain_statistics:       # ... for inputs outside the training models' own weight scales
            gate, trusted = TrustProfile.judged(con, sel.model_ids, sel.mask("train"))
            gated = {"fallback": balanced, "gate": gate, "trusted": trusted}
        else:
            partners = balanced
    return fitted, partners, gated


def train_fitted(catalog: Catalog, cfg: TrainConfig, store=None) -> RunReport:
    """A run whose answer is the tabular or weight-space predictor ``cfg.model`` (jobs.predictors), with
    the tabular predictors beside it when ``cfg.baselines``; saved so that ``jobs predict`` rebuilds it."""
    started = time.perf_counter()
    con = duck.connect(catalog)
    try:
        sel, counts, task = _selection(con, catalog, cfg)
        names = [cfg.model] + ([n for n in baseline_names() if n != cfg.model] if cfg.baselines else [])
        fitted = fit_all(con, sel, names, cfg.seed)
    finally:
        con.close()
    predictor, answer = fitted[cfg.model]
    if not answer.applicable.any():
        raise JobError(f"{cfg.model} cannot be fitted on this selection: {answer.note}")
    results, metrics = {}, {}
    _score_tabular(task, sel, fitted, results, metrics)
    run_id = f"run-{now_utc():%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"
    catalog.commit_artifacts(run_id, predictor_files("predictor", predictor))
    artifact = catalog.location("artifacts", run_id)
    report = RunReport(run_id, sel.task, sel.target, metrics, counts, time.perf_counter() - started, 0,
                       artifact=artifact)
    write_run(catalog, run_id, asdict(cfg), sel, results, np.zeros((len(sel.model_ids), 0), np.float32), metrics,
              artifact, method=cfg.model)
    _write_back(report, catalog, store, sel, answer.predictions)
    return report


def _score_tabular(task: Task, sel: Selection, fitted: dict, results: dict, metrics: dict) -> None:
    """Each fitted tabular predictor's predictions into ``results`` and its test metrics (on the
    test models it reads) into ``metrics``."""
    test = sel.mask("test")
    for name, (_, r) in fitted.items():
        results[name] = r.predictions
        mask = test & r.applicable
        metrics[name] = {**task.metrics(sel.targets[mask], r.predictions[mask]), **({"note": r.note} if r.note else {})}


def _write_back(report: RunReport, catalog: Catalog, store, sel: Selection, answer: np.ndarray) -> None:
    """The run's answer into the graph store, if one is open; a failure leaves the run in Parquet
    and a warning on the report (`graphstore sync` catches the store up)."""
    if store is None:
        return
    try:
        write_back(catalog, store, sel, answer, report.run_id)
    except Exception as exc:
        report.store_warning = str(exc).splitlines()[0]
