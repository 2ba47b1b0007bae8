"""Conversion speed: neural graph per checkpoint vs loading the same checkpoint.

    .venv/bin/python benchmarks/bench_convert.py
"""
import time

from _zoos import base_zoo, grown_zoo

from pipeline import checkpoints
from pipeline.neural_graph.convert import PlanCache, convert_state_dict
from pipeline.neural_graph.plan import plan_from_module
from pipeline.spec import build_module, example_input, spec_hash


def main():
    zoo = grown_zoo(base_zoo("cnn", 40), 5)
    files = sorted(zoo.glob("*.safetensors"))
    specs = [checkpoints.read_sidecar(f)["architecture"] for f in files]
    unique = list({spec_hash(s): s for s in specs}.values())
    t0 = time.perf_counter()
    for s in unique:                             # the reference: torch.export + the ATen tracer
        plan_from_module(build_module(s), example_input(s))
    trace = time.perf_counter() - t0
    cache = PlanCache()
    t0 = time.perf_counter()
    for s in specs:
        cache.for_spec(s)                        # what ingest does: once per architecture, from the spec
    planned = time.perf_counter() - t0
    t0 = time.perf_counter()
    states = [checkpoints.load_state_dict(f) for f in files]
    load = time.perf_counter() - t0
    t0 = time.perf_counter()
    edges = 0
    for state, spec in zip(states, specs):
        edges += convert_state_dict(state, spec, cache).graph.num_edges
    conv = time.perf_counter() - t0
    n = len(files)
    print(f"{n} checkpoints, {len(unique)} architectures, {edges / n:.0f} edges per graph")
    print(f"load (safetensors)        {load / n * 1e3:8.2f} ms/checkpoint")
    print(f"convert (plan cached)     {conv / n * 1e3:8.2f} ms/checkpoint   ratio to load: {conv / load:.2f}x")
    print(f"plan from spec            {planned / len(unique) * 1e3:8.1f} ms/architecture "
          f"({cache.from_spec} read from the spec, {cache.exported} exported)")
    print(f"trace with torch.export   {trace / len(unique) * 1e3:8.1f} ms/architecture   "
          f"spec planning is {trace / planned:.0f}x faster")


if __name__ == "__main__":
    main()
