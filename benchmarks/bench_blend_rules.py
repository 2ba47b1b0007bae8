"""The blend's rules, re-scored on saved runs: the answer as today's code builds it with each of
several settings of ``jobs.predictors.stacking`` (``COLLAPSED``, the collapse threshold;
``WEIGHT_RULE``, how the metanetwork's weight is read from validation; ``CALIBRATION``, the blend's
recalibration on validation), paired on the same test models.

No training. For every metanetwork run with a blend that a catalog holds (3-fold benchmark runs),
each variant rebuilds the run's answer through ``stack_with_statistics``, the code runs use: the
partners kept (those within the threshold of the best on validation), the weight chosen on
validation, plain statistics where the gate trusts the input and the saved fallback's (its partners
refitted) elsewhere. A variant sets one setting over today's defaults; the first given is the
baseline. With the settings a run used, the rebuilt answer is the saved one. Per catalog, recipe
(metanetwork, training size, members, the answer's partners) and variant it prints mean test tau
over the folds, the paired difference to the strongest statistics (a partner or their mean) and to
the first variant, with bootstrap 95% intervals (test models resampled within each fold); then the
mean test R^2 and MAE (beside the best R^2 and the lowest MAE of any statistics row), and the MAE's
paired difference to the strongest statistics' and to the first variant's (negative: lower error).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_blend_rules.py /tmp/zoograph-bench/catalog-blind-wild_cnn-1500-3 --variants WEIGHT_RULE=grid,WEIGHT_RULE=bagged

Rules, like any lever, are chosen on development zoos; blind zoos' runs are re-scored for the
report only.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from bench_blend_statistics import not_catalogs, saved_rows, saved_runs


SETTINGS = {"COLLAPSED": "float", "WEIGHT_RULE": "str", "CALIBRATION": "str"}     # what a variant may set, and how its value is read


def variant(text: str) -> tuple[str, object]:
    """``"COLLAPSED=0.1"`` -> ``("COLLAPSED", 0.1)``, read by the project's KEY=VALUE parser
    (zoocore.settings); ValueError names what is wrong."""
    import jobs.predictors.stacking as stacking
    from zoocore.settings import typed_pairs

    (name, value), = typed_pairs([text], SETTINGS, "a variant").items()
    if name == "COLLAPSED" and not value >= 0:
        raise ValueError(f"COLLAPSED takes a number >= 0; got {text!r}")
    if name == "WEIGHT_RULE" and value not in stacking.WEIGHT_RULES:
        raise ValueError(f"WEIGHT_RULE is one of {', '.join(stacking.WEIGHT_RULES)}; got {text!r}")
    if name == "CALIBRATION" and value not in stacking.CALIBRATIONS:
        raise ValueError(f"CALIBRATION is one of {', '.join(stacking.CALIBRATIONS)}; got {text!r}")
    return name, value


def label(v: tuple[str, object]) -> str:
    return f"{v[0]}={v[1]:g}" if isinstance(v[1], float) else f"{v[0]}={v[1]}"


def rebuild(con, catalog, run_id: str, cfg: dict, method: str, variants) -> dict | None:
    """``{"y": test targets, "answers": {variant: test answers}, "statistics": {name: test
    predictions}, "saved": the saved answer for every model, "rebuilt": {variant: answer for every
    model}}`` of one saved run, or None when its rows lack a partner. ``variants``: (setting, value)
    pairs (``variant``), each set alone over today's defaults."""
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
    for setting, value in variants:
        default = getattr(stacking, setting)
        setattr(stacking, setting, value)
        try:
            answer = stacking.stack_with_statistics(task, sel, metanet, metanetwork, plain).predictions
            if fallback is not None:
                answer = np.where(trusted, answer,
                                  stacking.stack_with_statistics(task, sel, metanet, metanetwork, fallback).predictions)
        finally:
            setattr(stacking, setting, default)
        rebuilt[(setting, value)] = answer
    test = sel.mask("test")
    statistics = {n: column(n)[test] for n in partners}
    statistics["statnn_avg"] = np.mean([column(n) for n in partners], axis=0)[test]
    return {"y": sel.targets[test], "answers": {t: a[test] for t, a in rebuilt.items()}, "statistics": statistics,
            "saved": column(method), "rebuilt": rebuilt}


def main(argv=None) -> int:
    from graphstore import duck
    from graphstore.catalog import Catalog
    from sklearn.metrics import mean_absolute_error, r2_score

    from jobs.training.compare import kendall_tau, paired_bootstrap

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("catalogs", nargs="+", type=Path, help="catalogs holding 3-fold benchmark runs")
    ap.add_argument("--variants", default="COLLAPSED=0.1,COLLAPSED=0.05",
                    help="comma-separated SETTING=VALUE, each set alone over today's defaults; the first is the "
                         f"baseline. Settings: COLLAPSED (a number >= 0), WEIGHT_RULE (select, grid, bagged, even), "
                         "CALIBRATION (affine, none). "
                         "Default: COLLAPSED=0.1,COLLAPSED=0.05")
    ap.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples")
    args = ap.parse_args(argv)
    try:
        variants = [variant(v) for v in args.variants.split(",") if v]
    except ValueError as exc:
        ap.error(str(exc))
    if len(variants) < 2:
        ap.error("--variants takes at least two, e.g. WEIGHT_RULE=grid,WEIGHT_RULE=bagged")
    if not_catalogs(args.catalogs):
        return 2
    for cat in args.catalogs:
        con = duck.connect(cat)
        groups: dict[tuple, dict[int, dict]] = defaultdict(dict)
        for run_id, cfg, method in saved_runs(con):          # the latest run of each fold
            if cfg.get("residual") or not cfg.get("folds"):
                continue
            scores = rebuild(con, Catalog(cat), run_id, cfg, method, variants)
            if scores is not None:
                key = (cfg["model"], cfg.get("train_size") or 0, cfg.get("ensemble", 1), method.count("+"))
                groups[key][cfg.get("fold")] = scores
        con.close()
        print(f"{cat.name}: mean test tau over folds; paired differences with bootstrap 95% intervals")
        for (model, size, members, partners), folds in sorted(groups.items()):
            runs = [folds[f] for f in sorted(folds)]
            y = [r["y"] for r in runs]

            def mean(metric, predictions):          # a metric's mean over the folds
                return np.mean([metric(a, b) for a, b in zip(y, predictions)])

            statistics = {n: [r["statistics"][n] for r in runs] for n in runs[0]["statistics"]}
            taus, r2s, maes = ({n: mean(m, p) for n, p in statistics.items()}
                               for m in (kendall_tau, r2_score, mean_absolute_error))
            best = max(taus, key=taus.get)
            strongest = statistics[best]
            print(f"  {model} @ {size or 'all'} train, {members} member(s), {partners} partners, {len(runs)} folds; "
                  f"strongest statistics {best} {taus[best]:.3f} (R^2 {r2s[best]:.3f}, MAE {maes[best]:.4f})")
            top, low = max(r2s, key=r2s.get), min(maes, key=maes.get)
            print(f"    best of the statistics: R^2 {r2s[top]:.3f} ({top}), MAE {maes[low]:.4f} ({low})")
            base = [r["answers"][variants[0]] for r in runs]
            width = max(len(label(v)) for v in variants)
            errors = []                             # printed after every variant's tau
            for v in variants:
                answers = [r["answers"][v] for r in runs]
                vs = paired_bootstrap(y, answers, strongest, args.resamples)
                line = (f"    {label(v):<{width}}  answer {mean(kendall_tau, answers):.3f}   vs {best}: {vs.mean:+.3f} "
                        f"[{vs.low:+.3f}, {vs.high:+.3f}]")
                vs = paired_bootstrap(y, answers, strongest, args.resamples, metric=mean_absolute_error)
                error = (f"    {label(v):<{width}}  R^2 {mean(r2_score, answers):.3f} MAE "
                         f"{mean(mean_absolute_error, answers):.4f}   MAE vs {best}: {vs.mean:+.4f} "
                         f"[{vs.low:+.4f}, {vs.high:+.4f}]")
                if v != variants[0]:
                    d = paired_bootstrap(y, answers, base, args.resamples)
                    line += f"   vs {label(variants[0])}: {d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}]"
                    d = paired_bootstrap(y, answers, base, args.resamples, metric=mean_absolute_error)
                    error += f"   vs {label(variants[0])}: {d.mean:+.4f} [{d.low:+.4f}, {d.high:+.4f}]"
                print(line, flush=True)
                errors.append(error)
            print("\n".join(errors), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
