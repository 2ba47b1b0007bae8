"""Zoo generation and ingest rules, on real zoos made by `pipeline zoo make`."""
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from graphstore import duck
from graphstore.catalog import Catalog
from pipeline.cli import main as pipeline_cli
from pipeline.ingest import ingest_zoo
from pipeline.zoo.make import make_zoo


def test_zoo_is_deterministic_and_resumes(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    make_zoo("mlp", a, n=3, seed=11, progress=False)
    make_zoo("mlp", b, n=3, seed=11, progress=False)
    for name in ("mlp-00000.safetensors", "mlp-00002.safetensors", "metrics.csv"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    (a / "mlp-00001.safetensors").unlink()
    report = make_zoo("mlp", a, n=4, seed=11, progress=False)
    assert (report.made, report.skipped) == (2, 2)
    assert (a / "mlp-00001.safetensors").read_bytes() == (b / "mlp-00001.safetensors").read_bytes()


def test_cnn_zoo_accuracy_spreads(catalog_dir):
    con = duck.connect(catalog_dir)
    lo, hi, archs = con.execute("SELECT min(test_accuracy), max(test_accuracy), count(DISTINCT architecture_id) "
                                "FROM models WHERE zoo = 'cnn'").fetchone()
    assert lo < 0.3 and hi > 0.85 and archs > 5


def test_metadata_columns_and_counts(catalog_dir, cnn_zoo):
    con = duck.connect(catalog_dir)
    cols = {r[0]: r[1] for r in con.execute("DESCRIBE models").fetchall()}
    assert cols["test_accuracy"] == "DOUBLE" and cols["optimizer"] == "VARCHAR" and cols["batchnorm"] == "BOOLEAN"
    row = con.execute("SELECT test_accuracy, optimizer, num_nodes, num_edges, model_id FROM models "
                      "WHERE checkpoint = 'cnn-00000.safetensors'").fetchone()
    side = json.loads((cnn_zoo / "cnn-00000.json").read_text())
    assert row[0] == pytest.approx(side["metrics"]["test_accuracy"]) and row[1] == side["metadata"]["optimizer"]
    n_nodes = con.execute("SELECT count(*) FROM nodes WHERE model_id = ?", [row[4]]).fetchone()[0]
    n_edges = con.execute("SELECT count(*) FROM edges WHERE model_id = ?", [row[4]]).fetchone()[0]
    assert (n_nodes, n_edges) == (row[2], row[3])
    # every model is complete: nodes and edges agree with its counts
    bad = con.execute("SELECT count(*) FROM models m LEFT JOIN (SELECT model_id, count(*) n FROM nodes GROUP BY 1) "
                      "x USING (model_id) WHERE x.n IS DISTINCT FROM m.num_nodes").fetchone()[0]
    assert bad == 0


def test_ingesting_twice_or_a_copy_adds_nothing(tmp_path, cnn_zoo):
    zoo = tmp_path / "zoo"
    shutil.copytree(cnn_zoo, zoo)
    first = ingest_zoo(zoo, tmp_path / "cat", progress=False)
    assert first.added == len(list(zoo.glob("*.safetensors")))
    shutil.copy(zoo / "cnn-00001.safetensors", zoo / "copy.safetensors")
    shutil.copy(zoo / "cnn-00001.json", zoo / "copy.json")
    again = ingest_zoo(zoo, tmp_path / "cat", progress=False)
    assert again.added == 0 and again.duplicates == first.added + 1
    con = duck.connect(tmp_path / "cat")
    assert con.execute("SELECT count(*), count(DISTINCT model_id) FROM models").fetchone() == (first.added,) * 2


class Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_bad_checkpoints_are_recorded_and_the_rest_ingested(tmp_path, mlp_zoo, monkeypatch):
    monkeypatch.chdir(tmp_path)
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    for name in ("mlp-00000", "mlp-00001"):
        shutil.copy(mlp_zoo / f"{name}.safetensors", zoo)
        shutil.copy(mlp_zoo / f"{name}.json", zoo)
    data = (mlp_zoo / "mlp-00002.safetensors").read_bytes()
    (zoo / "truncated.safetensors").write_bytes(data[: len(data) // 2])
    shutil.copy(mlp_zoo / "mlp-00002.json", zoo / "truncated.json")
    (zoo / "garbage.pt2").write_bytes(b"not a zip at all")
    with open(zoo / "evil.pt", "wb") as fh:
        pickle.dump({"w": Payload()}, fh)
    shutil.copy(mlp_zoo / "mlp-00002.json", zoo / "evil.json")
    spec = json.loads((mlp_zoo / "mlp-00003.json").read_text())
    spec["architecture"]["layers"][0]["out_features"] = 7          # does not match the weights
    shutil.copy(mlp_zoo / "mlp-00003.safetensors", zoo / "mismatch.safetensors")
    (zoo / "mismatch.json").write_text(json.dumps(spec))
    shutil.copy(mlp_zoo / "mlp-00004.safetensors", zoo / "nospec.safetensors")

    result = CliRunner().invoke(pipeline_cli, ["ingest", str(zoo), "--catalog", str(tmp_path / "cat"), "--no-graph"])
    assert result.exit_code == 1, result.output
    assert "2 new models" in result.output and "5 failed" in result.output
    assert not (tmp_path / "PWNED").exists() and not (zoo / "PWNED").exists()
    con = duck.connect(tmp_path / "cat")
    errors = dict(con.execute("SELECT source_path, error_type FROM ingest_errors").fetchall())
    assert set(errors) == {"truncated.safetensors", "garbage.pt2", "evil.pt", "mismatch.safetensors",
                           "nospec.safetensors"}
    assert errors["evil.pt"] == "CheckpointError" and errors["nospec.safetensors"] == "SpecError"
    assert con.execute("SELECT count(*) FROM models").fetchone()[0] == 2


KILL_SCRIPT = r"""
import os, sys, time
from graphstore.catalog import Catalog
original = Catalog._commit
def slow_commit(self, kind, name, tables):
    # write every file of the part, then stall before the rename that publishes it
    base = self.location(kind)
    tmp = base / f"_tmp-{name}"
    import pyarrow.parquet as pq
    base.mkdir(parents=True, exist_ok=True); tmp.mkdir()
    for rel, t in tables.items():
        if t is not None and t.num_rows:
            pq.write_table(t, tmp / f"{rel}.parquet")
    print("STALLED", flush=True)
    time.sleep(600)
Catalog._commit = slow_commit if os.environ.get("STALL") else original
from pipeline.ingest import ingest_zoo
ingest_zoo(sys.argv[1], sys.argv[2], part_models=int(sys.argv[3]), progress=False)
print("DONE", flush=True)
"""


def test_killed_ingest_leaves_nothing_partial_and_rerun_finishes(tmp_path, mlp_zoo):
    cat = tmp_path / "cat"
    env = {**os.environ, "STALL": "1"}
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(mlp_zoo), str(cat), "5"], env=env,
                            stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    line = ""
    while time.time() < deadline and "STALLED" not in line:
        line = proc.stdout.readline()
    assert "STALLED" in line
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list((cat / "parts").glob("_tmp-*")), "the interrupted part should be on disk, unpublished"
    con = duck.connect(cat)
    assert con.execute("SELECT count(*) FROM models").fetchone()[0] == 0
    assert con.execute("SELECT count(*) FROM nodes").fetchone()[0] == 0
    con.close()
    done = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(mlp_zoo), str(cat), "5"], capture_output=True,
                          text=True, timeout=300)
    assert "DONE" in done.stdout, done.stderr
    assert not list((cat / "parts").glob("_tmp-*"))
    con = duck.connect(cat)
    n_files = len(list(mlp_zoo.glob("*.safetensors")))
    assert con.execute("SELECT count(DISTINCT model_id) FROM models").fetchone()[0] == n_files
    assert len(Catalog(cat).files("models")) == -(-n_files // 5)


def test_ingest_exported_archives(tmp_path):
    zoo = tmp_path / "inr"
    make_zoo("inr", zoo, n=2, seed=0, fmt="pt2", progress=False)
    report = ingest_zoo(zoo, tmp_path / "cat", progress=False)
    assert report.ok and report.added == 2
    con = duck.connect(tmp_path / "cat")
    assert con.execute("SELECT count(*) FROM models WHERE label IS NOT NULL AND psnr > 0").fetchone()[0] == 2


def test_shards_split_a_zoo_without_collisions(tmp_path, mlp_zoo):
    cat = tmp_path / "cat"
    reports = [ingest_zoo(mlp_zoo, cat, shard=(i, 3), progress=False) for i in range(3)]
    assert sum(r.added for r in reports) == len(list(mlp_zoo.glob("*.safetensors")))
    names = [p.parent.name for p in Catalog(cat).files("models")]
    assert len(names) == len(set(names)) == 3 and all(f"s{i}of3" in n for i, n in enumerate(sorted(
        names, key=lambda n: n.split("-s")[1])))


def test_two_writers_of_one_model_do_not_double_its_graph(tmp_path, mlp_zoo):
    """Two machines ingest copies of one checkpoint (other names, so other shards) at the same
    moment: both commit the model. The views read it from one part only."""
    from pipeline.graph_codec import read_graphs

    src = sorted(mlp_zoo.glob("*.safetensors"))[0]
    for zoo, name in (("z1", "a"), ("z2", "b")):
        (tmp_path / zoo).mkdir()
        shutil.copy(src, tmp_path / zoo / f"{name}.safetensors")
        shutil.copy(src.with_suffix(".json"), tmp_path / zoo / f"{name}.json")
    first = ingest_zoo(tmp_path / "z1", tmp_path / "cat", progress=False)
    other = ingest_zoo(tmp_path / "z2", tmp_path / "other", progress=False)   # a writer that never saw "cat"
    assert first.added == other.added == 1
    part = Catalog(tmp_path / "other").files("models")[0].parent
    shutil.move(str(part), str(tmp_path / "cat" / "parts" / part.name))     # both parts now committed in "cat"
    assert len(Catalog(tmp_path / "cat").files("nodes")) == 2
    con = duck.connect(tmp_path / "cat")
    (model_id, checkpoint, n_nodes, n_edges), = con.execute(
        "SELECT model_id, checkpoint, num_nodes, num_edges FROM models").fetchall()
    assert checkpoint == "a.safetensors"                                     # the first committed copy
    assert con.execute("SELECT count(*) FROM nodes").fetchone()[0] == n_nodes
    assert con.execute("SELECT count(*) FROM edges").fetchone()[0] == n_edges
    assert con.execute("SELECT count(*) FROM layers").fetchone()[0] == con.execute(
        "SELECT num_ops FROM architectures").fetchone()[0]
    arrays, = read_graphs(con, [model_id])
    assert len(arrays.node_type) == n_nodes and len(arrays.src) == n_edges
    con.close()
