"""The SQL and Cypher gates, fuzzed (issue #29): statements built from the grammars' dangerous parts
(COPY, ATTACH, EXPLAIN ANALYZE, CALL, quoting, comments, several statements, unicode) run through
the real surfaces (the DuckDB worker of `pipeline sql`, the read-only Ladybug worker of `graphstore
cypher`) against a real catalog. Whatever the statement, the catalog folder's bytes stay the same
and the caller gets a result or one ZooGraphError, never a crash or another exception."""
from __future__ import annotations

import hashlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphstore.metadata.ladybug_store import LadybugStore
from graphstore.sql import run_readonly
from zoocore.errors import ZooGraphError

SEPARATORS = [" ", "\n", "/**/", " -- x\n", "\t"]


def _digest(folder) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(folder)).encode() + p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def catalog(tmp_path_factory):
    from pipeline.ingest import ingest_zoo
    from pipeline.zoo.make import make_zoo

    base = tmp_path_factory.mktemp("fuzz")
    make_zoo("mlp", base / "zoo", n=3, seed=2, workers=1, progress=False)
    with LadybugStore(base / "cat" / "graph.lbug") as store:
        assert ingest_zoo(base / "zoo", base / "cat", progress=False, store=store).added == 3
    return base / "cat"


def _draw_statement(data, parts: list[str]) -> str:
    """1 to 9 of ``parts`` joined by spaces, newlines, comments or tabs."""
    picked = data.draw(st.lists(st.sampled_from(parts), min_size=1, max_size=9))
    seps = data.draw(st.lists(st.sampled_from(SEPARATORS), min_size=len(picked), max_size=len(picked)))
    out = picked[0]
    for part, sep in zip(picked[1:], seps):
        out += sep + part
    return out


def sql_parts(cat) -> list[str]:
    models = next(cat.glob("parts/*/models.parquet"))
    return [
        "SELECT", "*", "FROM", "models", "WHERE", "1=1", "EXPLAIN", "ANALYZE", "ANALYSE", "COPY", "(SELECT 1)",
        "TO", f"'{models}'", f"'{cat}/graph.lbug'", f"'{cat}/new.csv'", "(FORMAT parquet)", "(FORMAT csv)",
        "ATTACH", f"'{cat}/evil.duckdb'", "AS evil", "DETACH", "INSTALL", "LOAD", "httpfs", "SET", "memory_limit",
        "=", "'1TB'", "enable_external_access", "true", "CALL", "PRAGMA", "CREATE TABLE t AS", "CREATE VIEW models AS",
        "INSERT INTO", "DELETE FROM", "UPDATE models SET test_accuracy = 0", "DROP VIEW models", "EXPORT DATABASE",
        f"'{cat}/dump'", "IMPORT DATABASE", "WITH x AS (SELECT 1)", "query('COPY (SELECT 1) TO ''x.csv''')",
        f"read_parquet('{models}')", "read_csv('/etc/passwd')", "read_text('/etc/hostname')",
        "getenv('HOME')", ";", "--", "/*", "*/", "'", '"', "(", ")", "\u201cmodels\u201d", "\u00e9", "\U0001F600",
        "\uff33\uff25\uff2c\uff25\uff23\uff34", "USE", "CHECKPOINT", "VACUUM", "SUMMARIZE", "DESCRIBE", "SHOW TABLES",
    ]


def cypher_parts(cat) -> list[str]:
    return [
        "MATCH (m:Model)", "RETURN", "count(m)", "m.model_id", "*", "CALL", "`threads`", "threads", "=", "1",
        "`read_csv_serial`", "read_csv", "`read_parquet`", "read_npy", "(", ")", '"/etc/passwd"',
        f"'{cat}/graph.lbug'", "table_info('Model')", "db.labels()", "YIELD", "label", "LOAD FROM", "LOAD CSV FROM",
        "'file:///etc/passwd'", "AS line", "COPY", "Model", "TO", f"'{cat}/stolen.csv'", "FROM", "DETACH DELETE m",
        "DELETE", "CREATE (:Zoo {name: 'x'})", "MERGE", "SET m.test_accuracy = 0", "REMOVE", "DROP TABLE Model",
        "EXPORT DATABASE", f"'{cat}/dump'", "IMPORT DATABASE", "ATTACH", "INSTALL", "httpfs", "USE", "{", "}", "WITH m",
        "UNWIND range(1, 3) AS x", ";", "//", "/*", "*/", "`", "'", '"', "\uff23\uff21\uff2c\uff2c", "\u00e9",
        "\U0001F600", "BEGIN TRANSACTION", "COMMIT", "CHECKPOINT",
    ]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_sql_never_writes_and_never_crashes(catalog, data):
    query = _draw_statement(data, sql_parts(catalog))
    before = _digest(catalog)
    try:
        run_readonly(catalog, query, timeout=20, memory_limit="512MB")
    except ZooGraphError:
        pass
    assert _digest(catalog) == before, query


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_cypher_never_writes_and_never_crashes(catalog, data):
    query = _draw_statement(data, cypher_parts(catalog))
    before = _digest(catalog)
    store = LadybugStore(catalog / "graph.lbug", read_only=True)
    store.isolated, store.query_timeout = True, 20
    try:
        store.run(query)
    except ZooGraphError:
        pass
    finally:
        store.close()
    assert _digest(catalog) == before, query
    assert not (catalog / "stolen.csv").exists() and not (catalog / "dump").exists()


def test_the_fuzzed_surfaces_still_answer_reads(catalog):
    assert run_readonly(catalog, "SELECT count(*) AS n FROM models").to_pylist() == [{"n": 3}]
    with LadybugStore(catalog / "graph.lbug", read_only=True) as store:
        store.isolated = True
        assert store.run("MATCH (m:Model) RETURN count(m)").rows == [[3]]
