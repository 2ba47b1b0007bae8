"""Scoring a run on function-preserving rescalings of its test models (``--rescale-test``).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from jobs.config import TrainConfig
from jobs.analysis.probing import node_prober
from jobs.metanets.ngnn import NGGNN
from jobs.training.data import GraphList, LayerStats, Selection
from jobs.training.inference import infer_ensemble
from jobs.training.preparation import prepared_graphs
from jobs.training.tasks import TargetScale, task_named
from jobs.training.trust import TrustProfile


def rescaled_test_graphs(con, ids, max_scale: float, seed: int) -> list:
    """Function-preserving random rescalings U[1, max_scale] of ``ids`` (the same ones on every call)."""
    from pipeline.graph_codec import read_graphs, read_plans
    from pipeline.neural_graph.symmetry import random_rescaling

    arch, plans = read_plans(con, ids)
    return [random_rescaling(g, np.random.default_rng([seed, 7919, k]), max_scale, steps=plans[arch[m]].steps)
            for k, (m, g) in enumerate(zip(ids, read_graphs(con, list(ids), plans=plans)))]


def score_rescaled(con, models: list[NGGNN], sel: Selection, stats: LayerStats, scale: TargetScale,
                   cfg: TrainConfig, device, max_scale: float, baselines=(),
                   trust: TrustProfile | None = None, stack=None, head=None) -> dict[str, dict]:
    """Test metrics of the metanetwork (and of the fitted ``baselines`` that read in-memory graphs,
    and of the run's blend ``stack``; ``head``: the run's head statistics, if it has them) on rescaled
    copies U[1, max_scale] of the test models:
    ``{"ngnn@xMAX": ..., "statnn@xMAX": ..., "ngnn+statnn+...+probegen@xMAX": ...}``."""
    test_idx = np.nonzero(sel.mask("test"))[0]
    ids = [sel.model_ids[i] for i in test_idx]
    graphs = rescaled_test_graphs(con, ids, max_scale, cfg.seed)
    y = sel.targets[test_idx]
    tag = f"@x{max_scale:g}"
    inputs = prepared_graphs(con, ids, graphs, cfg)      # the same preparation the run trained on
    listed = GraphList(inputs, sel, stats, raw=bool(cfg.probes), model_ids=ids,
                       probe=node_prober(con, cfg.fixed_probes, inputs=cfg.probe_inputs) if cfg.fixed_probes else None)
    if head is not None:      # the head's statistics of the rescaled copies (jobs.training.head_statistics)
        listed.side = head.of_graphs(con, ids, graphs)
    task = task_named(sel.task)
    out, _ = infer_ensemble(models, listed, np.arange(len(ids)), cfg.batch_size, device, task)
    pred = task.decode(out, scale)
    readable = stack is not None and all(hasattr(p, "features_of_graphs") for p in stack.predictors)
    own = pred
    if readable and stack.residual:      # a residual metanetwork's row: on top of the copies' statistics (w = 1)
        own = replace(stack, weight=1.0, fallback=stack.fallback and replace(stack.fallback, weight=1.0)
                      ).predict_graphs(con, ids, graphs, pred)
    metrics = {cfg.model + tag: task.metrics(y, own)}
    if readable:
        metrics[stack.name + tag] = task.metrics(y, stack.predict_graphs(con, ids, graphs, pred))
    if trust is not None:       # how many copies `jobs predict` would flag (the clean test models: beside)
        flagged = int((~trust.judge_graphs(con, ids, graphs)).sum())
        clean = int((~trust.judge_catalog(con, ids)).sum())
        metrics[cfg.model + tag]["note"] = (f"out of distribution: {flagged} of {len(ids)} rescaled copies, "
                                            f"{clean} of {len(ids)} clean test models")
    for base in baselines:
        if hasattr(base, "features_of_graphs"):       # predictors that can read in-memory graphs (StatNN)
            metrics[base.name + tag] = task.metrics(y, base.predict_features(base.features_of_graphs(con, ids, graphs)))
    return metrics
