"""`graphstore sync` writes back each run's own answer without knowing any predictor by name: the
run names its method (``runs.method``), so a predictor added tomorrow syncs like NG-GNN does; runs
saved before the column existed are read by their configuration's ``model``."""
import datetime as dt
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from graphstore import duck
from graphstore.catalog import Catalog
from graphstore.metadata.ladybug_store import LadybugStore
from graphstore.schema import RUNS
from graphstore.sync import sync_store
from jobs.training.data import select_models
from jobs.training.runs import write_run


@pytest.mark.slow
def test_sync_writes_back_the_method_each_run_names(tmp_path):
    from pipeline.ingest import ingest_zoo
    from pipeline.zoo.make import make_zoo

    make_zoo("mlp", tmp_path / "zoo", n=4, seed=2, workers=1, progress=False)
    cat = Catalog(tmp_path / "cat")
    ingest_zoo(tmp_path / "zoo", cat.root, progress=False)
    con = duck.connect(cat)
    sel = select_models(con, "test_accuracy")
    con.close()
    n = len(sel.model_ids)
    ridge, noise = np.linspace(0.1, 0.4, n), np.full(n, 0.99)
    write_run(cat, "run-ridge", {"where": None}, sel, {"statnn": noise, "ridge": ridge}, np.zeros((n, 2)), {}, None,
              method="ridge")
    with LadybugStore(cat.root / "graph.lbug") as store:
        sync_store(cat, store)
        got = dict(store.run("MATCH (m:Model) RETURN m.model_id, m.predicted_test_accuracy").rows)
    assert got == pytest.approx(dict(zip(sel.model_ids, ridge)))

    # a run saved before runs.method: its configuration names the metanetwork
    legacy = {"run_id": ["run-old"], "task": ["regression"], "target": ["test_accuracy"], "where_sql": [None],
              "config_json": [json.dumps({"model": "ngt"})], "metrics_json": ["{}"], "model_path": [None],
              "created_at": [dt.datetime(2100, 1, 1, tzinfo=dt.timezone.utc)]}       # the newest run
    newest = np.linspace(0.5, 0.8, n)
    write_run(cat, "run-tmp", {"where": None}, sel, {"ngt": newest}, np.zeros((n, 2)), {}, None)
    folder = next(p for p in (cat.root / "results").iterdir() if p.name.startswith("run-tmp"))
    preds = pq.read_table(folder / "predictions.parquet")
    preds = preds.set_column(0, "run_id", pa.array(["run-old"] * n))
    pq.write_table(preds, folder / "predictions.parquet")
    pq.write_table(pa.table(legacy, schema=pa.schema([f for f in RUNS if f.name != "method"])),
                   folder / "runs.parquet")
    with LadybugStore(cat.root / "graph.lbug") as store:
        sync_store(cat, store)
        got = dict(store.run("MATCH (m:Model) RETURN m.model_id, m.predicted_test_accuracy").rows)
    assert got == pytest.approx(dict(zip(sel.model_ids, newest)))



def test_a_catalog_whose_runs_predate_a_column_still_has_it_in_its_view(tmp_path):
    """Every column of a relation's schema is in its view, null where the files predate it."""
    old_schema = pa.schema([f for f in RUNS if f.name != "method"])
    cat = Catalog(tmp_path / "cat")
    cat.commit_results("run-old", {"runs": pa.table({f.name: [None] for f in old_schema}, schema=old_schema)
                                   .set_column(0, "run_id", pa.array(["run-old"]))})
    con = duck.connect(cat, ["runs"])
    try:
        assert con.execute("SELECT run_id, method FROM runs").fetchall() == [("run-old", None)]
        assert con.execute("SELECT typeof(method) FROM runs").fetchone()[0] == "VARCHAR"
    finally:
        con.close()
