"""NG-GNN training end to end on a real catalog, prediction, and the symmetry guarantees."""
import json

import numpy as np
import pytest
import torch

from graphstore import duck
from graphstore.catalog import Catalog
from jobs.training.compare import kendall_tau
from jobs.training.data import hash_split, normalised_graph
from jobs.config import TrainConfig
from jobs.training.artifacts import load_metanetwork
from jobs.training.predict import predict
from jobs.training.train import train_heterognn
from pipeline.ingest import ingest_zoo
from pipeline.graph_codec import read_graphs
from pipeline.neural_graph.symmetry import random_hidden_permutation
from pipeline.zoo.make import make_zoo
from tests.conftest import ingest_with_split_column
from zoocore.errors import JobError
from jobs.predictors import answer_name

FAST = dict(ensemble=1, epochs=3, batch_size=8, hidden=16, edge_hidden=8, layers=2, patience=3)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, catalog_dir):
    import shutil

    root = tmp_path_factory.mktemp("trained") / "catalog"
    shutil.copytree(catalog_dir, root)
    report = train_heterognn(root, TrainConfig(where="zoo = 'cnn'", **FAST), progress=False)
    return root, report


def test_run_reports_and_writes_results(trained):
    root, report = trained
    from jobs.predictors import answer_name, baseline_names

    assert set(report.metrics) == {"ngnn", answer_name("ngnn"), *baseline_names()}
    assert report.metrics["ngnn"]["n"] == report.n_models["test"]
    con = duck.connect(root)
    # the reported scores are the scores of the written predictions against the catalog's targets
    for method in ("ngnn", "statnn"):
        pred, true = zip(*con.execute("SELECT p.predicted, m.test_accuracy FROM predictions p JOIN models m "
                                      "USING (model_id) WHERE p.run_id = ? AND p.method = ? AND p.split = 'test'",
                                      [report.run_id, method]).fetchall())
        assert report.metrics[method]["kendall_tau"] == pytest.approx(kendall_tau(np.array(pred), np.array(true)))
        assert report.metrics[method]["mae"] == pytest.approx(np.abs(np.array(pred) - np.array(true)).mean())
    n = con.execute("SELECT count(*) FROM models WHERE zoo = 'cnn'").fetchone()[0]
    assert con.execute("SELECT count(*) FROM predictions WHERE run_id = ? AND method = 'ngnn'",
                       [report.run_id]).fetchone()[0] == n
    width = load_metanetwork(Catalog(root), report.run_id)[0][0].readout_dim
    assert con.execute("SELECT count(*), min(len(vector)), max(len(vector)) FROM embeddings WHERE run_id = ?",
                       [report.run_id]).fetchone() == (n, width, width)
    metrics = json.loads(con.execute("SELECT metrics_json FROM runs WHERE run_id = ?", [report.run_id]).fetchone()[0])
    assert metrics["ngnn"]["kendall_tau"] == pytest.approx(report.metrics["ngnn"]["kendall_tau"])
    # the split is a function of model_id alone
    for mid, split in con.execute("SELECT model_id, split FROM predictions WHERE run_id = ?", [report.run_id]).fetchall():
        assert split == hash_split(mid)


def test_predict_applies_the_saved_metanetwork_to_new_models(trained, tmp_path):
    root, report = trained
    zoo = tmp_path / "new"
    make_zoo("cnn", zoo, n=4, seed=99, progress=False)
    ingest_zoo(zoo, root, zoo_name="new", progress=False)
    res = predict(root, report.run_id, where="zoo = 'new'")
    assert res.n == 4
    con = duck.connect(root)
    rows = con.execute("SELECT count(DISTINCT model_id), count(predicted) FROM predictions p JOIN runs r "
                       "USING (run_id, method) WHERE split = 'predict' AND run_id LIKE ?",
                       [report.run_id + "-predict-%"]).fetchone()
    assert rows == (4, 4)
    # the run's answer is the blend it saved, rebuilt from the metanetwork and the refitted baseline:
    # statistics of the checkpoints' own weights for a model within the training models' weight
    # scales, of the balanced graphs for any other, each recalibrated by its line
    from jobs.predictors.stacking import Line, read_stack

    saved = json.loads(Catalog(root).read_artifact(report.run_id, "stack.json"))
    weight, partners, fallback = saved["weight"], saved["partners"], saved["fallback"]
    run_id, method = con.execute("SELECT run_id, method FROM runs WHERE run_id LIKE ?",
                                 [report.run_id + "-predict-%"]).fetchone()
    assert method == answer_name("ngnn")
    by = {m: dict(con.execute("SELECT model_id, predicted FROM predictions WHERE run_id = ? AND method = ?",
                              [run_id, m]).fetchall()) for m in (method, "ngnn", *partners)}
    assert len(by[method]) == 4
    stack = read_stack(Catalog(root), report.run_id)
    ids = sorted(by[method])
    trusted = dict(zip(ids, stack.gate.judge_catalog(con, ids)))
    balanced = [dict(zip(ids, p.predict(con, ids)[0])) for p in stack.fallback.predictors]
    line, fallback_line = Line.from_dict(saved["line"]), Line.from_dict(fallback["line"])
    assert line.slope > 0 and line.low <= line.high          # recalibrated on validation, clipped to the targets' range
    for mid, p in by[method].items():
        if trusted[mid]:
            expected = line(weight * by["ngnn"][mid] + (1 - weight) * np.mean([by[name][mid] for name in partners]))
        else:
            expected = fallback_line(fallback["weight"] * by["ngnn"][mid]
                                     + (1 - fallback["weight"]) * np.mean([b[mid] for b in balanced]))
        assert p == pytest.approx(expected)


def test_a_saved_baseline_refits_to_the_same_predictions(trained):
    """The blend's partners are saved as their training rows and hyperparameters, not pickled:
    refitted from them, with the run's saved NG-GNN predictions, they give the blend the run wrote.
    The blend's partners read the checkpoints' own weights (they are the run's ``statnn`` rows);
    its fallback's, for inputs outside the training models' weight scales, the run's balanced
    graphs, as the metanetwork did."""
    from jobs.predictors import PREDICTORS
    from jobs.predictors.stacking import read_stack

    root, report = trained
    stack = read_stack(Catalog(root), report.run_id)
    partners = [n for n, e in PREDICTORS.items() if e.stack]
    assert stack.candidates == partners and stack.partners and set(stack.partners) <= set(partners)
    assert all(not getattr(p, "settings", {}).get("prepare") for p in stack.predictors)
    # the fallback's statistics read the balanced graphs; its probing partners are the run's own (a
    # rescaling that keeps the function does not change what they read)
    for name, p in zip(stack.fallback.partners, stack.fallback.predictors):
        assert p.settings.get("prepare") == ({"balanced": True} if PREDICTORS[name].reads == "weights" else None)
    assert stack.gate.prepare is None
    con = duck.connect(root)
    saved = {m: dict(con.execute("SELECT model_id, predicted FROM predictions WHERE run_id = ? AND method = ?",
                                 [report.run_id, m]).fetchall()) for m in (stack.name, "ngnn", *stack.partners)}
    ids = sorted(saved[stack.name])
    parts, balanced = [], []
    for name, predictor in zip(stack.partners, stack.predictors):
        again, ok = predictor.predict(con, ids)
        assert ok.all(), name
        np.testing.assert_allclose(again, [saved[name][i] for i in ids], rtol=1e-6)    # the plain baseline's rows
        parts.append(again)
    for predictor in stack.fallback.predictors:
        again, ok = predictor.predict(con, ids)
        assert ok.all()
        balanced.append(again)
    trusted = stack.gate.judge_catalog(con, ids)
    assert trusted.mean() > 0.9          # the run's own models lie within their weight scales
    blend = stack.apply(np.array([saved["ngnn"][i] for i in ids]), parts, trusted, balanced)
    np.testing.assert_allclose(blend, [saved[stack.name][i] for i in ids], rtol=1e-5)


def test_bench_blend_statistics_gives_a_default_run_back_its_own_answer(trained):
    """benchmarks/bench_blend_statistics.py re-blends a saved run's plain statistics rows through the
    gate, as today's default does: on a default run's own rows it rebuilds that run's answer, and its
    balanced answer is the saved fallback's, which the run gave the models the gate did not trust."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_blend_statistics

    root, report = trained
    con = duck.connect(root)
    (run_id, config, method), = bench_blend_statistics.saved_runs(con)
    assert run_id == report.run_id
    scores = bench_blend_statistics.rescore(con, run_id, config, method, Catalog(root))
    con.close()
    assert scores["gated"] == pytest.approx(report.metrics[method]["kendall_tau"], abs=1e-9)
    assert scores[method] == pytest.approx(report.metrics[method]["kendall_tau"], abs=1e-9)
    assert scores["statnn"] == pytest.approx(report.metrics["statnn"]["kendall_tau"], abs=1e-9)
    assert 0 <= scores["untrusted"] < 0.5
    y, gated, balanced = scores["test"]
    con = duck.connect(root)
    answer = np.array([p for _, p in con.execute(
        "SELECT model_id, predicted FROM predictions WHERE run_id = ? AND method = ? AND split = 'test' "
        "ORDER BY model_id", [run_id, method]).fetchall()])
    con.close()
    np.testing.assert_allclose(gated, answer, rtol=1e-6)
    from jobs.predictors import PREDICTORS
    from jobs.predictors.stacking import read_stack

    stack = read_stack(Catalog(root), run_id)
    # statistics of the plain weights in the answer moved the trusted models' answers
    plain = [s for n, s in zip(stack.partners, stack.shares) if PREDICTORS[n].reads == "weights" and s > 0]
    if plain and stack.weight < 1:
        assert not np.allclose(gated, balanced), stack.note


def test_bench_blend_rules_rebuilds_a_saved_answer_with_the_runs_settings(trained):
    """benchmarks/bench_blend_rules.py re-blends a saved run under several settings of the blend: with
    the ones the run used it gives back the run's own answer for every model, and the module's
    settings are restored; the plain mean of the partners where selection weighed them apart, an even
    weight where the run chose another, or no recalibration where the run drew a line, gives a
    different answer."""
    import sys
    from pathlib import Path

    import jobs.predictors.stacking as stacking

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_blend_rules
    import bench_blend_statistics

    root, report = trained
    before = (stacking.COLLAPSED, stacking.WEIGHT_RULE, stacking.CALIBRATION)
    con = duck.connect(root)
    (run_id, config, method), = bench_blend_statistics.saved_runs(con)
    variants = [bench_blend_rules.variant(v) for v in (f"COLLAPSED={stacking.COLLAPSED}", "WEIGHT_RULE=grid",
                                                       "WEIGHT_RULE=even", "WEIGHT_RULE=bagged", "CALIBRATION=none")]
    scores = bench_blend_rules.rebuild(con, Catalog(root), run_id, config, method, variants)
    con.close()
    today, mean_rule, even, bagged, uncalibrated = (scores["rebuilt"][v] for v in variants)
    np.testing.assert_allclose(today, scores["saved"], rtol=1e-9)
    assert (stacking.COLLAPSED, stacking.WEIGHT_RULE, stacking.CALIBRATION) == before   # the module's settings are restored
    saved = stacking.read_stack(Catalog(root), run_id)
    if max(saved.shares) - min(saved.shares) > 1e-9:        # unequal shares: the plain mean is another answer
        assert not np.allclose(mean_rule, scores["saved"])
    if saved.weight != 0.5:
        assert not np.allclose(even, scores["saved"])
    if saved.line != stacking.Line():
        assert not np.allclose(uncalibrated, scores["saved"])
    assert np.isfinite(bagged).all()
    with pytest.raises(ValueError, match="WEIGHT_RULE is one of select, grid, bagged, even"):
        bench_blend_rules.variant("WEIGHT_RULE=best")
    with pytest.raises(ValueError, match="CALIBRATION is one of affine, none"):
        bench_blend_rules.variant("CALIBRATION=isotonic")
    with pytest.raises(ValueError, match="KEY=VALUE with KEY one of: CALIBRATION, COLLAPSED, WEIGHT_RULE"):
        bench_blend_rules.variant("THRESHOLD=0.1")


def test_classification_of_the_training_dataset(catalog_copy):
    from graphstore.metadata import open_store
    from graphstore.sync import sync_store

    with open_store(catalog_copy, use_env=False) as store:
        sync_store(catalog_copy, store)
        report = train_heterognn(catalog_copy, TrainConfig(target="dataset", where="zoo = 'mlp'", **FAST),
                                 store=store, progress=False)
        q = "MATCH (m:Model) WHERE m.predicted_dataset IS NOT NULL RETURN m.model_id, m.predicted_dataset"
        in_store = dict(store.run(q).rows)
        store.clear()
        sync_store(catalog_copy, store)                     # rebuilt from Parquet: the labels come back
        assert dict(store.run(q).rows) == in_store
    assert report.task == "classification"
    assert "macro_f1" in report.metrics["statnn"]
    con = duck.connect(catalog_copy)
    hits = con.execute("SELECT p.predicted_label = m.dataset FROM predictions p JOIN models m USING (model_id) "
                       "WHERE p.run_id = ? AND p.method = 'ngnn' AND p.split = 'test'", [report.run_id]).fetchall()
    assert len(hits) == report.n_models["test"]
    assert report.metrics["ngnn"]["accuracy"] == pytest.approx(np.mean([h[0] for h in hits]))
    con = duck.connect(catalog_copy)
    labels = {r[0] for r in con.execute("SELECT DISTINCT predicted_label FROM predictions WHERE run_id = ? "
                                        "AND method = 'ngnn'",
                                        [report.run_id]).fetchall()}
    assert labels <= {"iris", "wine", "breast_cancer", "digits"}
    expected = dict(con.execute("SELECT model_id, predicted_label FROM predictions WHERE run_id = ? "
                                "AND method = 'ngnn'", [report.run_id]).fetchall())
    assert in_store == expected and len(in_store) == report.n_models["train"] + report.n_models["val"] + \
        report.n_models["test"]


def test_bad_requests_are_clear(catalog_dir):
    with pytest.raises(JobError, match="no column 'nope'"):
        train_heterognn(catalog_dir, TrainConfig(target="nope"), progress=False)
    with pytest.raises(JobError, match="no models match"):
        train_heterognn(catalog_dir, TrainConfig(where="zoo = 'absent'"), progress=False)
    if not torch.cuda.is_available():
        with pytest.raises(JobError, match="no CUDA device"):
            train_heterognn(catalog_dir, TrainConfig(device="cuda"), progress=False)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_predictions_are_invariant_and_node_embeddings_equivariant(trained, seed):
    root, report = trained
    models, meta = load_metanetwork(Catalog(root), report.run_id)
    model = models[0]
    stats = meta.stats
    frame, etypes = meta.frame, model.cfg.etypes
    con = duck.connect(root)
    mid = sorted(r[0] for r in con.execute("SELECT model_id FROM models WHERE zoo = 'cnn'").fetchall())[seed * 5]
    (graph,) = read_graphs(con, [mid])
    perm = random_hidden_permutation(graph, np.random.default_rng(seed))
    assert (perm != np.arange(len(perm))).any()
    g0 = normalised_graph(graph, stats, frame, etypes)
    g1 = normalised_graph(graph.permuted(perm), stats, frame, etypes)
    # the head's statistics (the default) are read from each graph: permuting neurons leaves them alone
    s0, s1 = (torch.as_tensor(meta.head.of_graphs(con, [mid], [g])) for g in (graph, graph.permuted(perm)))
    con.close()
    assert s0.shape == (1, model.cfg.statistics_dim) and model.cfg.statistics_dim > 0
    assert float((s1 - s0).abs().max()) < 1e-5
    with torch.no_grad():
        out0, z0 = model(g0, s0)
        out1, z1 = model(g1, s1)
        h0, h1 = model.node_embeddings(g0)["hidden"], model.node_embeddings(g1)["hidden"]
    rel = lambda a, b: float((a - b).abs().max() / (b.abs().max() + 1e-12))  # noqa: E731
    # the prediction users read (the decoded accuracy) and the graph embedding change by < 1e-5 relative;
    # the raw head output is one number that may sit near 0, where float32 rounding alone (~1e-8 in
    # absolute terms) is a large relative change, so it is held to an absolute bound far below any signal
    task = meta.task_kind
    pred0, pred1 = (torch.as_tensor(task.decode(o.numpy().astype(np.float64), meta.scale)) for o in (out0, out1))
    assert rel(pred1, pred0) < 1e-5 and rel(z1, z0) < 1e-5
    assert float((out1 - out0).abs().max()) < 1e-6
    n_in = int((graph.node_type == 0).sum())
    hidden = np.nonzero(graph.node_type == 1)[0]
    moved = torch.as_tensor(perm[hidden] - n_in)
    assert rel(h1[moved], h0[torch.as_tensor(hidden - n_in)]) < 1e-5
    assert rel(h1, h0) > 1e-3     # the embeddings really moved with the neurons


@pytest.mark.parametrize("calibration", ["linear", "monotone"])
def test_the_saved_calibration_is_the_validation_fit_and_reaches_predict(tmp_path, cnn_zoo, calibration):
    """The run's predictions are a * p + b of the raw outputs, fitted by least squares on the
    validation split (kept as they are when the slope is not positive), and with the monotone
    calibration that line's values through the saved isotonic knots, blended with the identity: the
    same order, a validation squared error no larger than uncalibrated (than the line, for the
    monotone map), and `jobs predict` decodes them the same way."""
    # enough validation models to fit on (at least 10)
    ingest_with_split_column(cnn_zoo, tmp_path, ["train", "val", "train", "val", "test"])
    report = train_heterognn(tmp_path / "cat", TrainConfig(split_column="fold", baselines=False,
                                                           calibration=calibration, **FAST), progress=False)
    models, meta = load_metanetwork(Catalog(tmp_path / "cat"), report.run_id)
    con = duck.connect(tmp_path / "cat")
    got = con.execute("SELECT p.model_id, p.split, p.predicted, m.test_accuracy FROM predictions p JOIN models m "
                      "USING (model_id) WHERE p.run_id = ?", [report.run_id]).fetchall()
    split = np.array([r[1] for r in got])
    cal, y = np.array([r[2] for r in got]), np.array([r[3] for r in got])
    ys = y[split == "train"]
    mean, std = float(np.mean(ys)), float(np.std(ys))
    on_line = cal
    if meta.scale.knots_x:          # undo the (strictly increasing) monotone map to find the line's values
        grid = np.linspace(min(cal.min(), meta.scale.knots_x[0]) - 1, max(cal.max(), meta.scale.knots_x[-1]) + 1,
                           400001)
        on_grid = 0.9 * np.interp(grid, meta.scale.knots_x, meta.scale.knots_y) + 0.1 * grid
        on_line = np.interp(cal, on_grid, grid)
    raw = (on_line - meta.scale.mean) / meta.scale.std * std + mean    # the same outputs, the training scale
    val = split == "val"
    assert val.sum() >= 10
    a, b = np.polyfit(raw[val], y[val], 1)
    if a > 0:
        assert on_line == pytest.approx(a * raw + b, abs=1e-5)      # the line is the validation least squares
        assert np.mean((on_line[val] - y[val]) ** 2) <= np.mean((raw[val] - y[val]) ** 2) + 1e-10
    if a > 0 and calibration == "monotone":
        from sklearn.isotonic import IsotonicRegression

        iso = IsotonicRegression(out_of_bounds="clip").fit(on_line[val], y[val])
        assert meta.scale.knots_y == pytest.approx(iso.y_thresholds_, abs=1e-5)
        assert np.mean((cal[val] - y[val]) ** 2) <= np.mean((on_line[val] - y[val]) ** 2) + 1e-10
    elif a > 0:
        assert not meta.scale.knots_x
    else:
        assert (meta.scale.mean, meta.scale.std) == pytest.approx((mean, std))
    assert kendall_tau(y, cal) == pytest.approx(kendall_tau(y, raw))
    predict(tmp_path / "cat", report.run_id, where="true")
    con = duck.connect(tmp_path / "cat")          # a new connection sees the new run
    again = dict(con.execute("SELECT model_id, predicted FROM predictions WHERE starts_with(run_id, ?) AND method = 'ngnn'",
                             [report.run_id + "-predict-"]).fetchall())
    assert len(again) == len(got) and all(abs(again[m] - v) < 1e-5 for m, _, v, _ in got)


def test_an_ensemble_averages_its_members(catalog_copy):
    report = train_heterognn(catalog_copy, TrainConfig(where="zoo = 'cnn'", **{**FAST, "ensemble": 2}, baselines=False), progress=False)
    models, meta = load_metanetwork(Catalog(catalog_copy), report.run_id)
    assert len(models) == meta.members == 2
    assert {h["member"] for h in report.history} == {0, 1}
    con = duck.connect(catalog_copy)
    width = con.execute("SELECT max(len(vector)) FROM embeddings WHERE run_id = ?", [report.run_id]).fetchone()[0]
    assert width == 2 * models[0].readout_dim
    res = predict(catalog_copy, report.run_id, where="zoo = 'cnn'")
    mine = dict(con.execute("SELECT model_id, predicted FROM predictions WHERE run_id = ? AND method = 'ngnn'",
                            [report.run_id]).fetchall())
    con = duck.connect(catalog_copy)
    again = dict(con.execute("SELECT model_id, predicted FROM predictions WHERE starts_with(run_id, ?) AND method = 'ngnn'",
                             [report.run_id + "-predict-"]).fetchall())
    assert res.n == len(mine) and all(abs(again[m] - v) < 1e-5 for m, v in mine.items())
