"""Conversion time and peak memory of large models: ResNet-50 (torchvision) and BERT-base
(Hugging Face, ~110M parameters, random weights from the default config; nothing downloaded).

Each model runs in a fresh process so its peak resident memory is its own:

    .venv/bin/python benchmarks/bench_large.py            # both
    .venv/bin/python benchmarks/bench_large.py resnet50   # one

Reported: the trace (torch.export + plan), the graph build, the exact inverse (checked bit for
bit), graph size, and peak RSS against the RSS with the model alone loaded. A second table
writes the same graphs to Parquet op by op (pipeline.neural_graph.stream), never holding them
whole: its peak RSS is what a graph too large for memory needs.

    .venv/bin/python benchmarks/bench_large.py --prep            # preparation of ResNet-18
    .venv/bin/python benchmarks/bench_large.py --prep resnet50   # or of other models

``--prep`` prints the symmetry preparations a run applies to its inputs (canonical_scaling and
balanced_scaling, pipeline.neural_graph.symmetry) on a randomly initialised model: seconds, and
the same as multiples of one np.linalg.norm pass over the model's state (its float tensors as one
float32 vector) and over the graph's edge features (the (E, Kh*Kw) array preparation reads and
writes), timed in the same process: the machine is shared, the ratios travel better than seconds.
Each preparation runs ``--repeat=N`` times (default 3), the best is printed.
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

    if name in ("resnet50", "resnet18"):
        import torchvision

        return torchvision.models.get_model(name, weights=None).eval(), torch.randn(2, 3, 224, 224)
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


def measure_prep(name: str, repeat: int = 3) -> dict:
    import numpy as np
    import torch

    warnings.filterwarnings("ignore")
    from pipeline.neural_graph.build import graph_from_plan
    from pipeline.neural_graph.plan import plan_from_module
    from pipeline.neural_graph.symmetry import balanced_scaling, canonical_scaling

    torch.manual_seed(0)
    model, x = _build(name)
    state = dict(model.state_dict())
    plan = plan_from_module(model, x)
    graph, steps = graph_from_plan(plan, state), plan.steps
    flat = np.concatenate([v.numpy().ravel() for v in state.values() if v.is_floating_point()])
    for _ in range(2):      # a VM's first touch of fresh memory can cost a second per 400 MB, once: not timed
        np.empty_like(graph.weight).fill(0)

    def best(fn, n):
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    norm_state, norm_graph = best(lambda: np.linalg.norm(flat), 5), best(lambda: np.linalg.norm(graph.weight), 5)
    canonical = best(lambda: canonical_scaling(graph, steps), repeat)
    balanced = best(lambda: balanced_scaling(graph, steps), repeat)
    # the norm passes again after the preparations, the faster of before and after
    norm_state = min(norm_state, best(lambda: np.linalg.norm(flat), 5))
    norm_graph = min(norm_graph, best(lambda: np.linalg.norm(graph.weight), 5))
    return {"model": name, "floats": int(flat.size), "edges": graph.num_edges, "features": int(graph.weight.size),
            "norm_state_s": norm_state, "norm_graph_s": norm_graph, "canonical_s": canonical, "balanced_s": balanced,
            "repeat": repeat}


def main_prep(argv):
    repeat = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("--repeat=")), 3)
    names = [a for a in argv if not a.startswith("--")] or ["resnet18"]
    print(f"| model | state floats | edges x frame | norm pass s: state / graph | canonical s "
          f"| x norm: state / graph | balanced s | x norm: state / graph |   (best of {repeat})")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        out = subprocess.run([sys.executable, __file__, "--prep-one", name, str(repeat)], capture_output=True,
                             text=True)
        if out.returncode:
            print(f"| {name} | failed: {out.stderr.strip().splitlines()[-1][:200]} |")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        ns, ng, c, b = r["norm_state_s"], r["norm_graph_s"], r["canonical_s"], r["balanced_s"]
        print(f"| {r['model']} | {r['floats']:,} | {r['edges']:,} x {r['features'] // max(1, r['edges'])} | "
              f"{ns:.4f} / {ng:.4f} | {c:.2f} | {c / ns:.0f} / {c / ng:.1f} | {b:.2f} | {b / ns:.0f} / {b / ng:.1f} |",
              flush=True)


def _run(mode: str, name: str) -> dict | str:
    out = subprocess.run([sys.executable, __file__, mode, name], capture_output=True, text=True)
    if out.returncode:
        return out.stderr.strip().splitlines()[-1][:200]
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv):
    if argv[:1] == ["--prep-one"]:
        print(json.dumps(measure_prep(argv[1], int(argv[2]))))
        return
    if argv[:1] == ["--prep"]:
        return main_prep(argv[1:])
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
