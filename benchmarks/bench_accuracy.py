"""Accuracy prediction on models never seen: every method on the same K folds, with paired intervals.

Two zoos made with ``pipeline zoo make`` (reused from /tmp/zoograph-bench): the diverse CNN zoo
(``cnn``: widths, depths, kernels, batch norm, residuals, activations) and the fixed-architecture
CNN zoo (``cnn-fixed``: one architecture, the training recipe varied). Each is split K ways by a
hash of model_id (``jobs train-heterognn --folds K --fold I``): every model is a test model in
exactly one fold. Per fold, in one run:

- every metanetwork of the registry (jobs.predictors: NG-GNN, NG-T) with the project's default
  recipe, and its answer: the metanetwork blended with the mean of the statistics predictors, the weight
  chosen on validation (``ngnn+statnn+statnn_mlp+statnn_spectral``, jobs.predictors.stacking);
- every tabular predictor of the registry: StatNN as gradient boosting (``statnn``) and as the
  paper's MLP (``statnn_mlp``), each tuned on validation, with shape descriptors on mixed zoos;
  StatNN with spectral descriptors (``statnn_spectral``); the flat-weights MLP (one-shape zoos); and
  ``statnn_avg``, the mean of the statistics predictors (the blend's partners);
- predictors trained on what the models compute (``--function probegen``: learned probes from a
  shared deep linear generator, jobs.predictors.probegen), each as its own run;
- peers (``--peers``, the optional extra ``.[peers]``; ``jobs.predictors.peers``): NFN with NP and with HNP
  layers (fixed zoo only: one shape), WeightWatcher's summary metrics as zero-training predictors
  (``ww_alpha`` ...; sign chosen on the training split) and its per-layer metrics into tuned
  gradient boosting (``ww_gbt``).

It prints, per zoo and method, the mean and standard deviation over folds of test Kendall tau, R^2
and MAE, and the paired difference in tau to the strongest statistics (``statnn``, ``statnn_mlp``,
``statnn_spectral`` or ``statnn_avg``) with a bootstrap 95% interval
(test models resampled within each fold, the same draw for both methods). A margin whose interval
holds zero is not a win. Predictions are read back from the catalog's ``predictions`` relation.

    .venv/bin/python benchmarks/bench_accuracy.py            # quick: 400-model zoos, 3 folds, one member (~20 min)
    .venv/bin/python benchmarks/bench_accuracy.py --full     # 1,500-model zoos, 3 folds (test sets of ~500),
                                                             # the default recipe (an ensemble of 3)
    .venv/bin/python benchmarks/bench_accuracy.py --zoos cnn-fixed --peers nfn_np,nfn_hnp,ww
    .venv/bin/python benchmarks/bench_accuracy.py --blind    # the blind zoos of benchmarks/blind, reported apart
    .venv/bin/python benchmarks/bench_accuracy.py --versus head_statistics=true   # a lever against the recipe

The blind zoos are for reporting only: a recipe lever chosen by looking at their numbers makes
them development zoos (regenerate them with a new --seed).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from _zoos import BLIND, blind_catalog, zoo_catalog
from jobs.predictors.peers import PEERS, PeerRunner
from jobs.predictors import PREDICTORS, names

METANETS = tuple(names("metanetwork"))
FUNCTION = tuple(names("function"))
TABULAR = tuple(n for n in names("tabular") if PREDICTORS[n].reads != "data")    # data-free: no probe_data
# the statistics predictors, and their mean (what a metanetwork's answer is blended with: jobs.predictors.stacking),
# computed here per fold so that the paired difference is against the strongest statistics
STATNNS = (*(n for n in TABULAR if PREDICTORS[n].stack and PREDICTORS[n].reads == "weights"), "statnn_avg")
# the strongest single predictor a metanetwork and the answer are measured against: statistics or probing
# every single predictor a run fits: the statistics, and those reading the function (probe, and probegen: not tabular)
SINGLES = (*STATNNS, *(n for n in (*TABULAR, *FUNCTION) if PREDICTORS[n].reads == "function"))


def shown(levers: dict) -> str:
    """Levers in one form for every line the bench prints (the recipe's levers, the variant's row
    tag): booleans as typed (``head_spectral=true``), a tuple's items joined by ``+`` since commas
    separate the levers."""
    def value(v) -> str:
        if isinstance(v, tuple):
            return "+".join(map(str, v))
        return str(v).lower() if isinstance(v, bool) else str(v)
    return ",".join(f"{k}={value(v)}" for k, v in levers.items())


def tag_name(text: str) -> str:
    """A ``--tag``: letters, digits, ``_`` and ``-`` (it names table rows)."""
    import re

    if not re.fullmatch(r"[A-Za-z0-9_-]{1,24}", text):
        raise argparse.ArgumentTypeError(f"a tag is 1-24 letters, digits, _ or -; got {text!r}")
    return text


def overrides(pairs: list[str]) -> dict:
    """``--set key=value`` pairs as TrainConfig fields (a lever of the recipe, e.g. layers=5)."""
    from dataclasses import fields

    from jobs.config import TrainConfig
    from zoocore.settings import typed_pairs

    try:
        return typed_pairs(pairs, {f.name: f.type for f in fields(TrainConfig)}, "TrainConfig")
    except ValueError as exc:
        raise SystemExit(f"--set {exc}") from None


def run_fold(cat: Path, model: str, folds: int, fold: int, epochs: int | None, seed: int, baselines: bool,
             lever: dict | None = None, tag: str = "") -> str:
    from jobs.config import TrainConfig
    from jobs.training.train import train_heterognn

    # None: the recipe's schedule (10 epochs, more on small training sets: TrainConfig.schedule_for)
    fixed = {} if epochs is None else {"epochs": epochs, "patience": max(5, epochs // 3)}
    settings = {**fixed, **(lever or {})}
    cfg = TrainConfig(folds=folds, fold=fold, seed=seed, model=model, baselines=baselines, **settings)
    t = time.perf_counter()
    report = train_heterognn(cat, cfg, progress=False)
    taus = "  ".join(f"{k} {v.get('kendall_tau', float('nan')):.3f}" for k, v in report.metrics.items())
    best = max(report.history, key=lambda h: h["val_score"])["epoch"] + 1 if report.history else 0
    print(f"  fold {fold} {model + tag:5s} {taus}   ({time.perf_counter() - t:.0f}s, {report.n_models['test']} test models, "
          f"best epoch {best} of {report.epochs_run})", flush=True)
    return report.run_id


def baseline_predictions(cat: Path, folds: int, fold: int, seed: int, train_size: int | None = None
                         ) -> dict[str, dict[str, tuple[float, float]]]:
    """Every tabular predictor of the registry on fold ``fold``'s test models, fitted as ``jobs
    train-heterognn`` fits them (on ``train_size`` training models), without a metanetwork
    (``--models ''``: baselines and peers only)."""
    from graphstore import duck
    from jobs.training.data import select_models
    from jobs.predictors.tabular import fit_all

    t = time.perf_counter()
    con = duck.connect(cat)
    sel = select_models(con, "test_accuracy", folds=(folds, fold))
    if train_size is not None:
        sel = sel.with_training_models(train_size)
    fitted = fit_all(con, sel, TABULAR, seed)
    con.close()
    test = sel.mask("test")
    print(f"  fold {fold} baselines ({time.perf_counter() - t:.0f}s, {int(test.sum())} test models)", flush=True)
    return {name: {m: (y, p) for m, y, p, keep in zip(sel.model_ids, sel.targets, r.predictions, test & r.applicable)
                   if keep} for name, (_, r) in fitted.items()}


def training_models(cat: Path, folds: int, fold: int) -> int:
    """How many training models fold ``fold`` holds."""
    from graphstore import duck
    from jobs.training.data import select_models

    con = duck.connect(cat)
    try:
        return int(select_models(con, "test_accuracy", folds=(folds, fold)).mask("train").sum())
    finally:
        con.close()


def curve_table(curves: list[tuple[str, int, list[dict]]]) -> list[str]:
    """Mean test tau per zoo, method and training size (the learning curve), and the margin of each
    method over the strongest single predictor (statistics or probing) at that size."""
    from jobs.training.compare import kendall_tau

    lines = ["learning curve: mean test tau over folds (margin over the strongest single predictor at that size)"]
    for kind in dict.fromkeys(k for k, _, _ in curves):
        rows = [(size, per_fold) for k, size, per_fold in curves if k == kind]
        methods = [m for m in dict.fromkeys(m for _, pf in rows for f in pf for m in f)
                   if all(len(f.get(m, ())) >= 2 for _, pf in rows for f in pf)]
        lines.append(f"  {kind}: " + "  ".join(f"{s:>14d}" for s, _ in rows))
        taus = [{x: np.mean([kendall_tau(*_arrays(f[x])) for f in pf]) for x in methods} for _, pf in rows]
        best = [max((x for x in SINGLES if x in tau), key=tau.get) for tau in taus]
        for m in methods:
            cells = [f"{tau[m]:.3f} ({tau[m] - tau[b]:+.3f})" for tau, b in zip(taus, best)]
            lines.append(f"    {m:24s} " + "  ".join(f"{c:>14s}" for c in cells))
    return lines


def with_statistics_mean(fold: dict[str, dict]) -> dict[str, dict]:
    """The fold's predictions plus ``statnn_avg``: the mean of the statistics predictors' predictions."""
    parts = [fold[n] for n in STATNNS[:-1] if n in fold]
    if len(parts) < 2:
        return fold
    ids = set.intersection(*(set(p) for p in parts))
    return {**fold, "statnn_avg": {i: (parts[0][i][0], float(np.mean([p[i][1] for p in parts]))) for i in ids}}


def test_predictions(cat: Path, run_ids: list[str]) -> dict[str, dict[str, tuple[float, float]]]:
    """method -> {model_id: (target, prediction)} on the test models of these runs (one fold)."""
    from graphstore import duck

    con = duck.connect(cat, ["models", "predictions"])
    rows = con.execute(
        "SELECT p.method, p.model_id, m.test_accuracy, p.predicted FROM predictions p JOIN models m USING (model_id) "
        f"WHERE p.split = 'test' AND p.run_id IN ({', '.join('?' * len(run_ids))}) AND p.predicted IS NOT NULL "
        "AND NOT isnan(p.predicted)", run_ids).fetchall()
    con.close()
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for method, model_id, y, p in rows:
        out.setdefault(method, {})[model_id] = (y, p)
    return out


def peer_test_predictions(cat: Path, preds: dict[str, dict[str, float]], folds: int, fold: int
                          ) -> dict[str, dict[str, tuple[float, float]]]:
    """The peers' predictions (method -> {model_id: prediction}) on fold ``fold``'s test models, as
    ``test_predictions`` gives them: method -> {model_id: (target, prediction)}."""
    from graphstore import duck
    from jobs.training.data import fold_split

    con = duck.connect(cat, ["models"])
    target = dict(con.execute("SELECT model_id, test_accuracy FROM models WHERE test_accuracy IS NOT NULL").fetchall())
    con.close()
    return {m: {i: (target[i], p) for i, p in by_id.items()
                if fold_split(i, folds, fold) == "test" and np.isfinite(p)} for m, by_id in preds.items()}


def _arrays(preds: dict[str, tuple[float, float]], ids=None) -> tuple[np.ndarray, np.ndarray]:
    ids = sorted(preds) if ids is None else ids
    return np.array([preds[i][0] for i in ids], float), np.array([preds[i][1] for i in ids], float)


def summarise(kind: str, per_fold: list[dict[str, dict]], resamples: int) -> list[str]:
    from sklearn.metrics import mean_absolute_error, r2_score

    from jobs.training.compare import kendall_tau, paired_bootstrap

    seen = sorted({m for f in per_fold for m in f} - {*METANETS, *STATNNS, *TABULAR})
    # a method that scored under half of a fold's test models (the flat-weights MLP on a zoo of many
    # shapes scores one shape's few) would be ranked on another, tiny test set: left out, and said so
    n_fold = [max(len(f.get(m, ())) for m in STATNNS) for f in per_fold]
    covered = {m: [len(f.get(m, ())) for f in per_fold] for m in dict.fromkeys((*METANETS, *seen, *STATNNS, *TABULAR))}
    methods = [m for m, n in covered.items() if all(k >= max(2, t / 2) for k, t in zip(n, n_fold))]
    left_out = [f"  ({m}: left out, it scored only {n} of {n_fold} test models)" for m, n in covered.items()
                if m not in methods and any(n)]
    score = {}
    for m in methods:
        arrays = [_arrays(f[m]) for f in per_fold]
        score[m] = {"tau": [kendall_tau(*a) for a in arrays], "r2": [r2_score(*a) for a in arrays],
                    "mae": [mean_absolute_error(*a) for a in arrays]}
    w = max(11, *map(len, methods))
    best = max((m for m in SINGLES if m in score), key=lambda m: np.mean(score[m]["tau"]))
    n_test = [len(f[best]) for f in per_fold]
    lines = [f"{kind}: {len(per_fold)} folds, test models per fold {n_test}; paired difference to {best} "
             "(the strongest single predictor: statistics or probing), bootstrap 95% interval",
             f"  {'method':{w}s} {'tau mean ± sd':>16s} {'R^2 mean ± sd':>16s} {'MAE mean ± sd':>16s}"
             f"   {'d tau vs ' + best:>28s}"]
    for m in methods:
        cells = [f"{np.mean(score[m][k]):.3f} ± {np.std(score[m][k]):.3f}" for k in ("tau", "r2", "mae")]
        if m == best:
            diff = "-"
        else:       # paired: both methods on the test models both predicted (all of them but for flat_mlp)
            pairs = [(_arrays(f[m], ids), _arrays(f[best], ids)) for f in per_fold
                     for ids in [sorted(set(f[m]) & set(f[best]))]]
            d = paired_bootstrap([a[0] for a, _ in pairs], [a[1] for a, _ in pairs], [b[1] for _, b in pairs],
                                 resamples=resamples)
            diff = f"{d}" + (" *" if d.significant else "")
        lines.append(f"  {m:{w}s} " + " ".join(f"{c:>16s}" for c in cells) + f"   {diff:>28s}")
    lines += left_out
    return lines


def variant_tag(name: str | None, versus: dict) -> str:
    """The variant rows' tag: ``[name]`` (``--tag``), else the levers themselves (``[layers=5]``)."""
    return f"[{name or shown(versus)}]"


def versus_lines(per_fold: list[dict[str, dict]], tag: str, resamples: int, levers: str | None = None) -> list[str]:
    """Each variant row ``<method><tag>`` (``--versus``) against the same method without the
    lever: the paired difference in tau on the test models both scored, with its interval. A tag
    that is a short name (``--tag``) is spelled out once as ``levers`` in the header."""
    from jobs.training.compare import paired_bootstrap

    named = f" = {levers}" if levers and f"[{levers}]" != tag else ""
    lines = [f"  the lever {tag}{named} against the recipe, paired on the same test models:"]
    for m in [m for m in per_fold[0] if m.endswith(tag) and all(m[:-len(tag)] in f and m in f for f in per_fold)]:
        base = m[:-len(tag)]
        pairs = [(_arrays(f[m], ids), _arrays(f[base], ids)) for f in per_fold
                 for ids in [sorted(set(f[m]) & set(f[base]))]]
        d = paired_bootstrap([a[0] for a, _ in pairs], [a[1] for a, _ in pairs], [b[1] for _, b in pairs],
                             resamples=resamples)
        lines.append(f"    {m} - {base}: {d}" + (" *" if d.significant else ""))
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="1,500-model zoos (default: quick, 400)")
    ap.add_argument("--n", type=int, default=None, help="models per zoo (default 400 quick, 1500 full)")
    ap.add_argument("--folds", type=int, default=3, help="K of the K-fold split (default 3)")
    ap.add_argument("--epochs", type=int, default=None,
                    help="metanetwork epochs per ensemble member (default: the recipe's: 10, more where a member "
                    "would take fewer than --min-steps batches)")
    ap.add_argument("--zoos", default=None, help="comma-separated zoo kinds (default cnn,cnn-fixed; with --blind, "
                    "some of the blind ones)")
    ap.add_argument("--blind", action="store_true",
                    help=f"the blind zoos instead ({', '.join(BLIND)}; benchmarks/blind, written without reading "
                    "this project's generators): report only, never choose a lever by them")
    ap.add_argument("--models", default=",".join(METANETS),
                    help="metanetworks to train (ngnn,ngt; '' = none: the baselines and peers only)")
    ap.add_argument("--function", default="", metavar="NAMES",
                    help=f"predictors trained on what the models compute, each as its own run beside the others "
                    f"({','.join(FUNCTION)}; '' = none, the default: they train for minutes per fold)")
    ap.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peers", default="",
                    help=f"peer methods to run beside them, comma-separated ({','.join(PEERS)}; nfn_* on "
                    "one-architecture zoos only); needs pip install '.[peers]' (default: none)")
    ap.add_argument("--nfn-epochs", type=int, default=20, help="NFN training epochs (default 20)")
    ap.add_argument("--curve", nargs="?", const="100,250,500,1000", default=None, metavar="SIZES",
                    help="a learning curve: every method at these training sizes (default 100,250,500,1000; "
                    "sizes above what a fold holds are skipped), the same validation and test models at each")
    ap.add_argument("--set", dest="lever", action="append", default=[], metavar="KEY=VALUE",
                    help="a TrainConfig field for the metanetworks (a recipe lever), e.g. --set layers=5; repeatable")
    ap.add_argument("--versus", action="append", default=[], metavar="KEY=VALUE",
                    help="also train every metanetwork with this field changed, on the same folds (rows "
                    "'<method>[KEY=VALUE]'), and print each of its rows' paired difference to the same row "
                    "without it: a lever measured against the recipe; repeatable (one variant, all changes)")
    ap.add_argument("--tag", type=tag_name, default=None, metavar="NAME",
                    help="name the --versus rows '<method>[NAME]' (default: the levers, which a long value such "
                    "as a catalog path makes wide); the paired lines spell the levers out once")
    args = ap.parse_args(argv)
    n = args.n or (1500 if args.full else 400)
    epochs = args.epochs
    # quick mode trains one metanetwork per fold, not the recipe's ensemble of 3, to stay under 20 minutes
    lever = {**({} if args.full else {"ensemble": 1}), **overrides(args.lever)}
    versus = overrides(args.versus)
    tag = variant_tag(args.tag, versus)
    peer_names = [p for p in args.peers.split(",") if p]
    if lever:
        print(f"recipe levers: {shown(lever)}", flush=True)
    started = time.perf_counter()
    tables = []
    curves = []
    sizes = [int(s) for s in args.curve.split(",")] if args.curve else [None]
    kinds = args.zoos.split(",") if args.zoos else list(BLIND if args.blind else ("cnn", "cnn-fixed"))
    unknown = set(kinds) - set(BLIND) if args.blind else set()
    if unknown:
        ap.error(f"unknown blind zoo(s) {sorted(unknown)}; the blind zoos are {', '.join(BLIND)}")
    unknown = set(filter(None, args.function.split(","))) - set(FUNCTION)
    if unknown:
        ap.error(f"--function takes {', '.join(FUNCTION)}; not {', '.join(sorted(unknown))}")
    for kind in kinds:
        cat = blind_catalog(kind, n, args.seed) if args.blind else zoo_catalog(kind, n)
        schedule = "the recipe's epochs" if epochs is None else f"{epochs} epochs"
        print(f"{kind}: {n}-model zoo, {args.folds} folds, {schedule}", flush=True)
        available = min(training_models(cat, args.folds, fold) for fold in range(args.folds))
        for size in sizes:
            if size is not None and size > available:
                print(f"  {size} training models: skipped, a fold holds {available}", flush=True)
                continue
            label = kind if size is None else f"{kind} @ {size} train"
            at_size = {**lever, **({} if size is None else {"train_size": size})}
            per_fold = []
            peers = PeerRunner(cat, peer_names, seed=args.seed, nfn_epochs=args.nfn_epochs) if peer_names else None
            for fold in range(args.folds):
                # every run fits the baselines: a metanetwork's answer is blended with them (jobs.predictors.stacking)
                runs = [run_fold(cat, model, args.folds, fold, epochs, args.seed, baselines=True, lever=at_size)
                        for model in filter(None, args.models.split(","))]
                own = [run_fold(cat, name, args.folds, fold, None, args.seed, baselines=False,
                                lever={} if size is None else {"train_size": size})
                       for name in filter(None, args.function.split(","))]
                found = test_predictions(cat, runs) if runs else baseline_predictions(cat, args.folds, fold, args.seed, size)
                per_fold.append(with_statistics_mean({**found, **(test_predictions(cat, own) if own else {})}))
                if versus and runs:
                    variant = [run_fold(cat, model, args.folds, fold, epochs, args.seed, baselines=True,
                                        lever={**at_size, **versus}, tag=tag)
                               for model in filter(None, args.models.split(","))]
                    per_fold[-1].update({m + tag: p for m, p in test_predictions(cat, variant).items()
                                         if m not in TABULAR})
                if peers is not None:
                    per_fold[-1].update(peer_test_predictions(cat, peers.fold(args.folds, fold), args.folds, fold))
            table = summarise(label, per_fold, args.resamples) + (
                versus_lines(per_fold, tag, args.resamples, shown(versus)) if versus else [])
            print("\n".join(table) + "\n", flush=True)
            tables += table + [""]
            curves.append((kind, size, per_fold))
    print("\n" + "\n".join(tables))
    if args.curve:
        print("\n".join(curve_table(curves)))
    print(f"{time.perf_counter() - started:.0f}s in all  (* = interval excludes 0)")


if __name__ == "__main__":
    sys.exit(main())
