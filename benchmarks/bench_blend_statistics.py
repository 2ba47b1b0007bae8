"""The blend's statistics, plain where trusted against balanced everywhere, re-scored from saved runs.

A run saved before plain statistics where trusted (or with ``--no-plain-statistics``) holds, per
model of its selection, NG-GNN's prediction, its answer (NG-GNN blended with StatNN read from the
balanced graphs, jobs.predictors.stacking) and the baselines StatNN and StatNN-MLP read from the
checkpoints' own weights. Without training anything, this gives each such run the answer today's
default gives: NG-GNN blended with those plain rows (partners and weight chosen on the run's
validation models by ``stack_with_statistics``, the code runs use), for every model whose own
weight scales lie within the run's training models' (``TrustProfile`` of the plain graphs), and
the saved balanced answer for the others. It prints, per catalog, training size and head setting,
the mean test tau over the runs' folds of NG-GNN, both answers and the statistics, each minus the
strongest statistics (StatNN, StatNN-MLP or their mean) at that size, and how many test models the
gate sent to the balanced answer.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_blend_statistics.py /tmp/zoograph-bench/catalog-cnn-1500-0

Runs made with plain statistics where trusted (the default since it existed) are left out: their
answer is already the gated one.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

STATISTICS = ("statnn", "statnn_mlp")


def saved_runs(con) -> list[tuple[str, dict, str]]:
    """(run_id, configuration, answer method) of the runs whose answer blends balanced statistics,
    oldest first."""
    runs = []
    for run_id, config, method in con.execute("SELECT run_id, config_json, method FROM runs ORDER BY created_at, run_id").fetchall():
        cfg = json.loads(config or "{}")
        if (cfg.get("model") in ("ngnn", "ngt") and cfg.get("balanced") and cfg.get("stack", True)
                and not cfg.get("plain_statistics", False) and not cfg.get("init_from") and "+" in (method or "")):
            runs.append((run_id, cfg, method))
    return runs


def rescore(con, run_id: str, cfg: dict, method: str) -> dict[str, float] | None:
    """Test tau of each method of one run, with ``gated``: the answer plain where trusted."""
    from jobs.predictors.stacking import stack_with_statistics
    from jobs.predictors.tabular import Prediction
    from jobs.training.compare import kendall_tau
    from jobs.training.tasks import task_named
    from jobs.training.trust import TrustProfile

    rows = con.execute("SELECT p.model_id, p.split, p.method, p.predicted, m.test_accuracy FROM predictions p "
                       "JOIN models m USING (model_id) WHERE p.run_id = ?", [run_id]).fetchall()
    by: dict[str, dict[str, float]] = defaultdict(dict)
    split, target = {}, {}
    for model_id, s, m, p, y in rows:
        by[m][model_id] = np.nan if p is None else p
        split[model_id], target[model_id] = s, y
    metanet = cfg["model"]
    if not all(m in by for m in (metanet, method, *STATISTICS)):
        return None
    ids = sorted(split)
    sel = _Selection(ids, np.array([split[i] for i in ids]), np.array([target[i] for i in ids], float))
    fitted = {n: (None, Prediction(n, np.array([by[n][i] for i in ids], float),
                                   np.isfinite([by[n][i] for i in ids]))) for n in STATISTICS}
    task = task_named("regression")
    plain = stack_with_statistics(task, sel, metanet, np.array([by[metanet][i] for i in ids], float), fitted)
    gate = TrustProfile.of_catalog(con, sel.ids("train"))
    trusted = gate.judge_catalog(con, ids)
    gated = np.where(trusted, plain.predictions, [by[method][i] for i in ids])
    test = sel.mask("test")
    y = sel.targets[test]
    out = {m: kendall_tau(y, np.array([by[m][i] for i in ids], float)[test]) for m in (metanet, method, *STATISTICS)}
    out["statnn_avg"] = kendall_tau(y, np.mean([fitted[n][1].predictions for n in STATISTICS], axis=0)[test])
    out["gated"] = kendall_tau(y, gated[test])
    out["untrusted"] = float((~trusted[test]).mean())
    return out


class _Selection:
    """What ``stack_with_statistics`` reads of a jobs.training.data.Selection, from a saved run."""

    def __init__(self, ids, splits, targets):
        self.model_ids, self.splits, self.targets = ids, splits, targets

    def mask(self, split: str) -> np.ndarray:
        return self.splits == split

    def ids(self, split: str) -> list[str]:
        return [i for i, s in zip(self.model_ids, self.splits) if s == split]


def main(argv=None) -> int:
    from graphstore import duck

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("catalogs", nargs="+", type=Path, help="catalogs holding benchmark runs")
    args = ap.parse_args(argv)
    for cat in args.catalogs:
        if not (cat / "parts").exists():
            print(f"{cat}: not a catalog", file=sys.stderr)
            return 2
        con = duck.connect(cat)
        groups: dict[tuple, dict[int, dict]] = defaultdict(dict)
        for run_id, cfg, method in saved_runs(con):      # the first run of each fold (a benchmark may repeat one)
            key = (cfg["model"], cfg.get("train_size") or 0, bool(cfg.get("head_statistics")))
            if cfg.get("fold") in groups[key]:
                continue
            scores = rescore(con, run_id, cfg, method)
            if scores is not None:
                groups[key][cfg.get("fold")] = scores
        con.close()
        print(f"{cat.name}: mean test tau over folds, minus the strongest statistics at that size")
        print(f"  {'model':5s} {'train':>5s} {'head':>4s} {'folds':>5s} {'NG-GNN':>8s} {'balanced':>9s} {'gated':>8s}"
              f" {'strongest':>10s} {'untrusted':>9s}")
        for (model, size, head), folds in sorted(groups.items()):
            runs = list(folds.values())
            if not runs:
                continue
            mean = {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}
            method = next(k for k in runs[0] if "+" in k)
            best = max(("statnn", "statnn_mlp", "statnn_avg"), key=mean.get)
            print(f"  {model:5s} {size or 'all':>5} {'on' if head else 'off':>4s} {len(runs):5d} "
                  f"{mean[model] - mean[best]:+8.3f} {mean[method] - mean[best]:+9.3f} {mean['gated'] - mean[best]:+8.3f}"
                  f" {best + f' {mean[best]:.3f}':>10s} {100 * mean['untrusted']:8.1f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
