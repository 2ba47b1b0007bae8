"""Merging replica pairs of the CNN zoo (one recipe, two initialisations): test accuracy and loss
barrier of naive averaging vs aligned merging by each method, averaged over the pairs whose
parents both reach 50% test accuracy.

    .venv/bin/python benchmarks/bench_merge.py
"""
import tempfile
from collections import defaultdict

import numpy as np
from _zoos import CACHE

from graphstore import duck
from jobs.analysis.merge import MergeConfig, merge_models
from jobs.config import TrainConfig
from jobs.training.train import train_heterognn
from pipeline.ingest import ingest_zoo
from pipeline.zoo.make import make_zoo


def main(n: int = 60, seed: int = 3):
    zoo = CACHE / f"cnn-replicas-{n}-{seed}"
    make_zoo("cnn", zoo, n=n, seed=seed, workers=2, progress=False, replicas=2)
    with tempfile.TemporaryDirectory() as d:
        ingest_zoo(zoo, d, progress=False)
        run = train_heterognn(d, TrainConfig(epochs=15, baselines=False), progress=False)
        con = duck.connect(d)
        rows = con.execute("SELECT recipe, model_id, test_accuracy FROM models ORDER BY checkpoint").fetchall()
        con.close()
        pairs = defaultdict(list)
        for recipe, model_id, acc in rows:
            pairs[recipe].append((model_id, acc))
        good = [p for p in pairs.values() if len(p) == 2 and min(a for _, a in p) >= 0.5]
        acc, barrier, wins = defaultdict(list), defaultdict(list), defaultdict(int)
        for (a, _), (b, _) in good:
            report = merge_models(d, a, b, MergeConfig(method="weights", run_id=run.run_id))
            naive = report.row("naive average").test_accuracy
            for r in report.rows:
                acc[r.name].append(r.test_accuracy)
                if r.barrier is not None:
                    barrier[r.name].append(r.barrier)
                wins[r.name] += r.test_accuracy > naive
    print(f"{len(good)} replica pairs with both parents >= 0.5 test accuracy (of {len(pairs)} recipes, zoo of {n})")
    print(f"  {'model':26s} {'mean test acc':>14s} {'mean barrier':>13s} {'beats naive':>12s}")
    for name in acc:
        b = f"{np.mean(barrier[name]):13.3f}" if barrier[name] else f"{'':13s}"
        w = f"{wins[name]:>5d}/{len(good)}" if name.startswith("aligned") else ""
        print(f"  {name:26s} {np.mean(acc[name]):14.3f} {b} {w:>12s}")


if __name__ == "__main__":
    main()
