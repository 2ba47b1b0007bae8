"""Ingest throughput vs the floor, and peak memory for a zoo and a 4x larger zoo.

The floor loads the same checkpoints and writes their raw tensors (one row per tensor, values
as a float list) to Parquet: the least any ingest must do. Each measurement runs in a fresh
process so peak RSS is its own.

    .venv/bin/python benchmarks/bench_ingest.py
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _zoos import base_zoo, grown_zoo

CHILD = r"""
import json, resource, sys, time
from pathlib import Path
mode, zoo, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
t0 = time.perf_counter()
if mode == "ingest":
    from pipeline.ingest import ingest_zoo
    r = ingest_zoo(zoo, out, progress=False)
    n = r.added
else:
    import pyarrow as pa, pyarrow.parquet as pq
    from pipeline.checkpoints import load_state_dict
    schema = pa.schema([("file", pa.string()), ("key", pa.string()), ("values", pa.list_(pa.float32()))])
    out.mkdir(parents=True, exist_ok=True)
    w = pq.ParquetWriter(out / "raw.parquet", schema, compression="zstd")
    n = 0
    for f in sorted(zoo.glob("*.safetensors")):
        st = load_state_dict(f)
        keys = [k for k, v in st.items() if v.is_floating_point()]
        w.write_table(pa.table({"file": [f.name] * len(keys), "key": keys,
                                "values": [st[k].reshape(-1).numpy() for k in keys]}, schema=schema))
        n += 1
    w.close()
dt = time.perf_counter() - t0
print(json.dumps({"n": n, "seconds": dt, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def run(mode, zoo):
    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run([sys.executable, "-c", CHILD, mode, str(zoo), str(Path(d) / "cat")],
                             capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(label, zoo):
    ing, floor = run("ingest", zoo), run("floor", zoo)
    print(f"{label}: {ing['n']} checkpoints")
    print(f"  floor  (load + raw tensors to Parquet): {floor['n'] / floor['seconds']:7.1f} models/s")
    print(f"  ingest (neural graphs, all relations):  {ing['n'] / ing['seconds']:7.1f} models/s"
          f"   time ratio to floor: {ing['seconds'] / floor['seconds']:.2f}x (target <= 2x)")
    return ing


def main():
    # a zoo of few architectures (like published zoos: one architecture, many checkpoints) ...
    mlp = base_zoo("mlp", 40)
    report(f"MLP zoo, {len({json.loads(p.read_text())['architecture']['layers'][1]['fn'] for p in mlp.glob('*.json')})} "
           "architectures", grown_zoo(mlp, 20))
    # ... and the CNN zoo, where almost every model has an architecture of its own to trace
    base = base_zoo("cnn", 40)
    small, large = grown_zoo(base, 3), grown_zoo(base, 12)
    ing = report("CNN zoo, 40 architectures (each planned once, from its spec)", small)
    big = run("ingest", large)
    print(f"peak memory: CNN zoo ({ing['n']}) {ing['peak_mb']:.0f} MB, 4x zoo ({big['n']}) {big['peak_mb']:.0f} MB"
          f"   ratio: {big['peak_mb'] / ing['peak_mb']:.2f}x (target <= 1.2x)")


if __name__ == "__main__":
    main()
