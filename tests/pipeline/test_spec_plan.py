"""Plans read from a spec equal the plans torch.export + the ATen tracer give (or defer to them)."""
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from pipeline.neural_graph.convert import PlanCache
from pipeline.neural_graph.plan import plan_from_module
from pipeline.neural_graph.spec_plan import plan_from_spec
from pipeline.spec import build_module, example_input
from pipeline.zoo.kinds import RECIPES
from zoocore.errors import SpecError

ACTS = ["relu", "gelu", "silu", "tanh", "sigmoid", "leaky_relu", "relu6", "hardswish", "sin", "identity"]


def _conv(draw, kind):
    k = draw(st.sampled_from([1, 2, 3, 5]))
    return {"type": kind, "out_channels": draw(st.integers(1, 4)), "kernel_size": k,
            "padding": draw(st.sampled_from([0, 1, k // 2, "same", "valid"])), "stride": draw(st.sampled_from([1, 1, 2])),
            "dilation": draw(st.sampled_from([1, 1, 2])), "bias": draw(st.booleans())}


@st.composite
def any_layer(draw, depth=0):
    kind = draw(st.sampled_from(["conv2d", "conv1d", "batchnorm", "activation", "maxpool", "avgpool", "adaptive_avgpool",
                                 "flatten", "linear", "dropout", "residual", "layernorm"]))
    if kind in ("conv2d", "conv1d"):
        return _conv(draw, kind)
    if kind == "activation":
        return {"type": kind, "fn": draw(st.sampled_from(ACTS))}
    if kind in ("maxpool", "avgpool"):
        return {"type": kind, "kernel_size": draw(st.sampled_from([1, 2, 3]))}
    if kind == "adaptive_avgpool":
        return {"type": kind, "output_size": draw(st.sampled_from([1, 2, 3]))}
    if kind == "linear":
        return {"type": kind, "out_features": draw(st.integers(1, 5)), "bias": draw(st.booleans())}
    if kind == "residual" and depth < 2:
        return {"type": kind, "body": draw(st.lists(any_layer(depth + 1), min_size=1, max_size=3))}
    if kind == "dropout":
        return {"type": kind, "p": 0.1}
    return {"type": "batchnorm"} if kind == "residual" else {"type": kind}


@st.composite
def any_spec(draw):
    shape = draw(st.sampled_from([[2, 6, 6], [1, 8, 8], [3, 10], [5]]))
    return {"input_shape": shape, "layers": draw(st.lists(any_layer(), min_size=1, max_size=7))}


def _exported_or_none(spec):
    try:
        return plan_from_module(build_module(spec), example_input(spec))
    except Exception:
        return None


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(spec=any_spec())
def test_spec_plan_equals_exported_plan(spec):
    """Wherever the spec reader answers, its plan is the tracer's, path and signature included;
    where the tracer rejects a spec, the reader defers (returns None)."""
    try:
        net = build_module(spec)
    except SpecError:
        assume(False)
    mine = plan_from_spec(net, spec)
    if mine is None:
        return
    ref = _exported_or_none(spec)
    assert ref is not None, "the spec reader planned a network the tracer rejects"
    assert mine.to_json() == ref.to_json()


@pytest.mark.parametrize("kind", sorted(RECIPES))
def test_zoo_specs_need_no_export(kind):
    """Every zoo kind's architectures are read from the spec, and equal the exported plan."""
    for seed in range(12):
        spec = RECIPES[kind](np.random.default_rng(seed), seed).spec
        mine = plan_from_spec(build_module(spec), spec)
        assert mine is not None, spec
        assert mine.to_json() == plan_from_module(build_module(spec), example_input(spec)).to_json()


def test_plan_cache_falls_back_to_export_for_what_the_reader_skips():
    spec = {"input_shape": [5], "input_dtype": "int64", "layers": [
        {"type": "embedding", "num_embeddings": 7, "embedding_dim": 4}, {"type": "linear", "out_features": 3}]}
    assert plan_from_spec(build_module(spec), spec) is None
    cache = PlanCache()
    plan = cache.for_spec(spec)
    assert [op["kind"] for op in plan.ops] == ["embedding", "linear"]
    assert cache.exported == 1 and cache.from_spec == 0
