"""What probing costs, measured in one run (issue #54): seconds per model of each predictor, the
share of an NG-GNN epoch that fixed probes take, and an epoch with learned probes against one
without.

    python benchmarks/bench_probe_cost.py            # quick: 240-model CNN and MLP zoos (~10 min)
    python benchmarks/bench_probe_cost.py --full     # 1,200 models each
    python benchmarks/bench_probe_cost.py --catalog PATH   # any catalog's CNN rows instead of the CNN zoo

Every predictor is fitted as ``jobs train-heterognn`` fits it, on fold 0 of a 3-fold split, with
the process caches of probe answers and checked programs emptied first: its seconds per model are
its fit (features of every model of the split, the tuning on validation, the predictions) over
the models of the split. NG-GNN trains two epochs with ``--fixed-probes 0`` and ``16``: the first
epoch reads the graphs (and runs the probes), the second reuses what the stream keeps, so both
are printed. Learned probes (``--probes 32``) are the MLP zoo's (1x1 edges only): the issue's bar
is an epoch at most twice one without.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _zoos import zoo_catalog  # noqa: E402
from jobs.analysis.probing import clear_caches  # noqa: E402

PREDICTORS = ("statnn", "statnn_spectral", "probe", "probegen")


def predictor_seconds(cat: Path, where: str | None) -> dict[str, float]:
    """Seconds per model of each predictor's fit on fold 0 (features of every model included)."""
    from graphstore import duck
    from jobs.predictors import fitted_predictor
    from jobs.training.data import select_models

    con = duck.connect(cat)
    sel = select_models(con, "test_accuracy", where, folds=(3, 0), catalog=cat)
    out = {}
    for name in PREDICTORS:
        clear_caches()
        t = time.perf_counter()
        fitted_predictor(name, 0).fit(con, sel)
        out[name] = (time.perf_counter() - t) / len(sel.model_ids)
    con.close()
    return out


def epoch_seconds(cat: Path, where: str | None, **lever) -> list[float]:
    """Seconds of NG-GNN's two training epochs with ``lever`` (fold 0, one member, no baselines)."""
    from jobs.config import TrainConfig
    from jobs.training.train import train_heterognn

    clear_caches()
    cfg = TrainConfig(where=where, folds=3, fold=0, ensemble=1, epochs=2, baselines=False,
                      head_statistics=False, **lever)
    report = train_heterognn(cat, cfg, progress=False)
    return [h["train_seconds"] for h in report.history]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="1,200-model zoos (default: quick, 240)")
    ap.add_argument("--catalog", type=Path, help="measure on this catalog's models instead of the CNN zoo")
    ap.add_argument("--where", help="which of its models (SQL over the models view)")
    args = ap.parse_args(argv)
    n = 1200 if args.full else 240
    cnn = args.catalog or zoo_catalog("cnn", n)
    mlp = zoo_catalog("mlp", n)
    started = time.perf_counter()

    per_model = predictor_seconds(cnn, args.where)
    print(f"seconds per model (fit on fold 0 of 3, every model's features included), {cnn.name}:")
    for name, s in per_model.items():
        print(f"  {name:16s} {s:8.4f}   x{s / per_model['statnn']:.1f} of statnn")

    plain = epoch_seconds(cnn, args.where, fixed_probes=0)
    probed = epoch_seconds(cnn, args.where, fixed_probes=16)
    print("NG-GNN epoch seconds (first, second), fixed probes 0 vs 16:")
    print(f"  0 probes   {plain[0]:7.1f} {plain[-1]:7.1f}")
    print(f"  16 probes  {probed[0]:7.1f} {probed[-1]:7.1f}")
    for k, label in ((0, "first"), (-1, "second")):
        print(f"  probes' share of the {label} epoch: {max(0.0, 1 - plain[k] / probed[k]):.0%}")

    plain = epoch_seconds(mlp, None, probes=0)
    learned = epoch_seconds(mlp, None, probes=32)
    ratio = learned[-1] / plain[-1]
    print(f"learned probes (MLP zoo, {mlp.name}): second epoch {plain[-1]:.1f}s without, {learned[-1]:.1f}s "
          f"with 32: x{ratio:.2f} (bar: at most x2: {'met' if ratio <= 2 else 'NOT met'})")
    print(f"{time.perf_counter() - started:.0f}s in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
