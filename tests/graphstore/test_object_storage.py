"""A catalog on object storage: ingest, read-only SQL, training and prediction against an S3 server.

The server is moto's S3 implementation on a loopback port (a real HTTP S3 endpoint; no object
store can be downloaded here); the project talks to it with the real s3fs/botocore client, and
DuckDB reads the Parquet through that same file system.
"""
import os
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from graphstore import duck
from graphstore.catalog import Catalog
from jobs.config import TrainConfig
from jobs.training.artifacts import load_metanetwork
from jobs.training.predict import predict
from jobs.training.train import train_heterognn
from pipeline.cli import main as pipeline_cli
from pipeline.ingest import ingest_zoo

ROOT = "s3://zoo-bucket/catalogs/main"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                             "AWS_ENDPOINT_URL", "XDG_CACHE_HOME")}
    os.environ.update(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://{host}:{port}",
                      XDG_CACHE_HOME=str(tmp_path_factory.mktemp("cache")))
    import boto3

    boto3.client("s3").create_bucket(Bucket="zoo-bucket")
    yield
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def s3_catalog(s3, mlp_zoo):
    report = ingest_zoo(mlp_zoo, ROOT, progress=False, part_models=20)
    assert report.ok and report.added == len(list(mlp_zoo.glob("*.safetensors")))
    return report


def test_ingest_publishes_marked_parts_only(s3_catalog, mlp_zoo):
    cat = Catalog(ROOT)
    assert cat.remote and cat.root == ROOT and cat.exists()
    files = cat.files("models")
    assert len(files) == s3_catalog.parts == 3 and all(f.startswith(ROOT + "/parts/") for f in files)
    # a writer that died before its marker: its files are there, the part is not
    with cat.fs.open(f"{ROOT}/parts/crashed/models.parquet", "wb") as fh:
        pq.write_table(pa.table({"model_id": ["ghost"]}), fh)
    cat.fs.invalidate_cache()
    assert cat.files("models") == files
    con = duck.connect(ROOT)
    assert con.execute("SELECT count(*), count(DISTINCT model_id) FROM models").fetchone() == (48, 48)
    assert con.execute("SELECT count(*) FROM models WHERE model_id = 'ghost'").fetchone()[0] == 0
    con.close()
    again = ingest_zoo(mlp_zoo, ROOT, progress=False)
    assert (again.added, again.duplicates) == (0, 48)


def test_sql_cli_reads_object_storage_and_stays_read_only(s3_catalog, catalog_dir):
    run = CliRunner().invoke
    remote = run(pipeline_cli, ["sql", "SELECT dataset, count(*) AS n FROM models GROUP BY ALL ORDER BY dataset",
                                "--format", "csv", "--catalog", ROOT])
    local = run(pipeline_cli, ["sql", "SELECT dataset, count(*) AS n FROM models WHERE zoo = 'mlp' GROUP BY ALL "
                               "ORDER BY dataset", "--format", "csv", "--catalog", str(catalog_dir)])
    assert remote.exit_code == 0, remote.output
    assert remote.output == local.output
    refused = run(pipeline_cli, ["sql", "COPY models TO 'out.parquet'", "--catalog", ROOT])
    assert refused.exit_code == 1 and "refused" in refused.output
    outside = run(pipeline_cli, ["sql", "SELECT * FROM read_parquet('s3://zoo-bucket/elsewhere/x.parquet')",
                                 "--catalog", ROOT])                    # the sandbox is the catalog's prefix
    assert outside.exit_code == 1 and "refused" in outside.output, outside.output


def test_training_and_prediction_against_object_storage(s3_catalog):
    report = train_heterognn(ROOT, TrainConfig(ensemble=1, epochs=2, batch_size=8, hidden=16, edge_hidden=8, layers=2,
                                               baselines=False), progress=False)
    assert str(report.artifact) == f"{ROOT}/artifacts/{report.run_id}"
    models, meta = load_metanetwork(Catalog(ROOT), report.run_id)
    assert meta.target == "test_accuracy" and len(models) == 1
    pred = predict(ROOT, report.run_id, where="dataset = 'iris'")
    con = duck.connect(ROOT)
    n = con.execute("SELECT count(*) FROM predictions WHERE starts_with(run_id, ?) AND split = 'predict'",
                    [report.run_id]).fetchone()[0]
    con.close()
    assert n == pred.n == 12
