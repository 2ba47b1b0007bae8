"""Pretraining on a large generated zoo, fine-tuning on the user's (issue #31's lever, ``--init-from``).

1. Make (or reuse) a development zoo of ``--source-n`` models (one per kind of ``--source-kind``,
   in one catalog) with a seed of its own
   (``--source-seed``; the evaluated zoos use seed 0), and train one NG-GNN on it with the recipe
   (one member, no baselines): the pretrained metanetwork.
2. Run ``bench_accuracy.py`` on the evaluated zoos with ``--versus init_from=<that run>``: at each
   training size of the curve, every fold trains the recipe from scratch and fine-tuned from the
   pretrained metanetwork on the same training, validation and test models, and prints the
   paired difference of the fine-tuned rows to the recipe's.

``--blind --seed S`` evaluates on the blind zoos of that seed instead: report only, since a lever
chosen by looking at the blind zoos makes them development zoos.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_pretraining.py              # ~1 hour on 2 cores
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_pretraining.py --source-run RUN_ID   # reuse step 1
"""
from __future__ import annotations

import argparse
import sys
import time

from _zoos import mixed_catalog

import bench_accuracy


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source-kind", default="cnn",
                    help="the pretraining zoo's kind (default cnn: the diverse CNNs); several, comma-separated "
                    "(cnn,mlp), make one catalog holding a zoo of each, whose edge types the source then knows")
    ap.add_argument("--source-n", type=int, default=3000, help="models in the pretraining zoo, per kind "
                    "(default 3000)")
    ap.add_argument("--source-seed", type=int, default=1, help="its generator seed (default 1; evaluated zoos: 0)")
    ap.add_argument("--source-run", default=None, help="a pretrained run of the pretraining catalog to reuse")
    ap.add_argument("--zoos", default="cnn,cnn-fixed", help="the evaluated development zoos (default cnn,cnn-fixed)")
    ap.add_argument("--n", type=int, default=1500, help="models per evaluated zoo (default 1500)")
    ap.add_argument("--curve", default="100,250", help="training sizes (default 100,250: small user zoos)")
    ap.add_argument("--blind", action="store_true", help="evaluate on the blind zoos (--zoos among wild_cnn, "
                    "tabular_mlp, fixed_cnn) instead: report only, never choose by them")
    ap.add_argument("--seed", type=int, default=0, help="with --blind, the blind zoos' seed (default 0)")
    args = ap.parse_args(argv)
    if args.source_seed == 0:
        ap.error("--source-seed 0 is the evaluated zoos' seed: pretraining on them would see their test models")
    started = time.perf_counter()
    source = mixed_catalog(args.source_kind.split(","), args.source_n, args.source_seed)
    run = args.source_run
    if run is None:
        from jobs.config import TrainConfig
        from jobs.training.train import train_heterognn

        t = time.perf_counter()
        report = train_heterognn(source, TrainConfig(ensemble=1, baselines=False), progress=False)
        run = report.run_id
        tau = report.metrics["ngnn"]["kendall_tau"]
        print(f"pretrained {run} on {source} ({report.n_models['train']} training models, test tau {tau:.3f}, "
              f"{time.perf_counter() - t:.0f}s)", flush=True)
    bench_accuracy.main(["--n", str(args.n), "--zoos", args.zoos, "--models", "ngnn", "--curve", args.curve,
                         "--versus", f"init_from={run}", "--versus", f"init_catalog={source}", "--tag", "PRE"]
                        + (["--blind", "--seed", str(args.seed)] if args.blind else []))
    print(f"{time.perf_counter() - started:.0f}s with pretraining")


if __name__ == "__main__":
    sys.exit(main())
