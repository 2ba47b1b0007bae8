"""--aux-targets: numeric models columns learnt beside the target (jobs.training.data.auxiliary_targets)."""
import duckdb
import numpy as np
import pytest
from scipy.special import ndtri

from graphstore import duck
from jobs.config import TrainConfig
from jobs.training.data import Selection, auxiliary_targets
from jobs.training.predict import predict
from jobs.training.train import train_heterognn
from zoocore.errors import JobError

FAST = dict(ensemble=1, epochs=3, batch_size=8, hidden=16, edge_hidden=8, layers=2, patience=3, baselines=False)


def _models(rows):
    con = duckdb.connect()
    con.execute("CREATE TABLE models (model_id VARCHAR, test_accuracy DOUBLE, lr DOUBLE, epochs INTEGER, "
                "optimizer VARCHAR)")
    con.executemany("INSERT INTO models VALUES (?, ?, ?, ?, ?)", rows)
    return con


def test_auxiliary_targets_are_training_ranks_mapped_to_a_normal():
    lrs = [1e-4, 1e-1, 1e-3, None, 1e-2, 3e-2]
    rows = [(f"m{i}", 0.5, lr, i, "sgd") for i, lr in enumerate(lrs)]
    con = _models(rows)
    splits = np.array(["train", "train", "train", "train", "val", "test"])
    sel = Selection([r[0] for r in rows], np.full(6, 0.5), splits, ["a"] * 6, "regression", "test_accuracy")
    aux = auxiliary_targets(con, sel, ["lr", "epochs"])
    assert aux.shape == (6, 2)
    # lr: the three known training values by rank (1e-4 < 1e-3 < 1e-1), spread like a normal, not like decades
    np.testing.assert_allclose(aux[[0, 2, 1], 0], ndtri((np.arange(1, 4) - 0.5) / 3))
    assert np.isnan(aux[3, 0])                                    # missing value
    assert np.isnan(aux[4:]).all()                                # validation and test models: never learnt
    np.testing.assert_allclose(aux[:4, 1], ndtri((np.arange(1, 5) - 0.5) / 4))
    assert auxiliary_targets(con, sel, []).shape == (6, 0)


@pytest.mark.parametrize("column, match", [("loss", "no column 'loss'"), ("optimizer", "'optimizer' is VARCHAR"),
                                           ("test_accuracy", "the target itself")])
def test_an_auxiliary_target_that_is_not_a_numeric_column_is_refused_by_name(column, match):
    con = _models([("m0", 0.5, 0.1, 1, "sgd")])
    sel = Selection(["m0"], np.array([0.5]), np.array(["train"]), ["a"], "regression", "test_accuracy")
    with pytest.raises(JobError, match=match):
        auxiliary_targets(con, sel, [column])


def _rows(con, run_id: str) -> dict[str, float]:
    return dict(con.execute("SELECT model_id, predicted FROM predictions WHERE run_id = ? AND method = 'ngnn'",
                            [run_id]).fetchall())


def test_auxiliary_targets_train_the_shared_network_and_predict_rebuilds_the_run(catalog_copy):
    """The auxiliary loss reaches the network: with the same seed, width and batches, weight 0 and
    weight 5 give different predictions; the aux outputs are not predictions: jobs predict rebuilds
    the run's target predictions from the saved (wider) metanetwork."""
    cfg = dict(where="zoo = 'mlp'", aux_targets=("train_accuracy", "lr"), **FAST)
    off = train_heterognn(catalog_copy, TrainConfig(aux_weight=0.0, **cfg), progress=False)
    on = train_heterognn(catalog_copy, TrainConfig(aux_weight=5.0, **cfg), progress=False)
    con = duck.connect(catalog_copy)
    first, second = _rows(con, off.run_id), _rows(con, on.run_id)
    con.close()
    ids = sorted(first)
    assert not np.allclose([first[m] for m in ids], [second[m] for m in ids], atol=1e-6)
    predict(catalog_copy, on.run_id, where="zoo = 'mlp'")
    con = duck.connect(catalog_copy)
    again = con.execute("SELECT run_id FROM runs WHERE starts_with(run_id, ?)", [on.run_id + "-predict-"]).fetchone()[0]
    rebuilt = _rows(con, again)
    con.close()
    np.testing.assert_allclose([rebuilt[m] for m in ids], [second[m] for m in ids], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("change, match", [(dict(target="optimizer"), "numeric target"),
                                           (dict(init_from="run-x"), "--init-from")])
def test_auxiliary_targets_with_a_class_target_or_a_source_run_are_refused(catalog_dir, change, match):
    with pytest.raises(JobError, match=match):
        train_heterognn(catalog_dir, TrainConfig(where="zoo = 'mlp'", aux_targets=("lr",), **FAST, **change),
                        progress=False)
