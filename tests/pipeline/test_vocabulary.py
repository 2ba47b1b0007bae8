"""The activation records are true: the tracer and the spec planner read each module as its name,
its function is its module's, and the symmetries it claims hold."""
import pytest
import torch
from torch import nn

from pipeline.neural_graph.convert import convert_module
from pipeline.neural_graph.spec_plan import plan_from_spec
from pipeline.neural_graph.vocabulary import ACTIVATIONS, SCALE, SIGN, VOCABULARY, spec_activations
from pipeline.spec import build_module


def _module(act) -> nn.Module:
    return nn.GELU(approximate="tanh") if act.name == "gelu_tanh" else act.module()


@pytest.mark.parametrize("act", VOCABULARY, ids=ACTIVATIONS)
def test_function_module_and_symmetries_agree(act):
    x = torch.randn(2000, dtype=torch.float64) * 3
    assert torch.allclose(_module(act)(x), act.fn(x))
    s = torch.rand(2000, dtype=torch.float64) * 4 + 0.1
    assert torch.allclose(act.fn(s * x), s * act.fn(x)) == (SCALE in act.symmetries)
    assert torch.allclose(act.fn(-x), -act.fn(x)) == (SIGN in act.symmetries)


@pytest.mark.parametrize("act", VOCABULARY, ids=ACTIVATIONS)
def test_the_tracer_reads_each_activation_by_its_name(act):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), _module(act), nn.Linear(4, 2)).eval()
    graph = convert_module(model, torch.randn(1, 3)).graph
    assert graph.layer_activation[1] == act.name


@pytest.mark.parametrize("name", sorted(spec_activations()))
def test_specs_build_and_plan_each_activation_they_name(name):
    spec = {"format": "zoograph.spec/1", "input_shape": [3], "layers": [
        {"type": "linear", "out_features": 4}, {"type": "activation", "fn": name}, {"type": "linear", "out_features": 2}]}
    net = build_module(spec)
    assert isinstance(net.layers[1], spec_activations()[name])
    from_spec = plan_from_spec(net, spec)
    assert from_spec is not None and from_spec.layers[1].activation == name
