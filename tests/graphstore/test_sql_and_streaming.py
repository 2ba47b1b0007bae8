"""DuckDB views, record-batch streaming, and the read-only SQL surface."""
import json

import pyarrow as pa
import pytest
from click.testing import CliRunner

from graphstore import duck
from graphstore.catalog import Catalog
from graphstore.schema import EDGES, NODES
from graphstore.sql import run_readonly
from pipeline.cli import main as pipeline_cli
from zoocore.errors import QueryRefused


def test_views_of_an_empty_catalog_are_typed(tmp_path):
    con = duck.connect(tmp_path)
    assert con.execute("SELECT count(*) FROM edges").fetchone() == (0,)
    cols = [r[0] for r in con.execute("DESCRIBE nodes").fetchall()]
    assert cols == NODES.names


def test_parquet_files_follow_the_declared_schemas(catalog_dir):
    import pyarrow.parquet as pq

    for f in Catalog(catalog_dir).files("edges"):
        assert pq.read_schema(f).equals(EDGES, check_metadata=False)
    for f in Catalog(catalog_dir).files("nodes"):
        assert pq.read_schema(f).equals(NODES, check_metadata=False)


def test_stream_yields_bounded_record_batches_and_does_not_block(catalog_dir):
    con = duck.connect(catalog_dir)
    total = con.execute("SELECT count(*) FROM edges").fetchone()[0]
    reader = duck.stream(con, "SELECT * FROM edges", batch_size=1000)
    first = next(reader)
    assert isinstance(first, pa.RecordBatch) and 0 < first.num_rows <= 1000
    # the half-read stream lives on its own cursor: the connection still answers
    assert con.execute("SELECT count(*) FROM models").fetchone()[0] > 0
    rest = sum(b.num_rows for b in reader)
    assert first.num_rows + rest == total


@pytest.mark.parametrize("query", [
    "COPY models TO 'x.csv'", "CREATE TABLE t AS SELECT 1", "INSERT INTO models SELECT * FROM models",
    "ATTACH 'x.db'", "INSTALL httpfs", "LOAD httpfs", "SET threads = 1", "DROP VIEW models",
    "SELECT 1; DELETE FROM models"])
def test_writes_are_refused(catalog_dir, query):
    with pytest.raises(QueryRefused, match="read-only"):
        run_readonly(catalog_dir, query)


def test_reading_files_outside_the_catalog_is_refused(catalog_dir):
    with pytest.raises(QueryRefused, match="refused"):
        run_readonly(catalog_dir, "SELECT * FROM read_csv('/etc/passwd')")


def test_sql_cli(catalog_dir, tmp_path):
    run = CliRunner().invoke
    ok = run(pipeline_cli, ["sql", "SELECT zoo, count(*) AS n FROM models GROUP BY zoo ORDER BY zoo", "--format",
                            "json", "--catalog", str(catalog_dir)])
    assert ok.exit_code == 0, ok.output
    assert [r["zoo"] for r in json.loads(ok.output)] == ["cnn", "mlp"]
    same = run(pipeline_cli, ["sql", "SELECT a.zoo, b.zoo FROM models a JOIN models b USING (model_id) LIMIT 1",
                              "--format", "csv", "--catalog", str(catalog_dir)])   # one column name twice
    assert same.exit_code == 0, same.output
    assert same.output.splitlines()[0] == "zoo,zoo" and same.output.splitlines()[1].count(",") == 1
    out = tmp_path / "m.parquet"
    pq_ok = run(pipeline_cli, ["sql", "SELECT model_id FROM models", "--format", "parquet", "--out", str(out),
                               "--catalog", str(catalog_dir)])
    assert pq_ok.exit_code == 0 and out.exists()
    refused = run(pipeline_cli, ["sql", "DELETE FROM models", "--catalog", str(catalog_dir)])
    assert refused.exit_code == 1 and "DELETE statements are refused" in refused.output
    bad = run(pipeline_cli, ["sql", "SELECT nope FROM models", "--catalog", str(catalog_dir)])
    assert bad.exit_code == 1 and "Binder Error" in bad.output and "Traceback" not in bad.output
    missing = run(pipeline_cli, ["sql", "SELECT 1", "--catalog", str(tmp_path / "none")])
    assert missing.exit_code == 1 and "no catalog at" in missing.output
