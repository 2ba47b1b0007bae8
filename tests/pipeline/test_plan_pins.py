"""Plans stored in catalogs keep their bytes: the plan JSON and the architecture signature of a set
of architectures are pinned to the values main computed before operations became typed records
(Swin, Swin v2 and MaxViT: as their first converter computed them, before it joined the registry).

``architecture_id`` is the signature and ``plan_json`` is read back by every catalog reader, so a
change here would orphan old catalogs. The cases cover every operation kind: the zoo kinds (read
from their specs and traced), concatenations, shuffles, gates, layer scale, layer norm, attention
(nn.MultiheadAttention, the fused encoder layer), embeddings, class tokens and positions; the slow
test adds the windowed attention (Swin, Swin v2, MaxViT), torchvision and Hugging Face models.
"""
import hashlib

import numpy as np
import pytest
import torch

from pipeline.neural_graph.plan import Plan, architecture_signature, plan_from_module
from pipeline.neural_graph.spec_plan import plan_from_spec
from pipeline.spec import build_module, example_input
from pipeline.zoo.kinds import RECIPES
from tests.pipeline.test_concat_gate import MODELS as CONCAT_GATE
from tests.pipeline.test_layout import tiny_convnext, tiny_vit
from tests.pipeline.test_neural_graph import Encoder, SelfAttention
from tests.pipeline.test_windowed_attention import tiny_maxvit, tiny_swin, tiny_swin_v2


def _digest(plan: Plan) -> tuple[str, str]:
    text = plan.to_json()
    again = Plan.from_json(text)
    assert again.to_json() == text and architecture_signature(again) == plan.signature
    return hashlib.sha256(text.encode()).hexdigest()[:16], plan.signature


def _zoo_cases():
    for kind in sorted(RECIPES):
        for seed in range(3 if kind == "cnn" else 1):
            spec = RECIPES[kind](np.random.default_rng(seed), seed).spec
            yield f"{kind}-{seed}", spec


def _module_cases():
    for name, make in sorted(CONCAT_GATE.items()):
        yield name, make, lambda: torch.randn(2, 3 if name != "dense" else 2, 8, 8)
    yield "convnext", tiny_convnext, lambda: torch.randn(2, 3, 8, 8)
    yield "vit", tiny_vit, lambda: torch.randn(2, 3, 16, 16)
    yield "mha", SelfAttention, lambda: torch.randn(2, 5, 4)
    yield "encoder", lambda: Encoder(False), lambda: torch.randint(0, 20, (2, 5))
    yield "encoder-norm-first", lambda: Encoder(True), lambda: torch.randint(0, 20, (2, 5))


def _windowed_cases():
    """The windowed-attention cases take two seconds each to trace, so they run in the slow test."""
    yield "swin", tiny_swin, lambda: torch.randn(2, 3, 8, 8)
    yield "swin-v2", tiny_swin_v2, lambda: torch.randn(2, 3, 8, 8)
    yield "maxvit", tiny_maxvit, lambda: torch.randn(2, 3, 16, 16)


def _traced(cases) -> dict[str, tuple[str, str]]:
    """(plan JSON digest, signature) of each module case, traced from seed 0."""
    out = {}
    for name, make, example in cases:
        torch.manual_seed(0)
        out[name] = _digest(plan_from_module(make(), example()))
    return out


def current_pins(slow: bool = False) -> dict[str, tuple[str, str]]:
    """(plan JSON digest, signature) per case, as this checkout computes them."""
    out = {}
    if not slow:
        for name, spec in _zoo_cases():
            net = build_module(spec)
            from_spec = plan_from_spec(net, spec)
            if from_spec is not None:
                out[f"{name}/spec"] = _digest(from_spec)
            out[f"{name}/traced"] = _digest(plan_from_module(net, example_input(spec)))
        return {**out, **_traced(_module_cases())}
    out.update(_traced(_windowed_cases()))
    import torchvision
    for name in ("resnet18", "mobilenet_v3_small", "squeezenet1_1", "shufflenet_v2_x0_5"):
        model = getattr(torchvision.models, name)(weights=None)
        out[name] = _digest(plan_from_module(model, torch.randn(2, 3, 64, 64)))
    from tests.pipeline.test_transformers import _make
    for name in ("bert", "gpt2", "vit"):
        model, x = _make(name)
        out[f"hf-{name}"] = _digest(plan_from_module(model, x))
    return out


PINS = {'cnn-0/spec': ('26bf74d260858146', '31d41272cff9b7d3'),
 'cnn-0/traced': ('26bf74d260858146', '31d41272cff9b7d3'),
 'cnn-1/spec': ('589ee756e455b709', '17eeccd0d783e1f4'),
 'cnn-1/traced': ('589ee756e455b709', '17eeccd0d783e1f4'),
 'cnn-2/spec': ('c29628fd45a804e5', '9dcc4ef7fe9eb5b3'),
 'cnn-2/traced': ('c29628fd45a804e5', '9dcc4ef7fe9eb5b3'),
 'cnn-fixed-0/spec': ('7355562d49f6c729', '15c10f603fa6a970'),
 'cnn-fixed-0/traced': ('7355562d49f6c729', '15c10f603fa6a970'),
 'convnext': ('4e7b867ceb299e27', '41785a8ee3c27a76'),
 'dense': ('0cefc8ed3ab76781', 'f5bdf4e4d5328c11'),
 'encoder': ('551cd41989315e89', '04cccb30561b50d0'),
 'encoder-norm-first': ('a3d35c983befec8a', '129354b8e4d8dfb8'),
 'fire': ('2fbe4c3a2f776e59', '710d7fcf0dbdd11c'),
 'inr-0/spec': ('698cd5b39cb131df', '07a82430b21971ce'),
 'inr-0/traced': ('698cd5b39cb131df', '07a82430b21971ce'),
 'mha': ('ff5b28412edb729e', 'eaf8eacf52b0f50b'),
 'mlp-0/spec': ('c104e22f0309643d', '7807fc6588b8f519'),
 'mlp-0/traced': ('c104e22f0309643d', '7807fc6588b8f519'),
 'mlp-equivariant-0/spec': ('e7eccf1e717c3d53', 'aab66f01cf2fd2ea'),
 'mlp-equivariant-0/traced': ('e7eccf1e717c3d53', 'aab66f01cf2fd2ea'),
 'se_hardsigmoid': ('f7f1d4e99cd553eb', 'fcf4de71f9c14995'),
 'se_sigmoid': ('c093cc6cf2694b1f', '60e44fc3a10b26bc'),
 'shuffle': ('0bcdd6ff98cb5a07', 'a78f410a8ad5d4aa'),
 'vit': ('ed8c18296a612e01', 'ba99df7832069919')}

SLOW_PINS = {'swin-v2': ('497b017d61caf241', '8c2b4a76ca4aa7d6'),
 'swin': ('1178d180fe655978', '6b1aff2a933f9139'),
 'maxvit': ('bfd251962156590b', 'f011dd2e7327a04e'),
 'hf-bert': ('34cef3ab30e52df0', '7f981a81b8f72c40'),
 'hf-gpt2': ('e03e7c6937c50a36', 'fab8ea198cd82068'),
 'hf-vit': ('8f07c86d8b3cff46', '481c0ddbc391fbcc'),
 'mobilenet_v3_small': ('286a41d34dc1f4d2', '994ec9911898ca54'),
 'resnet18': ('70401c56e0f794e0', '4fc3ef6350224ab8'),
 'shufflenet_v2_x0_5': ('b94cc0fc6a3cf6e1', 'cb51a1da95f13076'),
 'squeezenet1_1': ('ce169a072dcaae1c', '49a57eb90ef03c61')}


def test_plans_keep_their_bytes_and_signatures():
    assert current_pins() == PINS


@pytest.mark.slow
def test_torchvision_and_transformers_plans_keep_their_bytes_and_signatures():
    assert current_pins(slow=True) == SLOW_PINS
