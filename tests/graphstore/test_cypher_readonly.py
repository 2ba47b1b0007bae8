"""`graphstore cypher` is read-only unless --write (issue #14 item 5), on the real Ladybug store and
the real Neo4j server: every attack from the issue is refused and leaves the graph and the file
system as they were; ordinary reads still work."""
import json

import pytest
from click.testing import CliRunner

from graphstore.cli import main as graphstore_cli
from graphstore.metadata import open_store
from graphstore.metadata.read_only import CypherRefused, check_read_only
from graphstore.sync import sync_store
from zoocore.errors import StoreError

COUNT = "MATCH (m:Model) RETURN count(m) AS n"


def attacks(tmp_path):
    out = tmp_path / "stolen.csv"
    return out, {
        "create": "CREATE (:Model {model_id: 'evil'})",
        "merge": "MERGE (z:Zoo {name: 'evil'}) RETURN z",
        "detach_delete": "MATCH (m:Model) DETACH DELETE m",
        "set": "MATCH (m:Model) SET m.test_accuracy = 1.0",
        "remove": "MATCH (m:Model) REMOVE m.test_accuracy",
        "drop": "DROP TABLE Model",
        "load_from": "LOAD FROM '/etc/passwd' (file_format='csv', header=false, delim=':') RETURN *",
        "load_csv": "LOAD CSV FROM 'file:///etc/passwd' AS line RETURN line",
        "copy_to": f"COPY (MATCH (m:Model) RETURN m.model_id) TO '{out}'",
        "two_statements": "MATCH (m:Model) RETURN count(m); MATCH (m) DETACH DELETE m",
        "lower_case_hidden_by_comment": "MATCH (m:Model) /* harmless */ detach\ndelete m",
        "install": "INSTALL httpfs",
        "attach": "ATTACH 'other.lbug' AS other (dbtype lbug)",
        "setting": "CALL threads = 1",
        "procedure": "CALL dbms.security.createUser('x', 'y', false)",
        # a clause glued to a number (issue #53): read as the engine reads it, a number then a word
        "glued_load": "WITH 1 AS x LIMIT 1LOAD FROM '/etc/passwd' (header=false, delim=':', file_format='csv') "
                      "RETURN *",
        "glued_create": "MATCH (m:Model) RETURN m LIMIT 1CREATE (:Zoo {name: 'evil'})",
        "glued_after_exponent": "WITH 1 AS x LIMIT 1e0LOAD FROM '/etc/passwd' (header=false) RETURN *",
    }


def _run(*args):
    return CliRunner().invoke(graphstore_cli, ["cypher", *args])


def _count(args):
    res = _run(COUNT, "--format", "json", *args)
    assert res.exit_code == 0, res.output
    return json.loads(res.output)[0]["n"]


def _check_all_refused(tmp_path, args):
    before = _count(args)
    assert before > 0
    out, queries = attacks(tmp_path)
    for name, q in queries.items():
        res = _run(q, *args)
        assert res.exit_code == 1, (name, res.output)
        assert "read-only" in res.output and "--write" in res.output, (name, res.output)
        assert "Traceback" not in res.output and "root:" not in res.output, name
    assert not out.exists()
    assert _count(args) == before
    # ordinary reads, keywords inside strings, comments and names included, still run
    res = _run("MATCH (m:Model) WHERE m.model_id <> 'create; delete' // set remove\n"
               "RETURN count(m) AS `delete`", "--format", "json", *args)
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)[0]["delete"] == before
    assert _run("--named", "models_per_architecture", *args).exit_code == 0


def test_cypher_is_read_only_on_ladybug(catalog_copy, tmp_path):
    with open_store(catalog_copy, use_env=False) as s:
        sync_store(catalog_copy, s)
    args = ["--catalog", str(catalog_copy)]
    _check_all_refused(tmp_path, args)
    # the database itself refuses writes too, should the clause check ever miss one
    with open_store(catalog_copy, use_env=False, read_only=True) as s:
        with pytest.raises(StoreError, match="read-only"):
            s._run("CREATE (:Zoo {name: 'evil'})", {})
    # an administrator can write
    res = _run("MERGE (z:Zoo {name: 'admin'}) RETURN z.name AS name", "--write", *args)
    assert res.exit_code == 0 and "admin" in res.output, res.output
    res = _run("LOAD FROM '/etc/passwd' (file_format='csv', header=false, delim=':') RETURN * LIMIT 1",
               "--write", *args)
    assert res.exit_code == 0 and "root" in res.output     # what the default refuses is real


def test_a_cypher_query_is_held_to_its_memory_limit_and_sees_no_files(catalog_copy):
    """The embedded store's worker: an expression that would take gigabytes ends in one line at
    --memory-limit, and even a statement that reached the engine would find no file outside it."""
    import resource
    import subprocess
    import sys

    from graphstore.metadata.ladybug_store import LadybugStore

    with open_store(catalog_copy, use_env=False) as s:
        sync_store(catalog_copy, s)
    args = ["--catalog", str(catalog_copy), "--memory-limit", "512MB"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    res = subprocess.run([sys.executable, "-m", "graphstore.cli", "cypher",
                          "UNWIND range(1, 1000000000) AS i RETURN collect(i)[0]", *args],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "more memory than its limit of 512MB" in res.stderr
    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss < max(before, 2_000_000)    # KB: under 2 GB
    store = LadybugStore(catalog_copy / "graph.lbug", read_only=True)
    store.isolated = True
    with pytest.raises(StoreError, match="No file found"):      # past the gate (store.run calls it), in the worker
        store._run("LOAD FROM '/etc/passwd' (file_format='csv', header=false, delim=':') RETURN *", {})
    assert store._run(COUNT, {}).rows[0][0] > 0
    store.close()


def test_cypher_on_a_catalog_without_a_graph_store_says_so(tmp_path):
    res = _run(COUNT, "--catalog", str(tmp_path / "no-such-catalog"))
    assert res.exit_code == 1 and "no catalog at" in res.output and "pipeline ingest" in res.output
    assert not (tmp_path / "no-such-catalog").exists()


def test_cypher_is_read_only_on_neo4j(catalog_copy, neo4j_settings, tmp_path):
    with open_store(catalog_copy, neo4j_settings) as s:
        s.clear()
        sync_store(catalog_copy, s)
    args = ["--neo4j-uri", neo4j_settings.uri, "--catalog", str(catalog_copy)]
    _check_all_refused(tmp_path, args)
    # the server refuses writes in the read access mode too, should the clause check ever miss one
    with open_store(catalog_copy, neo4j_settings, read_only=True) as s:
        with pytest.raises(StoreError, match="AccessMode"):
            s._run("CREATE (:Zoo {name: 'evil'})", {})
        assert s.run(COUNT).rows[0][0] > 0
        # a result too large to hold is refused as it streams in, not after
        from graphstore.metadata import neo4j_store

        cap, neo4j_store.MAX_ROWS = neo4j_store.MAX_ROWS, 1000
        try:
            with pytest.raises(StoreError, match="more than 1000 rows; add LIMIT"):
                s.run("UNWIND range(1, 100000000) AS i RETURN i")
        finally:
            neo4j_store.MAX_ROWS = cap
        with pytest.raises(StoreError):              # the server reads no file of its own
            s._run("LOAD CSV FROM 'file:///etc/passwd' AS line RETURN line", {})


@pytest.mark.parametrize("query", [
    "MATCH (m:Model) RETURN m",
    "MATCH (m:Model) RETURN m;",
    "MATCH (m:Model {optimizer: 'set'}) RETURN m.create AS c",
    "MATCH (m:Model) WHERE m.model_id = $delete RETURN m",
    "MATCH (m:Created) RETURN {set: 1, drop: 2}",
    "CALL db.labels() YIELD label RETURN label",
    "CALL table_info('Model') RETURN *",
    "MATCH (m:Model) CALL { WITH m RETURN m.zoo AS z } RETURN z",
    "RETURN 'a;b' AS s, \"it's\" AS t // ; trailing comment",
])
def test_reads_pass_the_clause_check(query):
    check_read_only(query)


@pytest.mark.parametrize("query", [
    "match (n) detach delete n",
    "MATCH (n) WITH n SET n:Evil",
    "MATCH (n) FOREACH (x IN [1] | CREATE (:X))",
    "RETURN 1; RETURN 2",
    "RETURN '1'; // x\n MATCH (n) DELETE n",
    "USE system SHOW USERS",
    "CALL apoc.load.json('file:///etc/passwd')",
    "CALL db.createLabel('X')",
    "LOAD FROM \"/etc/passwd\" RETURN *",
    "/* */ COPY Model FROM '/tmp/x.csv'",
    "EXPORT DATABASE '/tmp/out'",
    "WITH 1 AS x LIMIT 1LOAD FROM '/etc/passwd' RETURN *",
    "RETURN 1 LIMIT 0x1CREATE (:X)",
    "RETURN 1 LIMIT 1_COPY Model FROM 'x'",
    "RETURN 1 LIMIT １LOAD FROM 'x' RETURN *",
])
def test_writes_and_files_fail_the_clause_check(query):
    with pytest.raises(CypherRefused):
        check_read_only(query)
