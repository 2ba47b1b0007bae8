"""The spectral descriptors of weight matrices (jobs.predictors.spectra): the graph's edges rebuild each
layer's matrix, the descriptors are the singular values' of that matrix, a permutation of hidden
neurons leaves them alone, and they see what statistics of the weight values cannot."""
import numpy as np
import torch
from torch import nn

from jobs.predictors.baselines import statnn_features_of_graphs
from jobs.predictors.spectra import SPECTRAL_NAMES, graph_spectra, spectral_features_of_graphs
from pipeline.neural_graph.convert import convert_module


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 5, 5, padding=2)
        self.fc = nn.Linear(5, 4)

    def forward(self, x):
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc(x.mean(dim=(2, 3)))


def graph_of(model):
    return convert_module(model.eval(), torch.randn(1, 3, 8, 8)).graph


def test_each_layers_descriptors_are_those_of_its_unfolded_weight():
    torch.manual_seed(0)
    model = SmallCNN()
    spectra = graph_spectra(graph_of(model))
    assert len(spectra) == 3
    expected = []
    for layer in (model.conv1, model.conv2, model.fc):
        w = layer.weight.detach().double().reshape(layer.weight.shape[0], -1).numpy()
        s = np.linalg.svd(w, compute_uv=False)
        expected.append([np.log(s[0]), np.log(np.linalg.norm(w)), (s ** 2).sum() / s[0] ** 2 / min(w.shape)])
    got = sorted(v[:3] for v in spectra.values())
    np.testing.assert_allclose(got, sorted(expected), rtol=1e-5)
    # the 3x3 kernel sits zero-padded in the model's 5x5 frame: padding adds no singular value
    assert all(len(v) == len(SPECTRAL_NAMES) and np.all(np.isfinite(v)) for v in spectra.values())


def test_permuting_hidden_neurons_leaves_them_and_shuffling_entries_does_not():
    torch.manual_seed(1)
    model = SmallCNN()
    before = spectral_features_of_graphs([graph_of(model)])
    perm = torch.randperm(6)
    with torch.no_grad():                 # the same function: conv1's channels reordered, conv2 reads them so
        model.conv1.weight.copy_(model.conv1.weight[perm])
        model.conv1.bias.copy_(model.conv1.bias[perm])
        model.conv2.weight.copy_(model.conv2.weight[:, perm])
    permuted = graph_of(model)
    np.testing.assert_allclose(spectral_features_of_graphs([permuted]), before, rtol=1e-5, equal_nan=True)
    stats = statnn_features_of_graphs([permuted])
    with torch.no_grad():                 # the same bag of values in conv2, the structure gone
        flat = model.conv2.weight.flatten()
        model.conv2.weight.copy_(flat[torch.randperm(len(flat))].reshape(model.conv2.weight.shape))
    shuffled = graph_of(model)
    np.testing.assert_allclose(statnn_features_of_graphs([shuffled]), stats, rtol=1e-5, equal_nan=True)
    assert not np.allclose(spectral_features_of_graphs([shuffled]), before, equal_nan=True)


def test_slots_by_index_and_position_and_index_only():
    torch.manual_seed(2)
    x = spectral_features_of_graphs([graph_of(SmallCNN())]).reshape(-1, len(SPECTRAL_NAMES))
    filled = np.isfinite(x).all(1)
    assert filled.sum() == 3 + 3            # three operations, and first / middle / last
    only = spectral_features_of_graphs([graph_of(SmallCNN())], index_only=True).reshape(-1, len(SPECTRAL_NAMES))
    assert np.isfinite(only).all(1).sum() == 3
    assert spectral_features_of_graphs([]).shape == (0, x.size)


def test_a_matrix_above_the_size_limit_is_a_missing_slot(monkeypatch):
    import jobs.predictors.spectra as spectra

    torch.manual_seed(3)
    graph = graph_of(SmallCNN())
    # in the model's 5x5 frame: conv1 is 6 x 3*25, conv2 5 x 6*25, fc 4 x 5*25 (its weight centred)
    monkeypatch.setattr(spectra, "MAX_ENTRIES", 5 * 6 * 25)
    assert len(spectra.graph_spectra(graph)) == 3
    monkeypatch.setattr(spectra, "MAX_ENTRIES", 5 * 6 * 25 - 1)   # conv2's matrix is one entry too many
    assert len(spectra.graph_spectra(graph)) == 2


def test_a_dead_direction_counts_as_rank_lost_not_as_a_nan(recwarn):
    from jobs.predictors.spectra import spectral_descriptors

    rng = np.random.default_rng(0)
    full = rng.normal(size=(6, 8))
    dead = full.copy()
    dead[-1] = 1e-300 * rng.normal(size=8)          # a dead neuron: its row is all but zero
    descriptors = spectral_descriptors(dead)
    assert np.isfinite(descriptors).all() and not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    five = spectral_descriptors(dead[:-1])          # the same matrix without that row: the same spectrum's top
    assert np.isclose(descriptors[0], five[0]) and np.isclose(descriptors[-1], five[-1])
    assert spectral_descriptors(np.zeros((3, 4))) is None
    assert np.isclose(spectral_descriptors(full)[0], np.log(np.linalg.norm(full, 2)))
