"""The blend's statistics, plain where trusted against balanced everywhere, paired on saved runs.

Without training anything, each metanetwork run on balanced graphs that a catalog holds gets both
answers:
- *balanced*: NG-GNN blended with StatNN read from the balanced graphs for every model. A run saved
  before plain statistics where trusted (or with ``--no-plain-statistics``) saved it as its answer;
  for a default run it is the saved blend's fallback (its partners refitted) applied to every model.
- *gated*, today's default: NG-GNN blended with the run's plain StatNN rows (the checkpoints' own
  weights; partners and weight chosen on the run's validation models by ``stack_with_statistics``,
  the code runs use) for every model whose weight scales lie within the run's training models'
  (``TrustProfile`` of the plain graphs), the balanced answer for the others. For a default run
  this rebuilds its own answer.
It prints, per catalog, training size and head setting, the mean test tau over the runs' folds of
NG-GNN and both answers, each minus the strongest statistics (one of the blend's partners or their
mean) at that size, the share of test models the gate sent to the balanced answer, and gated minus balanced
with a paired bootstrap 95% interval.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_blend_statistics.py /tmp/zoograph-bench/catalog-cnn-1500-0
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from jobs.predictors import PREDICTORS, names

STATISTICS = tuple(n for n in names("tabular") if PREDICTORS[n].stack)    # the blend's partners


def saved_runs(con) -> list[tuple[str, dict, str]]:
    """(run_id, configuration, answer method) of the metanetwork runs on balanced graphs with a
    blend, oldest first."""
    runs = []
    for run_id, config, method in con.execute("SELECT run_id, config_json, method FROM runs ORDER BY created_at, run_id").fetchall():
        cfg = json.loads(config or "{}")
        if (cfg.get("model") in ("ngnn", "ngt") and cfg.get("balanced") and cfg.get("stack", True)
                and not cfg.get("init_from") and "+" in (method or "")):
            runs.append((run_id, cfg, method))
    return runs


def rescore(con, run_id: str, cfg: dict, method: str, catalog=None) -> dict | None:
    """Test tau of each method of one run, with ``balanced`` (the blend of balanced statistics for
    every model) and ``gated`` (plain where trusted, rebuilt from the run's rows); ``test``: the
    test targets and both answers, for a paired interval. A run made with plain statistics where
    trusted (``catalog``: its Catalog, to refit the blend's balanced partners) saved the gated
    answer: the balanced one is its fallback applied to every model."""
    from jobs.predictors.stacking import stack_with_statistics
    from jobs.predictors.tabular import Prediction
    from jobs.training.compare import kendall_tau
    from jobs.training.tasks import task_named
    from jobs.training.trust import TrustProfile

    metanet, partners = cfg["model"], method.split("+")[1:]     # the run's own partners (its answer's name)
    by, ids, sel = saved_rows(con, run_id)
    if not all(m in by for m in (metanet, method, *partners)):
        return None
    fitted = {n: (None, Prediction(n, np.array([by[n][i] for i in ids], float),
                                   np.isfinite([by[n][i] for i in ids]))) for n in partners}
    task = task_named("regression")
    plain = stack_with_statistics(task, sel, metanet, np.array([by[metanet][i] for i in ids], float), fitted)
    _, trusted = TrustProfile.judged(con, ids, sel.mask("train"))
    balanced = np.array([by[method][i] for i in ids], float)
    if cfg.get("plain_statistics"):
        from jobs.predictors.stacking import read_stack
        from jobs.predictors.tabular import predict_all

        fallback = read_stack(catalog, run_id).fallback
        balanced = fallback.apply(np.array([by[metanet][i] for i in ids], float),
                                  predict_all(con, fallback.predictors, ids))
    gated = np.where(trusted, plain.predictions, balanced)
    test = sel.mask("test")
    y = sel.targets[test]
    out = {m: kendall_tau(y, np.array([by[m][i] for i in ids], float)[test]) for m in (metanet, method, *partners)}
    out["statnn_avg"] = kendall_tau(y, np.mean([fitted[n][1].predictions for n in partners], axis=0)[test])
    out["balanced"], out["gated"] = kendall_tau(y, balanced[test]), kendall_tau(y, gated[test])
    out["untrusted"] = float((~trusted[test]).mean())
    out["test"] = (y, gated[test], balanced[test])
    return out


def not_catalogs(paths) -> bool:
    """Say on stderr which of ``paths`` are not catalogs; True if any is not."""
    bad = [p for p in paths if not (Path(p) / "parts").exists()]
    for p in bad:
        print(f"{p}: not a catalog", file=sys.stderr)
    return bool(bad)


def saved_rows(con, run_id: str) -> tuple[dict[str, dict[str, float]], list[str], "_Selection"]:
    """One run's predictions by method and model_id (NaN where it gave none), its model_ids sorted,
    and their splits and targets as a selection ``stack_with_statistics`` reads."""
    rows = con.execute("SELECT p.model_id, p.split, p.method, p.predicted, m.test_accuracy FROM predictions p "
                       "JOIN models m USING (model_id) WHERE p.run_id = ?", [run_id]).fetchall()
    by: dict[str, dict[str, float]] = defaultdict(dict)
    split, target = {}, {}
    for model_id, s, m, p, y in rows:
        by[m][model_id] = np.nan if p is None else p
        split[model_id], target[model_id] = s, y
    ids = sorted(split)
    return by, ids, _Selection(ids, np.array([split[i] for i in ids]), np.array([target[i] for i in ids], float))


class _Selection:
    """What ``stack_with_statistics`` reads of a jobs.training.data.Selection, from a saved run."""

    def __init__(self, ids, splits, targets):
        self.model_ids, self.splits, self.targets = ids, splits, targets

    def mask(self, split: str) -> np.ndarray:
        return self.splits == split



def main(argv=None) -> int:
    from graphstore import duck
    from graphstore.catalog import Catalog
    from jobs.training.compare import paired_bootstrap

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("catalogs", nargs="+", type=Path, help="catalogs holding benchmark runs")
    args = ap.parse_args(argv)
    if not_catalogs(args.catalogs):
        return 2
    for cat in args.catalogs:
        con = duck.connect(cat)
        groups: dict[tuple, dict[int, dict]] = defaultdict(dict)
        for run_id, cfg, method in saved_runs(con):      # the first run of each fold (a benchmark may repeat one)
            key = (cfg["model"], cfg.get("train_size") or 0, bool(cfg.get("head_statistics")))
            if cfg.get("fold") in groups[key]:
                continue
            scores = rescore(con, run_id, cfg, method, Catalog(cat))
            if scores is not None:
                groups[key][cfg.get("fold")] = scores
        con.close()
        print(f"{cat.name}: mean test tau over folds, minus the strongest statistics at that size")
        print(f"  {'model':5s} {'train':>5s} {'head':>4s} {'folds':>5s} {'NG-GNN':>8s} {'balanced':>9s} {'gated':>8s}"
              f" {'strongest':>16s} {'untrusted':>9s}   gated - balanced, paired 95% interval")
        for (model, size, head), folds in sorted(groups.items()):
            runs = list(folds.values())
            if not runs:
                continue
            common = set.intersection(*(set(r) for r in runs)) - {"test"}    # runs from before a partner joined lack it
            mean = {k: float(np.mean([r[k] for r in runs])) for k in common}
            best = max((k for k in (*STATISTICS, "statnn_avg") if k in mean), key=mean.get)
            d = paired_bootstrap(*zip(*(r["test"] for r in runs)))
            print(f"  {model:5s} {size or 'all':>5} {'on' if head else 'off':>4s} {len(runs):5d} "
                  f"{mean[model] - mean[best]:+8.3f} {mean['balanced'] - mean[best]:+9.3f} {mean['gated'] - mean[best]:+8.3f}"
                  f" {best + f' {mean[best]:.3f}':>16s} {100 * mean['untrusted']:8.1f}%   "
                  f"{d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
