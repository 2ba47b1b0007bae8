"""Layout operations (permute between channels-first and channels-last) followed through, with
ConvNeXt's block as the example: LayerNorm over channels, linear layers on channels-last maps,
layer scale, stochastic depth (the identity at evaluation). And ViT's tokens: a patch embedding
(a conv with stride equal to its kernel), a class token and a learned positional embedding."""
import numpy as np
import pytest
import torch
from torch import nn
from torchvision.models.convnext import CNBlock, LayerNorm2d
from torchvision.models.vision_transformer import VisionTransformer

from pipeline.neural_graph.build import state_dict_from_graph
from pipeline.neural_graph.convert import convert_module
from pipeline.neural_graph.coverage import check_exact_inverse
from pipeline.neural_graph.symmetry import random_hidden_permutation, random_rescaling
from pipeline.neural_graph.vocabulary import NODE_TYPES, RELATIONS
from zoocore.errors import UnsupportedModuleError
from tests.pipeline.test_concat_gate import randomize


def tiny_convnext():
    return nn.Sequential(nn.Conv2d(3, 8, 2, stride=2), LayerNorm2d(8), CNBlock(8, 0.5, 0.1), CNBlock(8, 0.5, 0.1),
                         nn.AdaptiveAvgPool2d(1), LayerNorm2d(8), nn.Flatten(1), nn.Linear(8, 4))


def test_convnext_blocks_convert_invert_and_keep_their_function():
    model = randomize(tiny_convnext(), 0)
    x = torch.randn(2, 3, 8, 8)
    conv = convert_module(model, x)
    check_exact_inverse(conv.graph, model.state_dict(), "convnext")
    kinds = [op["kind"] for op in conv.plan.ops]
    assert kinds.count("layer_norm") == 4 and kinds.count("scale") == 2
    # every neuron layer is 8 channels wide except the 32-wide MLP expansions and the 4 outputs
    assert sorted({layer.size for layer in conv.plan.layers}) == [3, 4, 8, 32]
    for seed in range(3):
        rng = np.random.default_rng(seed)
        g = conv.graph.permuted(random_hidden_permutation(conv.graph, rng))
        g = random_rescaling(g, rng, max_scale=3.0, steps=conv.plan.steps)
        clone = tiny_convnext()
        clone.load_state_dict(state_dict_from_graph(g))
        torch.testing.assert_close(clone.eval()(x), model(x), rtol=1e-4, atol=1e-4)


class SwapHW(nn.Module):
    def __init__(self, dims=(0, 1, 3, 2), mid=4):
        super().__init__()
        self.a, self.b, self.dims = nn.Conv2d(3, 4, 3), nn.Conv2d(mid, 2, 3), dims

    def forward(self, x):
        return self.b(self.a(x).permute(*self.dims).contiguous())


def test_permutes_that_reorder_positions_are_recorded_steps():
    """Moving tokens (here H and W swapped) keeps the channels as the neurons; the plan records the
    permute, so the architecture signature tells it from the network without it."""
    x = torch.randn(2, 3, 8, 8)
    swapped, plain = convert_module(SwapHW(), x), convert_module(SwapHW((0, 1, 2, 3)), x)
    step = next(s for s in swapped.plan.steps if s["step"] == "permute")
    assert step["dims"] == [0, 1, 3, 2] and step["positions"]
    assert swapped.plan.signature != plain.plan.signature
    assert [layer.size for layer in swapped.plan.layers] == [3, 4, 2]


def test_permutes_that_put_neurons_between_positions_are_refused():
    with pytest.raises(UnsupportedModuleError, match="neurons between positions"):
        convert_module(SwapHW((0, 2, 1, 3), mid=6), torch.randn(2, 3, 8, 8))     # H becomes the channels


def tiny_vit():
    return VisionTransformer(image_size=16, patch_size=4, num_layers=2, num_heads=2, hidden_dim=8, mlp_dim=16,
                             num_classes=3)


def test_vit_tokens_convert_invert_and_keep_their_function():
    model = randomize(tiny_vit(), 0)
    x = torch.randn(2, 3, 16, 16)
    conv = convert_module(model, x)
    check_exact_inverse(conv.graph, model.state_dict(), "vit")
    g = conv.graph
    # the class token (1 neuron) and the 17 positions are input neurons with embedding edges to the 8 channels
    ops = {op["kind"]: op for op in conv.plan.ops if op["kind"] != "residual"}
    patches = next(op for op in conv.plan.ops if op["kind"] == "residual" and "tokens" in op)
    assert ops["class_token"]["tokens"] == [0, 1] and patches["tokens"] == [1, 17]
    sizes = g.layer_sizes()
    assert sizes[ops["class_token"]["src_layer"]] == 1 and sizes[ops["position"]["src_layer"]] == 17
    assert (g.node_type[g.node_layer == ops["position"]["src_layer"]] == NODE_TYPES.index("input")).all()
    emb = g.relation == RELATIONS.index("embedding")
    assert int(emb.sum()) == 8 + 17 * 8
    for seed in range(3):
        rng = np.random.default_rng(seed)
        h = g.permuted(random_hidden_permutation(g, rng))
        h = random_rescaling(h, rng, max_scale=3.0, steps=conv.plan.steps)
        clone = tiny_vit()
        clone.load_state_dict(state_dict_from_graph(h))
        torch.testing.assert_close(clone.eval()(x), model(x), rtol=1e-4, atol=1e-4)
