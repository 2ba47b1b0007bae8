"""nn.Upsample: a channel-wise step (no edges), read from the index arithmetic torch.export writes;
the graph stays exact, function-preserving symmetries stay function-preserving, and .pt2 archives
of such networks convert."""
import numpy as np
import pytest
import torch
from torch import nn

from pipeline.neural_graph.build import state_dict_from_graph
from pipeline.neural_graph.convert import convert_checkpoint, convert_module
from pipeline.neural_graph.symmetry import random_hidden_permutation, random_rescaling


class UpNet(nn.Module):
    """A decoder-like CNN: conv, upsample, conv, flatten, linear (a class of its own: torch 2.2.1
    cannot reload its export of an nn.Sequential)."""

    def __init__(self, up: nn.Module):
        super().__init__()
        self.conv1, self.up, self.conv2 = nn.Conv2d(1, 4, 3, padding=1), up, nn.Conv2d(4, 3, 3, padding=1)
        self.head = nn.Linear(3 * 12 * 12, 2)

    def forward(self, x):
        x = self.up(torch.relu(self.conv1(x)))
        return self.head(torch.flatten(torch.relu(self.conv2(x)), 1))


UPSAMPLERS = {"nearest": lambda: nn.Upsample(scale_factor=2, mode="nearest"),
              "bilinear": lambda: nn.Upsample(size=(12, 12), mode="bilinear"),
              "nearest2d": lambda: nn.UpsamplingNearest2d(scale_factor=2),
              "bilinear2d": lambda: nn.UpsamplingBilinear2d(scale_factor=2)}


def _net(kind: str) -> UpNet:
    torch.manual_seed(0)
    return UpNet(UPSAMPLERS[kind]()).eval()


@pytest.mark.parametrize("kind", sorted(UPSAMPLERS))
def test_upsampling_is_a_step_and_the_graph_is_exact(kind):
    net = _net(kind)
    x = torch.randn(5, 1, 6, 6)
    converted = convert_module(net, x[:1])
    steps = [s for s in converted.plan.steps if s["step"] == "upsample"]
    assert steps == [{"step": "upsample", "layer": 1, "out": [12, 12]}]
    assert converted.graph.num_nodes == 1 + 4 + 3 + 2          # channels are the neurons: no new layer
    state = state_dict_from_graph(converted.graph)
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())
    # permuting and rescaling hidden channels keeps the function: the step ties nothing
    rng = np.random.default_rng(1)
    graph = converted.graph.permuted(random_hidden_permutation(converted.graph, rng))
    graph = random_rescaling(graph, rng, 10.0, steps=converted.plan.steps)
    moved = _net(kind)
    moved.load_state_dict(state_dict_from_graph(graph))
    assert not torch.equal(moved.conv1.weight, net.conv1.weight)
    with torch.no_grad():
        torch.testing.assert_close(moved(x), net(x), rtol=1e-4, atol=1e-5)


def test_a_pt2_archive_with_upsampling_converts(tmp_path):
    net = _net("nearest")
    path = tmp_path / "up.pt2"
    torch.export.save(torch.export.export(net, (torch.randn(1, 1, 6, 6),)), str(path))
    converted = convert_checkpoint(path)
    assert [s["out"] for s in converted.plan.steps if s["step"] == "upsample"] == [[12, 12]]
    state = state_dict_from_graph(converted.graph)
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())
