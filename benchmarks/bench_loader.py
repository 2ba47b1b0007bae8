"""Loader graphs/s vs trainer graphs/s, and loader peak memory for a zoo and a 4x zoo.

The loader streams nodes/edges from DuckDB and builds normalised DGL heterographs with its
cache disabled (every batch comes from DuckDB, then is dropped); the trainer runs NG-GNN forward + backward on
batches already in memory. Memory is measured in fresh processes.

    .venv/bin/python benchmarks/bench_loader.py
    .venv/bin/python benchmarks/bench_loader.py --compare aa4c1f9   # trainer speed-up over a revision
    .venv/bin/python benchmarks/bench_loader.py --compare aa4c1f9 --threads 1   # the same on a busy machine

``--compare REV`` extracts REV's source (``git archive``) into a temporary folder and times its
trainer against this checkout's on the same in-memory batches, alternating the two several times
and keeping each one's best time, so that load from other processes does not decide the ratio.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _zoos import base_zoo, grown_zoo

CHILD = r"""
import json, resource, sys, time
import numpy as np, torch, dgl
from graphstore import duck
from jobs.training.data import GraphStream, layer_stats, select_models
from jobs.metanets.ngnn import NGGNN, NGGNNConfig
mode, catalog = sys.argv[1], sys.argv[2]
con = duck.connect(catalog)
sel = select_models(con, "test_accuracy")
stats = layer_stats(con, sel.ids("train"))
stream = GraphStream(con, sel, stats, workers=2, cache_bytes=0)
idx = np.arange(len(sel.model_ids))
out = {"n": len(idx)}
if mode == "load":          # stream every batch from DuckDB and drop it: the loader alone
    t0 = time.perf_counter()
    count = sum(len(g) for _, g in stream.batches(idx, 32))
    out["load_s"] = time.perf_counter() - t0
    out["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
else:                       # the trainer alone, on batches already in memory
    batches = [g for _, g in stream.batches(idx, 32)]
    model = NGGNN(NGGNNConfig(etypes=sel.etypes, edge_in=sel.frame[0] * sel.frame[1], out_dim=1))
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    bg = [dgl.batch(b) for b in batches]
    torch.manual_seed(0)
    times = []
    for _ in range(int(sys.argv[3]) if len(sys.argv) > 3 else 1):
        t0 = time.perf_counter()
        for g in bg:
            loss = model(g)[0].pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
        times.append(time.perf_counter() - t0)
    out["train_s"] = min(times)
print(json.dumps(out))
"""


def run(mode, catalog, source: Path | None = None, repeats: int = 1, threads: int | None = None):
    """Run the child on ``catalog``; with ``source``, the code imported is that folder's."""
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if source is not None:
        env["PYTHONPATH"] = str(source)
    p = subprocess.run([sys.executable, "-c", CHILD, mode, str(catalog), str(repeats)], capture_output=True,
                       text=True, check=True, env=env, cwd=source or Path(__file__).parent)
    return json.loads(p.stdout.strip().splitlines()[-1])


def source_of(rev: str, into: Path) -> Path:
    """The repository's source at ``rev`` (``git archive``), unpacked into ``into``."""
    repo = Path(__file__).resolve().parent.parent
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def compare(rev: str, catalog: Path, rounds: int = 3, threads: int | None = None) -> None:
    """Trainer graphs/s of ``rev`` and of this checkout, alternated ``rounds`` times, best of each;
    with ``threads``, every child runs that many torch threads (1 keeps a shared machine's load from
    deciding the ratio: two-thread children are slowed many times over by other processes)."""
    here = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        old_src = source_of(rev, Path(tmp))
        best = {"old": float("inf"), "new": float("inf")}
        n = 0
        for _ in range(rounds):
            for name, src in (("old", old_src), ("new", here)):
                r = run("train", catalog, src, repeats=2, threads=threads)
                best[name], n = min(best[name], r["train_s"]), r["n"]
    print(f"trainer on {n} models, best of {rounds}x2 passes: {rev} {n / best['old']:.0f} graphs/s, "
          f"this checkout {n / best['new']:.0f} graphs/s   speed-up: {best['old'] / best['new']:.2f}x (target >= 2x)")


def catalog_for(zoo: Path) -> Path:
    from pipeline.ingest import ingest_zoo

    cat = zoo.parent / f"catalog-{zoo.name}"
    if not (cat / "parts").exists():
        ingest_zoo(zoo, cat, workers=2, progress=False)
    return cat


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", metavar="REV", help="also time REV's trainer against this checkout's")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per timed child in --compare (default: torch's choice; 1 on a shared machine)")
    args = ap.parse_args()
    base = base_zoo("cnn", 40)
    small, large = catalog_for(grown_zoo(base, 3)), catalog_for(grown_zoo(base, 12))
    if args.compare:
        compare(args.compare, small, threads=args.threads)
    a, t, b = run("load", small), run("train", small), run("load", large)
    print(f"{a['n']} models: loader {a['n'] / a['load_s']:.0f} graphs/s, trainer {t['n'] / t['train_s']:.0f} graphs/s"
          f"   loader/trainer: {t['train_s'] / a['load_s']:.1f}x (target >= 3x)")
    print(f"loader peak memory: {a['n']} models {a['peak_mb']:.0f} MB, {b['n']} models {b['peak_mb']:.0f} MB"
          f"   ratio: {b['peak_mb'] / a['peak_mb']:.2f}x")


if __name__ == "__main__":
    main()
