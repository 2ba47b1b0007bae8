"""The Small CNN Zoo at full size: ingest time against the Parquet floor, peak memory, and one
epoch of NG-GNN training streamed from the catalog.

A synthetic zoo of the real shape and layout (30,000 training runs x 9 checkpoints = 270,000 rows
of 4,970 float32, 5.4 GB; random values; written by tests/fixtures/small_cnn_zoo.py, which was
written from the published description alone) is made once under --work. Then, each in a fresh
process whose whole process tree's resident memory is sampled every 0.2 s:

1. ``pipeline ingest`` of the final checkpoints (30,000 models), with the embedded graph store;
   the floor is the time pyarrow alone takes to write the same Parquet tables (read back from the
   catalog; zstd, the catalog's row groups), printed as a ratio;
2. one epoch of ``jobs train-heterognn`` (NG-GNN, one ensemble member, no tabular baselines)
   streamed from that catalog: training graphs/s of the epoch, and the run's wall time.

    .venv/bin/python benchmarks/bench_small_cnn_zoo.py            # quick: 3,000 runs (a few minutes)
    .venv/bin/python benchmarks/bench_small_cnn_zoo.py --full     # 30,000 runs (the issue's targets)

Targets (full): ingest <= 15 min and peak RSS <= 2 GB on the 2-core machine.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FLOOR = r"""
import json, sys, tempfile, time
from pathlib import Path
import pyarrow.parquet as pq
from graphstore.catalog import ROW_GROUP_ROWS
cat = Path(sys.argv[1])
files = sorted(p for p in cat.rglob("*.parquet") if "parts" in p.parts)
tables = [(p.stem, pq.read_table(p)) for p in files]
with tempfile.TemporaryDirectory(dir=cat.parent) as d:
    t0 = time.perf_counter()
    for i, (rel, t) in enumerate(tables):
        pq.write_table(t, f"{d}/{i}-{rel}.parquet", compression="zstd", row_group_size=ROW_GROUP_ROWS.get(rel, 65_536))
    dt = time.perf_counter() - t0
print(json.dumps({"files": len(files), "seconds": dt, "bytes": sum(p.stat().st_size for p in files)}))
"""

TRAIN = r"""
import json, sys, time
from jobs.config import TrainConfig
from jobs.training.train import train_heterognn
cfg = TrainConfig(model="ngnn", ensemble=1, epochs=1, baselines=False, stack=False, target="test_accuracy",
                  device=sys.argv[2])
t0 = time.perf_counter()
r = train_heterognn(sys.argv[1], cfg, progress=True)
h = r.history[0]
print(json.dumps({"wall": time.perf_counter() - t0, "train_graphs": h["train_graphs"],
                  "train_seconds": h["train_seconds"], "models": r.n_models}))
"""


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            with open(f"/proc/{p}/statm") as fh:
                total += int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            pass
    return total


def measured(cmd: list[str], env=None) -> tuple[float, int, str]:
    """(seconds, peak resident bytes of the process tree, stdout) of ``cmd``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, cwd=ROOT, env=env)
    peak = [0]

    def sample():
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss(proc.pid))
            time.sleep(0.2)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, _ = proc.communicate()
    dt = time.perf_counter() - t0
    th.join()
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])} ... failed with exit code {proc.returncode}:\n{out[-2000:]}")
    return dt, peak[0], out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="30,000 runs (default: 3,000)")
    ap.add_argument("--runs", type=int, default=None, help="training runs in the synthetic zoo (overrides)")
    ap.add_argument("--work", default="/tmp/zoograph-bench", help="where the zoo and catalog are written")
    ap.add_argument("--workers", type=int, default=1, help="pipeline ingest --workers (one is as fast here: the "
                    "writer, not the conversion, is the bottleneck, and each worker costs its own torch)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-train", action="store_true", help="ingest only")
    args = ap.parse_args()
    runs = args.runs or (30_000 if args.full else 3_000)
    work = Path(args.work)
    zoo, cat = work / f"small-cnn-zoo-{runs}", work / f"small-cnn-zoo-{runs}-catalog"
    if not (zoo / "metrics.csv.gz").exists():
        from tests.fixtures.small_cnn_zoo import write_full_size_zoo

        t0 = time.perf_counter()
        shutil.rmtree(zoo, ignore_errors=True)
        write_full_size_zoo(zoo, n_runs=runs)
        print(f"wrote a synthetic zoo of {runs:,} runs x 9 checkpoints in {time.perf_counter() - t0:.0f} s: {zoo}")
    size = (zoo / "weights.npy").stat().st_size
    shutil.rmtree(cat, ignore_errors=True)
    py = str(ROOT / ".venv/bin/python") if (ROOT / ".venv/bin/python").exists() else sys.executable
    dt, peak, out = measured([py, "-m", "pipeline.cli", "ingest", str(zoo), "--catalog", str(cat),
                              "--workers", str(args.workers)])
    print(out.strip().splitlines()[0])
    fdt, _, fout = measured([py, "-c", FLOOR, str(cat)])
    floor = json.loads(fout.strip().splitlines()[-1])
    print(f"ingest: {runs:,} final checkpoints of a {size / 2**30:.1f} GB weights.npy in {dt:.0f} s "
          f"({runs / dt:.0f} models/s; target <= 900 s), peak RSS of the process tree {peak / 2**30:.2f} GB "
          f"(target <= 2 GB)")
    print(f"floor (pyarrow writes the same {floor['files']} Parquet files, {floor['bytes'] / 2**20:.0f} MB): "
          f"{floor['seconds']:.1f} s   ingest / floor: {dt / floor['seconds']:.1f}x")
    if args.no_train:
        return
    tdt, tpeak, tout = measured([py, "-c", TRAIN, str(cat), args.device])
    t = json.loads(tout.strip().splitlines()[-1])
    print(f"train-heterognn, 1 epoch streamed from the catalog: {t['train_graphs']:,} training graphs in "
          f"{t['train_seconds']:.0f} s = {t['train_graphs'] / t['train_seconds']:.0f} graphs/s; whole run "
          f"(selection, statistics, validation and test inference, writing) {tdt:.0f} s; peak RSS "
          f"{tpeak / 2**30:.2f} GB")


if __name__ == "__main__":
    main()
