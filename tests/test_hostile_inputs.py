"""Hostile inputs (issue #29): checkpoints never run code, queries never write, names are not paths.

The corpus (tests.hostile.corpus) is written at test time by a builder that never read this
project's loaders; each payload is shown live (it runs when loaded the unsafe way) before the
project's own readers are shown to refuse it. The full sweep runs every command of the project as
a real process over every attack (tests.hostile.attacks)."""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from graphstore.catalog import Catalog
from graphstore.metadata.ladybug_store import LadybugStore
from pipeline import checkpoints, torch_archive
from tests.hostile.attacks import run_attacks, summary
from tests.hostile.corpus import build, fire
from tests.processes import press_ctrl_c
from zoocore.errors import CheckpointError, StoreError
from zoocore.names import InvalidName, check_name

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile")
    return {a.name: a for a in build(base / "corpus", base / "canaries")}, base / "canaries"


def test_the_payloads_are_live(corpus):
    """Loaded the unsafe way (torch.load with weights_only=True, torch.export.load), the payloads
    write their files: the refusals below are refusals of working attacks."""
    attacks, _ = corpus
    for name in ("torchscript_pt", "torchscript_in_pt2_state_dict"):
        assert fire(attacks[name]), name
        attacks[name].canary.unlink()


def test_the_readers_refuse_every_hostile_checkpoint_by_name(corpus):
    attacks, canaries = corpus
    expected = {
        "torchscript_pt": "TorchScript archive", "torchscript_in_pt2_state_dict": "TorchScript archive",
        "torchscript_in_pt2_constants": "TorchScript archive", "pickle_reduce_pt": "refused to load the global",
        "legacy_pickle_pt": "not a torch.save zip archive", "pickle_in_pt2_state_dict": "refused to load the global",
        "pt2_graph_calls_torch_function": "refused the graph call target", "safetensors_header_bomb": "header",
        "safetensors_truncated": "cannot read state dict", "zip_bomb_pt": "declares",
        "not_a_zip_pt2": "not a zip file", "artifact_torchscript": "TorchScript archive",
    }
    for name, words in expected.items():
        path = attacks[name].path
        with pytest.raises(CheckpointError, match=words):
            if path.suffix == ".pt2":
                checkpoints.load_exported(path)
            else:
                checkpoints.load_state_dict(path)
        if path.suffix != ".pt2":
            with pytest.raises(CheckpointError):
                checkpoints.tensor_shapes(path)
    assert not list(canaries.glob("*"))
    with pytest.raises(CheckpointError, match="nested too deeply"):
        checkpoints.read_sidecar(attacks["deep_json_sidecar"].path.with_suffix(".safetensors"))


def test_the_restricted_reader_reads_what_torch_save_writes(tmp_path):
    """Parameters, buffers, views of one storage, every common dtype, wrapped state dicts."""
    base = torch.arange(12.0).reshape(3, 4)
    state = {"w": torch.nn.Parameter(torch.randn(4, 3)), "t": base.t(), "row": base[1],
             "b": torch.tensor([True, False]),
             "h": torch.randn(3).half(), "bf": torch.randn(3).bfloat16(), "i": torch.arange(5),
             "scalar": torch.tensor(7), "empty": torch.zeros(0, 3)}
    buf = io.BytesIO()
    torch.save({"state_dict": state}, buf)
    got = torch_archive.load_tensor_dict(buf.getvalue())
    assert set(got) == set(state)
    for k, v in state.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v.detach()), k
    shapes = torch_archive.load_tensor_dict(buf.getvalue(), shapes_only=True)
    assert {k: tuple(v.shape) for k, v in shapes.items()} == {k: tuple(v.shape) for k, v in state.items()}


def test_a_torch_export_archive_round_trips_through_the_checked_reader(tmp_path):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.fc = torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Linear(144, 2)

        def forward(self, x):
            return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))

    net = Net().eval()
    x = torch.randn(2, 3, 8, 8)
    torch.export.save(torch.export.export(net, (x,)), tmp_path / "net.pt2")
    loaded = checkpoints.load_exported(tmp_path / "net.pt2")
    assert torch.allclose(loaded.module()(x), net(x), atol=1e-6)


@pytest.mark.parametrize("expr, ok", [("s0", True), ("2*s0 + 1", True), ("FloorDiv(s0, 2)", True),
                                      ("__import__('os').system('x')", False), ("s0.__class__", False),
                                      ("exec('1')", False), ("lambda: 1", False)])
def test_symbolic_shapes_are_arithmetic_only(expr, ok):
    """torch's deserialiser hands these strings to sympify, i.e. eval."""
    program = {"graph_module": {"graph": {"nodes": [], "sym_int_values": {"x": {"as_expr": {"expr_str": expr}}}}},
               "opset_version": {"aten": torch._C._get_max_operator_version()}}
    if ok:
        torch_archive.check_exported_program(program, "x.pt2")
    else:
        with pytest.raises(CheckpointError, match="symbolic shape"):
            torch_archive.check_exported_program(program, "x.pt2")


def test_an_old_operator_set_is_refused_before_torch_would_retrace_the_graph():
    program = {"graph_module": {"graph": {"nodes": []}}, "opset_version": {"aten": 1}}
    with pytest.raises(CheckpointError, match="retrace"):
        torch_archive.check_exported_program(program, "x.pt2")


@pytest.mark.parametrize("name", ["../../outside/evil", "/etc", "a/b", "..", "a..b", "", ".hidden", "x" * 201,
                                  "run\nid", "run id"])
def test_names_are_not_paths(name, tmp_path):
    with pytest.raises(InvalidName):
        check_name(name, "run id")
    cat = Catalog(tmp_path)
    with pytest.raises(InvalidName):
        cat.read_artifact(name, "metanet.json")
    with pytest.raises(InvalidName):
        cat.commit_artifacts(name, {"metanet.json": b"{}"})
    assert check_name("run-20261205T093444-05cabb_x.1") == "run-20261205T093444-05cabb_x.1"


def test_the_query_worker_cannot_write_the_catalog_even_past_every_check(tmp_path):
    """The OS-level lock of the SQL and Cypher workers: in their mount namespace the catalog folder
    is read-only, whatever a statement manages to ask DuckDB or Ladybug for."""
    folder = tmp_path / "catalog"
    folder.mkdir()
    (folder / "models.parquet").write_bytes(b"original")
    probe = ("import sys; from graphstore.isolation import read_only_mount\n"
             "kind = read_only_mount(sys.argv[1])\n"
             "try:\n    open(sys.argv[1] + '/models.parquet', 'wb').write(b'x'); print(kind, 'WROTE')\n"
             "except OSError as exc:\n    print(kind, 'REFUSED', exc.errno)\n")
    out = subprocess.run([sys.executable, "-c", probe, str(folder)], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60).stdout.split()
    if out[0] == "none" and not os.environ.get("CI"):
        pytest.skip("this machine allows no private mount namespace; DuckDB's own locks still hold")
    assert out[-2:] == ["REFUSED", "30"], out            # EROFS
    assert (folder / "models.parquet").read_bytes() == b"original"
    (folder / "models.parquet").write_bytes(b"still writable here")     # only inside the worker


def test_a_crash_of_the_graph_engine_stays_in_its_worker(tmp_path):
    """This Ladybug statement kills its process with SIGSEGV (the gate refuses it; here it is sent
    past the gate): the caller gets one error and lives on."""
    from pipeline.ingest import ingest_zoo
    from pipeline.zoo.make import make_zoo

    make_zoo("mlp", tmp_path / "zoo", n=2, seed=1, workers=1, progress=False)
    with LadybugStore(tmp_path / "cat" / "graph.lbug") as writer:
        ingest_zoo(tmp_path / "zoo", tmp_path / "cat", progress=False, store=writer)
    store = LadybugStore(tmp_path / "cat" / "graph.lbug", read_only=True)
    store.isolated = True
    with pytest.raises(StoreError, match="SIGSEGV|worker"):
        store._run('CALL read_csv_serial("/etc/passwd") RETURN *', {})
    assert store.run("MATCH (m:Model) RETURN count(m)").rows == [[2]]
    started = time.monotonic()
    store.query_timeout = 1.0
    store.memory_limit = "16GB"          # the time limit, not the memory limit, is what stops it here
    with pytest.raises(Exception, match="stopped after 1 s"):
        store.run("RETURN size(range(1, 300000000))")
    assert time.monotonic() - started < 2.0              # within a second of the limit
    store.close()


def _catalog(tmp_path, graph: bool = False):
    from pipeline.ingest import ingest_zoo
    from pipeline.zoo.make import make_zoo

    make_zoo("mlp", tmp_path / "zoo", n=2, seed=1, workers=1, progress=False)
    with LadybugStore(tmp_path / "cat" / "graph.lbug") if graph else contextlib.nullcontext() as store:
        ingest_zoo(tmp_path / "zoo", tmp_path / "cat", progress=False, store=store)
    return tmp_path / "cat"


def test_sql_limits_hold_for_the_whole_process_tree(tmp_path):
    """--memory-limit bounds the peak memory of every process of the command, and a single long
    expression stops within a second of --timeout (measured on real processes)."""
    cat = _catalog(tmp_path)
    measure = ("import resource, subprocess, sys, time\n"
               "t = time.monotonic(); p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
               "print(p.returncode, round(time.monotonic() - t, 2), "
               "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, repr(p.stderr.strip()))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def run(*args):
        out = subprocess.run([sys.executable, "-c", measure, sys.executable, "-m", "pipeline.cli", "sql", "--catalog",
                              str(cat), *args], capture_output=True, text=True, env=env, timeout=120).stdout
        code, secs, rss_kb, err = out.strip().split(" ", 3)
        return int(code), float(secs), int(rss_kb) * 1024, err

    code, _, peak, err = run("--memory-limit", "300MB", "select len(range(100000000))")
    assert code == 1 and "more memory than its limit of 300MB" in err and "Traceback" not in err
    assert peak < 300e6 + 250e6, peak                    # the limit plus one interpreter's own footprint
    code, secs, _, err = run("--timeout", "2", "select len(list_sort(list_reverse(range(30000000))))")
    assert code == 1 and "stopped after 2 s" in err and "\\n" not in err          # one line
    assert secs < 2 + 1 + 1.5, secs                      # the limit, a second, and the CLI's own start-up


@pytest.mark.slow
@pytest.mark.parametrize("command", [
    ["pipeline.cli", "sql", "SELECT count(*) FROM range(CAST(1e13 AS BIGINT))"],
    ["graphstore.cli", "cypher", "UNWIND range(1, 300000) AS x UNWIND range(1, 300000) AS y WITH x + y AS z "
                                 "WHERE z % 7 = 3 RETURN count(*)"]])
def test_ctrl_c_stops_a_query_with_one_line_and_exit_130(tmp_path, command):
    cat = _catalog(tmp_path, graph=command[1] == "cypher")
    res, children = press_ctrl_c([sys.executable, "-m", *command[:2], "--catalog", str(cat), "--timeout", "0",
                                  command[2]], {**os.environ, "PYTHONPATH": str(ROOT), "NEO4J_URI": ""},
                                 group=True, timeout=20)          # what the terminal does: the whole group
    out, err = res.stdout, res.stderr
    assert res.returncode == 130, (out, err)
    assert "Interrupted" in err and "Traceback" not in err
    assert children and all(not Path(f"/proc/{c}").exists() for c in children)     # the worker is gone


def test_sql_statements_are_decided_by_duckdbs_parser(tmp_path):
    from graphstore.sql import check_readonly
    from zoocore.errors import QueryRefused

    for q in ("EXPLAIN ANALYZE SELECT 1", "/* a */ explain -- b\n analyze SELECT 1", "EXPLAIN COPY (SELECT 1) TO 'x'",
              "SELECT 1; SELECT 2", "INSTALL httpfs"):
        with pytest.raises(QueryRefused):
            check_readonly(q)
    for q in ("EXPLAIN SELECT 1", "SELECT 1;", "DESCRIBE SELECT 1", "FROM range(3)",
              "WITH t AS (SELECT 1) SELECT * FROM t"):
        check_readonly(q)
    with pytest.raises(QueryRefused, match="INSTALL statements"):
        check_readonly("INSTALL httpfs")


@pytest.mark.slow
def test_every_command_refuses_every_hostile_input(tmp_path):
    """The sweep: every command over every attack, as real processes. Nothing a payload would write
    exists, no query changes a byte of the catalog, nothing crashes or prints a traceback, and each
    attack is refused with exit code 1 and one message."""
    outcomes = run_attacks(tmp_path)
    bad = [(o.name, o.exit_code, o.canaries, o.catalog_changed, o.output[-300:]) for o in outcomes if not o.clean]
    assert not bad, bad
    counts = summary(outcomes)
    assert counts["attacks"] >= 45 and counts["files written by payloads"] == 0 and counts["tracebacks"] == 0
    from graphstore.sql import run_readonly

    errors = run_readonly(tmp_path / "hostile-cat", "SELECT count(*) AS n, count(DISTINCT source_path) AS d "
                                                   "FROM ingest_errors").to_pylist()[0]
    assert errors["n"] == errors["d"] == 14          # every hostile checkpoint is recorded as a failure, once


def test_the_object_storage_client_of_the_query_worker_refuses_writes(tmp_path):
    import fsspec

    from graphstore.isolation import read_only_filesystem

    fs = fsspec.filesystem("memory")
    fs.pipe_file("/cat/parts/p/models.parquet", b"original")
    read_only_filesystem(fs)
    with fs.open("/cat/parts/p/models.parquet", "rb") as fh:
        assert fh.read() == b"original"
    for write in (lambda: fs.open("/cat/parts/p/models.parquet", "wb"), lambda: fs.rm("/cat", recursive=True),
                  lambda: fs.pipe_file("/cat/x", b"x"), lambda: fs.mv("/cat/parts", "/elsewhere")):
        with pytest.raises(PermissionError):
            write()
    assert fs.cat_file("/cat/parts/p/models.parquet") == b"original"
