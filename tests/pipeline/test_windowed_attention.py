"""Windowed attention with a relative-position bias: Swin (shifted windows by ``roll``, shift masks
made from constants, patch merging) and MaxViT (window and grid partitions by view + permute,
squeeze-excitation MBConv). The bias table is a learned parameter of the attention block: R
relative-position input neurons, one bias neuron per head, ``attn_bias`` edges into that head's
query neurons; the graph inverts bit for bit and keeps the function under its symmetries."""
import copy

import numpy as np
import pytest
import torch
from torchvision.models.maxvit import MaxVit
from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformer, SwinTransformerBlockV2

from pipeline.neural_graph.build import state_dict_from_graph
from pipeline.neural_graph.convert import convert_module
from pipeline.neural_graph.coverage import check_exact_inverse
from pipeline.neural_graph.plan import architecture_signature
from pipeline.neural_graph.symmetry import random_hidden_permutation, random_rescaling
from pipeline.neural_graph.vocabulary import NODE_TYPES, RELATIONS
from tests.pipeline.test_concat_gate import randomize


def tiny_swin():
    return SwinTransformer(patch_size=[2, 2], embed_dim=8, depths=[2, 2], num_heads=[2, 4], window_size=[2, 2],
                           num_classes=3)


def tiny_swin_v2():
    return SwinTransformer(patch_size=[2, 2], embed_dim=8, depths=[2, 2], num_heads=[2, 4], window_size=[2, 2],
                           num_classes=3, block=SwinTransformerBlockV2, downsample_layer=PatchMergingV2)


def tiny_maxvit():
    return MaxVit(input_size=(16, 16), stem_channels=8, partition_size=2, block_channels=[8, 16], block_layers=[1, 1],
                  head_dim=4, stochastic_depth_prob=0.0, num_classes=3)


def _keeps_function(conv, make, x, seeds=2):
    """Random hidden permutations and rescalings of the graph, inverted, compute what the model does."""
    model_out = None
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        h = conv.graph.permuted(random_hidden_permutation(conv.graph, rng))
        h = random_rescaling(h, rng, max_scale=3.0, steps=conv.plan.steps)
        clone = make().eval()
        clone.load_state_dict(state_dict_from_graph(h))
        with torch.no_grad():
            if model_out is None:
                model_out = conv.model(x)
            torch.testing.assert_close(clone(x), model_out, rtol=1e-4, atol=1e-4)


def _convert(make, x):
    model = randomize(make(), 0)
    conv = convert_module(model, x)
    conv.model = model
    check_exact_inverse(conv.graph, model.state_dict(), make.__name__)
    return conv


def test_swin_converts_with_its_relative_position_bias_and_keeps_its_function():
    x = torch.randn(2, 3, 8, 8)
    conv = _convert(tiny_swin, x)
    g, ops = conv.graph, conv.plan.ops
    tables = [op for op in ops if op["kind"] == "relative_position"]
    assert len(tables) == 4                                    # one per block
    sizes = g.layer_sizes()
    for op, heads in zip(tables, [2, 2, 4, 4]):
        assert sizes[op["src_layer"]] == 9 and sizes[op["dst_layer"]] == heads      # (2*2-1)^2 offsets
        assert (g.node_type[g.node_layer == op["src_layer"]] == NODE_TYPES.index("input")).all()
        (key, index), = op["buffers"].items()
        assert key.endswith("relative_position_index") and index["shape"] == [16] and index["dtype"] == "int64"
    # each bias neuron reaches exactly the query neurons of its head
    bias = [op for op in ops if op["kind"] == "attention_bias"]
    assert [int((g.relation == RELATIONS.index("attn_bias"))[g.edge_op == ops.index(op)].sum()) for op in bias] \
        == [8, 8, 16, 16]
    first = ops.index(bias[0])
    e = np.flatnonzero(g.edge_op == first)
    assert (g.node_position[g.src[e]] == g.node_position[g.dst[e]] // 4).all()    # head_dim 4
    assert {op["heads"] for op in ops if op["relation"] == "attn_q"} == {2, 4}
    # shifted windows are rolls of positions (the shifted blocks, inside and outside the window layout)
    assert any(s["step"] == "roll" and s["shifts"] == [-1, -1] for s in conv.plan.steps)
    # patch merging: four position slices of the 8 channels side by side, then LayerNorm(32), Linear(32, 16)
    merge = [op for op in ops if op["kind"] == "residual" and op.get("src_segments")
             and len(op["src_segments"]) == 4]
    assert len(merge) == 1 and sizes[merge[0]["dst_layer"]] == 32
    _keeps_function(conv, tiny_swin, x)
    # the window layout is architecture: another index or another shift is another signature
    plan = copy.deepcopy(conv.plan)
    next(iter(next(op for op in plan.ops if op["kind"] == "relative_position")["buffers"].values()))["values"].reverse()
    assert architecture_signature(plan) != conv.plan.signature
    plan = copy.deepcopy(conv.plan)
    next(s for s in plan.steps if s["step"] == "roll")["shifts"] = [1, 1]
    assert architecture_signature(plan) != conv.plan.signature


def test_swin_v2_writes_its_position_bias_mlp_and_logit_scale_as_neurons():
    """V2: cosine attention with a learned per-head logit scale, and the bias computed by an MLP
    (2 coordinates -> 512 relu -> heads, then 16 * sigmoid) from a fixed coordinate table."""
    x = torch.randn(2, 3, 8, 8)
    conv = _convert(tiny_swin_v2, x)
    g, ops, sizes = conv.graph, conv.plan.ops, conv.graph.layer_sizes()
    scales = [op for op in ops if op["kind"] == "logit_scale"]
    assert [int(sizes[op["dst_layer"]]) for op in scales] == [2, 2, 4, 4]
    assert [int(sizes[op["src_layer"]]) for op in scales] == [1] * 4
    assert sum(op["relation"] == "attn_scale" for op in ops) == 4
    bias = [op for op in ops if op["kind"] == "attention_bias"]
    assert [op["scale"] for op in bias] == [16.0] * 4
    for op in bias:
        assert g.layer_activation[op["src_layer"]] == "sigmoid"
    mlp = [op for op in ops if op["kind"] == "linear" and ".cpb_mlp." in op["weight_key"]]
    assert len(mlp) == 8 and "buffers" in mlp[0] and "buffers" in mlp[1]      # coordinates, index
    hidden = mlp[0]["dst_layer"]
    assert sizes[hidden] == 512 and g.layer_activation[hidden] == "relu" and sizes[mlp[0]["src_layer"]] == 2
    # the key rows of the fused qkv bias are zeroed at call time; the parameter still round-trips
    k = [op for op in ops if op["relation"] == "attn_k"]
    assert all(op["zeroed_bias_rows"] == op["rows"] for op in k)
    _keeps_function(conv, tiny_swin_v2, x)


def test_maxvit_converts_with_window_and_grid_partitions_and_keeps_its_function():
    x = torch.randn(2, 3, 16, 16)
    conv = _convert(tiny_maxvit, x)
    ops = conv.plan.ops
    assert sum(op["kind"] == "relative_position" for op in ops) == 4       # window + grid, two blocks
    assert any(op["relation"] == "gate" for op in ops)                       # squeeze-excitation
    assert any(s["step"] == "permute" and s.get("positions") for s in conv.plan.steps)
    _keeps_function(conv, tiny_maxvit, x)


@pytest.mark.parametrize("name", ["SwinModel", "Swinv2Model"])
def test_hugging_face_swin_converts_with_its_shifts_outside_the_attention_block(name):
    """Hugging Face's Swin rolls and partitions the tokens in the layer, outside the attention module:
    the rolls are followed as layout steps of the channel neurons."""
    transformers = pytest.importorskip("transformers")
    from tests.pipeline.test_transformers import LastHidden

    def make():
        torch.manual_seed(0)
        cfg = getattr(transformers, name.replace("Model", "Config"))(
            image_size=16, patch_size=2, embed_dim=8, depths=[2, 2], num_heads=[2, 4], window_size=2, num_channels=3)
        return LastHidden(getattr(transformers, name)(cfg, add_pooling_layer=False))

    make.__name__ = name
    x = torch.randn(2, 3, 16, 16)
    conv = _convert(make, x)
    assert [s["shifts"] for s in conv.plan.steps if s["step"] == "roll"][:2] == [[-1, -1], [1, 1]]
    assert sum(op["kind"] == "attention_bias" for op in conv.plan.ops) == 4
    _keeps_function(conv, make, x)
