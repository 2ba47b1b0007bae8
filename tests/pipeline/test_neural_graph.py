"""Conversion to neural graphs, the exact inverse, and the permutation symmetry."""
import io
import pickle
import zipfile

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from pipeline.checkpoints import load_exported
from pipeline.neural_graph.build import state_dict_from_graph
from pipeline.neural_graph.convert import convert_exported, convert_module, convert_state_dict
from pipeline.neural_graph.heterograph import neural_graph_to_dgl
from pipeline.neural_graph.symmetry import random_hidden_permutation
from pipeline.neural_graph.vocabulary import NODE_TYPES, RELATIONS
from pipeline.spec import build_module, example_input
from zoocore.errors import CheckpointError, UnsupportedModuleError


def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen) * 0.5 + (1.0 if "running_var" in name else 0.0)).abs_() \
                    if "running_var" in name else t.copy_(torch.randn(t.shape, generator=gen) * 0.5)
            elif "num_batches_tracked" in name:
                t.fill_(11)
    return model.eval()


CNN_SPEC = {"input_shape": [1, 8, 8], "layers": [
    {"type": "conv2d", "out_channels": 6, "kernel_size": 3, "padding": 1},
    {"type": "batchnorm"}, {"type": "activation", "fn": "relu"},
    {"type": "residual", "body": [
        {"type": "conv2d", "out_channels": 6, "kernel_size": 5, "padding": 2, "bias": False},
        {"type": "batchnorm"}, {"type": "activation", "fn": "gelu"},
        {"type": "conv2d", "out_channels": 6, "kernel_size": 3, "padding": 1, "groups": 6}]},
    {"type": "activation", "fn": "silu"},
    {"type": "maxpool", "kernel_size": 2},
    {"type": "adaptive_avgpool", "output_size": 2}, {"type": "flatten"},
    {"type": "linear", "out_features": 10}]}
MLP_SPEC = {"input_shape": [13], "layers": [
    {"type": "linear", "out_features": 16}, {"type": "activation", "fn": "tanh"},
    {"type": "linear", "out_features": 16}, {"type": "layernorm"}, {"type": "activation", "fn": "leaky_relu"},
    {"type": "dropout", "p": 0.2}, {"type": "linear", "out_features": 3}]}
CONV1D_SPEC = {"input_shape": [4, 12], "layers": [
    {"type": "conv1d", "out_channels": 8, "kernel_size": 3, "stride": 2, "dilation": 1},
    {"type": "activation", "fn": "sigmoid"},
    {"type": "conv1d", "out_channels": 8, "kernel_size": 3, "groups": 8, "padding": 1},
    {"type": "avgpool", "kernel_size": 5}, {"type": "flatten"}, {"type": "linear", "out_features": 2}]}
EMB_SPEC = {"input_shape": [5], "input_dtype": "int64", "layers": [
    {"type": "embedding", "num_embeddings": 20, "embedding_dim": 8}, {"type": "layernorm"},
    {"type": "linear", "out_features": 8}, {"type": "activation", "fn": "relu6"},
    {"type": "linear", "out_features": 4}]}
SPECS = {"cnn": CNN_SPEC, "mlp": MLP_SPEC, "conv1d": CONV1D_SPEC, "embedding": EMB_SPEC}


def sample_input(spec, n=4, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = example_input(spec, n)
    if x.dtype == torch.int64:
        return torch.randint(0, 20, x.shape, generator=gen)
    return torch.randn(x.shape, generator=gen)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_round_trip_is_bit_exact(name):
    spec = SPECS[name]
    model = randomize(build_module(spec))
    conv = convert_state_dict(model.state_dict(), spec)
    back = state_dict_from_graph(conv.graph)
    assert set(back) == set(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(back[key], value), key
    clone = build_module(spec)
    clone.load_state_dict(back)
    x = sample_input(spec)
    assert torch.equal(model(x), clone(x))


def test_counts_follow_the_parameters():
    model = randomize(build_module(CNN_SPEC))
    g = convert_state_dict(model.state_dict(), CNN_SPEC).graph
    sd = model.state_dict()
    conv_edges = sum(v.shape[0] * v.shape[1] for k, v in sd.items() if k.endswith("weight") and v.dim() == 4)
    linear = sd["layers.8.weight"]
    norm_edges = sum(v.shape[0] for k, v in sd.items() if k.endswith("running_mean"))
    residual_edges = 6
    assert g.num_edges == conv_edges + linear.shape[0] * 6 + norm_edges + residual_edges
    # 1 input + conv 6 + bn 6 + conv 6 + bn 6 + depthwise 6 (+ residual folded) + 10 outputs
    assert g.num_nodes == 1 + 6 * 5 + 10
    assert g.kernel_shape == (5, 5)
    types = [NODE_TYPES[t] for t in g.node_type]
    assert types.count("input") == 1 and types.count("output") == 10
    # the head reads a 2x2 map per channel: a 2x2 "conv", not 24 separate inputs
    head = [op for op in g.ops if op["kind"] == "linear"][0]
    assert head["relation"] == "conv" and head["kernel"] == [2, 2]
    assert set(RELATIONS[r] for r in np.unique(g.relation)) == {"conv", "norm", "residual"}
    assert g.layer_activation[-1] == "identity" and "silu" in g.layer_activation


def test_residual_after_activation_gets_its_own_layer():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            h = torch.relu(self.a(x))
            return self.head(torch.relu(self.b(h)) + h)   # both operands already activated

    model = randomize(Block())
    conv = convert_module(model, torch.randn(2, 4))
    kinds = [layer.kind for layer in conv.plan.layers]
    assert kinds == ["input", "linear", "linear", "add", "linear"]
    back = state_dict_from_graph(conv.graph)
    clone = Block()
    clone.load_state_dict(back)
    x = torch.randn(5, 4)
    assert torch.equal(model(x), clone.eval()(x))


class Cat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(3, 4)

    def forward(self, x):
        return torch.cat([self.a(x), self.b(x)], dim=0)      # along the batch: mixes samples, not neurons


class WithTransposed(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(2, 2, 2)

    def forward(self, x):
        return self.up(x)


def test_unsupported_modules_name_their_path():
    with pytest.raises(UnsupportedModuleError, match="cat.*along an axis other than the neurons"):
        convert_module(Cat(), torch.randn(2, 3))
    with pytest.raises(UnsupportedModuleError, match=r"'up'.*ConvTranspose2d"):
        convert_module(WithTransposed(), torch.randn(2, 2, 4, 4))


def test_exported_archive_round_trip(tmp_path):
    model = randomize(build_module(CNN_SPEC))
    path = tmp_path / "m.pt2"
    torch.export.save(torch.export.export(model, (sample_input(CNN_SPEC),)), str(path))
    conv = convert_exported(load_exported(path))
    direct = convert_state_dict(model.state_dict(), CNN_SPEC)
    assert conv.plan.signature == direct.plan.signature
    np.testing.assert_array_equal(conv.graph.weight, direct.graph.weight)
    back = state_dict_from_graph(conv.graph)
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def test_exported_archive_payload_is_not_executed(tmp_path):
    """A .pt2 whose weights pickle carries a payload: loading refuses, nothing runs."""
    marker = tmp_path / "pwned"
    model = randomize(build_module(MLP_SPEC))
    good = tmp_path / "good.pt2"
    torch.export.save(torch.export.export(model, (sample_input(MLP_SPEC),)), str(good))

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    bad = tmp_path / "bad.pt2"
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(bad, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename.endswith("serialized_state_dict.json"):  # torch.save bytes despite the name
                buf = io.BytesIO()
                pickle.dump(Payload(), buf)
                data = buf.getvalue()
            zout.writestr(item, data)
    with pytest.raises(CheckpointError):
        load_exported(bad)
    assert not marker.exists()


def test_dgl_and_networkx_views():
    model = randomize(build_module(CNN_SPEC))
    g = convert_state_dict(model.state_dict(), CNN_SPEC).graph
    hg = neural_graph_to_dgl(g)
    assert hg.num_nodes("input") == 1 and hg.num_nodes("output") == 10 and hg.num_nodes("hidden") == 30
    forward = [et for et in hg.canonical_etypes if not et[1].startswith("rev_")]
    assert sum(hg.num_edges(et) for et in forward) == g.num_edges
    for s, r, d in forward:
        assert hg.num_edges((d, "rev_" + r, s)) == hg.num_edges((s, r, d))
        assert hg.edges[(s, r, d)].data["w"].shape[1] == 25
    nxg = g.to_networkx()
    assert nxg.number_of_nodes() == g.num_nodes and nxg.number_of_edges() == g.num_edges


layer_st = st.sampled_from(["conv", "conv_bn", "residual", "depthwise"])


@st.composite
def random_cnn_spec(draw):
    width = draw(st.integers(2, 5))
    layers = [{"type": "conv2d", "out_channels": width, "kernel_size": draw(st.sampled_from([1, 3])), "padding": "same"}]
    for kind in draw(st.lists(layer_st, min_size=0, max_size=3)):
        act = {"type": "activation", "fn": draw(st.sampled_from(["relu", "tanh", "silu", "gelu"]))}
        if kind == "conv":
            layers += [act, {"type": "conv2d", "out_channels": draw(st.integers(2, 5)), "kernel_size": 3, "padding": 1}]
        elif kind == "conv_bn":
            layers += [act, {"type": "conv2d", "out_channels": draw(st.integers(2, 5)), "kernel_size": 3,
                             "padding": 1}, {"type": "batchnorm"}]
        elif kind == "depthwise":
            c = _channels(layers)
            layers += [act, {"type": "conv2d", "out_channels": c, "kernel_size": 3, "padding": 1, "groups": c}]
        else:
            c = _channels(layers)
            layers += [act, {"type": "residual", "body": [
                {"type": "conv2d", "out_channels": c, "kernel_size": 3, "padding": 1}, {"type": "batchnorm"}]}]
    layers += [{"type": "activation", "fn": "relu"}, {"type": "adaptive_avgpool", "output_size": draw(st.sampled_from([1, 2]))},
               {"type": "flatten"}, {"type": "linear", "out_features": 3}]
    return {"input_shape": [2, 6, 6], "layers": layers}


def _channels(layers):
    for layer in reversed(layers):
        if layer["type"] == "conv2d":
            return layer["out_channels"]
        if layer["type"] == "residual":
            return _channels(layer["body"])
    raise AssertionError


@settings(max_examples=25, deadline=None)
@given(spec=random_cnn_spec(), seed=st.integers(0, 2**16))
def test_permuted_model_gives_isomorphic_graph(spec, seed):
    """Permute hidden neurons (via the graph and its inverse): the function is unchanged and the
    permuted model converts to exactly the permuted graph."""
    model = randomize(build_module(spec), seed)
    conv = convert_state_dict(model.state_dict(), spec)
    perm = random_hidden_permutation(conv.graph, np.random.default_rng(seed))
    permuted_graph = conv.graph.permuted(perm)
    permuted_model = build_module(spec)
    permuted_model.load_state_dict(state_dict_from_graph(permuted_graph))
    x = sample_input(spec, seed=seed)
    torch.testing.assert_close(permuted_model(x), model(x), rtol=1e-5, atol=1e-5)
    again = convert_state_dict(permuted_model.state_dict(), spec).graph
    a, b = again.edge_key_order(), permuted_graph.edge_key_order()
    np.testing.assert_array_equal(again.src[a], permuted_graph.src[b])
    np.testing.assert_array_equal(again.dst[a], permuted_graph.dst[b])
    np.testing.assert_array_equal(again.weight[a], permuted_graph.weight[b])
    np.testing.assert_array_equal(again.bias, permuted_graph.bias)
    if (perm != np.arange(len(perm))).any():
        assert not np.array_equal(again.bias, conv.graph.bias) or np.allclose(conv.graph.bias, 0)


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.emb(x)
        a, _ = self.att(h, h, h)
        return self.head(a + h)


class Encoder(nn.Module):
    def __init__(self, norm_first=False):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, norm_first=norm_first, activation="gelu")
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.enc(self.emb(x)))


@pytest.mark.parametrize("make,example", [
    (SelfAttention, lambda: torch.randn(2, 5, 4)),
    (lambda: Encoder(False), lambda: torch.randint(0, 20, (2, 5))),
    (lambda: Encoder(True), lambda: torch.randint(0, 20, (2, 5)))])
def test_attention_becomes_typed_blocks_and_inverts_exactly(make, example):
    model = randomize(make())
    conv = convert_module(model, example())
    rels = {RELATIONS[r] for r in np.unique(conv.graph.relation)}
    assert {"attn_q", "attn_k", "attn_v", "attn_o"} <= rels
    heads = {op.get("heads") for op in conv.plan.ops if op["relation"].startswith("attn")}
    assert heads == {2}
    # q, k, v each read all 8 input neurons: 3 * 8 * 8 edges, and o 8 * 8
    attn_edges = sum(int((conv.graph.relation == RELATIONS.index(r)).sum()) for r in ("attn_q", "attn_k", "attn_v"))
    assert attn_edges == 3 * 64 and int((conv.graph.relation == RELATIONS.index("attn_o")).sum()) == 64
    clone = make()
    clone.load_state_dict(state_dict_from_graph(conv.graph))
    x = example()
    assert torch.equal(model(x), clone.eval()(x))
