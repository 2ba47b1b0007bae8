"""Runaway queries stop: a time limit and a memory limit for SQL, a time limit for Cypher, and a
clean exit 130 on Ctrl-C (real DuckDB, the real Ladybug store, a real Neo4j server, real processes)."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphstore.cli import main as graphstore_cli
from graphstore.sql import memory_limit_setting, physical_memory, run_readonly
from pipeline.cli import main as pipeline_cli
from pipeline.ingest import ingest_zoo
from pipeline.zoo.make import make_zoo
from tests.processes import press_ctrl_c
from zoocore.errors import CatalogError, QueryTimeout

ENDLESS_SQL = "SELECT count(*) FROM range(CAST(1e13 AS BIGINT))"
HUNGRY_SQL = "SELECT max(len(x)) FROM (SELECT list(i) AS x FROM range(200000000) t(i))"   # ~1.6 GB list
SLOW_CYPHER = ("UNWIND range(1, 300000) AS x UNWIND range(1, 300000) AS y WITH x + y AS z WHERE z % 7 = 3 "
               "RETURN count(*)")


@pytest.fixture(scope="module")
def small_catalog(tmp_path_factory):
    base = tmp_path_factory.mktemp("limits")
    make_zoo("mlp", base / "zoo", n=2, seed=3, workers=1, progress=False)
    assert ingest_zoo(base / "zoo", base / "catalog", progress=False).added == 2
    synced = CliRunner().invoke(graphstore_cli, ["sync", "--catalog", str(base / "catalog")], env={"NEO4J_URI": ""})
    assert synced.exit_code == 0, synced.output                        # the embedded store the Cypher tests read
    return base / "catalog"


def test_sql_timeout_stops_an_endless_query(small_catalog):
    started = time.monotonic()
    res = CliRunner().invoke(pipeline_cli, ["sql", ENDLESS_SQL, "--timeout", "1", "--catalog", str(small_catalog)])
    assert res.exit_code == 1, res.output
    assert "stopped after 1 s" in res.output and "--timeout" in res.output and "Traceback" not in res.output
    assert time.monotonic() - started < 15
    with pytest.raises(QueryTimeout):
        run_readonly(small_catalog, ENDLESS_SQL, timeout=0.5)
    ok = run_readonly(small_catalog, "SELECT count(*) AS n FROM models", timeout=30)
    assert ok.column("n").to_pylist() == [2]


def test_sql_memory_limit_refuses_a_hungry_query(small_catalog):
    started = time.monotonic()
    res = CliRunner().invoke(pipeline_cli, ["sql", HUNGRY_SQL, "--memory-limit", "64MB",
                                            "--catalog", str(small_catalog)])
    assert res.exit_code == 1 and "more memory than its limit of 64MB" in res.output, res.output
    assert time.monotonic() - started < 15
    limit = run_readonly(small_catalog, "SELECT current_setting('memory_limit') AS m", memory_limit="64MB")
    assert limit.column("m").to_pylist() == ["61.0 MiB"]                 # DuckDB: 64MB = 61.0 MiB
    default = run_readonly(small_catalog, "SELECT current_setting('memory_limit') AS m").column("m")[0].as_py()
    quarter = physical_memory() / 4 / 2**30
    value, unit = default.split()
    assert unit == "GiB" and abs(float(value) - quarter) < 0.1, default
    refused = CliRunner().invoke(pipeline_cli, ["sql", "SET memory_limit = '1TB'", "--catalog", str(small_catalog)])
    assert refused.exit_code == 1 and "refused" in refused.output
    bad = CliRunner().invoke(pipeline_cli, ["sql", "SELECT 1", "--memory-limit", "lots", "--catalog",
                                            str(small_catalog)])
    assert bad.exit_code == 1 and "invalid memory limit 'lots'" in bad.output
    with pytest.raises(CatalogError, match="more than 100%"):
        memory_limit_setting("150%")


def _interrupt(cmd: list[str], wait: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` and press Ctrl-C once its query runs and ``wait`` seconds have passed."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return press_ctrl_c(cmd, env, wait)[0]


@pytest.mark.slow  # a real process, interrupted after 6 s of running
def test_ctrl_c_stops_a_query_with_one_line_and_exit_130(small_catalog):
    res = _interrupt([sys.executable, "-m", "pipeline.cli", "sql", ENDLESS_SQL, "--timeout", "0",
                      "--catalog", str(small_catalog)], wait=6)
    assert res.returncode == 130, res.stderr
    assert "Traceback" not in res.stderr and "Interrupted" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_cypher_timeout_on_ladybug(small_catalog):
    started = time.monotonic()
    res = CliRunner().invoke(graphstore_cli, ["cypher", SLOW_CYPHER, "--timeout", "1", "--catalog",
                                              str(small_catalog)], env={"NEO4J_URI": ""})
    assert res.exit_code == 1 and "stopped after 1 s" in res.output, res.output
    assert time.monotonic() - started < 20
    ok = CliRunner().invoke(graphstore_cli, ["cypher", "RETURN 1 + 1 AS two", "--format", "csv", "--timeout", "1",
                                             "--catalog", str(small_catalog)], env={"NEO4J_URI": ""})
    assert ok.exit_code == 0 and ok.output.split() == ["two", "2"], ok.output


@pytest.mark.slow  # a real process, interrupted after 6 s of running
def test_cypher_ctrl_c_on_ladybug(small_catalog):
    env_free = [sys.executable, "-m", "graphstore.cli", "cypher", SLOW_CYPHER, "--timeout", "0",
                "--catalog", str(small_catalog)]
    res = _interrupt(env_free, wait=6)
    assert res.returncode == 130 and "Traceback" not in res.stderr, res.stderr


def test_cypher_timeout_on_neo4j(neo4j_settings, small_catalog):
    from graphstore.metadata import open_store

    store = open_store(small_catalog, neo4j_settings)
    try:
        store.query_timeout = 1.0
        started = time.monotonic()
        with pytest.raises(QueryTimeout, match="stopped after 1 s"):
            store.run("UNWIND range(1, 1000000000) AS x WITH x WHERE x % 7 = 3 RETURN count(*)")
        assert time.monotonic() - started < 20
        assert store.run("RETURN 1 AS one").rows == [[1]]
    finally:
        store.close()
