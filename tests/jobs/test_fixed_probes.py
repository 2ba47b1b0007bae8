"""Fixed probes run every architecture through its own checked program: the answers are the
network's, node values permute with the neurons, the probe predictor reads them, NG-GNN takes
them as node features and `jobs predict` gives the run's predictions back."""
import numpy as np
import pytest
import torch

from graphstore import duck
from jobs.analysis.catalog_models import load_model
from jobs.analysis.probing import InputSpec, Prober, node_prober, output_summaries
from jobs.config import TrainConfig
from jobs.predictors import fitted_predictor
from jobs.predictors.probegen import ProbeGen, ProbeGenModel
from jobs.training.data import select_models
from jobs.training.train import train_heterognn
from pipeline.graph_codec import read_graphs
from pipeline.neural_graph.symmetry import random_hidden_permutation
from zoocore.errors import JobError

from tests.jobs.predict_again import predict_again_gap


def _ids(con, zoo):
    return [m for (m,) in con.execute("SELECT model_id FROM models WHERE zoo = ? ORDER BY model_id", [zoo]).fetchall()]


@pytest.mark.parametrize("zoo", ["cnn", "mlp"])
def test_probe_answers_are_the_networks_own(catalog_dir, zoo):
    con = duck.connect(catalog_dir)
    mid = _ids(con, zoo)[0]
    model = load_model(con, mid)
    prober = Prober(con, n=5)
    probed = prober.run(mid, model.graph, nodes=True)
    net = model.module()
    x = InputSpec(tuple(prober._program(mid, model.state_dict())._zoograph_probe_input.shape), torch.float32).probes(5)
    with torch.no_grad():
        expected = net(x).reshape(5, -1).numpy()
    np.testing.assert_allclose(probed.outputs, expected, rtol=1e-4, atol=1e-5)
    # the output nodes' values are the outputs themselves (one position: mean = max), squashed
    out_nodes = np.flatnonzero(model.graph.node_type == 2)
    order = model.graph.node_position[out_nodes]
    squashed = np.sign(expected) * np.log1p(np.abs(expected))
    np.testing.assert_allclose(probed.nodes[out_nodes][:, 0::2], squashed.T[order], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(probed.nodes[out_nodes][:, 1::2], squashed.T[order], rtol=1e-4, atol=1e-5)
    layers = model.graph.node_layer                       # every layer of these graphs has a tap (a dead ReLU
    assert all(np.abs(probed.nodes[layers == k]).sum() > 0 for k in np.unique(layers))   # neuron may read 0)
    # the same probes for every model of one input shape, and cached answers equal fresh ones
    again, _ = Prober(con, n=5).outputs([mid])
    np.testing.assert_array_equal(again[0], probed.outputs)


def test_node_values_permute_with_the_hidden_neurons(catalog_dir):
    con = duck.connect(catalog_dir)
    mid = _ids(con, "cnn")[1]
    graph, = read_graphs(con, [mid])
    perm = random_hidden_permutation(graph, np.random.default_rng(0))
    probe = node_prober(con, 4)
    a, b = probe(mid, graph), probe(mid, graph.permuted(perm))
    np.testing.assert_allclose(b[perm], a, rtol=1e-4, atol=1e-5)


def test_a_model_over_the_memory_budget_is_refused_by_name(catalog_dir):
    con = duck.connect(catalog_dir)
    mid = _ids(con, "cnn")[0]
    graph, = read_graphs(con, [mid])
    with pytest.raises(JobError, match="over the budget"):
        Prober(con, n=64, memory_budget=1000).run(mid, graph)
    outs, reasons = Prober(con, n=64, memory_budget=1000).outputs([mid])
    assert outs == [None] and "over the budget" in reasons[0]


def test_output_summaries_do_not_depend_on_which_output_is_which():
    o = np.random.default_rng(0).normal(size=(16, 10))
    np.testing.assert_allclose(output_summaries(o[:, ::-1]), output_summaries(o))
    confident = np.zeros((16, 10))
    confident[:, 3] = 50.0
    s = output_summaries(confident)
    assert s[0] < 1e-6 and s[1] > 0.999 and s[3] == 1.0     # no entropy, top probability 1, one modal answer


def test_probe_predictor_reads_every_architecture(catalog_dir):
    """Its features on a catalog of CNNs and MLPs (its save and load: test_predictors, as every tabular one's)."""
    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", None, catalog=catalog_dir)
    p = fitted_predictor("probe")
    p.settings = p.settle(con, sel)
    x, ok = p.features(con, sel.model_ids)
    assert ok.all() and x.shape == (len(sel.model_ids), 8 + 2 * 10 + 16 * 10) and np.isfinite(x[:, :8]).all()


@pytest.mark.parametrize("model", ["ngnn", "ngt"])
def test_a_metanetwork_with_fixed_probes_trains_and_predicts_again(catalog_copy, model):
    cfg = TrainConfig(where="zoo = 'cnn'", model=model, fixed_probes=3, ensemble=1, epochs=2, batch_size=8,
                      hidden=16, edge_hidden=8, layers=2, baselines=False, head_statistics=False)
    report = train_heterognn(catalog_copy, cfg, progress=False)
    assert np.isfinite(report.metrics[model]["kendall_tau"])
    assert predict_again_gap(catalog_copy, report.run_id, "zoo = 'cnn'", method=model) < 1e-4


class _QuickProbeGen(ProbeGen):
    epochs = 2


def test_probegen_learns_probes_through_the_programs_and_survives_save(catalog_dir):
    """Learned probes move with training (the gradient flows through each model's program into the
    generator), every model of the CNN and MLP zoos is read, and a saved predictor predicts the same."""
    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", None, catalog=catalog_dir)
    p = _QuickProbeGen(0)
    fit = p.fit(con, sel)
    torch.manual_seed(0)                                          # the generators as fit drew them
    before = ProbeGenModel(p.settings["signatures"], p.settings["width"]).state_dict()
    assert fit.applicable.all() and np.isfinite(fit.predictions).all()
    assert len(p.settings["signatures"]) == 2                     # 1x8x8 images and 4 features: two generators
    after = p.model.state_dict()
    assert all(not torch.equal(after[k], before[k]) for k in before if k.startswith("generators."))
    assert all(isinstance(m, torch.nn.Linear) for m in p.model.generators["4:float32"].net)   # deep *linear*
    state, arrays = p.save()
    again = ProbeGen.load(state, arrays)
    np.testing.assert_allclose(again.predict(con, sel.model_ids)[0], fit.predictions, rtol=1e-5, atol=1e-6)


def test_data_probes_are_unlabelled_inputs_of_the_models_own_data_set(catalog_dir):
    """With inputs="data" a CNN of the digits zoo answers on digit images (training inputs, drawn
    with the seed), not on noise; a data set this project does not hold, or none recorded, is
    refused by name; the probe_data predictor reads them and is never fitted beside a run."""
    from jobs.predictors import baseline_names
    from pipeline.datasets import evaluation_data

    con = duck.connect(catalog_dir)
    mid = _ids(con, "cnn")[0]
    model = load_model(con, mid)
    spec = InputSpec((1, 8, 8), torch.float32)
    x = spec.data_probes("digits", 6, seed=0)
    train = evaluation_data("digits", [1, 8, 8])[0]
    assert all(any(np.array_equal(row, t) for t in train) for row in x.numpy())   # every probe a training image
    with torch.no_grad():
        expected = model.module()(x).reshape(6, -1).numpy()
    outs, reasons = Prober(con, n=6, inputs="data").outputs([mid])
    np.testing.assert_allclose(outs[0], expected, rtol=1e-4, atol=1e-5)
    noise, _ = Prober(con, n=6).outputs([mid])
    assert not np.allclose(noise[0], outs[0]) and reasons == []
    # the metanetwork's node features (--probe-inputs data): the input node carries each digit's mean intensity
    nodes = node_prober(con, 6, inputs="data")(mid, model.graph)
    inputs = np.flatnonzero(model.graph.node_type == 0)
    mean = x.numpy().reshape(6, -1).mean(1)
    np.testing.assert_allclose(nodes[inputs][0, 0::2], np.sign(mean) * np.log1p(np.abs(mean)), rtol=1e-4, atol=1e-6)
    with pytest.raises(JobError, match="not recorded"):
        spec.data_probes(None, 6)
    with pytest.raises(JobError, match=r"no inputs of data set 'digits' in the shape \[3, 8, 8\]"):
        InputSpec((3, 8, 8), torch.float32).data_probes("digits", 6)
    with pytest.raises(ValueError, match="one of noise, data"):
        Prober(con, n=6, inputs="mnist")
    sel = select_models(con, "test_accuracy", "zoo = 'cnn'", catalog=catalog_dir)
    p = fitted_predictor("probe_data")
    p.settings = p.settle(con, sel)
    xs, ok = p.features(con, sel.model_ids)
    assert p.settings["inputs"] == "data" and ok.all() and np.isfinite(xs[:, :8]).all()
    assert "unlabelled data probes" in p.note()
    assert "probe_data" not in baseline_names() and "probe" in baseline_names()
