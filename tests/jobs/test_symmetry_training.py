"""Scale symmetries in training: statistics and StatNN features from in-memory graphs, augmentation,
canonicalisation and the rescaled test rows of a run."""
import numpy as np
import pytest

from graphstore import duck
from jobs.predictors.baselines import statnn_features, statnn_features_of_graphs
from jobs.training.data import GraphStream, layer_stats, layer_stats_of_graphs, select_models
from jobs.config import TrainConfig
from jobs.training.preparation import canonical_graph, read_prepared, rescaler
from jobs.training.train import train_heterognn
from jobs.predictors import answer_name
from pipeline.graph_codec import read_graphs

FAST = dict(ensemble=1, epochs=2, batch_size=8, hidden=16, edge_hidden=8, layers=2, patience=2)


def test_statistics_of_graphs_are_the_catalogs(catalog_dir):
    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", "zoo = 'cnn'", catalog=catalog_dir)
    ids = sel.ids("train")
    graphs = read_graphs(con, ids)
    a, b = layer_stats(con, ids), layer_stats_of_graphs(graphs)
    for name in ("bias_mean", "bias_std", "weight_mean", "weight_std"):
        np.testing.assert_allclose(getattr(b, name), getattr(a, name), rtol=1e-4, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(statnn_features_of_graphs(graphs), statnn_features(con, ids), rtol=1e-4, atol=1e-6)


def test_augmented_stream_serves_a_new_rescaling_each_time_and_repeats_with_its_seed(catalog_dir):
    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", "zoo = 'cnn'", catalog=catalog_dir)
    stats = layer_stats(con, sel.ids("train"))
    clean = GraphStream(con, sel, stats)
    aug = [GraphStream(con, sel, stats, augment=rescaler(100.0), seed=3) for _ in range(2)]
    # three models a rescaling changes: ReLU (scaled) or tanh (sign-flipped) hidden neurons; a zoo's
    # first models by id may be all GELU / SiLU / sigmoid, which no rescaling touches
    act = dict(con.execute("SELECT model_id, activation FROM models WHERE zoo = 'cnn'").fetchall())
    idx = [i for i, m in enumerate(sel.model_ids) if act[m] in ("relu", "tanh")][:3]
    assert len(idx) == 3

    def weights(stream):
        _, graphs = next(stream.batches(idx, 3))
        return [np.concatenate([g.edges[et].data["w"].numpy().ravel() for et in g.canonical_etypes]) for g in graphs]

    w0, first, again, other = weights(clean), weights(aug[0]), weights(aug[0]), weights(aug[1])
    for k in range(3):
        assert not np.allclose(first[k], w0[k])                 # rescaled
        assert not np.allclose(again[k], first[k])              # a new draw on the next serving
        np.testing.assert_array_equal(other[k], first[k])       # the same draws from the same seed


def test_canonical_graphs_do_not_see_rescalings(catalog_dir):
    from pipeline.neural_graph.symmetry import random_rescaling
    from pipeline.graph_codec import read_plans

    con = duck.connect(catalog_dir)
    ids = [m for m, in con.execute("SELECT model_id FROM models WHERE zoo = 'cnn' LIMIT 10").fetchall()]
    arch, plans = read_plans(con, ids)
    checked = 0
    for m, canon in zip(ids, read_prepared(con, ids, canonical_graph)):
        g, = read_graphs(con, [m])
        moved = random_rescaling(g, np.random.default_rng(1), 1e3, steps=plans[arch[m]].steps)
        if np.allclose(moved.weight, g.weight):
            continue                     # activations without a scale or sign symmetry (gelu, sigmoid...)
        checked += 1
        again = canonical_graph(moved, plans[arch[m]].steps)
        np.testing.assert_allclose(again.weight, canon.weight, rtol=1e-3, atol=1e-5)
        np.testing.assert_allclose(again.bias, canon.bias, rtol=1e-3, atol=1e-5)
    assert checked >= 2


@pytest.fixture(scope="module")
def canonical_run(tmp_path_factory, catalog_dir):
    import shutil

    root = tmp_path_factory.mktemp("sym") / "catalog"
    shutil.copytree(catalog_dir, root)
    # balanced graphs (which start from the canonical ones) with signed-log values: training, the blend's
    # statistics, the rescaled rows and `jobs predict` must all apply them
    cfg = TrainConfig(where="zoo = 'cnn'", balanced=True, compress=True, scale_augment=10.0, rescale_test=(1000.0,),
                      **FAST)
    return root, train_heterognn(root, cfg, progress=False)


def test_a_run_scores_rescaled_test_models_beside_the_clean_ones(canonical_run):
    _, report = canonical_run
    assert {"ngnn", "statnn", "ngnn@x1000", "statnn@x1000"} <= set(report.metrics)
    assert report.metrics["ngnn@x1000"]["n"] == report.metrics["ngnn"]["n"] == report.n_models["test"]
    # canonicalised inputs: NG-GNN predicts the same for a model and its rescalings
    assert report.metrics["ngnn@x1000"]["r2"] == pytest.approx(report.metrics["ngnn"]["r2"], abs=1e-3)
    assert report.metrics["ngnn@x1000"]["kendall_tau"] == pytest.approx(report.metrics["ngnn"]["kendall_tau"],
                                                                        abs=0.02)
    assert "ngnn@x1000" in report.summary()
    assert answer_name("ngnn") + "@x1000" in report.metrics
    # the plain statistics beside it are not invariant
    assert report.metrics["statnn@x1000"]["r2"] != pytest.approx(report.metrics["statnn"]["r2"], abs=1e-3)


def test_a_rescaled_copy_gets_the_blend_of_balanced_statistics(canonical_run):
    """The answer blends statistics of the checkpoints' own weights where an input's weight scales
    lie within the training models', and statistics of the balanced graphs elsewhere: a copy
    rescaled by up to 1000 is flagged and gets exactly what its balanced graph gets, whatever the
    rescaling, so the answer is as invariant there as the metanetwork."""
    from graphstore.catalog import Catalog
    from jobs.predictors.stacking import read_stack
    from jobs.training.rescaled import rescaled_test_graphs

    root, report = canonical_run
    stack = read_stack(Catalog(root), report.run_id)
    con = duck.connect(root)
    rows = con.execute("SELECT model_id, predicted FROM predictions WHERE run_id = ? AND method = 'ngnn' "
                       "ORDER BY model_id", [report.run_id]).fetchall()
    ids, ngnn = [r[0] for r in rows], np.array([r[1] for r in rows])
    answer = dict(con.execute("SELECT model_id, predicted FROM predictions WHERE run_id = ? AND method = ?",
                              [report.run_id, stack.name]).fetchall())
    # every model of the run (train, val and test): the run's own answer, through the gate
    np.testing.assert_allclose(stack.predict(con, ids, ngnn)[stack.name], [answer[i] for i in ids], rtol=1e-5)
    balanced = stack.fallback.apply(ngnn, [p.predict(con, ids)[0] for p in stack.fallback.predictors])
    copies = [rescaled_test_graphs(con, ids, 1000.0, seed) for seed in (0, 1)]
    flagged = [~stack.gate.judge_graphs(con, ids, c) for c in copies]
    # (activations without a scale symmetry leave some copies as they were: those stay trusted)
    assert all(f.sum() >= 10 for f in flagged)
    # NG-GNN predicts the same for the copies (it reads balanced graphs), so its clean predictions stand in
    on_copies = [stack.predict_graphs(con, ids, c, ngnn) for c in copies]
    for f, p in zip(flagged, on_copies):
        np.testing.assert_allclose(p[f], balanced[f], rtol=1e-3, atol=1e-5)
    both = flagged[0] & flagged[1]
    np.testing.assert_allclose(on_copies[0][both], on_copies[1][both], rtol=1e-3, atol=1e-5)
    # where statistics of the plain weights are in the answer, they moved it off the balanced blend on the
    # clean models (the probing partners read the function, which a balancing does not change)
    from jobs.predictors import PREDICTORS

    plain = [s for n, s in zip(stack.partners, stack.shares) if PREDICTORS[n].reads == "weights" and s > 0]
    if plain and stack.weight < 1:     # the plain statistics in the answer moved it off the balanced blend
        assert not np.allclose([answer[i] for i in ids], balanced, rtol=1e-3), stack.note


def test_compressed_values_are_the_signed_log_of_the_graphs(catalog_dir):
    from jobs.training.preparation import compressed, run_preparation

    con = duck.connect(catalog_dir)
    ids = [m for m, in con.execute("SELECT model_id FROM models WHERE zoo = 'cnn' LIMIT 3").fetchall()]
    for g, c in zip(read_graphs(con, ids), read_prepared(con, ids, run_preparation({"compress": True}))):
        np.testing.assert_allclose(c.weight, np.sign(g.weight) * np.log1p(np.abs(g.weight)), rtol=1e-6)
        np.testing.assert_allclose(c.bias, np.sign(g.bias) * np.log1p(np.abs(g.bias)), rtol=1e-6)
        assert (np.argsort(c.weight, kind="stable") == np.argsort(g.weight, kind="stable")).all()
        assert compressed(g).src is g.src
    con.close()


def test_a_canonical_run_predicts_through_the_canonicalisation(canonical_run):
    from jobs.training.predict import predict

    root, report = canonical_run
    res = predict(root, report.run_id, where="zoo = 'cnn'")
    con = duck.connect(root)
    for method in ("ngnn", answer_name("ngnn")):
        rows = dict(con.execute("SELECT model_id, predicted FROM predictions WHERE run_id = ? AND method = ?",
                                [report.run_id, method]).fetchall())
        again = dict(con.execute("SELECT model_id, predicted FROM predictions WHERE run_id LIKE ? AND method = ?",
                                 [report.run_id + "-predict-%", method]).fetchall())
        assert res.n == len(rows) and set(again) == set(rows)
        assert max(abs(rows[m] - again[m]) for m in rows) < 1e-4, method


def test_rescaling_options_need_a_factor_above_one(catalog_copy):
    from zoocore.errors import JobError

    with pytest.raises(JobError, match="MAX > 1"):
        train_heterognn(catalog_copy, TrainConfig(where="zoo = 'cnn'", scale_augment=0.5, **FAST), progress=False)


def test_the_quasi_layer_keeps_permutation_symmetry_and_stays_near_the_identity(catalog_dir):
    import torch

    from jobs.training.data import normalised_graph
    from jobs.metanets.ngnn import NGGNN, NGGNNConfig, edge_index
    from pipeline.neural_graph.symmetry import random_hidden_permutation

    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", "zoo = 'cnn'", catalog=catalog_dir)
    stats = layer_stats(con, sel.ids("train"))
    torch.manual_seed(0)
    model = NGGNN(NGGNNConfig(etypes=sel.etypes, edge_in=sel.frame[0] * sel.frame[1], out_dim=1, hidden=16,
                              edge_hidden=8, layers=2, quasi=True, quasi_eps=0.2)).eval()
    extra, share = model.parameter_overhead()
    assert extra > 0 and 0 < share < 0.2
    graph, = read_graphs(con, [sel.model_ids[0]])
    perm = random_hidden_permutation(graph, np.random.default_rng(0))
    g0 = normalised_graph(graph, stats, sel.frame, sel.etypes)
    g1 = normalised_graph(graph.permuted(perm), stats, sel.frame, sel.etypes)
    with torch.no_grad():
        alpha = model.quasi.factors(g0, edge_index(g0, sel.etypes))
        (out0, z0), (out1, z1) = model(g0), model(g1)
        h0, h1 = model.node_embeddings(g0)["hidden"], model.node_embeddings(g1)["hidden"]
    assert float(alpha.min()) >= 0.8 - 1e-6 and float(alpha.max()) <= 1.2 + 1e-6 and float(alpha.std()) > 1e-4
    rel = lambda a, b: float((a - b).abs().max() / (b.abs().max() + 1e-12))  # noqa: E731
    assert rel(out1, out0) < 1e-5 and rel(z1, z0) < 1e-5
    n_in = int((graph.node_type == 0).sum())
    hidden = np.nonzero(graph.node_type == 1)[0]
    assert rel(h1[torch.as_tensor(perm[hidden] - n_in)], h0[torch.as_tensor(hidden - n_in)]) < 1e-5


def test_a_quasi_run_reports_its_overhead_and_reloads(catalog_copy):
    from jobs.training.artifacts import load_metanetwork
    from jobs.training.predict import predict
    from graphstore.catalog import Catalog

    report = train_heterognn(catalog_copy, TrainConfig(where="zoo = 'cnn'", quasi=True, baselines=False, **FAST), progress=False)
    assert "quasi-equivariant scaling: +" in report.summary()
    models, meta = load_metanetwork(Catalog(catalog_copy), report.run_id)
    assert models[0].quasi is not None and meta.model.quasi is True
    assert predict(catalog_copy, report.run_id, where="zoo = 'cnn'").n == report.n_models["train"] + \
        report.n_models["val"] + report.n_models["test"]


def test_balanced_graphs_are_computed_once_per_content(catalog_dir, monkeypatch):
    from jobs.training import preparation as prep
    from pipeline.neural_graph.symmetry import random_rescaling
    from pipeline.graph_codec import read_plans

    calls = []
    real = prep.balanced_graph
    monkeypatch.setattr(prep, "balanced_graph", lambda g, steps: calls.append(1) or real(g, steps))
    monkeypatch.setattr(prep, "_MEMO", prep._Memo())
    con = duck.connect(catalog_dir)
    ids = [m for m, in con.execute("SELECT model_id FROM models WHERE zoo = 'cnn' "
                                   "AND activation = 'relu' LIMIT 4").fetchall()]
    prepare = prep.preparation(balanced=True)
    first = read_prepared(con, ids, prepare)
    again = read_prepared(con, ids, prep.preparation(balanced=True))     # a second reader in the same run
    assert len(calls) == len(ids) and all(a is b for a, b in zip(first, again))
    arch, plans = read_plans(con, ids)
    g, = read_graphs(con, ids[:1])
    moved = random_rescaling(g, np.random.default_rng(3), 1e3, steps=plans[arch[ids[0]]].steps)
    out = prepare(moved, plans[arch[ids[0]]].steps)     # other values: computed, and the same orbit's representative
    assert len(calls) == len(ids) + 1
    np.testing.assert_allclose(out.weight, first[0].weight, rtol=1e-3, atol=1e-5)
    small = prep._Memo(budget=1)                         # past its budget it computes and keeps nothing
    small.get("balanced", g, lambda: real(g, plans[arch[ids[0]]].steps))
    assert not small.items and small.used == 0
