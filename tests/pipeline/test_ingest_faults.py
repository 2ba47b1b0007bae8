"""Careless and hostile inputs to ingest (issue #14): bad values, odd column names, broken
metrics.csv files, empty zoos, a graph write lost to kill -9 or a held lock, and a sync that fails."""
import csv
import os
import shutil
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pytest
from click.testing import CliRunner

from graphstore import duck
from graphstore.catalog import Catalog
from graphstore.metadata import open_store
from graphstore.sync import sync_store
from pipeline.cli import main as pipeline_cli
from zoocore.errors import StoreError

N = 6


def _rows(mlp_zoo, n=N):
    with open(mlp_zoo / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    return rows[:n]


def _zoo(tmp_path, mlp_zoo, name="zoo", rows=None, header=None, n=N):
    """A zoo of the first ``n`` models of the MLP zoo, with a metrics.csv of ``rows`` (dicts)."""
    zoo = tmp_path / name
    zoo.mkdir()
    for r in _rows(mlp_zoo, n):
        stem = r["checkpoint"].rsplit(".", 1)[0]
        shutil.copy(mlp_zoo / f"{stem}.safetensors", zoo)
        shutil.copy(mlp_zoo / f"{stem}.json", zoo)
    rows = rows if rows is not None else _rows(mlp_zoo, n)
    header = header or list(rows[0])
    with open(zoo / "metrics.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        for r in rows:
            w.writerow([r.get(h, "") for h in header])
    return zoo


def _zoo_of_rows(zoo, mlp_zoo, rows):
    """A zoo of exactly the models ``rows`` name, with those rows as its metrics.csv."""
    zoo.mkdir()
    for r in rows:
        stem = r["checkpoint"].rsplit(".", 1)[0]
        shutil.copy(mlp_zoo / f"{stem}.safetensors", zoo)
        shutil.copy(mlp_zoo / f"{stem}.json", zoo)
    with open(zoo / "metrics.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return zoo


def _ingest(zoo, cat, *args):
    return CliRunner().invoke(pipeline_cli, ["ingest", str(zoo), "--catalog", str(cat), *args])


def _types(cat):
    con = duck.connect(cat)
    return {name: typ for name, typ, *_ in con.execute("DESCRIBE models").fetchall()}


def _plain_rows(mlp_zoo, n=N):
    """metrics.csv rows without the hparams JSON (so a changed cell is the only source of a value)."""
    return [{k: v for k, v in r.items() if k != "hparams"} for r in _rows(mlp_zoo, n)]


# ----------------------------------------------------------------------------- item 1: type poisoning
def test_one_bad_value_becomes_null_and_the_column_stays_numeric(tmp_path, mlp_zoo):
    rows = _plain_rows(mlp_zoo)
    rows[1]["test_accuracy"] = "n/a"                       # data row 2 = line 3 of the file
    zoo = _zoo(tmp_path, mlp_zoo, rows=rows)
    cat = tmp_path / "cat"
    res = _ingest(zoo, cat)
    assert res.exit_code == 0, res.output
    assert f"{zoo / 'metrics.csv'} row 3 ({rows[1]['checkpoint']}), column 'test_accuracy'" in res.output
    assert "recorded as null" in res.output and "Traceback" not in res.output
    assert _types(cat)["test_accuracy"] == "DOUBLE"
    con = duck.connect(cat)
    nulls = con.execute("SELECT checkpoint FROM models WHERE test_accuracy IS NULL").fetchall()
    assert nulls == [(rows[1]["checkpoint"],)]
    # the graph store got every model, test_accuracy as a number
    with open_store(cat, use_env=False) as s:
        assert s.run("MATCH (m:Model) WHERE m.test_accuracy > 0 RETURN count(m)").rows == [[N - 1]]

    # another zoo whose test_accuracy is text everywhere: the catalog's column stays a number
    text_rows = _plain_rows(mlp_zoo, N + 3)[N:]
    for r in text_rows:
        r["test_accuracy"] = "high"
    other = _zoo_of_rows(tmp_path / "other", mlp_zoo, text_rows)
    res = _ingest(other, cat, "--no-graph")
    assert res.exit_code == 0, res.output
    assert "'high' is not a number (the catalog's test_accuracy holds numbers)" in res.output
    assert res.output.count("column 'test_accuracy'") == 3
    assert _types(cat)["test_accuracy"] == "DOUBLE"
    con = duck.connect(cat)
    assert con.execute("SELECT count(*) FROM models WHERE zoo = 'other' AND test_accuracy IS NULL").fetchone()[0] == 3
    assert con.execute("SELECT count(*) FROM models WHERE test_accuracy IS NOT NULL").fetchone()[0] == N - 1


def test_an_empty_column_does_not_fix_a_type_and_shards_decide_alike(tmp_path, mlp_zoo):
    from pipeline.formats.checkpoint_folder import list_checkpoints
    from pipeline.ingest import shard_of
    from pipeline.zoo_metadata import zoo_metadata

    rows = _plain_rows(mlp_zoo)
    for r in rows:
        r["psnr"] = ""
    zoo = _zoo(tmp_path, mlp_zoo, rows=rows)
    cat = tmp_path / "cat"
    assert _ingest(zoo, cat, "--no-graph").exit_code == 0
    later = _plain_rows(mlp_zoo, N + 2)[N:]
    for r in later:
        r["psnr"] = "31.5"
    other = _zoo_of_rows(tmp_path / "other", mlp_zoo, later)
    res = _ingest(other, cat, "--no-graph")
    assert res.exit_code == 0 and "WARNING" not in res.output, res.output
    assert _types(cat)["psnr"] == "DOUBLE"

    # a column that is mostly numbers: every shard decides "number", even one whose own rows are text
    rows = _plain_rows(mlp_zoo)
    files = list_checkpoints(zoo)
    shard0 = [p for p in files if shard_of(p, 2) == 0]
    assert 0 < len(shard0) < len(files) / 2 + 1
    for r in rows:
        r["score"] = "bad" if (zoo / r["checkpoint"]) == shard0[0] else "0.5"
    with open(zoo / "metrics.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    meta = zoo_metadata(zoo, shard0[:1], {}, zoo_files=files)
    assert str(meta.types["score"].type) == "double" and meta.columns[str(shard0[0])]["score"] is None
    assert str(zoo_metadata(zoo, shard0[:1], {}).types["score"].type) == "string"   # alone it would be text


def test_refuse_flag_refuses_the_zoo_before_anything_is_written(tmp_path, mlp_zoo):
    rows = _plain_rows(mlp_zoo)
    rows[3]["lr"] = "fast"
    zoo = _zoo(tmp_path, mlp_zoo, rows=rows)
    res = _ingest(zoo, tmp_path / "cat", "--on-bad-value", "refuse")
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert f"{zoo / 'metrics.csv'} row 5 ({rows[3]['checkpoint']}), column 'lr': 'fast' is not a number" in res.output
    assert "nothing was written" in res.output
    assert not (tmp_path / "cat").exists()        # no Parquet, and no empty graph store either


def test_a_column_whose_name_starts_with_a_digit_gets_a_prefix(tmp_path, mlp_zoo):
    rows = _plain_rows(mlp_zoo)
    for i, r in enumerate(rows):
        r["2nd_run"] = str(i % 2 == 0).lower()
    zoo = _zoo(tmp_path, mlp_zoo, rows=rows)
    cat = tmp_path / "cat"
    res = _ingest(zoo, cat)
    assert res.exit_code == 0, res.output
    assert "metadata field '2nd_run' is stored as column 'c_2nd_run'" in res.output
    assert _types(cat)["c_2nd_run"] == "BOOLEAN"
    with open_store(cat, use_env=False) as s:
        assert s.run("MATCH (m:Model) WHERE m.c_2nd_run RETURN count(m)").rows == [[N // 2]]


def test_a_failed_sync_leaves_the_previous_graph(tmp_path, mlp_zoo, store_factory):
    zoo = _zoo(tmp_path, mlp_zoo)
    cat = tmp_path / "cat"
    assert _ingest(zoo, cat, "--no-graph").exit_code == 0
    store = store_factory(cat)
    assert sync_store(cat, store).models == N
    count = "MATCH (:Zoo)-[:CONTAINS]->(m:Model)-[:HAS_ARCHITECTURE]->(:Architecture) RETURN count(m)"

    # 1. the store fails half-way through the rebuild (Neo4j: after the old graph was deleted in the
    # transaction; Ladybug: while the fresh database is written beside the old one). The failure is
    # injected into the backend class, so it reaches the store the rebuild writes to.
    backend, calls = type(store), []
    real_write = backend._write

    def failing_write(self, query, rows):
        calls.append(query)
        if len(calls) == 6:
            raise StoreError("disk full (injected)")
        return real_write(self, query, rows)

    backend._write = failing_write
    try:
        with pytest.raises(StoreError, match=r"disk full \(injected\) \(the graph store was left as it was\)"):
            sync_store(cat, store)
    finally:
        backend._write = real_write
    assert len(calls) == 6
    assert not list(cat.glob(".graph.lbug.rebuild-*"))          # a failed rebuild leaves nothing beside the store
    assert store.run(count).rows == [[N]]
    assert sync_store(cat, store).models == N                    # the same store syncs fine afterwards
    assert store.run("MATCH (m:Model) WHERE m.test_accuracy >= 0 AND m.lr > 0 RETURN count(m)").rows == [[N]]

    # 2. a catalog part written by an older version, with a column that cannot be a graph property
    con = duck.connect(cat)
    legacy = duck.table(con, "SELECT * FROM models LIMIT 1")
    con.close()
    legacy = legacy.set_column(0, "model_id", pa.array(["legacy-model"])).append_column("2nd_run", pa.array([1.0]))
    Catalog(cat).commit_part({"models": legacy})
    with pytest.raises(StoreError, match="2nd_run .* the graph store was left unchanged"):
        sync_store(cat, store)
    assert store.run(count).rows == [[N]]
    store.close()


# ----------------------------------------------------------------------------- item 8: raw tracebacks
def test_test_accuracy_spelled_two_ways_is_one_column(tmp_path, mlp_zoo):
    rows = _plain_rows(mlp_zoo)
    for r in rows:
        r["Test Accuracy"] = r.pop("test_accuracy")      # the sidecars say test_accuracy
    zoo = _zoo(tmp_path, mlp_zoo, rows=rows)
    cat = tmp_path / "cat"
    res = _ingest(zoo, cat)
    assert res.exit_code == 0, res.output
    assert "6 new models" in res.output and "Traceback" not in res.output
    assert "column 'test_accuracy' is given as 'Test Accuracy' (metrics.csv), 'test_accuracy' (sidecars)" \
        in res.output
    con = duck.connect(cat)
    got = dict(con.execute("SELECT checkpoint, test_accuracy FROM models").fetchall())
    assert got == {r["checkpoint"]: pytest.approx(float(r["Test Accuracy"])) for r in rows}


def test_two_headers_for_one_column_are_refused(tmp_path, mlp_zoo):
    rows = _plain_rows(mlp_zoo)
    for r in rows:
        r["Test Accuracy"] = r["test_accuracy"]
    zoo = _zoo(tmp_path, mlp_zoo, rows=rows)
    res = _ingest(zoo, tmp_path / "cat")
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert f"{zoo / 'metrics.csv'}: columns 'test_accuracy' and 'Test Accuracy' both become column " \
           "'test_accuracy'" in res.output
    assert not (tmp_path / "cat").exists()        # no Parquet, and no empty graph store either


def test_non_utf8_metrics_csv_is_refused_clearly(tmp_path, mlp_zoo):
    rows = _plain_rows(mlp_zoo)
    for r in rows:
        r["notes"] = "ok"
    zoo = _zoo(tmp_path, mlp_zoo, rows=rows)
    text = (zoo / "metrics.csv").read_bytes().replace(b"ok", "d\u00e9j\u00e0 vu".encode("latin-1"), 2)
    (zoo / "metrics.csv").write_bytes(text)
    res = _ingest(zoo, tmp_path / "cat")
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert f"{zoo / 'metrics.csv'} is not UTF-8 text: byte 0xe9 at line 2, column 'notes'" in res.output
    assert not (tmp_path / "cat").exists()        # no Parquet, and no empty graph store either


# ----------------------------------------------------------------------------- item 9: duplicates, empty zoo
def test_duplicate_metrics_rows_warn_and_the_last_wins(tmp_path, mlp_zoo):
    rows = _plain_rows(mlp_zoo)
    again = dict(rows[0], test_accuracy="0.125")
    zoo = _zoo(tmp_path, mlp_zoo, rows=rows + [again])
    cat = tmp_path / "cat"
    res = _ingest(zoo, cat, "--no-graph")
    assert res.exit_code == 0, res.output
    assert f"{zoo / 'metrics.csv'}: {rows[0]['checkpoint']} is listed twice (rows 2 and {N + 2}); " \
           f"row {N + 2} is used" in res.output
    con = duck.connect(cat)
    assert con.execute("SELECT test_accuracy FROM models WHERE checkpoint = ?",
                       [rows[0]["checkpoint"]]).fetchone()[0] == 0.125


def test_an_empty_zoo_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "README.txt").write_text("nothing here")
    res = _ingest(tmp_path / "empty", tmp_path / "cat")
    assert res.exit_code == 1 and "holds no zoo this program can read: no checkpoints" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "cat").exists()


# ----------------------------------------------------------------------------- item 3: graph repair
STALL_GRAPH_WRITE = r"""
import sys, time
from graphstore.metadata import open_store
from graphstore.metadata.ladybug_store import LadybugStore
from pipeline.ingest import ingest_zoo

def stall(self, *args, **kwargs):       # the Parquet part is committed; the graph write is about to start
    print("PARQUET_COMMITTED", flush=True)
    time.sleep(600)

LadybugStore.write_models = stall
with open_store(sys.argv[2], use_env=False) as store:
    ingest_zoo(sys.argv[1], sys.argv[2], store=store, progress=False)
"""

HOLD_STORE = r"""
import sys, time
from graphstore.metadata import open_store
store = open_store(sys.argv[1], use_env=False)
store.ensure_schema()
print("HOLDING", flush=True)
time.sleep(600)
"""


def _wait_for(proc, word, timeout=120):
    deadline = time.time() + timeout
    line = ""
    while time.time() < deadline and word not in line:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
    assert word in line, proc.stderr.read() if proc.stderr else ""


def _graph_models(cat):
    with open_store(cat, use_env=False) as s:
        s.ensure_schema()
        return s.run("MATCH (:Zoo)-[:CONTAINS]->(m:Model)-[:HAS_ARCHITECTURE]->(:Architecture) "
                     "RETURN count(m)").rows[0][0]


def test_rerun_repairs_a_graph_write_lost_to_kill_9(tmp_path, mlp_zoo):
    zoo = _zoo(tmp_path, mlp_zoo)
    cat = tmp_path / "cat"
    proc = subprocess.Popen([sys.executable, "-c", STALL_GRAPH_WRITE, str(zoo), str(cat)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(proc, "PARQUET_COMMITTED")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    con = duck.connect(cat)
    assert con.execute("SELECT count(*) FROM models").fetchone()[0] == N
    con.close()
    assert _graph_models(cat) == 0
    res = _ingest(zoo, cat)
    assert res.exit_code == 0, res.output
    assert "0 new models, 6 already in the catalog" in res.output
    assert "graph store repaired: wrote 6 models" in res.output
    assert _graph_models(cat) == N
    res = _ingest(zoo, cat)                       # nothing left to repair
    assert res.exit_code == 0 and "repaired" not in res.output


def test_a_held_graph_store_fails_ingest_and_a_rerun_repairs_it(tmp_path, mlp_zoo):
    zoo = _zoo(tmp_path, mlp_zoo)
    cat = tmp_path / "cat"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_STORE, str(cat)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(holder, "HOLDING")
        res = _ingest(zoo, cat)
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    assert res.exit_code == 1, res.output
    assert "6 new models" in res.output and "graph store not updated" in res.output
    assert "may lack up to 6 models of zoo 'zoo'" in res.output and "graphstore sync" in res.output
    res = _ingest(zoo, cat)
    assert res.exit_code == 0, res.output
    assert "graph store repaired: wrote 6 models" in res.output
    assert _graph_models(cat) == N


def test_training_write_back_restores_models_the_graph_lost(catalog_copy):
    from jobs.config import TrainConfig
    from jobs.training.train import train_heterognn

    with open_store(catalog_copy, use_env=False) as store:
        sync_store(catalog_copy, store)
        store.run("MATCH (m:Model) WHERE m.zoo = 'mlp' DETACH DELETE m")       # a graph write lost
        assert store.run("MATCH (m:Model) WHERE m.zoo = 'mlp' RETURN count(m)").rows == [[0]]
        report = train_heterognn(catalog_copy, TrainConfig(where="zoo = 'mlp'", ensemble=1, epochs=1, batch_size=16, hidden=8,
                                                           edge_hidden=4, layers=1, baselines=False),
                                 store=store, progress=False)
        assert report.store_warning is None
        n = duck.connect(catalog_copy).execute("SELECT count(*) FROM models WHERE zoo = 'mlp'").fetchone()[0]
        got = store.run("MATCH (:Zoo {name: 'mlp'})-[:CONTAINS]->(m:Model)-[:HAS_ARCHITECTURE]->(:Architecture) "
                        "WHERE m.predicted_test_accuracy_run = $run RETURN count(m)", {"run": report.run_id}).rows
        assert got == [[n]]
