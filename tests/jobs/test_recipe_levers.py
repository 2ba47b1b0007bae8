"""Recipe levers of the metanetworks: weight-space augmentation (noise, edge dropout), random
Fourier features of weights and biases, batch norms with their running statistics; each keeps the
symmetry and does what it says."""
import numpy as np
import pytest
import torch

from graphstore import duck
from graphstore.catalog import Catalog
from jobs.training.augment import augmenter, perturb_weights
from jobs.training.data import layer_stats, normalised_graph, select_models
from jobs.metanets import build_metanetwork
from jobs.metanets.ngnn import NGGNNConfig
from jobs.config import TrainConfig
from jobs.training.artifacts import load_metanetwork
from jobs.training.train import train_heterognn
from tests.jobs.predict_again import predict_again_gap
from pipeline.graph_codec import read_graphs
from pipeline.neural_graph.symmetry import random_hidden_permutation
from pipeline.neural_graph.vocabulary import RELATIONS


def _graph_with(con, sel, relation: str):
    """The first selected model whose graph has an edge of ``relation``."""
    code = RELATIONS.index(relation)
    for mid in sel.model_ids:
        graph, = read_graphs(con, [mid])
        if (graph.relation == code).any():
            return graph
    pytest.skip(f"no model with a {relation} edge")


def test_weight_noise_scales_with_each_operations_spread_and_spares_structure(catalog_dir):
    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", "zoo = 'cnn'", catalog=catalog_dir)
    graph = _graph_with(con, sel, "residual")
    out = perturb_weights(graph, np.random.default_rng(0), noise=0.1)
    residual = graph.relation == RELATIONS.index("residual")
    assert np.array_equal(out.weight[residual], graph.weight[residual])      # identities stay identities
    assert np.array_equal(out.weight == 0, graph.weight == 0)                # frame padding stays zero
    for i in np.unique(graph.edge_op[~residual]):
        e = graph.edge_op == i
        live = graph.weight[e] != 0
        sd = graph.weight[e][live].std()
        if sd == 0 or live.sum() < 200:          # too few values for a sample spread to say much
            continue
        ratio = (out.weight[e] - graph.weight[e])[live].std() / sd
        assert 0.07 < ratio < 0.13, (i, ratio)                              # N(0, (0.1 sd)^2), per operation
    assert not np.array_equal(out.bias, graph.bias)
    again = perturb_weights(graph, np.random.default_rng(0), noise=0.1)
    assert np.array_equal(again.weight, out.weight)                         # reproducible from the rng


def test_weight_dropout_zeroes_whole_edges_at_the_given_rate(catalog_dir):
    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", "zoo = 'cnn'", catalog=catalog_dir)
    graph = _graph_with(con, sel, "conv")
    before = (graph.weight != 0).any(1)
    out = perturb_weights(graph, np.random.default_rng(1), dropout=0.2)
    dropped = before & ~(out.weight != 0).any(1)
    kept = before & ~dropped
    assert np.array_equal(out.weight[kept], graph.weight[kept])             # the rest is untouched
    assert 0.15 < dropped.sum() / before.sum() < 0.25
    with pytest.raises(ValueError):
        perturb_weights(graph, np.random.default_rng(1), dropout=1.0)


def test_augmenter_chains_and_is_none_when_off(catalog_dir):
    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", "zoo = 'cnn'", catalog=catalog_dir)
    graph, = read_graphs(con, [sel.model_ids[0]])
    assert augmenter(None) is None
    calls = []
    first = lambda g, steps, rng: calls.append("first") or g  # noqa: E731
    out = augmenter(first, noise=0.05)(graph, [], np.random.default_rng(0))
    assert calls == ["first"] and not np.array_equal(out.weight, graph.weight)


@pytest.mark.parametrize("kind", ["ngnn", "ngt"])
def test_fourier_features_keep_predictions_invariant(catalog_dir, kind):
    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", "zoo = 'cnn'", catalog=catalog_dir)
    stats = layer_stats(con, sel.ids("train"))
    torch.manual_seed(0)
    model = build_metanetwork(NGGNNConfig(etypes=sel.etypes, edge_in=sel.frame[0] * sel.frame[1], out_dim=1,
                                          hidden=16, edge_hidden=8, layers=2, kind=kind, fourier=8)).eval()
    graph, = read_graphs(con, [sel.model_ids[1]])
    perm = random_hidden_permutation(graph, np.random.default_rng(1))
    g0 = normalised_graph(graph, stats, sel.frame, sel.etypes)
    g1 = normalised_graph(graph.permuted(perm), stats, sel.frame, sel.etypes)
    with torch.no_grad():
        out0, out1 = model(g0)[0], model(g1)[0]
        plain = build_metanetwork(NGGNNConfig(etypes=sel.etypes, edge_in=sel.frame[0] * sel.frame[1], out_dim=1,
                                              hidden=16, edge_hidden=8, layers=2, kind=kind, fourier=0)).eval()
        plain.load_state_dict(model.state_dict(), strict=False)
        out_plain = plain(g0)[0]
    assert float((out0 - out1).abs().max()) < 1e-5 * (1 + float(out0.abs().max()))
    assert float((out0 - out_plain).abs().max()) > 1e-4          # the features do reach the output


def test_a_run_with_the_levers_trains_and_reloads_with_them(catalog_copy):
    cfg = TrainConfig(where="zoo = 'cnn'", ensemble=1, epochs=2, batch_size=8, hidden=16, edge_hidden=8, layers=2,
                      patience=2, weight_noise=0.05, weight_dropout=0.05, fourier=4, bn_stats=True, rank_weight=2.0,
                      calibration="monotone", baselines=False)
    report = train_heterognn(catalog_copy, cfg, progress=False)
    models, manifest = load_metanetwork(Catalog(catalog_copy), report.run_id)
    assert models[0].cfg.fourier == 4 and models[0].edge_fourier is not None
    assert manifest.train["weight_noise"] == 0.05 and manifest.train["weight_dropout"] == 0.05
    assert manifest.train["rank_weight"] == 2.0 and manifest.train["calibration"] == "monotone"
    assert manifest.train["bn_stats"] is True
    # predict prepares the graphs the same way
    assert predict_again_gap(catalog_copy, report.run_id, "zoo = 'cnn'") < 1e-5


def test_without_epochs_a_small_zoo_trains_until_min_steps_batches():
    cfg = TrainConfig(batch_size=32, patience=5)                  # the recipe: no --epochs, --min-steps 400
    assert cfg.schedule_for(100) == (100, 50)        # 4 batches an epoch: 100 epochs, patience scaled alike
    assert cfg.schedule_for(250) == (50, 25)         # 8 batches
    assert cfg.schedule_for(850) == (15, 8)          # 27 batches: 270 steps in 10 epochs -> x 1.48
    assert cfg.schedule_for(5000) == (10, 5)         # large zoos keep 10 epochs
    assert TrainConfig(epochs=3, patience=2).schedule_for(100) == (3, 2)      # --epochs is obeyed as given
    assert TrainConfig(min_steps=0).schedule_for(100) == (10, 5)


def test_a_run_without_epochs_takes_the_scaled_schedule(catalog_copy):
    cfg = TrainConfig(where="zoo = 'cnn'", ensemble=1, batch_size=8, hidden=8, edge_hidden=4, layers=1,
                      min_steps=60, patience=100, baselines=False)
    report = train_heterognn(catalog_copy, cfg, progress=False)
    batches = -(-report.n_models["train"] // 8)
    epochs = -(-60 // batches) if batches * 10 < 60 else 10
    assert batches * 10 < 60                         # the fixture's zoo is small enough to be scaled up
    assert report.epochs_run == epochs == len(report.history)   # patience grew with them: no early stop
    assert sum(h["train_graphs"] for h in report.history) == epochs * report.n_models["train"]


def test_with_augmentation_batch_norms_become_affine_maps_after_each_rescaling(catalog_dir):
    from jobs.training.preparation import preparation, training_changes
    from pipeline.graph_codec import read_plans
    from pipeline.neural_graph.norm_stats import effective_batch_norms
    from pipeline.neural_graph.symmetry import random_rescaling

    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", "zoo = 'cnn' AND activation = 'relu'", catalog=catalog_dir)
    norm = RELATIONS.index("norm")
    mid, graph = next((m, g) for m in sel.model_ids for g in read_graphs(con, [m]) if (g.relation == norm).any())
    arch, plans = read_plans(con, [mid])
    steps = plans[arch[mid]].steps
    prepare, augment = training_changes(TrainConfig(scale_augment=10.0, bn_stats=True, balanced=False))
    assert prepare is None                                       # nothing on reading: all per serving
    served = augment(graph, steps, np.random.default_rng(3))
    expected = effective_batch_norms(random_rescaling(graph, np.random.default_rng(3), 10.0, steps=steps))
    np.testing.assert_allclose(served.weight, expected.weight, rtol=1e-6)
    wrong = random_rescaling(effective_batch_norms(graph), np.random.default_rng(3), 10.0, steps=steps)
    assert not np.allclose(wrong.weight, expected.weight, rtol=1e-3)   # the order matters
    assert training_changes(TrainConfig(scale_augment=10.0))[0] is not None     # the default: balanced on reading
    assert training_changes(TrainConfig(bn_stats=True))[1] is None
    assert training_changes(TrainConfig(bn_stats=True))[0] is not None and preparation(False, False) is None
