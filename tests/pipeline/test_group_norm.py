"""Group norm: converted as a norm layer, inverted bit for bit, and the function kept under the
graph's permutations (free with one group or one channel per group, none across several groups)
and scalings."""
import numpy as np
import torch
from torch import nn

from pipeline.ingest import summarize_plan
from pipeline.neural_graph.build import state_dict_from_graph
from pipeline.neural_graph.convert import convert_module
from pipeline.neural_graph.coverage import check_exact_inverse
from pipeline.neural_graph.symmetry import random_hidden_permutation, random_rescaling, tied_layer_classes
from tests.pipeline.test_concat_gate import randomize


def net():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8), nn.ReLU(), nn.Conv2d(8, 6, 3, padding=1),
                         nn.GroupNorm(6, 6), nn.SiLU(), nn.MaxPool2d(3), nn.Flatten(), nn.Linear(24, 5),
                         nn.GroupNorm(1, 5), nn.Tanh(), nn.Linear(5, 2))


def test_group_norm_converts_inverts_and_keeps_its_function():
    model = randomize(net(), 0)
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    assert model(x).std(0).min() > 0.01                 # the output depends on the input
    conv = convert_module(model, x)
    check_exact_inverse(conv.graph, model.state_dict(), "group norm")
    norms = [op for op in conv.plan.ops if op["kind"] == "group_norm"]
    assert [op.groups for op in norms] == [2, 6, 1] and all(op.relation == "norm" for op in norms)
    assert "group_norm(8 g2) relu" in summarize_plan(conv.plan)
    reps, fixed = tied_layer_classes(conv.graph)
    two_groups, per_channel, one_group = norms
    assert reps[two_groups.dst_layer] in fixed and reps[two_groups.src_layer] in fixed
    assert reps[one_group.dst_layer] == reps[one_group.src_layer] not in fixed
    assert reps[per_channel.dst_layer] == reps[per_channel.src_layer] not in fixed
    moved = False
    for seed in range(4):
        rng = np.random.default_rng(seed)
        perm = random_hidden_permutation(conv.graph, rng)
        moved |= bool((perm != np.arange(len(perm))).any())
        g = random_rescaling(conv.graph.permuted(perm), rng, max_scale=3.0, steps=conv.plan.steps)
        clone = net()
        clone.load_state_dict(state_dict_from_graph(g))
        torch.testing.assert_close(clone.eval()(x), model(x), rtol=1e-4, atol=1e-4)
    assert moved
