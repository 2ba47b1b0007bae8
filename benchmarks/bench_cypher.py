"""p50 / p95 latency of the README Cypher suite on a 2,000-model catalog, Ladybug and Neo4j.

    .venv/bin/python benchmarks/bench_cypher.py [--no-neo4j]
"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _zoos import base_zoo, grown_zoo

from graphstore import duck
from graphstore.metadata import open_store
from graphstore.metadata.queries import SUITE
from graphstore.sync import sync_store
from pipeline.ingest import ingest_zoo
from zoocore.config import Neo4jSettings

REPEATS = 30


def latencies(store, model_id):
    out = {}
    for name, q in SUITE.items():
        store.run(q, {"model_id": model_id})          # warm
        times = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            store.run(q, {"model_id": model_id})
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        out[name] = (statistics.median(times), times[int(0.95 * (len(times) - 1))])
    return out


def main():
    zoo = grown_zoo(base_zoo("cnn", 100, seed=1), 20)
    catalog = Path("/tmp/zoograph-bench/catalog-2000")
    if not (catalog / "parts").exists():
        ingest_zoo(zoo, catalog, workers=2, progress=False)
    con = duck.connect(catalog)
    n, archs = con.execute("SELECT count(*), count(DISTINCT architecture_id) FROM models").fetchone()
    mid = con.execute("SELECT model_id FROM models ORDER BY model_id LIMIT 1").fetchone()[0]
    print(f"catalog: {n} models, {archs} architectures; {REPEATS} runs per query")
    results = {}
    with tempfile.TemporaryDirectory() as d, open_store(d, use_env=False) as lb:
        t0 = time.perf_counter()
        sync_store(catalog, lb)
        print(f"ladybug sync: {time.perf_counter() - t0:.1f}s")
        results["ladybug"] = latencies(lb, mid)
    if "--no-neo4j" not in sys.argv:
        from graphstore.neo4j_server import Neo4jServer

        with Neo4jServer() as server, open_store(catalog, Neo4jSettings(server.uri, None, None)) as neo:
            t0 = time.perf_counter()
            sync_store(catalog, neo)
            print(f"neo4j sync:   {time.perf_counter() - t0:.1f}s")
            results["neo4j"] = latencies(neo, mid)
    backends = list(results)
    print(f"{'query':30s} " + " ".join(f"{b + ' p50':>12s} {b + ' p95':>12s}" for b in backends) + "   (ms)")
    for name in SUITE:
        print(f"{name:30s} " + " ".join(f"{results[b][name][0]:12.2f} {results[b][name][1]:12.2f}" for b in backends))
    if len(backends) == 2:
        ratio = [results["neo4j"][q][0] / results["ladybug"][q][0] for q in SUITE]
        print(f"neo4j / ladybug p50 ratio, median over queries: {statistics.median(ratio):.2f}x")


if __name__ == "__main__":
    main()
