"""One registry for everything that maps a model to a prediction: every entry trains as a run's
answer, saves without pickle, and `jobs predict` rebuilds it."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from graphstore import duck
from graphstore.catalog import Catalog
from jobs.predictors import PREDICTORS, baseline_names, entry, names, predictor_class, fitted_predictor


def test_every_entry_names_a_class_of_its_family():
    from jobs.metanets.ngnn import NGGNN
    from jobs.predictors.nfn import NFN
    from jobs.predictors.tabular import TabularPredictor

    from jobs.predictors.probegen import ProbeGen

    base = {"metanetwork": NGGNN, "tabular": TabularPredictor, "weightspace": NFN, "function": ProbeGen}
    for name, e in PREDICTORS.items():
        cls = predictor_class(name)
        assert issubclass(cls, base[e.family]), name
        if e.family != "metanetwork":
            assert cls.name == name
    assert set(names("metanetwork")) | set(names("tabular")) | set(names("weightspace")) | set(names("function")) \
        == set(PREDICTORS)
    with pytest.raises(ValueError, match="unknown predictor 'ridge'"):
        entry("ridge")
    with pytest.raises(ValueError, match="'ngnn' is a metanetwork, not a predictor fitted on a split"):
        fitted_predictor("ngnn")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n != "statnn" else n
                                  for n in names("tabular")])      # MLP grids take 8-13 s each
def test_a_tabular_predictor_saved_and_loaded_predicts_the_same(catalog_dir, name):
    """Saved as JSON plus its training rows (safetensors), loaded by refitting: the same answers."""
    from safetensors.numpy import load, save

    from jobs.training.data import select_models

    con = duck.connect(catalog_dir)
    try:
        # the cnn zoo holds many shapes, the mlp zoo one per data set: the flat MLP reads its commonest
        sel = select_models(con, "test_accuracy", "zoo = 'mlp'" if name == "flat_mlp" else "zoo = 'cnn'",
                            catalog=catalog_dir)
        p = fitted_predictor(name, seed=3)
        fitted = p.fit(con, sel)
        if not fitted.applicable.any():
            pytest.skip(f"{name}: {fitted.note}")
        state, arrays = p.save()
        again = predictor_class(name).load(json.loads(json.dumps(state)), load(save(arrays)))
        pred, ok = again.predict(con, sel.model_ids)
        np.testing.assert_array_equal(ok, fitted.applicable)
        np.testing.assert_allclose(pred[ok], fitted.predictions[ok], rtol=1e-9)
        train = sel.targets[sel.mask("train")]
        assert train.min() - 1e-9 <= pred[ok].min() and pred[ok].max() <= train.max() + 1e-9
    finally:
        con.close()


@pytest.mark.slow
def test_statnn_trains_as_a_run_and_predicts_like_a_metanetwork(catalog_copy):
    """`--model statnn` is a run like `--model ngnn`: its answer is StatNN's, the other baselines
    sit beside it, and `jobs predict` refits it from the run folder."""
    from jobs.cli import main

    res = CliRunner().invoke(main, ["train-heterognn", "--catalog", str(catalog_copy), "--model", "statnn",
                                    "--where", "zoo = 'cnn'"])
    assert res.exit_code == 0, res.output
    con = duck.connect(catalog_copy)
    run_id, method = con.execute("SELECT run_id, method FROM runs").fetchone()
    assert method == "statnn"
    assert {m for (m,) in con.execute("SELECT DISTINCT method FROM predictions").fetchall()} == set(baseline_names())
    mine = dict(con.execute("SELECT model_id, predicted FROM predictions WHERE method = 'statnn'").fetchall())
    assert "statnn " in res.output and "ngnn" not in res.output
    assert Catalog(catalog_copy).read_artifact(run_id, "metanet.json") is None
    res = CliRunner().invoke(main, ["predict", "--catalog", str(catalog_copy), "--run", run_id,
                                    "--where", "zoo = 'cnn'"])
    assert res.exit_code == 0, res.output
    con = duck.connect(catalog_copy)
    again = dict(con.execute("SELECT model_id, predicted FROM predictions WHERE run_id LIKE ? AND method = 'statnn'",
                             [run_id + "-predict-%"]).fetchall())
    assert set(again) == set(mine)
    assert all(again[m] == pytest.approx(v, rel=1e-9) for m, v in mine.items())


def test_a_tampered_predictor_file_is_refused_in_one_line(catalog_copy):
    """A run folder is someone else's input: a predictor file that names a metanetwork, or whose
    rows do not fit its columns, stops with one line, never a traceback."""
    from jobs.cli import main

    res = CliRunner().invoke(main, ["train-heterognn", "--catalog", str(catalog_copy), "--model", "statnn",
                                    "--where", "zoo = 'cnn'", "--no-baselines"])
    assert res.exit_code == 0, res.output
    cat = Catalog(catalog_copy)
    con = duck.connect(catalog_copy)
    run_id, = con.execute("SELECT run_id FROM runs").fetchone()
    con.close()
    path = cat.artifacts_dir / run_id / "predictor.json"
    good = json.loads(path.read_text())
    for bad, says in ((dict(good, name="ngnn"), "is a metanetwork, not a predictor fitted on a split"),
                      (dict(good, columns=good["columns"][:-1]), "training rows of shape"),
                      (dict(good, format="zoograph.predictor/99"), "not a zoograph.predictor/1 file")):
        path.write_text(json.dumps(bad))
        res = CliRunner().invoke(main, ["predict", "--catalog", str(catalog_copy), "--run", run_id])
        assert res.exit_code != 0
        assert says in res.output and "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1


def test_hyperparameters_that_do_not_fit_together_stop_in_one_line(catalog_copy):
    from jobs.cli import main

    res = CliRunner().invoke(main, ["train-heterognn", "--catalog", str(catalog_copy), "--model", "ngt",
                                    "--where", "zoo = 'cnn'", "--hidden", "10", "--heads", "4", "--no-baselines"])
    assert res.exit_code == 1
    assert res.output.strip() == "Error: --model ngt: hidden size 10 is not a multiple of 4 heads"


def test_a_collapsed_statistics_learner_is_left_out_of_the_blend():
    """The blend's partner is the mean of StatNN's learners, except one whose validation tau is more
    than COLLAPSED below the best: level learners are both kept, a failed one is dropped."""
    from jobs.predictors.stacking import COLLAPSED, healthy
    from jobs.training.tasks import task_named

    rng = np.random.default_rng(0)
    y = rng.uniform(0.1, 0.9, 80)
    good = y + rng.normal(0, 0.05, 80)
    level = y + rng.normal(0, 0.06, 80)
    task = task_named("regression")
    assert healthy(task, y, {"statnn": good, "statnn_mlp": level}) == ["statnn", "statnn_mlp"]
    noise = rng.uniform(0, 1, 80)
    tau = task.score(task.metrics(y, noise))
    assert tau < task.score(task.metrics(y, good)) - COLLAPSED
    assert healthy(task, y, {"statnn": good, "statnn_mlp": noise}) == ["statnn"]
    assert healthy(task, y, {"statnn_mlp": noise}) == ["statnn_mlp"]          # never empty


def test_the_blend_weight_rules_read_validation_as_documented(monkeypatch):
    """grid: the best weight on validation (1 for a metanetwork that is right where statistics are
    noise, 0 the other way round); bagged: the mean of the best on bootstrap resamples, the same on
    every call, at a clear winner the grid's and between the ends where two partners are level;
    even: 0.5; any other rule is refused by name."""
    import jobs.predictors.stacking as stacking
    from jobs.training.tasks import task_named

    rng = np.random.default_rng(1)
    task = task_named("regression")
    y = rng.uniform(0.1, 0.9, 120)
    right, noise = y + rng.normal(0, 0.02, 120), rng.uniform(0, 1, 120)
    one, other = y + rng.normal(0, 0.1, 120), y + rng.normal(0, 0.1, 120)
    assert stacking.choose_weight(task, y, right, noise) == 1.0
    assert stacking.choose_weight(task, y, noise, right) == 0.0
    monkeypatch.setattr(stacking, "WEIGHT_RULE", "bagged")
    assert stacking.choose_weight(task, y, right, noise) == 1.0
    bagged = stacking.choose_weight(task, y, one, other)
    assert 0.2 < bagged < 0.8 and bagged == stacking.choose_weight(task, y, one, other)
    assert bagged not in stacking.WEIGHTS            # a mean of picks, not a point of the grid
    monkeypatch.setattr(stacking, "WEIGHT_RULE", "even")
    assert stacking.choose_weight(task, y, right, noise) == 0.5
    monkeypatch.setattr(stacking, "WEIGHT_RULE", "best")
    with pytest.raises(ValueError, match="unknown weight rule 'best'"):
        stacking.choose_weight(task, y, right, noise)


def test_the_blend_is_recalibrated_on_validation_without_changing_its_order(monkeypatch):
    """A blend of narrow predictions (shrunk to a third of the targets' spread, shifted) gets the
    least-squares line of its validation models: the test error falls, the test order is the
    blend's, the answers stay inside the training targets' range, and the line is saved and read
    back (a saved line that would reverse the order or clip everything is refused). "none", too few
    validation models and a slope that is not positive give the identity; an unknown calibration is
    refused by name."""
    import jobs.predictors.stacking as stacking
    from jobs.predictors.tabular import Prediction
    from jobs.training.data import Selection
    from jobs.training.tasks import MIN_LINE_MODELS, task_named

    rng = np.random.default_rng(2)
    n = 300
    y = rng.uniform(0.2, 0.8, n)
    splits = np.array(["train"] * 150 + ["val"] * 60 + ["test"] * 90)
    sel = Selection([f"m{i}" for i in range(n)], y, splits, ["mlp"] * n, "regression", "test_accuracy")
    narrow = lambda sd: 0.5 + (y - 0.5) / 3 + 0.05 + rng.normal(0, sd, n)
    metanet = narrow(0.03)
    fitted = {name: (None, Prediction(name, narrow(0.03), np.ones(n, bool))) for name in ("statnn", "statnn_mlp")}
    task = task_named("regression")
    stack = stacking.stack_with_statistics(task, sel, "ngnn", metanet, fitted)
    monkeypatch.setattr(stacking, "CALIBRATION", "none")
    plain = stacking.stack_with_statistics(task, sel, "ngnn", metanet, fitted)
    assert plain.line == stacking.Line() and stack.weight == plain.weight
    test, train = sel.mask("test"), sel.mask("train")
    assert 2.0 < stack.line.slope < 4.0 and stack.line.intercept < 0
    assert f"recalibrated on val ({stack.line.slope:.3g} x - {-stack.line.intercept:.3g})" in stack.note
    mae = lambda p: np.abs(p[test] - y[test]).mean()
    assert mae(stack.predictions) < 0.5 * mae(plain.predictions)
    inside = (stack.predictions > y[train].min()) & (stack.predictions < y[train].max())
    assert np.array_equal(np.argsort(stack.predictions[inside]), np.argsort(plain.predictions[inside]))
    assert stack.predictions.min() >= y[train].min() and stack.predictions.max() <= y[train].max()
    assert stacking.Line.from_dict(json.loads(json.dumps(stack.line.to_dict()))) == stack.line
    assert stacking.Line.from_dict(stacking.Line().to_dict()) == stacking.Line() == stacking.Line.from_dict(None)
    for tampered in ({"slope": -1.0, "intercept": 0.0}, {"slope": "nan", "intercept": 0.0},
                     {"slope": 1.0, "intercept": 0.0, "low": 0.9, "high": 0.1}):
        with pytest.raises(ValueError, match="slope > 0 and low <= high"):       # read_stack: one line naming the run
            stacking.Line.from_dict(tampered)
    monkeypatch.setattr(stacking, "CALIBRATION", "affine")
    few = np.arange(MIN_LINE_MODELS - 1)
    assert stacking.fit_line(y[few], metanet[few], (0.0, 1.0)) == stacking.Line()
    assert stacking.fit_line(y, -y, (0.0, 1.0)) == stacking.Line()          # would reverse the order
    monkeypatch.setattr(stacking, "CALIBRATION", "isotonic")
    with pytest.raises(ValueError, match="unknown calibration 'isotonic'"):
        stacking.fit_line(y, metanet, (0.0, 1.0))


def test_nfn_trains_as_a_run_and_predict_rebuilds_it(catalog_copy):
    """`--model nfn_hnp` is a run like `--model statnn`: NFN on the commonest parameter shape of the
    selection (NaN elsewhere), saved as JSON plus safetensors, and `jobs predict` rebuilds the
    network and gives the same answers."""
    pytest.importorskip("nfn")
    from jobs.cli import main
    from jobs.predictors.baselines import parameter_shapes

    # the CNN zoo's models differ in shape, the MLP zoo's share one: NFN reads the MLPs
    res = CliRunner().invoke(main, ["train-heterognn", "--catalog", str(catalog_copy), "--model", "nfn_hnp",
                                    "--no-baselines"])
    assert res.exit_code == 0, res.output
    assert "nfn_hnp" in res.output and "chosen on val: lr=" in res.output
    con = duck.connect(catalog_copy)
    run_id, method = con.execute("SELECT run_id, method FROM runs").fetchone()
    mine = dict(con.execute("SELECT model_id, predicted FROM predictions WHERE method = 'nfn_hnp'").fetchall())
    ids = sorted(mine)
    shapes = dict(zip(ids, parameter_shapes(con, ids)))
    con.close()
    assert method == "nfn_hnp"
    read = {m for m, v in mine.items() if v is not None and np.isfinite(v)}
    assert read and len({shapes[m] for m in read}) == 1            # one parameter shape read ...
    assert len(set(shapes.values())) > 1 and read != set(mine)     # ... of several, the others left NaN
    assert all(0 < mine[m] < 1 for m in read)                      # a sigmoid: an accuracy
    files = Catalog(catalog_copy).artifacts_dir / run_id
    assert {"predictor.json", "predictor.safetensors"} <= {p.name for p in files.iterdir()}
    res = CliRunner().invoke(main, ["predict", "--catalog", str(catalog_copy), "--run", run_id])
    assert res.exit_code == 0, res.output
    con = duck.connect(catalog_copy)
    zoo = dict(con.execute("SELECT model_id, zoo FROM models").fetchall())
    again = dict(con.execute("SELECT model_id, predicted FROM predictions WHERE run_id LIKE ? AND method = 'nfn_hnp'",
                             [run_id + "-predict-%"]).fetchall())
    con.close()
    assert {zoo[m] for m in read} == {"mlp"}
    assert {m for m, v in again.items() if v is not None and np.isfinite(v)} == read
    assert all(again[m] == pytest.approx(mine[m], rel=1e-5) for m in read)


def test_ensemble_selection_keeps_a_strong_member_whole_and_mixes_level_ones():
    """The "select" rule: a member far ahead on validation is the answer alone (weaker partners are
    not averaged in), level members that err apart are mixed, and a collapsed one is never added."""
    from jobs.predictors.stacking import ensemble_selection
    from jobs.training.tasks import task_named

    rng = np.random.default_rng(2)
    task = task_named("regression")
    y = rng.uniform(0.1, 0.9, 200)
    strong, weak, noise = y + rng.normal(0, 0.02, 200), y + rng.normal(0, 0.3, 200), rng.uniform(0, 1, 200)
    assert ensemble_selection(task, y, {"ngnn": weak, "probegen": strong, "statnn": noise}) == \
        {"ngnn": 0.0, "probegen": 1.0, "statnn": 0.0}
    a, b = y + rng.normal(0, 0.1, 200), y + rng.normal(0, 0.1, 200)
    shares = ensemble_selection(task, y, {"a": a, "b": b, "noise": noise})
    assert shares["noise"] == 0.0 and 0.2 <= shares["a"] <= 0.8 and shares["a"] + shares["b"] == pytest.approx(1.0)
    mixed = shares["a"] * a + shares["b"] * b
    assert task.score(task.metrics(y, mixed)) > max(task.score(task.metrics(y, p)) for p in (a, b))


def test_the_answer_weighs_the_metanetwork_and_every_partner_on_validation():
    """stack_with_statistics under the default rule: the shares are saved, the predictions are the
    weighted blend recalibrated by the line, and a partner far ahead on validation carries it."""
    from types import SimpleNamespace

    from jobs.predictors.stacking import stack_with_statistics
    from jobs.predictors.tabular import Prediction
    from jobs.training.tasks import task_named

    rng = np.random.default_rng(3)
    n = 300
    y = rng.uniform(0.1, 0.9, n)
    split = np.array(["train"] * 150 + ["val"] * 75 + ["test"] * 75)
    sel = SimpleNamespace(targets=y, mask=lambda s: split == s)
    preds = {"statnn": y + rng.normal(0, 0.3, n), "statnn_mlp": rng.uniform(0, 1, n),
             "statnn_spectral": y + rng.normal(0, 0.3, n), "probe": y + rng.normal(0, 0.2, n),
             "probegen": y + rng.normal(0, 0.03, n)}
    fitted = {k: (object(), Prediction(k, v, np.ones(n, bool))) for k, v in preds.items()}
    metanet = y + rng.normal(0, 0.25, n)
    stack = stack_with_statistics(task_named("regression"), sel, "ngnn", metanet, fitted)
    assert stack.partners[0] == "probegen" and stack.shares[0] >= 0.7 and "statnn_mlp" not in stack.partners
    weighted = stack.weight * metanet + (1 - stack.weight) * sum(s * preds[p] for s, p in zip(stack.shares, stack.partners))
    np.testing.assert_allclose(stack.predictions, stack.line(weighted))
    test = split == "test"
    task = task_named("regression")
    assert task.score(task.metrics(y[test], stack.predictions[test])) >= task.score(task.metrics(y[test], preds["probegen"][test])) - 0.01


def test_a_grid_fitted_side_by_side_scores_and_chooses_as_one_after_another(monkeypatch):
    """fit_tuned fits a grid's settings in threads: the validation scores, and so the choice, are
    those of fitting them one at a time, and the process's thread limits are left as they were."""
    from threadpoolctl import threadpool_info

    from jobs.predictors import baselines

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(60, 12)), rng.uniform(size=60)
    x[:, 0] += 3 * y                                   # one informative column
    train, val = np.arange(60) < 40, (np.arange(60) >= 40) & (np.arange(60) < 50)
    scores, limits = {}, {}
    grid = baselines.GBT_GRID[::2]
    for workers in (1, 3):
        monkeypatch.setattr(baselines, "GRID_WORKERS", workers)
        scores[workers] = baselines.grid_scores(x, y, train, val, "regression", "gbt", grid, 0)
        est, _, best = baselines.fit_tuned(x, y, train, val, "regression", "gbt", 0, grid)
        assert best == grid[int(np.argmax(scores[workers]))]
        limits[workers] = [(i["filepath"], i["num_threads"]) for i in threadpool_info()]
    assert scores[1] == scores[3] and len(set(scores[1])) > 1
    assert limits[1] == limits[3]
