"""The Cypher suite on both real backends (Ladybug embedded, Neo4j over Bolt), sync, errors."""
import json
import shutil

import pytest
from click.testing import CliRunner

from graphstore import duck
from graphstore.cli import main as graphstore_cli
from graphstore.metadata import open_store
from graphstore.metadata.queries import SUITE
from graphstore.neo4j_server import free_port
from graphstore.sync import sync_store
from pipeline.cli import main as pipeline_cli
from zoocore.config import Neo4jSettings
from zoocore.errors import StoreError


def _suite(store, model_id):
    out = {}
    for name, q in SUITE.items():
        res = store.run(q, {"model_id": model_id})
        out[name] = [[round(v, 9) if isinstance(v, float) else v for v in row] for row in res.rows]
    return out


def _expected(catalog):
    """The suite's answers computed independently in SQL over Parquet."""
    con = duck.connect(catalog)
    conv_heavy = con.execute(
        "SELECT m.architecture_id, count(*) FROM layers l JOIN (SELECT architecture_id, min(model_id) AS model_id "
        "FROM models GROUP BY 1) m USING (model_id) WHERE l.kind = 'conv' GROUP BY 1 HAVING count(*) > 2 "
        "ORDER BY 1").fetchall()
    per_arch = con.execute("SELECT architecture_id, count(*) AS n, avg(test_accuracy) FROM models GROUP BY 1 "
                           "ORDER BY n DESC, architecture_id").fetchall()
    adam_bn = con.execute("SELECT DISTINCT m.model_id FROM models m JOIN layers l USING (model_id) "
                          "WHERE m.optimizer = 'adam' AND l.kind = 'batch_norm' ORDER BY 1").fetchall()
    residual = con.execute("SELECT DISTINCT m.architecture_id FROM models m JOIN layers l USING (model_id) "
                           "WHERE l.kind = 'residual' ORDER BY 1").fetchall()
    return {"conv_heavy_architectures": [list(r) for r in conv_heavy],
            "models_per_architecture": [[a, n, round(acc, 9)] for a, n, acc in per_arch],
            "adam_with_batchnorm": [list(r) for r in adam_bn],
            "residual_architectures": [list(r) for r in residual]}


def test_suite_agrees_with_sql_and_survives_a_lost_database(store_factory, catalog_copy):
    store = store_factory(catalog_copy)
    report = sync_store(catalog_copy, store)
    con = duck.connect(catalog_copy)
    assert report.models == con.execute("SELECT count(*) FROM models").fetchone()[0]
    mid = con.execute("SELECT model_id FROM models WHERE zoo = 'cnn' ORDER BY model_id LIMIT 1").fetchone()[0]
    got = _suite(store, mid)
    for name, rows in _expected(catalog_copy).items():
        assert got[name] == rows, name
    assert len(got["conv_heavy_architectures"]) > 0 and len(got["adam_with_batchnorm"]) > 0
    same_arch = con.execute("SELECT count(*) - 1 FROM models WHERE architecture_id = "
                            "(SELECT architecture_id FROM models WHERE model_id = ?)", [mid]).fetchone()[0]
    assert len(got["same_architecture_neighbours"]) == same_arch
    # lose the database, rebuild from Parquet, same answers
    if store_factory.backend == "ladybug":
        store.close()
        shutil.rmtree(catalog_copy / "graph.lbug", ignore_errors=True)
        (catalog_copy / "graph.lbug").unlink(missing_ok=True)
        store = store_factory(catalog_copy)
    else:
        store.clear()
        assert store.run("MATCH (m:Model) RETURN count(m) AS n").rows == [[0]]
    sync_store(catalog_copy, store)
    assert _suite(store, mid) == got
    store.close()


def test_both_backends_give_identical_answers(catalog_copy, neo4j_settings, tmp_path):
    neo = open_store(catalog_copy, neo4j_settings)
    lb = open_store(tmp_path, use_env=False)
    for s in (neo, lb):
        s.clear()
        sync_store(catalog_copy, s)
        s.write_similar([("a-missing", "b-missing", 0.5)], "r0")   # unknown models: no edge, no error
    con = duck.connect(catalog_copy)
    ids = [r[0] for r in con.execute("SELECT model_id FROM models ORDER BY model_id LIMIT 3").fetchall()]
    for s in (neo, lb):
        s.write_similar([(ids[0], ids[1], 0.9), (ids[0], ids[2], 0.7)], "run-x")
        s.write_predictions("test_accuracy", [(ids[0], 0.25)], "run-x")
    assert _suite(neo, ids[0]) == _suite(lb, ids[0])
    assert [r[0] for r in lb.run(SUITE["similar_neighbours"], {"model_id": ids[0]}).rows] == ids[1:]
    q = "MATCH (m:Model {model_id: $id}) RETURN m.predicted_test_accuracy AS p, m.predicted_test_accuracy_run AS r"
    assert neo.run(q, {"id": ids[0]}).rows == lb.run(q, {"id": ids[0]}).rows == [[0.25, "run-x"]]
    neo.close()
    lb.close()


def test_ingest_writes_the_graph_as_it_goes(tmp_path, store_factory, mlp_zoo):
    from pipeline.ingest import ingest_zoo

    store = store_factory(tmp_path / "cat")
    report = ingest_zoo(mlp_zoo, tmp_path / "cat", store=store, part_models=10, progress=False)
    assert report.store_warning is None and report.parts == -(-report.added // 10)
    n = store.run("MATCH (:Zoo {name: 'mlp'})-[:CONTAINS]->(m:Model)-[:TRAINED_ON]->(d:Dataset) "
                  "RETURN count(DISTINCT m) AS n, count(DISTINCT d) AS d").rows
    assert n == [[report.added, 4]]
    again = ingest_zoo(mlp_zoo, tmp_path / "cat", store=store, progress=False)   # idempotent
    assert again.added == 0
    # the MLPs differ only in activation (relu / tanh): two Architecture nodes for the whole zoo
    archs = duck.connect(tmp_path / "cat").execute("SELECT count(DISTINCT architecture_id) FROM models").fetchone()
    assert store.run("MATCH (a:Architecture) RETURN count(a) AS n").rows == [list(archs)] == [[2]]
    store.close()


def test_cypher_cli_formats_and_errors(catalog_copy):
    with open_store(catalog_copy, use_env=False) as s:
        sync_store(catalog_copy, s)
    run = CliRunner().invoke
    ok = run(graphstore_cli, ["cypher", "MATCH (m:Model) WHERE m.test_accuracy > $t RETURN count(m) AS n",
                              "--param", "t=0.5", "--format", "json", "--catalog", str(catalog_copy)])
    assert ok.exit_code == 0, ok.output
    n = json.loads(ok.output)[0]["n"]
    con = duck.connect(catalog_copy)
    assert n == con.execute("SELECT count(*) FROM models WHERE test_accuracy > 0.5").fetchone()[0]
    bad = run(graphstore_cli, ["cypher", "MATC (n) RETURN n", "--catalog", str(catalog_copy)])
    assert bad.exit_code == 1 and "Parser exception" in bad.output and "Traceback" not in bad.output
    unknown = run(graphstore_cli, ["cypher", "MATCH (n:Nope) RETURN n", "--catalog", str(catalog_copy)])
    assert unknown.exit_code == 1 and "Nope" in unknown.output
    named = run(graphstore_cli, ["cypher", "--named", "residual_architectures", "--format", "csv",
                                 "--catalog", str(catalog_copy)])
    assert named.exit_code == 0 and named.output.splitlines()[0] == "architecture"


def test_neo4j_errors_name_the_uri(neo4j_server, tmp_path):
    with pytest.raises(StoreError, match="SyntaxError"):
        with open_store(tmp_path, Neo4jSettings(neo4j_server.uri, None, None)) as s:
            s.run("MATC (n) RETURN n")
    with open_store(tmp_path, Neo4jSettings(neo4j_server.uri, None, None)) as s:
        res = s.run("MATCH (n:NoSuchLabel) RETURN n")
        assert res.rows == [] and any("NoSuchLabel" in n for n in res.notices)


def test_neo4j_down_gives_a_clear_error_and_ingest_still_completes(tmp_path, mlp_zoo):
    uri = f"bolt://127.0.0.1:{free_port()}"   # nothing listens there
    with pytest.raises(StoreError, match="cannot reach Neo4j at " + uri):
        open_store(tmp_path, Neo4jSettings(uri, "neo4j", "secret-pw"))
    result = CliRunner().invoke(pipeline_cli, ["ingest", str(mlp_zoo), "--catalog", str(tmp_path / "cat"),
                                               "--neo4j-uri", uri])
    assert result.exit_code == 1, result.output           # Parquet done, graph behind: said, and not a success
    assert f"cannot reach Neo4j at {uri}" in result.output and "graphstore sync" in result.output
    con = duck.connect(tmp_path / "cat")
    assert con.execute("SELECT count(*) FROM models").fetchone()[0] == len(list(mlp_zoo.glob("*.safetensors")))
