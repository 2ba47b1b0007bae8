"""Conversion time and peak memory of large models: ResNet-50 (torchvision) and BERT-base
(Hugging Face, ~110M parameters, random weights from the default config; nothing downloaded).

Each model runs in a fresh process so its peak resident memory is its own:

    .venv/bin/python benchmarks/bench_large.py            # both
    .venv/bin/python benchmarks/bench_large.py resnet50   # one

Reported: the trace (torch.export + plan), the graph build, the exact inverse (checked bit for
bit), graph size, and peak RSS against the RSS with the model alone loaded. A second table
writes the same graphs to Parquet op by op (pipeline.neural_graph.stream), never holding them
whole: its peak RSS is what a graph too large for memory needs.
"""
import json
import resource
import subprocess
import sys
import time
import warnings

MODELS = ("resnet50", "bert-base")


def _rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _build(name):
    import torch

    if name == "resnet50":
        import torchvision

        return torchvision.models.resnet50(weights=None).eval(), torch.randn(2, 3, 224, 224)
    if name == "bert-base":
        import transformers

        class LastHidden(torch.nn.Module):
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, x):
                return self.m(x, return_dict=False)[0]

        cfg = transformers.BertConfig(attn_implementation="eager")       # bert-base: 12 x 768, 30522 tokens
        return LastHidden(transformers.BertModel(cfg, add_pooling_layer=False)).eval(), torch.randint(0, 30522, (2, 128))
    raise SystemExit(f"unknown model {name!r}; choose from {MODELS}")


def measure(name: str) -> dict:
    warnings.filterwarnings("ignore")
    from pipeline.neural_graph.build import graph_from_plan
    from pipeline.neural_graph.coverage import check_exact_inverse
    from pipeline.neural_graph.plan import plan_from_module

    model, x = _build(name)
    state = dict(model.state_dict())
    params = sum(p.numel() for p in model.parameters())
    base = _rss_mb()
    t0 = time.perf_counter()
    plan = plan_from_module(model, x)
    t1 = time.perf_counter()
    graph = graph_from_plan(plan, state)
    t2 = time.perf_counter()
    check_exact_inverse(graph, state, name)
    t3 = time.perf_counter()
    graph_mb = sum(getattr(graph, k).nbytes for k in ("src", "dst", "relation", "edge_op", "weight", "node_type",
                                                      "node_layer", "node_position", "bias", "extra")) / 2**20
    return {"model": name, "params": params, "nodes": graph.num_nodes, "edges": graph.num_edges,
            "kernel_frame": list(graph.kernel_shape), "graph_mb": round(graph_mb),
            "trace_s": round(t1 - t0, 1), "build_s": round(t2 - t1, 1), "inverse_s": round(t3 - t2, 1),
            "rss_model_mb": round(base), "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def measure_stream(name: str) -> dict:
    import tempfile

    warnings.filterwarnings("ignore")
    from pipeline.neural_graph.plan import plan_from_module
    from pipeline.neural_graph.stream import write_graph_parquet

    model, x = _build(name)
    state = dict(model.state_dict())
    plan = plan_from_module(model, x)
    base = _rss_mb()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        out = write_graph_parquet(plan, state, name, tmp)
        took = time.perf_counter() - t0
        size = (out.edges_path.stat().st_size + out.nodes_path.stat().st_size) / 2**20
    return {"model": name, "edges": out.num_edges, "row_groups": out.row_groups, "parquet_mb": round(size),
            "write_s": round(took, 1), "rss_before_mb": round(base),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def _run(mode: str, name: str) -> dict | str:
    out = subprocess.run([sys.executable, __file__, mode, name], capture_output=True, text=True)
    if out.returncode:
        return out.stderr.strip().splitlines()[-1][:200]
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv):
    if len(argv) == 2 and argv[0] in ("--one", "--stream"):
        print(json.dumps((measure if argv[0] == "--one" else measure_stream)(argv[1])))
        return
    print("| model | parameters | nodes | edges | frame | graph MB | trace s | build s | inverse s | RSS model MB | peak RSS MB |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    names = argv or MODELS
    for name in names:
        r = _run("--one", name)
        if isinstance(r, str):
            print(f"| {name} | failed: {r} |")
            continue
        print(f"| {r['model']} | {r['params']:,} | {r['nodes']:,} | {r['edges']:,} | {r['kernel_frame'][0]}x"
              f"{r['kernel_frame'][1]} | {r['graph_mb']:,} | {r['trace_s']} | {r['build_s']} | {r['inverse_s']} | "
              f"{r['rss_model_mb']:,} | {r['peak_rss_mb']:,} |", flush=True)
    print("\n| model | streamed to Parquet: edges | row groups | Parquet MB | write s | RSS before MB | peak RSS MB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in names:
        r = _run("--stream", name)
        if isinstance(r, str):
            print(f"| {name} | failed: {r} |")
            continue
        print(f"| {r['model']} | {r['edges']:,} | {r['row_groups']} | {r['parquet_mb']:,} | {r['write_s']} | "
              f"{r['rss_before_mb']:,} | {r['peak_rss_mb']:,} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
