"""The blend's collapse threshold, re-scored on saved runs: the answer as today's code builds it with
``jobs.predictors.stacking.COLLAPSED`` at each of several values, paired on the same test models.

No training. For every metanetwork run with a blend that a catalog holds (3-fold benchmark runs),
each threshold rebuilds the run's answer through ``stack_with_statistics``, the code runs use: the
partners kept (those within the threshold of the best on validation), the weight chosen on
validation, plain statistics where the gate trusts the input and the saved fallback's (its partners
refitted) elsewhere. The first threshold given is the baseline; with it at the value the run used,
the rebuilt answer is the saved one. Per catalog, recipe (metanetwork, training size, members, the
answer's partners) and threshold it prints mean test tau over the folds, the paired difference to
the strongest statistics (a partner or their mean) and to the first threshold, with bootstrap 95%
intervals (test models resampled within each fold).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_blend_threshold.py /tmp/zoograph-bench/catalog-blind-wild_cnn-1500-3 --thresholds 0.1,0.05

The thresholds, like any lever, are chosen on development zoos; blind zoos' runs are re-scored for
the report only.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from bench_blend_statistics import not_catalogs, saved_rows, saved_runs


def rebuild(con, catalog, run_id: str, cfg: dict, method: str, thresholds) -> dict | None:
    """``{"y": test targets, "answers": {threshold: test answers}, "statistics": {name: test
    predictions}, "saved": the saved answer for every model, "rebuilt": {threshold: answer for every
    model}}`` of one saved run, or None when its rows lack a partner."""
    import jobs.predictors.stacking as stacking
    from jobs.predictors.tabular import Prediction, predict_all
    from jobs.training.tasks import task_named
    from jobs.training.trust import TrustProfile

    metanet, partners = cfg["model"], method.split("+")[1:]
    by, ids, sel = saved_rows(con, run_id)
    if not all(m in by for m in (metanet, method, *partners)):
        return None

    def column(name):
        return np.array([by[name][i] for i in ids], float)

    def as_fitted(names, predictions):
        return {n: (None, Prediction(n, p, np.isfinite(p))) for n, p in zip(names, predictions)}

    plain = as_fitted(partners, [column(n) for n in partners])
    saved = stacking.read_stack(catalog, run_id)
    fallback = trusted = None
    if saved is not None and saved.fallback is not None:
        fallback = as_fitted(saved.fallback.partners, predict_all(con, saved.fallback.predictors, ids))
        _, trusted = TrustProfile.judged(con, ids, sel.mask("train"))
    task, metanetwork = task_named("regression"), column(metanet)
    rebuilt = {}
    default = stacking.COLLAPSED
    try:
        for threshold in thresholds:
            stacking.COLLAPSED = threshold
            answer = stacking.stack_with_statistics(task, sel, metanet, metanetwork, plain).predictions
            if fallback is not None:
                answer = np.where(trusted, answer,
                                  stacking.stack_with_statistics(task, sel, metanet, metanetwork, fallback).predictions)
            rebuilt[threshold] = answer
    finally:
        stacking.COLLAPSED = default
    test = sel.mask("test")
    statistics = {n: column(n)[test] for n in partners}
    statistics["statnn_avg"] = np.mean([column(n) for n in partners], axis=0)[test]
    return {"y": sel.targets[test], "answers": {t: a[test] for t, a in rebuilt.items()}, "statistics": statistics,
            "saved": column(method), "rebuilt": rebuilt}


def main(argv=None) -> int:
    from graphstore import duck
    from graphstore.catalog import Catalog
    from jobs.training.compare import kendall_tau, paired_bootstrap

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("catalogs", nargs="+", type=Path, help="catalogs holding 3-fold benchmark runs")
    ap.add_argument("--thresholds", default="0.1,0.05",
                    help="comma-separated values of COLLAPSED; the first is the baseline (default 0.1,0.05)")
    ap.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples")
    args = ap.parse_args(argv)
    try:
        thresholds = [float(t) for t in args.thresholds.split(",") if t]
    except ValueError:
        ap.error(f"--thresholds takes numbers, e.g. 0.1,0.05; got {args.thresholds!r}")
    if len(thresholds) < 2 or any(t < 0 for t in thresholds):
        ap.error("--thresholds takes at least two values >= 0")
    if not_catalogs(args.catalogs):
        return 2
    for cat in args.catalogs:
        con = duck.connect(cat)
        groups: dict[tuple, dict[int, dict]] = defaultdict(dict)
        for run_id, cfg, method in saved_runs(con):          # the latest run of each fold
            if cfg.get("residual") or not cfg.get("folds"):
                continue
            scores = rebuild(con, Catalog(cat), run_id, cfg, method, thresholds)
            if scores is not None:
                key = (cfg["model"], cfg.get("train_size") or 0, cfg.get("ensemble", 1), method.count("+"))
                groups[key][cfg.get("fold")] = scores
        con.close()
        print(f"{cat.name}: mean test tau over folds; paired differences with bootstrap 95% intervals")
        for (model, size, members, partners), folds in sorted(groups.items()):
            runs = [folds[f] for f in sorted(folds)]
            y = [r["y"] for r in runs]
            names = list(runs[0]["statistics"])
            best = max(names, key=lambda n: np.mean([kendall_tau(r["y"], r["statistics"][n]) for r in runs]))
            strongest = [r["statistics"][best] for r in runs]
            print(f"  {model} @ {size or 'all'} train, {members} member(s), {partners} partners, {len(runs)} folds; "
                  f"strongest statistics {best} {np.mean([kendall_tau(a, b) for a, b in zip(y, strongest)]):.3f}")
            base = [r["answers"][thresholds[0]] for r in runs]
            for t in thresholds:
                answers = [r["answers"][t] for r in runs]
                tau = np.mean([kendall_tau(a, b) for a, b in zip(y, answers)])
                vs = paired_bootstrap(y, answers, strongest, args.resamples)
                line = (f"    COLLAPSED={t:<5g} answer {tau:.3f}   vs {best}: {vs.mean:+.3f} [{vs.low:+.3f}, "
                        f"{vs.high:+.3f}]")
                if t != thresholds[0]:
                    d = paired_bootstrap(y, answers, base, args.resamples)
                    line += f"   vs COLLAPSED={thresholds[0]:g}: {d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}]"
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
