"""Hugging Face ``transformers`` models built from a config with random weights (nothing is
downloaded): BERT, GPT-2 (its Conv1D and fused q/k/v projection) and ViT convert, invert bit for
bit, and keep their function under the graph's permutation and scaling symmetries."""
import numpy as np
import pytest
import torch

from pipeline.neural_graph.build import state_dict_from_graph
from pipeline.neural_graph.convert import convert_module
from pipeline.neural_graph.coverage import check_exact_inverse
from pipeline.neural_graph.symmetry import random_hidden_permutation, random_rescaling
from pipeline.neural_graph.vocabulary import RELATIONS

transformers = pytest.importorskip("transformers")


class LastHidden(torch.nn.Module):
    """The model's last hidden state as a plain tensor output."""

    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, x):
        return self.m(x, return_dict=False)[0]


def bert():
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, attn_implementation="eager")
    return transformers.BertModel(cfg, add_pooling_layer=False), lambda g: torch.randint(0, 50, (2, 7), generator=g)


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=16, use_cache=False)
    return transformers.GPT2Model(cfg), lambda g: torch.randint(0, 50, (2, 7), generator=g)


def vit():
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=32, num_channels=3)
    return transformers.ViTModel(cfg, add_pooling_layer=False), lambda g: torch.randn(2, 3, 16, 16, generator=g)


MODELS = {"bert": bert, "gpt2": gpt2, "vit": vit}


def _make(name, seed=0):
    torch.manual_seed(seed)
    model, sample = MODELS[name]()
    return LastHidden(model).eval(), sample(torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_converts_inverts_and_keeps_its_function(name):
    model, x = _make(name)
    conv = convert_module(model, x)
    check_exact_inverse(conv.graph, model.state_dict(), name)
    g = conv.graph
    for rel in ("attn_q", "attn_k", "attn_v"):
        assert (g.relation == RELATIONS.index(rel)).sum() == 2 * 16 * 16       # two layers of 16 x 16
    assert {op.get("heads") for op in conv.plan.ops if op["relation"].startswith("attn")} == {2}
    for seed in range(2):
        rng = np.random.default_rng(seed)
        h = g.permuted(random_hidden_permutation(g, rng))
        h = random_rescaling(h, rng, max_scale=3.0, steps=conv.plan.steps)
        clone, _ = _make(name, seed=seed + 1)
        clone.load_state_dict(state_dict_from_graph(h))
        with torch.no_grad():
            torch.testing.assert_close(clone(x), model(x), rtol=1e-4, atol=1e-4)


def test_gpt2_conv1d_and_fused_projection_are_read_as_such():
    model, x = _make("gpt2")
    conv = convert_module(model, x)
    fused = [op for op in conv.plan.ops if op.get("rows") and op["weight_key"].endswith("c_attn.weight")]
    assert [op["relation"] for op in fused[:3]] == ["attn_q", "attn_k", "attn_v"]
    assert all(op["transposed"] for op in fused) and fused[0]["param_shape"] == [16, 48]
    assert "gelu_tanh" in conv.graph.layer_activation                        # gelu_new, seven ATen ops
    # positions are an embedding from 16 position neurons (n_positions), token ids from 50
    emb = [conv.graph.layer_sizes()[op["src_layer"]] for op in conv.plan.ops if op["kind"] == "embedding"]
    assert sorted(emb) == [16, 50]
