"""Temporary folders of catalog writes carry leases: a cleaner removes only abandoned ones.

Real processes: a writer (a real `pipeline ingest`) stopped with SIGSTOP inside its commit window
while a second real `pipeline ingest` starts on the same catalog; a writer killed with SIGKILL
there, whose leftovers the next ingest does remove; a run's artifacts killed between two files.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

from graphstore import duck
from graphstore.catalog import Catalog
from graphstore.lease import LEASE, LocalLease, local_abandoned
from pipeline.zoo.make import make_zoo

# Runs a CLI with the catalog's Parquet writer made to stop itself (SIGSTOP) on its first call,
# i.e. inside the commit window: the leased temporary folder exists, nothing is renamed yet.
PAUSING_CLI = r"""
import os, signal, sys
import graphstore.catalog as catalog
original = catalog.pq.write_table
def write_table(*args, **kwargs):
    if not write_table.paused:
        write_table.paused = True
        os.kill(os.getpid(), signal.SIGSTOP)
    return original(*args, **kwargs)
write_table.paused = False
catalog.pq.write_table = write_table
from pipeline.cli import main
main(sys.argv[1:], prog_name="pipeline")
"""

# Commits two artifact files and dies (SIGKILL) while writing the second.
ARTIFACT_CRASH = r"""
import os, pathlib, signal, sys
from graphstore.catalog import Catalog
original = pathlib.Path.write_bytes
def write_bytes(self, data):
    if self.name == "metanet.json":
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, data)
pathlib.Path.write_bytes = write_bytes
Catalog(sys.argv[1]).commit_artifacts("run-crash", {"metanet-0.pt": b"weights", "metanet.json": b"{}"})
"""


def _env():
    root = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def _wait_stopped(proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        if _state(proc.pid) == "T":
            return
        time.sleep(0.05)
    raise AssertionError("the writer never reached its commit window")


def _ingest(zoo, cat, *extra, script=None):
    cmd = [sys.executable, "-c", script] if script else [sys.executable, "-m", "pipeline.cli"]
    return cmd + ["ingest", str(zoo), "--catalog", str(cat), "--no-graph", *extra]


@pytest.fixture(scope="module")
def zoos(tmp_path_factory):
    """Two small disjoint zoos: the paused writer's and the second process's."""
    base = tmp_path_factory.mktemp("lease-zoos")
    make_zoo("mlp", base / "first", n=4, seed=21, workers=1, progress=False)
    make_zoo("mlp", base / "second", n=2, seed=22, workers=1, progress=False)
    return base / "first", base / "second"


def _names(zoo) -> set[tuple[str, str]]:
    return {(zoo.name, p.name) for p in zoo.glob("*.safetensors")}


def _models(cat) -> set[tuple[str, str]]:
    con = duck.connect(cat)
    try:
        return {tuple(r) for r in con.execute("SELECT zoo, checkpoint FROM models").fetchall()}
    finally:
        con.close()


@pytest.mark.slow  # real ingest processes, paused and killed mid-write
def test_a_paused_writer_survives_a_second_ingest_and_commits(tmp_path, zoos):
    first, second = zoos
    cat = tmp_path / "cat"
    writer = subprocess.Popen(_ingest(first, cat, script=PAUSING_CLI), env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        _wait_stopped(writer)
        tmp, = (cat / "parts").glob("_tmp-*")
        lease = json.loads((tmp / LEASE).read_text())
        assert lease["pid"] == writer.pid and lease["host"] and lease["started"] <= time.time()
        other = subprocess.run(_ingest(second, cat), env=_env(), capture_output=True, text=True, timeout=300)
        assert other.returncode == 0, other.stderr
        assert "2 new models" in other.stdout
        assert tmp.is_dir() and (tmp / LEASE).exists(), "the second ingest removed a live writer's folder"
        assert Catalog(cat).clean_incomplete() == 0 and tmp.is_dir()
    finally:
        os.kill(writer.pid, signal.SIGCONT)
    out, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err
    assert "4 new models" in out
    assert not list((cat / "parts").glob("_tmp-*")) and not list((cat / "parts").glob(".new-*"))
    assert not list((cat / "parts").glob(f"*/{LEASE}")), "a committed part keeps no lease"
    assert _models(cat) == _names(first) | _names(second)


@pytest.mark.slow  # real ingest processes, paused and killed mid-write
def test_a_killed_writers_folder_is_cleaned_by_the_next_ingest(tmp_path, zoos):
    first, second = zoos
    cat = tmp_path / "cat"
    writer = subprocess.Popen(_ingest(first, cat, script=PAUSING_CLI), env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    _wait_stopped(writer)
    tmp, = (cat / "parts").glob("_tmp-*")
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    assert tmp.is_dir()
    other = subprocess.run(_ingest(second, cat), env=_env(), capture_output=True, text=True, timeout=300)
    assert other.returncode == 0, other.stderr
    assert not tmp.exists(), "an abandoned temporary folder was left behind"
    assert _models(cat) == _names(second)
    again = subprocess.run(_ingest(first, cat), env=_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "4 new models" in again.stdout, again.stderr
    assert _models(cat) == _names(first) | _names(second)


# A training run's write-back (runs / predictions / embeddings), stopped inside its commit window.
PAUSED_RESULTS = r"""
import os, signal, sys
import pyarrow as pa
import graphstore.catalog as catalog
from graphstore.schema import RUNS
original = catalog.pq.write_table
def write_table(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGSTOP)
    catalog.pq.write_table = original
    return original(*args, **kwargs)
catalog.pq.write_table = write_table
runs = pa.table({name: [None] for name in RUNS.names}, schema=RUNS).set_column(0, "run_id", pa.array(["run-x"]))
print(catalog.Catalog(sys.argv[1]).commit_results("run-x", {"runs": runs}))
"""


def test_a_paused_training_write_back_survives_a_cleaner(tmp_path):
    cat = Catalog(tmp_path / "cat")
    writer = subprocess.Popen([sys.executable, "-c", PAUSED_RESULTS, str(cat.root)], env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_stopped(writer)
        cleaner = subprocess.run([sys.executable, "-c", "import sys; from graphstore.catalog import Catalog; "
                                  "print(Catalog(sys.argv[1]).clean_incomplete())", str(cat.root)],
                                 env=_env(), capture_output=True, text=True, timeout=120)
        assert cleaner.stdout.strip() == "0", cleaner.stderr
    finally:
        os.kill(writer.pid, signal.SIGCONT)
    out, err = writer.communicate(timeout=60)
    assert writer.returncode == 0, err
    assert [Path(f).parent.name for f in cat.files("runs")] == [Path(out.strip()).name]
    con = duck.connect(cat)
    assert con.execute("SELECT run_id FROM runs").fetchall() == [("run-x",)]
    con.close()


def test_lock_not_pid_decides_on_a_local_catalog(tmp_path):
    stage = tmp_path / ".new-x"
    stage.mkdir()
    lease = LocalLease.take(stage)
    assert not local_abandoned(stage)            # held by this process, through another descriptor
    tmp = tmp_path / "_tmp-x"
    os.rename(stage, tmp)
    assert not local_abandoned(tmp)
    lease.release()
    assert local_abandoned(tmp)                  # our pid is alive, but the lock is free: nobody writes
    legacy = tmp_path / "_tmp-legacy"            # written by a version without leases
    legacy.mkdir()
    assert local_abandoned(legacy)
    fresh = tmp_path / ".new-fresh"              # a writer between mkdir and its lease
    fresh.mkdir()
    assert not local_abandoned(fresh)
    old = time.time() - 3600
    os.utime(fresh, (old, old))
    assert local_abandoned(fresh)


def test_object_storage_uses_pid_host_and_age(monkeypatch):
    """No locks on object storage: this host's dead pid, or another host's old lease, is abandoned."""
    import socket

    import fsspec

    root = "memory://lease-test/cat"
    cat = Catalog(root)
    cat.commit_part({"models": pa.table({"model_id": ["m"]})}, "committed")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    now = time.time()
    leases = {"dead-pid": {"pid": dead.pid, "host": socket.gethostname(), "started": now},
              "live-pid": {"pid": os.getpid(), "host": socket.gethostname(), "started": now - 10 * 86400},
              "other-host-old": {"pid": 1, "host": "elsewhere", "started": now - 2 * 86400},
              "other-host-new": {"pid": 1, "host": "elsewhere", "started": now - 60}}
    fs = fsspec.filesystem("memory")
    for name, record in leases.items():
        fs.pipe_file(cat._key("parts", name, LEASE), json.dumps(record).encode())
        fs.pipe_file(cat._key("parts", name, "models.parquet"), b"partial")
    assert cat.clean_incomplete() == 2
    left = {p.rsplit("/", 1)[-1] for p in fs.ls(cat._key("parts"), detail=False)}
    assert left == {"committed", "live-pid", "other-host-new"}
    monkeypatch.setenv("ZOOGRAPH_LEASE_STALE_SECONDS", "30")
    assert cat.clean_incomplete() == 1
    assert {p.rsplit("/", 1)[-1] for p in fs.ls(cat._key("parts"), detail=False)} == {"committed", "live-pid"}
    assert [f.rsplit("/", 1)[-1] for f in cat.files("models")] == ["models.parquet"]
    fs.rm(cat._key(), recursive=True)


def test_artifacts_are_committed_at_once_and_a_crash_leaves_none(tmp_path):
    from jobs.training.artifacts import load_metanetwork
    from zoocore.errors import JobError

    cat = Catalog(tmp_path / "cat")
    proc = subprocess.run([sys.executable, "-c", ARTIFACT_CRASH, str(cat.root)], env=_env(), timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert not (cat.artifacts_dir / "run-crash").exists()
    assert cat.read_artifact("run-crash", "metanet-0.pt") is None
    with pytest.raises(JobError, match="no run 'run-crash' in the catalog"):
        load_metanetwork(cat, "run-crash")
    assert len(list(cat.artifacts_dir.glob("_tmp-run-crash"))) == 1
    assert cat.clean_incomplete() == 1 and not list(cat.artifacts_dir.iterdir())
    cat.commit_artifacts("run-ok", {"a.pt": b"A", "metanet.json": b"{}"})
    assert sorted(p.name for p in (cat.artifacts_dir / "run-ok").iterdir()) == ["a.pt", "metanet.json"]
    assert cat.read_artifact("run-ok", "a.pt") == b"A"


def test_write_artifact_replaces_a_file_whole(tmp_path, monkeypatch):
    cat = Catalog(tmp_path / "cat")
    cat.write_artifact("run", "notes.json", b"old")

    def crash(*_):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        cat.write_artifact("run", "notes.json", b"new and longer")
    assert cat.read_artifact("run", "notes.json") == b"old"
    assert [p.name for p in (cat.artifacts_dir / "run").iterdir()] == ["notes.json"]
