"""--residual: the metanetwork trained on what statistics miss (jobs.predictors.stacking), on a real catalog."""
import json

import numpy as np
import pytest

from graphstore import duck
from graphstore.catalog import Catalog
from jobs.config import TrainConfig
from jobs.predictors.stacking import read_stack
from jobs.predictors.tabular import StatNN
from jobs.training.data import Selection
from jobs.training.predict import predict
from jobs.training.train import train_heterognn
from zoocore.errors import JobError

FAST = dict(ensemble=1, epochs=3, batch_size=8, hidden=16, edge_hidden=8, layers=2, patience=3)


def _rows(con, run_id: str, method: str) -> dict[str, float]:
    return dict(con.execute("SELECT model_id, predicted FROM predictions WHERE run_id = ? AND method = ?",
                            [run_id, method]).fetchall())


def test_out_of_fold_predictions_never_saw_their_own_targets():
    rng = np.random.default_rng(0)
    n = 200
    x = rng.normal(size=(n, 6))
    y = rng.uniform(size=n)                  # noise: nothing to learn, everything to memorise
    splits = np.array(["train"] * 150 + ["val"] * 30 + ["test"] * 20)
    sel = Selection([f"m{i}" for i in range(n)], y, splits, ["a"] * n, "regression", "acc")
    p = StatNN(0)
    p.grid = [{"learning_rate": 0.1, "max_leaf_nodes": 31, "l2_regularization": 0.0}]   # no search: the fast tier
    ok = np.ones(n, bool)
    fitted = p.fit(None, sel, (x, ok), {})
    oof = p.out_of_fold(x, ok, sel)
    train = sel.mask("train")
    # outside the training split: the fitted learner's answers, unchanged
    np.testing.assert_array_equal(oof[~train], fitted.predictions[~train])
    # inside it: answers of learners that did not see the model, as far off as on unseen models
    in_sample = np.abs(fitted.predictions[train] - y[train]).mean()
    held_out = np.abs(oof[train] - y[train]).mean()
    assert held_out > in_sample + 0.02
    assert held_out == pytest.approx(np.abs(fitted.predictions[~train] - y[~train]).mean(), abs=0.06)


def test_a_residual_run_adds_its_metanetwork_to_statistics_and_predict_rebuilds_it(catalog_copy):
    """With the quasi-equivariant layer too: the metanetwork's row keeps both notes."""
    report = train_heterognn(catalog_copy, TrainConfig(where="zoo = 'mlp'", residual=True, quasi=True, **FAST),
                             progress=False)
    catalog = Catalog(catalog_copy)
    saved = json.loads(catalog.read_artifact(report.run_id, "stack.json"))
    assert saved["residual"] is True and saved["fallback"]
    stack = read_stack(catalog, report.run_id)
    assert stack.residual and stack.fallback.residual
    answer = stack.name
    assert answer in report.metrics and "residual" in report.metrics[answer]["note"]
    assert "quasi-equivariant scaling" in report.metrics["ngnn"]["note"]
    assert "trained on the residual of" in report.metrics["ngnn"]["note"]
    con = duck.connect(catalog_copy)
    rows = {m: _rows(con, report.run_id, m) for m in (answer, "ngnn", *stack.partners)}
    ids = sorted(rows[answer])
    trusted = stack.gate.judge_catalog(con, ids)
    statistics = np.array([np.mean([rows[n][m] for n in stack.partners]) for m in ids])
    residual = np.array([rows["ngnn"][m] for m in ids]) - statistics      # the metanetwork's row: statistics + residual
    blended = np.array([rows[answer][m] for m in ids])
    np.testing.assert_allclose(blended[trusted], stack.line(statistics + stack.weight * residual)[trusted], rtol=1e-5, atol=1e-6)
    # jobs predict rebuilds the answer and the metanetwork's row from the saved run
    predict(catalog_copy, report.run_id, where="zoo = 'mlp'")
    con = duck.connect(catalog_copy)         # a connection reads the catalog as it was when opened
    run_id = con.execute("SELECT run_id FROM runs WHERE starts_with(run_id, ?)", [report.run_id + "-predict-"]).fetchone()[0]
    for method in (answer, "ngnn"):
        again = _rows(con, run_id, method)
        np.testing.assert_allclose([again[m] for m in ids], [rows[method][m] for m in ids], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("change", [dict(stack=False), dict(baselines=False), dict(target="optimizer")])
def test_residual_without_statistics_to_train_against_is_refused(catalog_dir, change):
    with pytest.raises(JobError, match="--residual"):
        train_heterognn(catalog_dir, TrainConfig(where="zoo = 'mlp'", residual=True, **FAST, **change), progress=False)
