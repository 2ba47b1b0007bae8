"""Probe features run the network on its graph: exact for MLPs, equivariant, trainable."""
import numpy as np
import pytest
import torch

from graphstore import duck
from jobs.training.data import LayerStats, normalised_graph
from jobs.metanets.ngnn import NGGNN, NGGNNConfig
from jobs.metanets.probes import ProbeFeatures
from jobs.config import TrainConfig
from jobs.training.train import train_heterognn
from pipeline.neural_graph.convert import convert_checkpoint
from pipeline.neural_graph.heterograph import canonical_etypes_of, with_reverses
from pipeline.neural_graph.symmetry import random_hidden_permutation
from pipeline.neural_graph.vocabulary import RELATIONS
from pipeline.spec import build_module
from zoocore.errors import JobError

IDENTITY = LayerStats(np.zeros(1), np.ones(1), np.zeros((1, len(RELATIONS))), np.ones((1, len(RELATIONS))))


def _graph(ng, raw=True):
    etypes = with_reverses(canonical_etypes_of(ng.node_type, ng.src, ng.dst, ng.relation))
    return normalised_graph(ng, IDENTITY, (1, 1), etypes, raw=raw), etypes


def test_probe_activations_are_the_networks_own_outputs(mlp_zoo):
    ckpt = sorted(mlp_zoo.glob("*.safetensors"))[0]
    conv = convert_checkpoint(ckpt)
    g, _ = _graph(conv.graph)
    probes = ProbeFeatures(3)
    x = torch.randn(3, 4)
    with torch.no_grad():
        probes.inputs[:4] = x.T                      # probe j feeds input i with x[j, i]
        feats = probes(g)["output"]                  # (10 outputs, 3 probes), squashed
    values = torch.sign(feats) * torch.expm1(feats.abs())
    model = build_module(conv.spec)
    model.load_state_dict(conv.state)
    torch.testing.assert_close(values.T, model(x), rtol=1e-4, atol=1e-5)


def test_probe_features_permute_with_the_neurons(mlp_zoo):
    conv = convert_checkpoint(sorted(mlp_zoo.glob("*.safetensors"))[1])
    perm = random_hidden_permutation(conv.graph, np.random.default_rng(0))
    g0, etypes = _graph(conv.graph)
    g1, _ = _graph(conv.graph.permuted(perm))
    torch.manual_seed(0)
    model = NGGNN(NGGNNConfig(etypes=etypes, edge_in=1, out_dim=1, hidden=16, edge_hidden=8, layers=2, probes=4)).eval()
    with torch.no_grad():
        (o0, z0), (o1, z1) = model(g0), model(g1)
    # relative to the largest value, as the other equivariance tests: summation order moves the last float bits
    rel = lambda a, b: float((a - b).abs().max() / (b.abs().max() + 1e-12))  # noqa: E731
    # the prediction is one small number (~0.007): its relative rounding error reaches ~4e-5 for some
    # initialisations (measured over seeds); the embeddings stay under 1e-5
    assert rel(o1, o0) < 1e-4 and rel(z1, z0) < 1e-5
    perturbed = _graph(conv.graph.permuted(perm))[0]
    perturbed.nodes["hidden"].data["bias"] += 0.5          # a different network is told apart
    with torch.no_grad():
        assert rel(model(perturbed)[1], z0) > 1e-3


def test_training_with_probes_and_refusal_on_cnns(catalog_copy):
    report = train_heterognn(catalog_copy, TrainConfig(target="dataset", where="zoo = 'mlp'", probes=4, ensemble=1, epochs=2,
                                                      batch_size=8, hidden=16, edge_hidden=8, layers=2, baselines=False),
                             progress=False)
    con = duck.connect(catalog_copy)
    hits = [h[0] for h in con.execute("SELECT p.predicted_label = m.dataset FROM predictions p JOIN models m "
                                      "USING (model_id) WHERE p.run_id = ? AND p.method = 'ngnn' AND p.split = 'test'",
                                      [report.run_id]).fetchall()]
    assert len(hits) == report.n_models["test"] and report.metrics["ngnn"]["accuracy"] == pytest.approx(np.mean(hits))
    with pytest.raises(JobError, match="probe features"):
        train_heterognn(catalog_copy, TrainConfig(where="zoo = 'cnn'", probes=4, ensemble=1, epochs=1), progress=False)
