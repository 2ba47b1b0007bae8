"""Every command of the project against hostile inputs, as real processes, with what each did.

``run_attacks(work)`` builds a small real zoo and catalog (with a trained run and a synced graph
store), the hostile corpus of ``tests.hostile.corpus``, and runs each attack as a user would: a
``pipeline``, ``graphstore`` or ``jobs`` command in its own process. For each it records the exit
code, whether a payload wrote its canary, which files of the catalog changed, whether the process
crashed (killed by a signal: exit >= 128 or negative) and whether a traceback was printed. A
query (``pipeline sql``, ``graphstore cypher``) may change no byte of the catalog; a job may change
no byte but the embedded graph store's (jobs open it to write predictions back, and Ladybug
rewrites its header when a read-write connection closes). ``tests/test_hostile_inputs.py``
asserts every outcome is clean; ``benchmarks/bench_faults.py`` prints the counts as its
hostile-input table.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tests.hostile.corpus import build

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
TINY_TRAIN = ["--ensemble", "1", "--epochs", "1", "--hidden", "8", "--layers", "1", "--batch-size", "16",
              "--no-baselines", "--loader-workers", "1"]
MLP_SPEC = {"format": "zoograph.spec/1", "input_shape": [4],
            "layers": [{"type": "linear", "out_features": 3}, {"type": "activation", "fn": "relu"},
                       {"type": "linear", "out_features": 2}]}


@dataclass
class Outcome:
    name: str
    command: list[str]
    exit_code: int
    seconds: float
    output: str
    canaries: list[str] = field(default_factory=list)
    catalog_changed: list[str] = field(default_factory=list)      # files added, removed or rewritten
    expect_refused: bool = True

    @property
    def crashed(self) -> bool:
        return self.exit_code < 0 or self.exit_code >= 128

    @property
    def traceback(self) -> bool:
        return "Traceback (most recent call last)" in self.output

    @property
    def clean(self) -> bool:
        refused_ok = self.exit_code == 1 if self.expect_refused else self.exit_code in (0, 1)
        return refused_ok and not (self.crashed or self.traceback or self.canaries or self.catalog_changed)


def tree_digest(folder: Path) -> dict[str, str]:
    """The hash of every file under ``folder``, by its path relative to it."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def changed_files(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "NEO4J_URI": "", "ZOOGRAPH_CATALOG": ""}


def _cli(args: list[str], timeout: float = 300) -> tuple[int, str, float]:
    started = time.monotonic()
    proc = subprocess.run([PY, "-m", f"{args[0]}.cli", *args[1:]], capture_output=True, text=True, env=_env(),
                          timeout=timeout, cwd=ROOT)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - started


def setup(work: Path) -> dict:
    """A real 12-model MLP zoo, its catalog with a trained run and a synced embedded graph store,
    and the hostile corpus."""
    from pipeline.ingest import ingest_zoo
    from pipeline.zoo.make import make_zoo

    zoo, catalog = work / "zoo", work / "catalog"
    make_zoo("mlp", zoo, n=12, seed=3, workers=1, progress=False)
    assert ingest_zoo(zoo, catalog, progress=False).added == 12
    code, out, _ = _cli(["jobs", "train-heterognn", "--catalog", str(catalog), *TINY_TRAIN])
    assert code == 0, out
    run_id = next(line.split()[1].rstrip(":") for line in out.splitlines() if line.startswith("run "))
    code, out, _ = _cli(["graphstore", "sync", "--catalog", str(catalog)])
    assert code == 0, out
    attacks = build(work / "corpus", work / "canaries")
    (work / "spec.json").write_text(json.dumps(MLP_SPEC))
    return {"zoo": zoo, "catalog": catalog, "run_id": run_id, "attacks": attacks, "canaries": work / "canaries",
            "spec": work / "spec.json"}


def _hostile_run(catalog: Path, run_id: str, artifact: Path) -> str:
    """A copy of ``run_id``'s artifacts whose weights are the hostile file, as a run the catalog
    lists (the artifacts folder of a run is data someone may hand over)."""
    hostile = "run-hostile"
    src, dst = catalog / "artifacts" / run_id, catalog / "artifacts" / hostile
    shutil.copytree(src, dst)
    (dst / "metanet-0.safetensors").unlink()
    shutil.copy(artifact, dst / "metanet-0.pt")
    results = next((catalog / "results").glob(f"{run_id}-*"))
    runs = pq.read_table(results / "runs.parquet")
    runs = runs.set_column(runs.schema.get_field_index("run_id"), "run_id", pa.array([hostile] * runs.num_rows))
    out = catalog / "results" / f"{hostile}-000000"
    out.mkdir()
    pq.write_table(runs, out / "runs.parquet")
    return hostile


def _sql_attacks(cat: str, part: str) -> dict[str, list[str]]:
    models = f"{cat}/parts/{part}/models.parquet"
    graph = f"{cat}/graph.lbug"
    copy = f"COPY (SELECT * REPLACE (0.0123 AS test_accuracy) FROM read_parquet('{models}')) TO '{models}' " \
           "(FORMAT parquet)"
    sql = {
        "explain_analyze_copy_models": f"EXPLAIN ANALYZE {copy}",
        "explain_analyze_copy_graph": f"EXPLAIN ANALYZE COPY (SELECT 1) TO '{graph}' (FORMAT csv)",
        "commented_explain_analyze": f"/* a */ EXPLAIN /* b */ ANALYZE {copy}",
        "copy_models": copy,
        "attach": f"ATTACH '{cat}/evil.duckdb' AS evil",
        "read_etc_passwd": "SELECT * FROM read_csv('/etc/passwd')",
        "two_statements": "SELECT 1; SELECT 2",
        "install": "INSTALL httpfs",
        "set": "SET memory_limit = '1TB'",
        "pragma": "PRAGMA enable_external_access",
        "call": "CALL pragma_version()",
        "export": f"EXPORT DATABASE '{cat}/dump'",
        "create_table": "CREATE TABLE evil AS SELECT 1",
        "memory_range": ["--memory-limit", "300MB", "select len(range(100000000))"],
        "memory_1kb": ["--memory-limit", "1KB", "select 1"],
        "long_expression_timeout": ["--timeout", "2", "select len(list_sort(list_reverse(range(30000000))))"],
        "unicode_quotes": "SELECT * FROM \u201cmodels\u201d",
        "nested_parentheses": "SELECT " + "(" * 3000 + "1" + ")" * 3000,
    }
    return {k: ["pipeline", "sql", "--catalog", cat, *(v if isinstance(v, list) else [v])] for k, v in sql.items()}


def _cypher_attacks(cat: str) -> dict[str, list[str]]:
    cy = {
        "backquoted_setting": "CALL `threads` = 1",
        "backquoted_read_csv": "CALL `read_csv_serial`(\"/etc/passwd\") RETURN *",
        "backquoted_read_parquet": f"CALL `read_parquet`(\"{cat}/x.parquet\") RETURN *",
        "backquoted_read_npy": "CALL `read_npy`(\"/etc/passwd\") RETURN *",
        "load_from": "LOAD FROM '/etc/passwd' (file_format='csv', header=false, delim=':') RETURN *",
        "copy_to": f"COPY (MATCH (m:Model) RETURN m.model_id) TO '{cat}/stolen.csv'",
        "two_statements": "MATCH (m:Model) RETURN count(m); MATCH (m) DETACH DELETE m",
        "detach_delete": "MATCH (m:Model) DETACH DELETE m",
        "fullwidth_call": "\uff23\uff21\uff2c\uff2c threads = 1",
        "long_expression_timeout": ["--timeout", "2", "RETURN size(range(1, 300000000))"],
    }
    return {k: ["graphstore", "cypher", "--catalog", cat, *(v if isinstance(v, list) else [v])] for k, v in cy.items()}


def _format_attacks(work: Path, canaries: Path) -> dict[str, Path]:
    """Zoos of the published formats (tests/fixtures) with a payload where the importer reads: a
    Model Zoos checkpoint that is a TorchScript archive, a Small CNN Zoo ``weights.npy`` that is a
    pickled object array, and a Hugging Face shard index naming a file outside the member folder."""
    import numpy as np

    from tests.fixtures.hf_zoo import write_hf_zoo
    from tests.fixtures.model_zoos import write_model_zoo
    from tests.fixtures.small_cnn_zoo import write_small_cnn_zoo
    from tests.hostile.corpus import _ReducePayload, _torchscript_bytes

    out = {}
    mz = work / "formats" / "model_zoos"
    write_model_zoo(mz, kind="CNN", n_models=2, epochs=(0, 1), seed=1)
    next(mz.rglob("checkpoint_000001/checkpoints")).write_bytes(_torchscript_bytes(canaries / "model_zoos_ts"))
    out["model_zoos_torchscript_checkpoint"] = mz
    scz = work / "formats" / "small_cnn_zoo"
    write_small_cnn_zoo(scz, n_runs=2, crashed_runs=0)
    payload = np.empty(18, dtype=object)
    payload[:] = [_ReducePayload(canaries / "small_cnn_zoo_pickle")] * 18
    np.save(scz / "weights.npy", payload, allow_pickle=True)
    out["small_cnn_zoo_pickled_weights"] = scz
    hf = work / "formats" / "hf"
    info = write_hf_zoo(hf, n_per_arch=1, archs=("vit",), sharded=1, seed=1)
    index = hf / next(iter(info)) / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"] = {k: "../../../outside.safetensors" for k in doc["weight_map"]}
    index.write_text(json.dumps(doc))
    out["hf_shard_outside_its_folder"] = hf
    return out


def run_attacks(work: Path, progress=None) -> list[Outcome]:
    """Every attack, in its own process; see the module docstring."""
    env = setup(work)
    cat, canaries = env["catalog"], env["canaries"]
    part = next(p.name for p in (cat / "parts").iterdir())
    digest = tree_digest(cat)
    outcomes: list[Outcome] = []

    def attempt(name: str, args: list[str], expect_refused: bool = True) -> None:
        nonlocal digest
        code, out, secs = _cli(args)
        now = tree_digest(cat)
        changed, digest = changed_files(digest, now), now       # each attempt answers for its own changes
        if args[0] == "jobs":           # jobs open the graph store to write back; Ladybug rewrites its header then
            changed = [f for f in changed if f != "graph.lbug"]
        o = Outcome(name, args, code, secs, out, sorted(p.name for p in canaries.glob("*")), changed, expect_refused)
        outcomes.append(o)
        if progress:
            progress(o)

    # checkpoints: convert each, with a valid spec so the file itself is read
    for a in env["attacks"]:
        if a.kind == "checkpoint":
            spec = [] if a.path.suffix == ".pt2" else ["--spec", str(env["spec"])]
            attempt(f"convert:{a.name}", ["pipeline", "convert", str(a.path), *spec])
        elif a.kind == "sidecar":
            attempt(f"convert:{a.name}", ["pipeline", "convert", str(a.path.with_suffix(".safetensors"))])
    # ingest all hostile checkpoints as one zoo (each with a sidecar spec), into a catalog of its own
    hostile_zoo = work / "hostile-zoo"
    for a in env["attacks"]:
        if a.kind in ("checkpoint", "sidecar"):
            dst = hostile_zoo / a.name
            shutil.copytree(a.path.parent, dst)
            if a.kind == "checkpoint" and a.path.suffix != ".pt2":
                (dst / a.path.with_suffix(".json").name).write_text(json.dumps({"architecture": MLP_SPEC}))
    attempt("ingest:hostile_zoo", ["pipeline", "ingest", str(hostile_zoo), "--catalog", str(work / "hostile-cat")],
            expect_refused=False)
    # the published zoo formats, each with a payload where its own files would be read
    for name, zoo in _format_attacks(work, canaries).items():
        attempt(f"ingest:{name}", ["pipeline", "ingest", str(zoo), "--catalog", str(work / f"{name}-cat")])
    metrics = next(a for a in env["attacks"] if a.kind == "metrics")
    attempt("ingest:metrics_unterminated_quote", ["pipeline", "ingest", str(metrics.path.parent),
                                                  "--catalog", str(work / "metrics-cat")])
    # run ids that are paths, and a run whose weights are a TorchScript archive
    outside = work / "outside" / "evil"
    outside.mkdir(parents=True)
    artifact = next(a for a in env["attacks"] if a.kind == "artifact")
    shutil.copy(artifact.path, outside / "metanet-0.pt")
    (outside / "metanet.json").write_bytes((cat / "artifacts" / env["run_id"] / "metanet.json").read_bytes())
    traversal = os.path.relpath(outside, cat / "artifacts")
    for command in (["jobs", "predict"], ["jobs", "retrieve", "--run"], ["jobs", "classify", "--target", "dataset"]):
        if command[1] == "retrieve":
            args = [*command, traversal, "x", "--catalog", str(cat)]
        else:
            args = [*command, "--run", traversal, "--catalog", str(cat)]
        attempt(f"{command[1]}:run_id_traversal", args)
    listed = _cli(["pipeline", "sql", "--catalog", str(cat), "--format", "json", "SELECT model_id FROM models WHERE "
                   "architecture_id = (SELECT architecture_id FROM models GROUP BY 1 ORDER BY count(*) DESC LIMIT 1) "
                   "ORDER BY model_id LIMIT 2"])
    ids = [r["model_id"] for r in json.loads(listed[1])]
    attempt("merge:run_id_traversal", ["jobs", "merge", *ids, "--run", traversal, "--catalog", str(cat)])
    injection = f"1=1); COPY (SELECT 1) TO '{cat}/parts/{part}/models.parquet' (FORMAT csv); SELECT (1"
    for command in (["layer-equivariance", "--transform", "perm-input"], ["train-editor"]):
        attempt(f"where:{command[0]}", ["jobs", *command, "--catalog", str(cat), "--where", injection])
    hostile_run = _hostile_run(cat, env["run_id"], artifact.path)
    digest = tree_digest(cat)
    attempt("predict:torchscript_run_weights", ["jobs", "predict", "--run", hostile_run, "--catalog", str(cat)])
    # SQL and Cypher, against the catalog's bytes
    for name, args in _sql_attacks(str(cat), part).items():
        attempt(f"sql:{name}", args)
    attempt("where:explain_analyze_copy", ["jobs", "train-heterognn", "--catalog", str(cat), *TINY_TRAIN, "--where",
                                           f"1=1); EXPLAIN ANALYZE COPY (SELECT 1) TO '{cat}/parts/{part}/"
                                           "models.parquet' (FORMAT csv); SELECT (1"])
    for name, args in _cypher_attacks(str(cat)).items():
        attempt(f"cypher:{name}", args)
    return outcomes


def summary(outcomes: list[Outcome]) -> dict[str, int]:
    return {"attacks": len(outcomes),
            "files written by payloads": len({c for o in outcomes for c in o.canaries}),
            "catalog bytes changed": sum(bool(o.catalog_changed) for o in outcomes),
            "crashes (exit >= 128)": sum(o.crashed for o in outcomes),
            "tracebacks": sum(o.traceback for o in outcomes),
            "not refused with exit 1": sum(not o.clean for o in outcomes)}
