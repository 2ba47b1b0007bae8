"""Loader graphs/s vs trainer graphs/s, and loader peak memory for a zoo and a 4x zoo.

The loader streams nodes/edges from DuckDB and builds normalised DGL heterographs with its
cache disabled (every batch comes from DuckDB, then is dropped); the trainer runs NG-GNN forward + backward on
batches already in memory. Memory is measured in fresh processes.

    .venv/bin/python benchmarks/bench_loader.py
"""
import json
import subprocess
import sys
from pathlib import Path

from _zoos import base_zoo, grown_zoo

CHILD = r"""
import json, resource, sys, time
import numpy as np, torch, dgl
from graphstore import duck
from jobs.data import GraphStream, layer_stats, select_models
from jobs.ngnn import NGGNN, NGGNNConfig
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
    t0 = time.perf_counter()
    for g in bg:
        loss = model(g)[0].pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
    out["train_s"] = time.perf_counter() - t0
print(json.dumps(out))
"""


def run(mode, catalog):
    p = subprocess.run([sys.executable, "-c", CHILD, mode, str(catalog)], capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def catalog_for(zoo: Path) -> Path:
    from pipeline.ingest import ingest_zoo

    cat = zoo.parent / f"catalog-{zoo.name}"
    if not (cat / "parts").exists():
        ingest_zoo(zoo, cat, workers=2, progress=False)
    return cat


def main():
    base = base_zoo("cnn", 40)
    small, large = catalog_for(grown_zoo(base, 3)), catalog_for(grown_zoo(base, 12))
    a, t, b = run("load", small), run("train", small), run("load", large)
    print(f"{a['n']} models: loader {a['n'] / a['load_s']:.0f} graphs/s, trainer {t['n'] / t['train_s']:.0f} graphs/s"
          f"   loader/trainer: {t['train_s'] / a['load_s']:.1f}x (target >= 3x)")
    print(f"loader peak memory: {a['n']} models {a['peak_mb']:.0f} MB, {b['n']} models {b['peak_mb']:.0f} MB"
          f"   ratio: {b['peak_mb'] / a['peak_mb']:.2f}x")


if __name__ == "__main__":
    main()
