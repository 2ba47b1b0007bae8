"""The graph store follows the catalog (issue #29 items 4 and 9), on the real Ladybug store and real
processes: a zoo whose columns have other types than the store's defaults (text ``label`` and
``test_accuracy``, numeric ``optimizer``) is written and synced, later zoos too; and a `graphstore
sync` killed with SIGKILL at any moment leaves a store that read-only queries can read."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphstore.cli import main as graphstore_cli
from graphstore.metadata.ladybug_store import LadybugStore
from graphstore.sql import run_readonly
from pipeline.ingest import ingest_zoo

ROOT = Path(__file__).resolve().parents[2]


def _zoo(tmp_path, name: str, rows: list[str], n: int = 3, seed: int = 4) -> Path:
    from pipeline.zoo.make import make_zoo

    zoo = tmp_path / name
    make_zoo("mlp", zoo, n=n, seed=seed, workers=1, progress=False)
    files = sorted(p.name for p in zoo.glob("*.safetensors"))
    (zoo / "metrics.csv").write_text("file,label,optimizer,test_accuracy\n"
                                     + "".join(f"{f},{r}\n" for f, r in zip(files, rows)))
    return zoo


def _cypher(cat, query: str):
    res = CliRunner().invoke(graphstore_cli, ["cypher", query, "--format", "json", "--catalog", str(cat)],
                             env={"NEO4J_URI": ""})
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_column_types_follow_the_catalog_in_the_graph_store(tmp_path):
    cat = tmp_path / "cat"
    text_first = _zoo(tmp_path, "text", ["cat,3,high", "dog,4,low", "dog,5,mid"])
    with LadybugStore(cat / "graph.lbug") as store:
        report = ingest_zoo(text_first, cat, progress=False, store=store)
    assert report.added == 3 and report.store_warning is None, report.store_warning
    got = _cypher(cat, "MATCH (m:Model) RETURN m.label AS label, m.optimizer AS opt, m.test_accuracy AS acc "
                       "ORDER BY acc")
    assert [(r["label"], r["opt"], r["acc"]) for r in got] == [("cat", 3.0, "high"), ("dog", 4.0, "low"),
                                                              ("dog", 5.0, "mid")]
    numbers_later = _zoo(tmp_path, "numbers", ["1.5,adam,0.9", "2.5,sgd,0.8"], n=2, seed=9)
    with LadybugStore(cat / "graph.lbug") as store:
        report = ingest_zoo(numbers_later, cat, progress=False, store=store)
    assert report.added == 2 and report.store_warning is None, report.store_warning
    res = CliRunner().invoke(graphstore_cli, ["sync", "--catalog", str(cat)], env={"NEO4J_URI": ""})
    assert res.exit_code == 0 and "5 models" in res.output, res.output
    graph = {r["id"]: (r["label"], r["acc"]) for r in _cypher(
        cat, "MATCH (m:Model) RETURN m.model_id AS id, m.label AS label, m.test_accuracy AS acc")}
    parquet = {r["model_id"]: (r["label"], r["test_accuracy"]) for r in run_readonly(
        cat, "SELECT model_id, label, test_accuracy FROM models").to_pylist()}
    assert graph == parquet and len(graph) == 5           # the graph is the catalog, types and all
    assert {type(v[0]) for v in graph.values()} == {str}


def test_a_store_whose_types_differ_from_the_catalog_is_rebuilt_by_sync(tmp_path):
    """A store built before a zoo gave ``label`` text values keeps ``label DOUBLE`` with values in
    it: sync rebuilds a fresh database and swaps it in."""
    cat = tmp_path / "cat"
    numbers = _zoo(tmp_path, "numbers", ["1.5,adam,0.9", "2.5,sgd,0.8", "3.5,sgd,0.7"])
    with LadybugStore(cat / "graph.lbug") as store:
        ingest_zoo(numbers, cat, progress=False, store=store)
    with LadybugStore(cat / "graph.lbug") as store:       # what an older store held: a number, a type
        store._execute("ALTER TABLE Model ADD surprise DOUBLE")
        store._execute("MATCH (m:Model) SET m.surprise = 1.0")
    (tmp_path / "extra").mkdir()
    zoo = _zoo(tmp_path / "extra", "text", ["cat,3,high"], n=1, seed=11)
    text = (zoo / "metrics.csv").read_text().replace("label,optimizer,test_accuracy", "surprise,optimizer,label")
    (zoo / "metrics.csv").write_text(text.replace(",cat,3,high", ",words,3,1.0"))
    with LadybugStore(cat / "graph.lbug") as store:
        report = ingest_zoo(zoo, cat, progress=False, store=store)
    assert report.added == 1
    res = CliRunner().invoke(graphstore_cli, ["sync", "--catalog", str(cat)], env={"NEO4J_URI": ""})
    assert res.exit_code == 0 and "4 models" in res.output, res.output
    assert not list(cat.glob(".graph.lbug.rebuild-*"))
    assert len(_cypher(cat, "MATCH (m:Model) RETURN m.model_id AS id")) == 4


@pytest.mark.slow
def test_sync_killed_at_any_moment_leaves_a_readable_store(tmp_path):
    from pipeline.zoo.make import make_zoo

    zoo = tmp_path / "zoo"
    make_zoo("mlp", zoo, n=6, seed=5, workers=1, progress=False)
    cat = tmp_path / "cat"
    assert ingest_zoo(zoo, cat, progress=False).added == 6
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NEO4J_URI": ""}
    sync = [sys.executable, "-m", "graphstore.cli", "sync", "--catalog", str(cat)]
    assert subprocess.run(sync, env=env, capture_output=True, timeout=120).returncode == 0
    for delay in (0.3, 0.8, 1.2, 1.6, 2.0, 2.5):
        proc = subprocess.Popen(sync, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        rows = _cypher(cat, "MATCH (m:Model) RETURN count(m) AS n")
        assert rows == [{"n": 6}], (delay, rows)          # the old graph or the new one, whole
    done = subprocess.run(sync, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert not list(cat.glob(".graph.lbug.rebuild-*"))     # a later sync clears what a killed one left


def test_metrics_rows_key_by_the_path_inside_the_zoo(tmp_path):
    from pipeline.zoo.make import make_zoo

    made = tmp_path / "made"
    make_zoo("mlp", made, n=2, seed=6, workers=1, progress=False)
    zoo = tmp_path / "zoo"
    for sub, src in zip(("a", "b"), sorted(made.glob("*.safetensors"))):
        (zoo / sub).mkdir(parents=True)
        shutil.copy(src, zoo / sub / "m.safetensors")
        shutil.copy(src.with_suffix(".json"), zoo / sub / "m.json")
    (zoo / "metrics.csv").write_text("file,score\na/m.safetensors,0.1\nb/m.safetensors,0.9\n")
    report = ingest_zoo(zoo, tmp_path / "cat", progress=False)
    assert report.added == 2 and not any("listed twice" in w for w in report.warnings), report.warnings
    rows = run_readonly(tmp_path / "cat", "SELECT source_path, score FROM models ORDER BY score").to_pylist()
    assert [(Path(r["source_path"]).parent.name, r["score"]) for r in rows] == [("a", 0.1), ("b", 0.9)]
    # a bare name that names two checkpoints gives neither of them that row, and says so
    (zoo / "metrics.csv").write_text("file,other\nm.safetensors,5\n")
    report = ingest_zoo(zoo, tmp_path / "cat2", progress=False)
    assert any("names 2 checkpoints" in w for w in report.warnings), report.warnings
    assert "other" not in run_readonly(tmp_path / "cat2", "SELECT * FROM models").column_names


@pytest.mark.parametrize("text", ['file,score\na.safetensors,0.5\n"b.safetensors,0.6\nc.safetensors,0.7\n',
                                  'file,score\n"b.safetensors,0.6\nc.safetensors",0.7\n'])
def test_a_quote_left_open_refuses_the_zoo(tmp_path, text):
    from zoocore.errors import ZooGraphError

    from pipeline.zoo_metadata import read_metrics_csv

    (tmp_path / "metrics.csv").write_text(text)
    with pytest.raises(ZooGraphError, match="quote left open"):
        read_metrics_csv(tmp_path, [])


def test_a_boolean_column_is_written_again_after_the_store_reopens(tmp_path):
    """Ladybug's table_info names a BOOLEAN column BOOL: a store reopened after a zoo with a boolean
    column took another zoo of the same column without calling it a type change (a `jobs predict`
    once stopped with "Model.flag is BOOL and the catalog's column is BOOLEAN")."""
    cat = tmp_path / "cat"
    for k, rows in enumerate((["true,0.5", "false,0.6", "true,0.7"], ["false,0.8", "true,0.9", "false,0.1"])):
        zoo = tmp_path / f"z{k}"
        from pipeline.zoo.make import make_zoo

        make_zoo("mlp", zoo, n=3, seed=20 + k, workers=1, progress=False)
        files = sorted(p.name for p in zoo.glob("*.safetensors"))
        (zoo / "metrics.csv").write_text("file,flag,test_accuracy\n" + "".join(f"{f},{r}\n" for f, r in zip(files, rows)))
        with LadybugStore(cat / "graph.lbug") as store:
            report = ingest_zoo(zoo, cat, progress=False, store=store)
        assert report.added == 3 and report.store_warning is None, report.store_warning
    got = _cypher(cat, "MATCH (m:Model) RETURN m.flag AS flag")
    assert sorted(r["flag"] for r in got) == [False, False, False, True, True, True]
