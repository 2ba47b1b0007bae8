"""The trust signal's two error rates: clean test models wrongly flagged, and transformed copies flagged.

On the development zoos (``cnn``, ``cnn-fixed``; made once into /tmp/zoograph-bench), for each of
K folds by hash of model_id, the envelope is fitted on the training models' scale profiles
(``jobs.training.trust.TrustProfile``) read as a run reads them: the checkpoints' own weights
(``plain``, what a ``--no-balanced`` run saves) or their balanced graphs (``balanced``, the default
run's). Printed per zoo and reading, the share flagged of:

- the clean test models (every one of them a false alarm);
- function-preserving copies, every hidden neuron rescaled U[1, 10] or U[1, 10^3] and its sign
  flipped where the activation is odd (counted over the models the transformation changes): a
  plain run's predictions move under them, so it should flag them; a balanced run's do not (the
  copy is the same network to it), so it should not;
- copies whose every weight is 10 or 100 times larger (another function, outside what training
  made): both should flag them.

No metanetwork is trained: this measures the envelope alone.

    .venv/bin/python benchmarks/bench_trust.py               # 400-model zoos (~2 min)
    .venv/bin/python benchmarks/bench_trust.py --full        # 1,500-model zoos (~10 min)
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np

from _zoos import zoo_catalog

READINGS = {"plain": None, "balanced": {"balanced": True}}


def flagged_shares(cat, folds: int, reading: str) -> dict[str, list[float]]:
    """Per column, the share flagged in each fold."""
    from graphstore import duck
    from jobs.training.data import select_models
    from jobs.training.rescaled import rescaled_test_graphs
    from jobs.training.trust import TrustProfile, scale_profiles
    from pipeline.graph_codec import read_graphs

    con = duck.connect(cat)
    out: dict[str, list[float]] = {}
    try:
        for fold in range(folds):
            sel = select_models(con, "test_accuracy", None, catalog=cat, folds=(folds, fold))
            trust = TrustProfile.of_catalog(con, sel.ids("train"), READINGS[reading])
            test = sel.ids("test")
            raw = read_graphs(con, test)
            base = scale_profiles(raw)
            out.setdefault("clean", []).append(float((~trust.judge_catalog(con, test)).mean()))
            for max_scale in (10.0, 1000.0):
                moved = rescaled_test_graphs(con, test, max_scale, seed=fold)
                changed = np.abs(np.nan_to_num(scale_profiles(moved)) - np.nan_to_num(base)).max(1) > 1e-6
                keep = [m for m, c in zip(test, changed) if c]
                flags = ~trust.judge_graphs(con, keep, [g for g, c in zip(moved, changed) if c])
                out.setdefault(f"x{max_scale:g}", []).append(float(flags.mean()) if len(flags) else float("nan"))
            for factor in (10, 100):
                larger = [dataclasses.replace(g, weight=g.weight * factor) for g in raw]
                out.setdefault(f"weights x{factor}", []).append(float((~trust.judge_graphs(con, test, larger)).mean()))
    finally:
        con.close()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="1,500-model zoos (default: quick, 400)")
    ap.add_argument("--n", type=int, default=None, help="models per zoo (default 400 quick, 1500 full)")
    ap.add_argument("--zoos", default="cnn,cnn-fixed", help="comma-separated zoo kinds")
    ap.add_argument("--folds", type=int, default=3, help="K of the K-fold split (default 3)")
    args = ap.parse_args(argv)
    n = args.n or (1500 if args.full else 400)
    started = time.perf_counter()
    cols = ("clean", "x10", "x1000", "weights x10", "weights x100")
    print(f"share of test models flagged, mean (min-max) over {args.folds} folds; {n}-model zoos")
    print(f"{'zoo':12s}{'reading':10s}" + "".join(f"{c:>18s}" for c in cols))
    for kind in args.zoos.split(","):
        cat = zoo_catalog(kind, n)
        for reading in READINGS:
            shares = flagged_shares(cat, args.folds, reading)
            cells = [f"{100 * np.mean(v):.1f}% ({100 * min(v):.0f}-{100 * max(v):.0f})" for v in
                     (shares[c] for c in cols)]
            print(f"{kind:12s}{reading:10s}" + "".join(f"{c:>18s}" for c in cells), flush=True)
    print(f"\n{time.perf_counter() - started:.0f}s in all")


if __name__ == "__main__":
    sys.exit(main())
