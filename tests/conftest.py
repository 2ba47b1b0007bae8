"""Shared fixtures: real zoos made on the spot, a real ingest, both real graph stores.

The Neo4j server is a real Neo4j Community 5.26 built from Maven Central and started on a free
loopback port (graphstore.neo4j_server). Under CI=true a Neo4j test whose server cannot start
fails; elsewhere it is skipped with the reason and how to enable it.
"""
from __future__ import annotations

import os
import shutil

import pytest

os.environ.setdefault("DGLBACKEND", "pytorch")

CNN_ZOO_SIZE = 36
MLP_ZOO_SIZE = 48
IN_CI = os.environ.get("CI", "").lower() == "true"

# The fast tier (`pytest -m "not slow"`, a few minutes) leaves out every test that trains a zoo or
# a metanetwork or starts Neo4j; those carry the ``slow`` marker, given here by what they use. Tests
# that race real processes on a timer (Ctrl-C after seconds, writers paused and killed) mark
# themselves.
SLOW_FIXTURES = {"cnn_zoo", "mlp_zoo", "neo4j_server"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if (SLOW_FIXTURES & set(item.fixturenames) or item.get_closest_marker("neo4j")
                or params.get("store_factory") == "neo4j"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="session")
def _short_probegen():
    """Every run that fits its baselines trains ProbeGen beside it, for its 30 epochs: on the suite's
    30-model splits, 4 take the same path (choice on validation, save, load, the blend) at a
    seventh of the time, as the suite's metanetworks train for 1 or 2 epochs. ProbeGen's own tests
    set their epochs; the notebooks and real processes keep the default."""
    from jobs.predictors.probegen import ProbeGen

    default, ProbeGen.epochs = ProbeGen.epochs, 4
    yield
    ProbeGen.epochs = default


@pytest.fixture(scope="session")
def cnn_zoo(tmp_path_factory):
    from pipeline.zoo.make import make_zoo

    out = tmp_path_factory.mktemp("zoo") / "cnn"
    make_zoo("cnn", out, n=CNN_ZOO_SIZE, seed=3, workers=2, progress=False)
    return out


@pytest.fixture(scope="session")
def mlp_zoo(tmp_path_factory):
    from pipeline.zoo.make import make_zoo

    out = tmp_path_factory.mktemp("zoo") / "mlp"
    make_zoo("mlp", out, n=MLP_ZOO_SIZE, seed=5, workers=2, progress=False)
    return out


@pytest.fixture(scope="session")
def catalog_dir(tmp_path_factory, cnn_zoo, mlp_zoo):
    """A catalog with the CNN and MLP zoos ingested (Parquet only; read-only for tests)."""
    from pipeline.ingest import ingest_zoo

    root = tmp_path_factory.mktemp("catalog") / "catalog"
    for zoo in (cnn_zoo, mlp_zoo):
        report = ingest_zoo(zoo, root, progress=False)
        assert report.ok and report.added == len(list(zoo.glob("*.safetensors")))
    return root


def ingest_with_split_column(zoo, root, folds: list[str], column: str = "fold") -> list[dict]:
    """Copy ``zoo`` to ``root/zoo``, give its metrics.csv a ``column`` cycling through ``folds`` (a
    user's own split), ingest it into ``root/cat`` and return the rows as written."""
    import csv

    from pipeline.ingest import ingest_zoo

    copy = root / "zoo"
    shutil.copytree(zoo, copy)
    with open(copy / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    for i, r in enumerate(rows):
        r[column] = folds[i % len(folds)]
    with open(copy / "metrics.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    assert ingest_zoo(copy, root / "cat", progress=False).ok
    return rows


@pytest.fixture
def catalog_copy(tmp_path, catalog_dir):
    """A private copy of the shared catalog that a test may write to."""
    dst = tmp_path / "catalog"
    shutil.copytree(catalog_dir, dst)
    return dst


@pytest.fixture(scope="session")
def neo4j_server():
    from graphstore.neo4j_server import Neo4jServer
    from zoocore.errors import StoreError

    try:
        server = Neo4jServer().start()
    except (StoreError, OSError) as exc:
        msg = f"cannot start the Neo4j test server: {exc}"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg + " -- install Java 17+ and Maven (the suite assembles Neo4j 5.26 from Maven Central "
                          "into ~/.cache/zoograph) to run the Neo4j tests")
    yield server
    server.stop()


@pytest.fixture
def neo4j_settings(neo4j_server):
    from zoocore.config import Neo4jSettings

    return Neo4jSettings(neo4j_server.uri, None, None)


@pytest.fixture(params=["ladybug", "neo4j"])
def store_factory(request, tmp_path):
    """A function returning a fresh, empty store of each real backend."""
    from graphstore.metadata import open_store

    if request.param == "neo4j":
        settings = request.getfixturevalue("neo4j_settings")

        def make(catalog=tmp_path):
            store = open_store(catalog, settings)
            store.clear()
            return store
    else:
        def make(catalog=tmp_path):
            return open_store(catalog, use_env=False)
    make.backend = request.param
    return make
