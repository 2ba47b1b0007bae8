"""``jobs train-heterognn`` and ``jobs predict``: the one training module.

A run selects models, computes per-layer statistics on its training split, streams graphs,
trains NG-GNN with early stopping on validation, evaluates it and the two baselines on the same
test split, and writes ``runs`` / ``predictions`` / ``embeddings`` to the catalog, the trained
metanetwork to ``CATALOG/artifacts/RUN_ID/``, and ``predicted_<target>`` to the graph store.
"""
from __future__ import annotations

import copy
import math
import time
import uuid
from dataclasses import asdict, fields

import dgl
import numpy as np
import torch
from tqdm import tqdm

from graphstore import duck
from graphstore.catalog import Catalog, now_utc
from jobs.training.augment import augmenter
from jobs.config import DataConfig, MetanetConfig, ModelConfig, OptimConfig, TrainConfig  # noqa: F401  (OptimConfig: re-exported)
from jobs.training.distributed import (DistContext, barrier, broadcast, gather_rows, init_from_env, local_batch_size,
                              shard)
from jobs.training.data import (GraphList, GraphStream, LayerStats, Selection, layer_stats, layer_stats_of_graphs,
                       select_models)
from jobs.training.manifest import RunManifest
from jobs.training.runs import PredictReport, RunReport, write_back, write_run
from jobs.metanets import build_metanetwork
from jobs.metanets.ngnn import NGGNN, NGGNNConfig
from jobs.predictors import entry, names as predictor_names
from jobs.metanets.probes import check_probe_graph
from jobs.training.run_weights import predictor_files, read_predictor, read_weights, require_run, weights_files
from jobs.predictors.stacking import Stack, read_stack, stack_with_statistics
from jobs.predictors.tabular import fit_all
from jobs.training.tasks import CALIBRATIONS, TargetScale, Task, task_named
from jobs.training.trust import TrustProfile, profiles_of, scale_profiles, warning_line
from zoocore.errors import JobError


def metanet_config(model: ModelConfig, etypes, frame: tuple[int, int], out_dim: int) -> NGGNNConfig:
    """The metanetwork's configuration: the model part's hyperparameters plus what the selected
    models fix."""
    return NGGNNConfig(etypes=etypes, edge_in=frame[0] * frame[1], out_dim=out_dim, kind=model.model,
                       **{f.name: getattr(model, f.name) for f in fields(MetanetConfig)})


def metrics_for(task: str, y: np.ndarray, p: np.ndarray) -> dict[str, float]:
    """The task's test metrics: Kendall tau, R^2, MAE (regression) or accuracy, macro-F1 (classification)."""
    return task_named(task).metrics(y, p)


def _batch(graphs, device):
    return dgl.batch(graphs).to(device)


@torch.no_grad()
def infer(model: NGGNN, stream: GraphStream, indices, batch_size: int, device,
          ctx: DistContext | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Raw outputs (n, out_dim) and embeddings (n, d) for ``indices``, in that order; under
    torchrun each rank infers its shard and every rank gets all rows."""
    ctx = ctx or DistContext()
    model.eval()
    local = shard(indices, ctx)
    outs, embs = [], []
    for _idx, graphs in stream.batches(local, batch_size):   # batches come back in order
        out, z = model(_batch(graphs, device))
        outs.append(out.cpu().numpy())
        embs.append(z.cpu().numpy())
    out = np.concatenate(outs) if outs else np.zeros((0, model.cfg.out_dim), np.float32)
    emb = np.concatenate(embs) if embs else np.zeros((0, model.readout_dim), np.float32)
    return gather_rows(ctx, np.asarray(indices, dtype=np.int64), local, out, emb)


def _fit_one(mcfg: NGGNNConfig, cfg: TrainConfig, seed: int, sel: Selection, stream: GraphStream, train_idx, val_idx,
             scale: TargetScale, device, progress: bool, desc: str, ctx: DistContext,
             train_stream: GraphStream | None = None):
    """Train one metanetwork with early stopping on the validation split (data-parallel under
    torchrun: this rank's shard of every global batch, gradients all-reduced). Training batches
    come from ``train_stream`` (e.g. augmented) when given, validation from ``stream``."""
    train_stream = train_stream or stream
    task = task_named(sel.task)
    loss_fn = task.loss(cfg.rank_weight)
    torch.manual_seed(seed)
    model = build_metanetwork(mcfg).to(device)
    step_model = model
    if ctx.active:          # some relations are absent from some batches: their parameters get no gradient
        step_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None, find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs, eta_min=cfg.lr * 0.05)
    best, best_state, bad, history = -math.inf, None, 0, []
    bar = tqdm(range(cfg.epochs), desc=desc, unit="epoch", disable=not progress)
    epochs_run = 0
    for epoch in bar:
        model.train()
        total, n = 0.0, 0
        local = shard(train_idx, ctx, seed=seed + epoch)
        for b, (idx, graphs) in enumerate(train_stream.batches(local, local_batch_size(cfg.batch_size, ctx))):
            if cfg.max_train_batches is not None and b >= cfg.max_train_batches:
                break
            out, _ = step_model(_batch(graphs, device))
            loss = loss_fn(out, task.encode(sel.targets[idx], scale, device))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            total += float(loss) * len(idx)
            n += len(idx)
        sched.step()
        epochs_run = epoch + 1
        score_idx = val_idx if len(val_idx) >= 2 else train_idx
        out, _ = infer(model, stream, score_idx, cfg.batch_size, device, ctx)
        score = task.score(task.metrics(sel.targets[score_idx], task.decode(out, scale)))
        history.append({"epoch": epoch, "train_loss": total / max(n, 1), "val_score": score})
        bar.set_postfix(loss=f"{total / max(n, 1):.4f}", val=f"{score:.3f}")
        if score > best + 1e-4:
            best, best_state, bad = score, copy.deepcopy(model.state_dict()), 0
        else:
            bad += 1
            if bad >= cfg.patience:
                break
    bar.close()
    if best_state is not None:
        model.load_state_dict(best_state)
    return model, history, epochs_run


def infer_ensemble(models: list[NGGNN], stream: GraphStream, indices, batch_size: int, device,
                   task: Task, ctx: DistContext | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The members' outputs combined by the task (regression: mean; classification: log of the
    mean softmax) and their embeddings side by side (still invariant)."""
    outs, embs = zip(*(infer(m, stream, indices, batch_size, device, ctx) for m in models))
    return task.combine(list(outs)), np.concatenate(embs, axis=1)


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
    if family == "tabular":
        return train_tabular(catalog, cfg, store)
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
    cfg.rescale_test = tuple(float(m) for m in (cfg.rescale_test or ()))
    if cfg.scale_augment and cfg.scale_augment <= 1 or any(m <= 1 for m in cfg.rescale_test):
        raise JobError("--scale-augment and --rescale-test take the largest factor MAX > 1 of U[1, MAX]")
    if cfg.weight_noise < 0 or not 0 <= cfg.weight_dropout < 1:
        raise JobError("--weight-noise must be >= 0 and --weight-dropout in [0, 1)")
    prepare = preparation(cfg.canonical, cfg.bn_stats)
    stats = (layer_stats_of_graphs(read_prepared(con, sel.ids("train"), prepare)) if prepare is not None
             else layer_stats(con, sel.ids("train")))
    trust = TrustProfile.fit(profiles_of(con, sel.ids("train")))
    if cfg.probes:
        check_probe_graph(sel.etypes)
    stream = GraphStream(con, sel, stats, chunk=cfg.chunk, workers=cfg.loader_workers, raw=bool(cfg.probes),
                         prepare=prepare)
    train_stream = stream
    train_prepare, augment = training_changes(cfg)
    if augment is not None:
        train_stream = GraphStream(con, sel, stats, chunk=cfg.chunk, workers=cfg.loader_workers,
                                   raw=bool(cfg.probes), prepare=train_prepare, augment=augment, seed=cfg.seed)
    train_idx = np.nonzero(sel.mask("train"))[0]
    val_idx = np.nonzero(sel.mask("val"))[0]
    scale = task.fit_scale(sel.targets[train_idx])
    mcfg = metanet_config(cfg, sel.etypes, sel.frame, task.output_size(sel.classes))
    try:
        build_metanetwork(mcfg)        # hyperparameters that do not fit together (NG-T: --hidden 10 --heads 4)
    except ValueError as exc:
        raise JobError(f"--model {cfg.model}: {exc}") from None
    models, history, epochs_run = [], [], 0
    for k in range(cfg.ensemble):
        model, hist, ran = _fit_one(mcfg, cfg, cfg.seed + k, sel, stream, train_idx, val_idx, scale, device,
                                    progress, f"train NG-GNN {k + 1}/{cfg.ensemble}" if cfg.ensemble > 1 else "train NG-GNN",
                                    ctx, train_stream)
        models.append(model)
        history += [dict(h, member=k) for h in hist]
        epochs_run = max(epochs_run, ran)
    all_idx = np.arange(len(sel.model_ids))
    out, emb = infer_ensemble(models, stream, all_idx, cfg.batch_size, device, task, ctx)
    if cfg.calibrate and len(val_idx):
        scale = task.calibrate(out[val_idx], sel.targets[val_idx], scale, cfg.calibration)
    pred = task.decode(out, scale)
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
    fitted = fit_all(con, sel, predictor_names("tabular"), cfg.seed) if cfg.baselines else {}
    for name, (_, base) in fitted.items():
        results[name] = base.predictions
        mask = test & base.applicable
        metrics[name] = {**task.metrics(sel.targets[mask], base.predictions[mask]),
                         **({"note": base.note} if base.note else {})}
    stack = stack_with_statistics(task, sel, cfg.model, pred, fitted) if cfg.stack else None
    answer = cfg.model
    if stack is not None:
        answer = stack.name
        results = {answer: stack.predictions, **results}
        metrics = {answer: {**task.metrics(sel.targets[test], stack.predictions[test]), "note": stack.note}, **metrics}
    for max_scale in cfg.rescale_test:
        metrics.update(score_rescaled(con, models, sel, stats, scale, cfg, device, max_scale,
                                      [p for p, r in fitted.values() if r.applicable.all()], trust))
    con.close()
    artifact = save_metanetwork(catalog, run_id, models, sel, stats, scale, cfg, stack, trust)
    report = RunReport(run_id, sel.task, sel.target, metrics, counts, time.perf_counter() - started, epochs_run,
                       artifact=artifact, history=history)
    write_run(catalog, run_id, {**asdict(cfg), "world_size": ctx.world}, sel, results, emb, metrics, artifact,
              method=answer)
    if store is not None:
        try:
            write_back(catalog, store, sel, results[answer], run_id)
        except Exception as exc:
            report.store_warning = str(exc).splitlines()[0]
    barrier(ctx)
    return report


def train_tabular(catalog: Catalog, cfg: TrainConfig, store=None) -> RunReport:
    """A run whose answer is the tabular predictor ``cfg.model`` (jobs.predictors.tabular), with the other
    tabular predictors beside it when ``cfg.baselines``; saved so that ``jobs predict`` refits it."""
    started = time.perf_counter()
    con = duck.connect(catalog)
    try:
        sel, counts, task = _selection(con, catalog, cfg)
        names = [cfg.model] + ([n for n in predictor_names("tabular") if n != cfg.model] if cfg.baselines else [])
        fitted = fit_all(con, sel, names, cfg.seed)
    finally:
        con.close()
    predictor, answer = fitted[cfg.model]
    if not answer.applicable.any():
        raise JobError(f"{cfg.model} cannot be fitted on this selection: {answer.note}")
    test = sel.mask("test")
    results = {name: r.predictions for name, (_, r) in fitted.items()}
    metrics = {name: {**task.metrics(sel.targets[test & r.applicable], r.predictions[test & r.applicable]),
                      **({"note": r.note} if r.note else {})} for name, (_, r) in fitted.items()}
    run_id = f"run-{now_utc():%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"
    catalog.commit_artifacts(run_id, predictor_files("predictor", predictor))
    artifact = catalog.location("artifacts", run_id)
    report = RunReport(run_id, sel.task, sel.target, metrics, counts, time.perf_counter() - started, 0,
                       artifact=artifact)
    write_run(catalog, run_id, asdict(cfg), sel, results, np.zeros((len(sel.model_ids), 0), np.float32), metrics,
              artifact, method=cfg.model)
    if store is not None:
        try:
            write_back(catalog, store, sel, answer.predictions, run_id)
        except Exception as exc:
            report.store_warning = str(exc).splitlines()[0]
    return report


def canonical_graph(graph, steps):
    """The scale canonicalisation of a graph (``pipeline.neural_graph.symmetry.canonical_scaling``)."""
    from pipeline.neural_graph.symmetry import canonical_scaling

    return canonical_scaling(graph, steps)[0]


def preparation(canonical: bool = False, bn_stats: bool = False):
    """The GraphStream ``prepare`` a run's graphs get (None: none): the scale canonicalisation, then
    batch norms as their evaluation-time affine maps (pipeline.neural_graph.norm_stats); in that
    order, because the canonicalisation moves factors through batch norm's running statistics."""
    if not (canonical or bn_stats):
        return None
    from pipeline.neural_graph.norm_stats import effective_batch_norms

    def prepare(graph, steps):
        if canonical:
            graph = canonical_graph(graph, steps)
        return effective_batch_norms(graph) if bn_stats else graph
    return prepare


def training_changes(cfg: DataConfig):
    """(prepare, augment) of the training stream: augment is None when the run has no augmentation
    (training then reads the same graphs as validation). Rescalings act on the checkpoint's own
    parameters (batch norm's gamma and running statistics), so with augmentation the batch norms
    become their affine maps last, after each rescaling and noise draw, not once on reading."""
    augment = augmenter(rescaler(cfg.scale_augment) if cfg.scale_augment else None,
                        noise=cfg.weight_noise, dropout=cfg.weight_dropout)
    if augment is None:
        return preparation(cfg.canonical, cfg.bn_stats), None
    if cfg.bn_stats:
        from pipeline.neural_graph.norm_stats import effective_batch_norms

        augment = augmenter(augment, lambda graph, steps, rng: effective_batch_norms(graph))
    return preparation(cfg.canonical, False), augment


def rescaler(max_scale: float):
    """An ``augment`` for GraphStream: a random function-preserving rescaling (and sign flip where the
    activation allows it) of every hidden neuron, magnitudes U[1, max_scale]."""
    from pipeline.neural_graph.symmetry import random_rescaling

    def augment(graph, steps, rng):
        return random_rescaling(graph, rng, max_scale, steps=steps)
    return augment


def read_prepared(con, ids, prepare=None, chunk: int = 256) -> list:
    """The NeuralGraphs of ``ids`` from the catalog, with ``prepare(graph, steps)`` applied."""
    from pipeline.graph_codec import read_graphs, read_plans

    arch, plans = read_plans(con, ids)
    out = []
    for start in range(0, len(ids), chunk):
        part = list(ids[start:start + chunk])
        graphs = read_graphs(con, part, plans=plans)
        out += graphs if prepare is None else [prepare(g, plans[arch[m]].steps) for m, g in zip(part, graphs)]
    return out


def rescaled_test_graphs(con, ids, max_scale: float, seed: int) -> list:
    """Function-preserving random rescalings U[1, max_scale] of ``ids`` (the same ones on every call)."""
    from pipeline.graph_codec import read_graphs, read_plans
    from pipeline.neural_graph.symmetry import random_rescaling

    arch, plans = read_plans(con, ids)
    return [random_rescaling(g, np.random.default_rng([seed, 7919, k]), max_scale, steps=plans[arch[m]].steps)
            for k, (m, g) in enumerate(zip(ids, read_graphs(con, list(ids), plans=plans)))]


def score_rescaled(con, models: list[NGGNN], sel: Selection, stats: LayerStats, scale: TargetScale,
                   cfg: TrainConfig, device, max_scale: float, baselines=(),
                   trust: TrustProfile | None = None) -> dict[str, dict]:
    """Test metrics of the metanetwork (and of the fitted ``baselines`` that read in-memory graphs)
    on rescaled copies U[1, max_scale] of the test models: ``{"ngnn@xMAX": ..., "statnn@xMAX": ...}``."""
    test_idx = np.nonzero(sel.mask("test"))[0]
    ids = [sel.model_ids[i] for i in test_idx]
    graphs = rescaled_test_graphs(con, ids, max_scale, cfg.seed)
    y = sel.targets[test_idx]
    tag = f"@x{max_scale:g}"
    inputs = graphs
    prepare = preparation(cfg.canonical, cfg.bn_stats)      # the same preparation the run trained on
    if prepare is not None:
        from pipeline.graph_codec import read_plans

        arch, plans = read_plans(con, ids)
        inputs = [prepare(g, plans[arch[m]].steps) for m, g in zip(ids, graphs)]
    listed = GraphList(inputs, sel, stats, raw=bool(cfg.probes))
    task = task_named(sel.task)
    out, _ = infer_ensemble(models, listed, np.arange(len(ids)), cfg.batch_size, device, task)
    metrics = {cfg.model + tag: task.metrics(y, task.decode(out, scale))}
    if trust is not None:       # how many copies `jobs predict` would flag (the clean test models: beside)
        flagged = int((~trust.in_distribution(scale_profiles(graphs))).sum())
        clean = int((~trust.in_distribution(profiles_of(con, ids))).sum())
        metrics[cfg.model + tag]["note"] = (f"out of distribution: {flagged} of {len(ids)} rescaled copies, "
                                            f"{clean} of {len(ids)} clean test models")
    for base in baselines:
        if hasattr(base, "features_of_graphs"):       # predictors that can read in-memory graphs (StatNN)
            metrics[base.name + tag] = task.metrics(y, base.predict_features(base.features_of_graphs(con, ids, graphs)))
    return metrics


def save_metanetwork(catalog: Catalog, run_id: str, models: list[NGGNN], sel: Selection, stats: LayerStats,
                     scale: TargetScale, cfg: TrainConfig, stack: Stack | None = None,
                     trust: TrustProfile | None = None):
    """``CATALOG/artifacts/RUN/``: one ``metanet-<k>.safetensors`` state dict per member,
    ``metanet.json`` and the blend with a baseline (jobs.predictors.stacking) if the run made one, committed as
    one folder (a crash leaves all of them or none)."""
    manifest = RunManifest(model=models[0].cfg, stats=stats, task=sel.task, target=sel.target, frame=tuple(sel.frame),
                           scale=scale, classes=list(sel.classes), members=len(models), train=asdict(cfg), trust=trust)
    files = {}
    for k, model in enumerate(models):
        files.update(weights_files(f"metanet-{k}", model.state_dict()))
    files["metanet.json"] = manifest.to_json()
    if stack is not None:
        files.update(stack.files())
    catalog.commit_artifacts(run_id, files)
    return catalog.location("artifacts", run_id)


def load_metanetwork(catalog: Catalog, run_id: str, device: str = "cpu") -> tuple[list[NGGNN], RunManifest]:
    """The trained members of a run (weights read as tensors only: jobs.training.run_weights) and its manifest."""
    require_run(catalog, run_id)
    raw = catalog.read_artifact(run_id, "metanet.json")
    if raw is None:
        raise JobError(f"no trained metanetwork for run {run_id!r} in {catalog.artifacts_dir}")
    manifest = RunManifest.from_json(raw, f"the manifest of run {run_id!r}")
    models = []
    for k in range(manifest.members):
        model = build_metanetwork(manifest.model)
        model.load_state_dict(read_weights(catalog, run_id, f"metanet-{k}"))
        models.append(model.to(device).eval())
    return models, manifest


def predict(catalog: Catalog | str, run_id: str, where: str | None = None, device: str = "cpu", store=None,
            batch_size: int = 64) -> PredictReport:
    """Apply a run's trained predictor to the models matching ``where`` (targets need not be known):
    its metanetwork (blended with its baseline when the run blended them) or its tabular predictor."""
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
                         prepare=preparation(manifest.train.get("canonical", False), manifest.train.get("bn_stats", False)))
    out, emb = infer_ensemble(models, stream, np.arange(len(sel.model_ids)), batch_size, torch.device(device), task)
    kind = manifest.model.kind
    results = {kind: task.decode(out, manifest.scale)}
    if stack is not None:
        results = {**stack.predict(con, sel.model_ids, results[kind]), **results}
    flags = manifest.trust.in_distribution(profiles_of(con, sel.model_ids)) if manifest.trust is not None else None
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
