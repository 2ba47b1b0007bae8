"""Calibration modes re-scored on saved runs: what ``--calibration monotone`` would have given.

Calibration is fitted after training, on the validation predictions alone, so it can be refitted on
a finished run's saved ``predictions`` (validation and test rows of its metanetwork) without
training again. The saved predictions are already linearly calibrated; refitting the line on them
gives the identity, and the monotone map is then fitted on exactly the values training would have
fitted it on. Per run it prints the test Kendall tau, R^2 and MAE of each mode (tau is the same by
construction: both maps are strictly increasing), then the mean over the selected runs.

    .venv/bin/python benchmarks/bench_calibration.py /tmp/zoograph-bench/catalog-cnn-fixed-1500-0 --run run-2026...
    .venv/bin/python benchmarks/bench_calibration.py CATALOG --since '2026-12-05 03:00'   # every run since then
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from graphstore import duck
from jobs.training.tasks import CALIBRATIONS, Regression, TargetScale


def saved_predictions(con, run_id: str, method: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """split -> (targets, predictions) of ``method`` in a saved run, test_accuracy as the target."""
    rows = con.execute("SELECT p.split, m.test_accuracy, p.predicted FROM predictions p JOIN models m "
                       "USING (model_id) WHERE p.run_id = ? AND p.method = ? AND p.predicted IS NOT NULL",
                       [run_id, method]).fetchall()
    out: dict[str, list] = {}
    for split, y, p in rows:
        out.setdefault(split, []).append((y, p))
    return {s: tuple(np.array(v, dtype=np.float64).T) for s, v in out.items()}


def rescore(val: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray]) -> dict[str, dict]:
    """Each calibration mode fitted on ``val`` (targets, predictions), scored on ``test``."""
    task = Regression()
    results = {}
    for mode in CALIBRATIONS:
        scale = task.calibrate(val[1][:, None], val[0], TargetScale(), mode)
        results[mode] = task.metrics(test[0], task.decode(test[1][:, None], scale))
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("catalog")
    ap.add_argument("--run", action="append", default=[], help="a run id (repeatable)")
    ap.add_argument("--since", help="every regression run created at or after this time")
    args = ap.parse_args(argv)
    con = duck.connect(args.catalog)
    if args.since:
        args.run += [r for r, in con.execute("SELECT run_id FROM runs WHERE created_at >= ? AND task = 'regression' "
                                             "ORDER BY created_at", [args.since]).fetchall()]
    if not args.run:
        ap.error("no runs: give --run or --since")
    groups: dict[str, list] = {}
    for run_id in args.run:
        cfg = json.loads(con.execute("SELECT config_json FROM runs WHERE run_id = ?", [run_id]).fetchone()[0])
        data = saved_predictions(con, run_id, cfg["model"])
        if "val" not in data or "test" not in data:
            print(f"{run_id}: no saved validation and test predictions of {cfg['model']}; skipped")
            continue
        res = rescore(data["val"], data["test"])
        recipe = f"{cfg['model']} seed {cfg.get('seed')} rank_weight {cfg.get('rank_weight', 0.0)}"
        if cfg["model"] == "ngt":
            recipe += f" relation_values {cfg.get('relation_values', False)}"
        groups.setdefault(recipe, []).append(res)
        print(f"{run_id} {recipe} fold {cfg.get('fold')}  " + "  ".join(
            f"{m}: tau {r['kendall_tau']:.4f} R^2 {r['r2']:.3f} MAE {r['mae']:.4f}" for m, r in res.items()),
            flush=True)
    for recipe, rows in groups.items():      # one line per recipe: the mean over its runs (folds)
        mean = {m: {k: np.mean([r[m][k] for r in rows]) for k in ("kendall_tau", "r2", "mae")} for m in CALIBRATIONS}
        print(f"mean of {len(rows)} runs, {recipe}:  " + "  ".join(
            f"{m}: tau {v['kendall_tau']:.4f} R^2 {v['r2']:.3f} MAE {v['mae']:.4f}" for m, v in mean.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
