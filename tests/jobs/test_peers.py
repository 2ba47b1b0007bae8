"""Peer methods' inputs (jobs.predictors.peers) on a real fixed-architecture zoo: NFN's weight-space layout,
the flat-weights vector, WeightWatcher's metrics, and the symmetries each should (or should not) have."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from graphstore import duck
from pipeline.graph_codec import read_graphs
from jobs.analysis.catalog_models import catalog_state_dicts, plan_of
from jobs.predictors import nfn, peers
from jobs.predictors.baselines import flat_weights
from pipeline.ingest import ingest_zoo
from pipeline.neural_graph.build import state_dict_from_graph
from pipeline.neural_graph.symmetry import random_hidden_permutation
from pipeline.zoo.make import make_zoo

N = 6


@pytest.fixture(scope="module")
def fixed(tmp_path_factory):
    """A 6-model cnn-fixed zoo ingested into a catalog: (catalog, zoo dir, model ids, spec)."""
    root = tmp_path_factory.mktemp("peers")
    make_zoo("cnn-fixed", root / "zoo", n=N, seed=7, workers=1, progress=False)
    ingest_zoo(root / "zoo", root / "catalog", progress=False)
    con = duck.connect(root / "catalog")
    ids = [r[0] for r in con.execute("SELECT model_id FROM models ORDER BY model_id").fetchall()]
    spec = json.loads(con.execute("SELECT spec_json FROM architectures").fetchone()[0])
    con.close()
    return root / "catalog", root / "zoo", ids, spec


def _states(catalog, ids):
    con = duck.connect(catalog)
    try:
        return [s for _, _, s in catalog_state_dicts(con, ids, chunk=4)]
    finally:
        con.close()


def test_catalog_state_dicts_are_the_checkpoints(fixed):
    catalog, zoo, ids, _ = fixed
    con = duck.connect(catalog)
    files = dict(con.execute("SELECT model_id, checkpoint FROM models").fetchall())
    con.close()
    for mid, state in zip(ids, _states(catalog, ids)):
        ckpt = load_file(str(zoo / files[mid]))
        assert set(state) == set(ckpt)
        assert all(torch.equal(state[k], ckpt[k]) for k in ckpt)


def _layout(catalog, model_id):
    con = duck.connect(catalog)
    try:
        return nfn.nfn_layout(plan_of(con, model_id))
    finally:
        con.close()


def test_nfn_layout_treats_the_pooled_linear_head_as_a_2x2_conv(fixed):
    """Read off the plan (so .pt2 zoos work too): the head after 2x2 pooling is a 2x2 kernel."""
    catalog, _, ids, spec = fixed
    states = _states(catalog, ids)
    weights, biases = nfn.weight_arrays(_layout(catalog, ids[0]), states)
    assert [w.shape for w in weights] == [(N, 1, 8, 1, 3, 3), (N, 1, 8, 8, 3, 3), (N, 1, 8, 8, 3, 3),
                                          (N, 1, 10, 8, 2, 2)]
    assert [b.shape for b in biases] == [(N, 1, 8)] * 3 + [(N, 1, 10)]
    head = [k for k in states[0] if states[0][k].dim() == 2][0]
    # torch flattens (channel, row, col): feature 4c + 2r + s is kernel position (r, s) of channel c
    for i, s in enumerate(states):
        lin = s[head].numpy()
        assert np.array_equal(weights[3][i, 0, :, 2, 1, 0], lin[:, 4 * 2 + 2 * 1 + 0])
        assert np.array_equal(weights[3][i, 0].reshape(10, 32), lin)
    total = sum(w[0].size for w in weights) + sum(b[0].size for b in biases)
    assert total == sum(v.numel() for v in states[0].values())


def test_nfn_refuses_what_it_cannot_read_by_name():
    """Norms, residuals and bias-free layers are not in NFN's weight space: named, before any training."""
    from torch import nn as tnn

    from pipeline.neural_graph.plan import plan_from_module

    x = torch.zeros(1, 1, 8, 8)
    cases = [(tnn.Sequential(tnn.Conv2d(1, 4, 3), tnn.BatchNorm2d(4), tnn.ReLU(), tnn.Flatten(), tnn.Linear(144, 3)),
              "this architecture has a batch_norm operation"),
             (tnn.Sequential(tnn.Conv2d(1, 4, 3, bias=False), tnn.ReLU(), tnn.Flatten(), tnn.Linear(144, 3)),
              r"with biases only; the conv operation \S+ has none")]
    for net, says in cases:
        with pytest.raises(peers.JobError, match=says):
            nfn.nfn_layout(plan_from_module(net.eval(), x))
    # a plain chain reads: a linear layer after a 6x6 map is a 6x6 kernel over 4 channels
    layout = nfn.nfn_layout(plan_from_module(tnn.Sequential(tnn.Conv2d(1, 4, 3), tnn.ReLU(), tnn.Flatten(),
                                                            tnn.Linear(144, 3)).eval(), x))
    assert [la.shape for la in layout] == [(4, 1, 3, 3), (3, 4, 6, 6)]


def test_flat_weights_hold_every_parameter_once(fixed):
    catalog, _, ids, _ = fixed
    con = duck.connect(catalog)
    x = flat_weights(con, ids)
    con.close()
    states = _states(catalog, ids)
    # the catalog's edges hold kernels in the zoo's 3x3 frame: the 2x2 head kernels padded with zeros
    varying = x.std(0) > 0
    assert varying.sum() == sum(v.numel() for v in states[0].values())
    assert (x[:, ~varying] == 0).all()
    for row, s in zip(x, states):
        assert np.array_equal(np.sort(row[varying]), np.sort(np.concatenate([v.numpy().ravel() for v in s.values()])))


def _permuted_states(catalog, ids, seed):
    """The state dicts of ``ids`` after a random function-preserving permutation of hidden neurons."""
    con = duck.connect(catalog)
    graphs = read_graphs(con, ids)
    con.close()
    rng = np.random.default_rng(seed)
    out = []
    for g in graphs:
        perm = random_hidden_permutation(g, rng)
        assert (perm != np.arange(len(perm))).any()
        out.append(state_dict_from_graph(g.permuted(perm)))
    return out


@pytest.mark.parametrize("mode", ["NP", "HNP"])
def test_nfn_predictions_are_invariant_to_hidden_permutations(fixed, mode):
    pytest.importorskip("nfn")
    nfn_common = pytest.importorskip("nfn.common")
    catalog, _, ids, spec = fixed
    layout = _layout(catalog, ids[0])
    weights, biases = nfn.weight_arrays(layout, _states(catalog, ids))
    pweights, pbiases = nfn.weight_arrays(layout, _permuted_states(catalog, ids, seed=1))
    flat = lambda ws: np.concatenate([w.reshape(N, -1) for w in ws], 1)  # noqa: E731
    assert not np.allclose(flat(weights), flat(pweights))            # the permutation moved weights ...
    rows = np.arange(N)
    net_spec = nfn_common.network_spec_from_wsfeat(nfn.wsfeat(weights, biases, rows[:1]))
    assert str(net_spec) == str(nfn.network_spec(layout))
    torch.manual_seed(0)
    model = nfn.nfn_predictor(net_spec, mode, (8, 4), head=32).eval()
    with torch.no_grad():
        a = model(nfn.wsfeat(weights, biases, rows))
        b = model(nfn.wsfeat(pweights, pbiases, rows))
        # ... and a network with other weights is told apart
        c = model(nfn.wsfeat([w * 1.5 for w in weights], biases, rows))
    assert a.shape == (N,) and bool(((a > 0) & (a < 1)).all())
    rel = float((a - b).abs().max() / a.abs().max())
    assert rel < 1e-5
    assert float((a - c).abs().max()) > 1e-4


def test_weightwatcher_metrics_are_per_layer_and_permutation_invariant(fixed):
    pytest.importorskip("weightwatcher")
    catalog, _, ids, spec = fixed
    summary, layers = peers.ww_metrics(spec, _states(catalog, ids[:1])[0])
    assert set(summary) == set(peers.WW_SUMMARY) and len(layers) == 4        # 3 convs and the linear head
    assert all(np.isfinite(layer["log_norm"]) and np.isfinite(layer["alpha"]) for layer in layers)
    psummary, players = peers.ww_metrics(spec, _permuted_states(catalog, ids[:1], seed=2)[0])
    for k in ("log_norm", "log_spectral_norm", "stable_rank"):       # spectra do not see neuron order
        assert psummary[k] == pytest.approx(summary[k], rel=1e-4, abs=1e-6)


def test_zero_training_predictor_takes_its_sign_from_the_training_split():
    from jobs.training.compare import kendall_tau

    rng = np.random.default_rng(0)
    y = rng.uniform(0.1, 0.9, 200)
    metric = -3.0 * y + rng.normal(0, 0.1, 200)
    metric[5] = np.nan
    train = np.arange(200) < 120
    pred, note = peers.zero_training(metric, y, train)
    assert note.startswith("sign -")
    assert np.isfinite(pred).all()
    test = ~train
    assert kendall_tau(y[test], pred[test]) > 0.7
    # the line maps the metric onto the target's scale
    assert abs(pred[train].mean() - y[train].mean()) < 1e-6


def test_models_differing_only_in_activation_share_one_parameter_shape(fixed):
    from jobs.predictors.baselines import parameter_shapes

    catalog, _, ids, _ = fixed
    con = duck.connect(catalog)
    archs = dict(con.execute("SELECT model_id, architecture_id FROM models").fetchall())
    acts = dict(con.execute("SELECT model_id, activation FROM models").fetchall())
    shapes = parameter_shapes(con, ids)
    con.close()
    assert len({acts[m] for m in ids}) == 2 and len({archs[m] for m in ids}) == 2     # relu and tanh models
    assert len(set(shapes)) == 1 and shapes[0].startswith("layers.0.weight=[8, 1, 3, 3];")
