"""Robustness to function-preserving rescalings: clean and rescaled test Kendall tau, side by side.

On the models of one activation at a time (``--activations``, default ReLU and tanh) of the
fixed-architecture zoo (``cnn-fixed``) and of the diverse zoo (``cnn``), every method is trained on
the clean training split and scored on the clean test models and on random function-preserving
transformations of them (the same ones for every method): per-neuron rescalings U[1, 10] and
U[1, 10^3] where the activation allows scaling (ReLU-like), random sign flips where it is odd (tanh;
there the two columns are the same kind of change):

- StatNN (per-layer statistics into gradient boosting), which rescalings move;
- NG-GNN as it is, with ``--canonical`` (one graph per rescaling orbit), with ``--balanced`` (the
  orbit's representative whose neurons have equal incoming and outgoing norms), canonical with signed-log
  values (``--compress``: the factors pushed forward pile up in the last layers), canonical with
  the quasi layer, with ``--quasi`` (the quasi-equivariant scaling layer) and with
  ``--scale-augment 1000`` (training on rescalings); under each, ``blend``: the run's answer, the
  variant blended with StatNN (whose statistics are read from the same balanced or canonical graphs).

    .venv/bin/python benchmarks/bench_symmetry.py            # quick: 400-model zoos, every variant, 20 epochs
    .venv/bin/python benchmarks/bench_symmetry.py --full     # 1,500-model zoos, plain and balanced, the recipe's epochs
    # --full --zoos cnn-fixed and --full --zoos cnn, one per core: 47 and 29 min, side by side

Every model is a test model once: K folds by hash of model_id (``--folds``, default 3);
seeds change the metanetworks' initialisation and training order; the spread printed is over
folds and seeds. Below the table, each variant's paired difference to plain NG-GNN (same seed and
fold; its blend to the plain blend) on clean test models, and each one's loss under the largest
rescaling (clean minus rescaled tau, same runs): what issue #33's bar reads. Zoos are made with ``pipeline zoo make`` into
/tmp/zoograph-bench and reused.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import numpy as np

from _zoos import zoo_catalog

SCALES = (10.0, 1000.0)
PLAIN = {"balanced": False}          # the checkpoints' own weights (balanced inputs are the default)
VARIANTS = {"ngnn": PLAIN, "ngnn+canonical": {"canonical": True},
            "ngnn+canon+slog": {"canonical": True, "compress": True}, "ngnn+balanced": {"balanced": True},
            "ngnn+canon+quasi": {"canonical": True, "quasi": True},
            "ngnn+quasi": {**PLAIN, "quasi": True}, "ngnn+augment": {**PLAIN, "scale_augment": 1000.0}}


def run_variant(cat: Path, variant: str, seed: int, epochs: int, baselines: bool, folds: int = 0,
                fold: int = 0, activation: str = "relu") -> dict:
    from jobs.config import TrainConfig
    from jobs.training.train import train_heterognn

    cfg = TrainConfig(where=f"activation = '{activation}'", epochs=epochs, patience=max(4, epochs // 3), seed=seed,
                      rescale_test=SCALES, baselines=baselines, folds=folds, fold=fold, **VARIANTS[variant])
    t = time.perf_counter()
    report = train_heterognn(cat, cfg, progress=False)
    taus = {k: v.get("kendall_tau", float("nan")) for k, v in report.metrics.items()}
    print(f"  {variant:15s} {activation} seed {seed} fold {fold}: " + "  ".join(f"{k} {v:.3f}" for k, v in taus.items()
                                                       if k.startswith(("ngnn", "statnn")))
          + f"   ({time.perf_counter() - t:.0f}s, {report.n_models['test']} test models)", flush=True)
    return {"taus": taus, "n_test": report.n_models["test"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true",
                    help="1,500-model zoos (about 500 test models per fold), plain and balanced NG-GNN, the "
                    "recipe's epochs (default: quick)")
    ap.add_argument("--n", type=int, default=None, help="models per zoo (default 400 quick, 1500 full)")
    ap.add_argument("--seeds", type=int, default=1, help="seeds per method (default 1)")
    ap.add_argument("--epochs", type=int, default=None,
                    help="epochs per ensemble member (default 20 quick, the recipe's 10 full)")
    ap.add_argument("--zoos", default="cnn-fixed,cnn", help="comma-separated zoo kinds")
    ap.add_argument("--activations", default="relu,tanh",
                    help="comma-separated activations, each its own runs: relu-like models are rescaled, tanh "
                    "models sign-flipped (odd), gelu/silu are the control (no symmetry to protect)")
    ap.add_argument("--variants", default=None,
                    help=f"comma-separated, of {', '.join(VARIANTS)} (default all quick, ngnn,ngnn+balanced full)")
    ap.add_argument("--folds", type=int, default=3,
                    help="K-fold splits (every model tested once); 0 = the zoo's hash split")
    args = ap.parse_args(argv)
    from jobs.config import DEFAULT_EPOCHS

    n = args.n or (1500 if args.full else 400)
    seeds = max(1, args.seeds)
    epochs = args.epochs or (DEFAULT_EPOCHS if args.full else 20)
    variants = [v for v in (args.variants or ("ngnn,ngnn+balanced" if args.full else ",".join(VARIANTS))).split(",")
                if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variant(s) {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    started = time.perf_counter()
    table: dict[str, dict[str, list[float]]] = {}
    n_test: dict[str, int] = {}
    groups = [(kind, act) for kind in args.zoos.split(",") for act in args.activations.split(",")]
    for kind, act in groups:
        cat = zoo_catalog(kind, n)
        print(f"{kind}: {act} models of a {n}-model zoo", flush=True)
        for variant in variants:
            for seed, fold in itertools.product(range(seeds), range(max(1, args.folds))):
                try:
                    # every variant fits the baselines: its answer is blended with them
                    res = run_variant(cat, variant, seed, epochs, baselines=True, folds=args.folds, fold=fold,
                                      activation=act)
                except Exception as exc:          # e.g. too few models of this activation in the zoo
                    print(f"  {variant} {act}: skipped ({str(exc).splitlines()[0]})", flush=True)
                    break
                group = f"{kind}/{act}"
                n_test[group] = n_test.get(group, 0) + (res["n_test"] if seed == 0 and variant == variants[0] else 0)
                for key, tau in res["taus"].items():
                    method, _, scale = key.partition("@")
                    if method in ("flat_mlp", "statnn_mlp", "statnn_ridge") or (
                            method == "statnn" and variant != variants[0]):      # the same statistics in every run
                        continue
                    # the variant's own row, and its answer: the blend with statistics (read from the same graphs)
                    name = variant if method == "ngnn" else f"{variant} blend" if method.startswith("ngnn+") else method
                    table.setdefault(name, {}).setdefault(f"{group} {scale or 'clean'}", []).append(tau)
    cols = [f"{kind}/{act} {s}" for kind, act in groups for s in ("clean", *(f"x{m:g}" for m in SCALES))]
    print(f"\ntest Kendall tau, mean ± sd over {seeds} seed(s) x {max(1, args.folds)} fold(s); test models in all: "
          + ", ".join(f"{k} {v}" for k, v in n_test.items()))
    print("(xMAX: every hidden neuron rescaled by U[1, MAX] where its activation allows it, its sign flipped at "
          "random where the activation is odd; the function is unchanged)")
    for kind, act in groups:
        mine = [c for c in cols if c.startswith(f"{kind}/{act} ")]
        print(f"\n{kind}/{act}" + " " * max(1, 22 - len(kind) - len(act) - 1) + "".join(f"{c.split(' ')[1]:>16s}" for c in mine))
        for name in ("statnn", *(n for v in variants for n in (v, f"{v} blend"))):
            cells = []
            for c in mine:
                v = np.array(table.get(name, {}).get(c, []), dtype=float)
                cells.append(f"{v.mean():.3f} ± {v.std():.3f}" if len(v) else "n/a")
            print(f"{name:22s}" + "".join(f"{x:>16s}" for x in cells))
    if "ngnn" in variants and len(variants) > 1:
        print(f"\npaired, same seed and fold: clean tau minus plain NG-GNN's (a blend minus the plain blend); "
              f"loss = clean minus x{max(SCALES):g} tau of the same runs; mean ± sd over runs")
        for kind, act in groups:
            print(f"{kind}/{act}")
            for name in (n for v in variants for n in (v, f"{v} blend")):
                base = "ngnn blend" if name.endswith(" blend") else "ngnn"
                cell = lambda nm, sc: np.array(table.get(nm, {}).get(f"{kind}/{act} {sc}", []), dtype=float)
                clean, moved, ref = cell(name, "clean"), cell(name, f"x{max(SCALES):g}"), cell(base, "clean")
                if not len(clean):
                    continue
                d = clean - ref if name != base and len(ref) == len(clean) else None
                loss = clean - moved if len(moved) == len(clean) else None
                print(f"  {name:22s}" + (f"  d clean {d.mean():+.3f} ± {d.std():.3f}" if d is not None
                                         else " " * 24)
                      + (f"   loss x{max(SCALES):g} {loss.mean():+.3f} ± {loss.std():.3f}" if loss is not None else ""))
    print(f"\n{time.perf_counter() - started:.0f}s in all")


if __name__ == "__main__":
    sys.exit(main())
