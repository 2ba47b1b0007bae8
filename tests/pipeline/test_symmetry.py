"""Scaling and sign symmetries: function-preserving transforms and the scale canonicalisation."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from pipeline.neural_graph.build import state_dict_from_graph
from pipeline.neural_graph.convert import convert_state_dict
from pipeline.neural_graph.vocabulary import NODE_TYPES
from pipeline.neural_graph.symmetry import (SCALE, SIGN, _incoming_norms, _outgoing_norms, apply_neuron_factors,
                                            balanced_scaling, canonical_scaling, random_factors,
                                            random_rescaling, scale_classes)
from pipeline.spec import build_module
from tests.pipeline.test_neural_graph import SPECS, randomize, sample_input

RELU_RES_CNN = {"input_shape": [1, 8, 8], "layers": [
    {"type": "conv2d", "out_channels": 6, "kernel_size": 3, "padding": 1},
    {"type": "batchnorm"}, {"type": "activation", "fn": "relu"},
    {"type": "residual", "body": [
        {"type": "conv2d", "out_channels": 6, "kernel_size": 3, "padding": 1, "bias": False},
        {"type": "batchnorm"}, {"type": "activation", "fn": "relu"},
        {"type": "conv2d", "out_channels": 6, "kernel_size": 5, "padding": 2, "groups": 6}]},
    {"type": "activation", "fn": "relu"},
    {"type": "maxpool", "kernel_size": 2},
    {"type": "conv2d", "out_channels": 5, "kernel_size": 3, "padding": 1},
    {"type": "activation", "fn": "leaky_relu"},
    {"type": "adaptive_avgpool", "output_size": 2}, {"type": "flatten"},
    {"type": "linear", "out_features": 7}, {"type": "activation", "fn": "relu"},
    {"type": "linear", "out_features": 10}]}
TANH_MLP = {"input_shape": [5], "layers": [
    {"type": "linear", "out_features": 12}, {"type": "activation", "fn": "tanh"},
    {"type": "linear", "out_features": 9}, {"type": "batchnorm"}, {"type": "activation", "fn": "tanh"},
    {"type": "linear", "out_features": 8},
    {"type": "linear", "out_features": 3}]}
SIREN = {"input_shape": [2], "layers": [
    {"type": "linear", "out_features": 16}, {"type": "activation", "fn": "sin"},
    {"type": "linear", "out_features": 16}, {"type": "activation", "fn": "sin"},
    {"type": "linear", "out_features": 1}]}
CASES = {**SPECS, "relu_res_cnn": RELU_RES_CNN, "tanh_mlp": TANH_MLP, "siren": SIREN}


def _convert(name, seed=0):
    spec = CASES[name]
    model = randomize(build_module(spec), seed)
    conv = convert_state_dict(model.state_dict(), spec)
    return spec, model, conv


def _run(spec, graph, x):
    net = build_module(spec)
    net.load_state_dict(state_dict_from_graph(graph))
    with torch.no_grad():
        return net.eval()(x)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(sorted(CASES)), seed=st.integers(0, 10_000), max_scale=st.sampled_from([2.0, 10.0, 1e3]))
def test_random_rescaling_preserves_the_function(name, seed, max_scale):
    spec, model, conv = _convert(name, seed % 7)
    x = sample_input(spec, n=16, seed=seed)
    rng = np.random.default_rng(seed)
    moved = random_rescaling(conv.graph, rng, max_scale, steps=conv.plan.steps)
    with torch.no_grad():
        expected = model(x)
    assert _rel(_run(spec, moved, x), expected) < 1e-5


@pytest.mark.parametrize("name, layer_groups", [
    ("relu_res_cnn", {SCALE}), ("tanh_mlp", {SIGN}), ("siren", {SIGN})])
def test_the_transform_is_not_trivial(name, layer_groups):
    """Factors really move weights, in the groups each activation allows (a test that can fail)."""
    spec, model, conv = _convert(name)
    reps, groups = scale_classes(conv.graph, conv.plan.steps)
    assert any(g == layer_groups for g in groups.values())
    s = random_factors(conv.graph, np.random.default_rng(0), 10.0, conv.plan.steps)
    hidden = conv.graph.node_type == NODE_TYPES.index("hidden")
    assert (s[hidden] != 1).mean() > 0.3
    assert not np.allclose(apply_neuron_factors(conv.graph, s).weight, conv.graph.weight)


def test_a_factor_the_activation_does_not_allow_changes_the_function():
    """Scaling a GELU layer or sign-flipping a ReLU layer changes the output: the classes are not too
    permissive, so the preservation test above is meaningful."""
    for name, fn in (("cnn", "gelu"), ("relu_res_cnn", "relu")):
        spec, model, conv = _convert(name)
        g = conv.graph
        layer = g.layer_activation.index(fn)
        s = np.ones(g.num_nodes)
        s[g.node_layer == layer] = -3.0 if fn == "relu" else 3.0
        reps, _ = scale_classes(g, conv.plan.steps)
        for other, r in enumerate(reps):
            if r == reps[layer]:
                s[g.node_layer == other] = s[g.node_layer == layer][0]
        x = sample_input(spec, n=16)
        with torch.no_grad():
            assert _rel(_run(spec, apply_neuron_factors(g, s), x), model(x)) > 1e-3


def test_fixed_neurons_and_layer_norm_inputs_are_refused():
    spec, model, conv = _convert("mlp")     # linear -> tanh -> linear -> layernorm -> ...
    g = conv.graph
    s = np.ones(g.num_nodes)
    s[g.node_type == NODE_TYPES.index("input")] = 2.0
    with pytest.raises(ValueError, match="input and output"):
        apply_neuron_factors(g, s)
    ln = next(op for op in g.ops if op["kind"] == "layer_norm")
    s = np.ones(g.num_nodes)
    s[g.node_layer == ln["src_layer"]] = 2.0
    with pytest.raises(ValueError, match="layer norm"):
        apply_neuron_factors(g, s)
    reps, groups = scale_classes(g, conv.plan.steps)
    assert groups[reps[ln["src_layer"]]] == set()


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(["relu_res_cnn", "tanh_mlp", "siren", "cnn", "mlp"]), seed=st.integers(0, 10_000))
def test_canonical_scaling_is_one_representative_per_orbit(name, seed):
    spec, model, conv = _convert(name, seed % 5)
    base, _ = canonical_scaling(conv.graph, conv.plan.steps)
    moved = random_rescaling(conv.graph, np.random.default_rng(seed), 1e3, steps=conv.plan.steps)
    again, _ = canonical_scaling(moved, conv.plan.steps)
    np.testing.assert_allclose(again.weight, base.weight, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(again.bias, base.bias, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.nan_to_num(again.extra), np.nan_to_num(base.extra), rtol=1e-4, atol=1e-6)
    x = sample_input(spec, n=8, seed=seed)
    with torch.no_grad():
        assert _rel(_run(spec, base, x), model(x)) < 1e-5


@settings(max_examples=15, deadline=None)
@given(name=st.sampled_from(["relu_res_cnn", "tanh_mlp", "cnn", "mlp"]), seed=st.integers(0, 10_000))
def test_the_balanced_form_is_one_representative_per_orbit_with_equal_in_and_out_norms(name, seed):
    """Invariant like the canonical form (it starts there), function-preserving, and balanced: every
    rescalable neuron of an untied layer ends with incoming norm = outgoing norm, and the total
    squared norm is no more than the network's own (the balance minimises it over the orbit)."""
    spec, model, conv = _convert(name, seed % 5)
    base = balanced_scaling(conv.graph, conv.plan.steps, sweeps=200)
    moved = random_rescaling(conv.graph, np.random.default_rng(seed), 1e3, steps=conv.plan.steps)
    again = balanced_scaling(moved, conv.plan.steps, sweeps=200)
    np.testing.assert_allclose(again.weight, base.weight, rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(again.bias, base.bias, rtol=1e-3, atol=1e-5)
    x = sample_input(spec, n=8, seed=seed)
    with torch.no_grad():
        assert _rel(_run(spec, base, x), model(x)) < 1e-4
    reps, groups = scale_classes(base, conv.plan.steps)
    untied = [layer for layer, rep in enumerate(reps) if SCALE in groups[rep] and reps.count(rep) == 1]
    assert untied or name == "tanh_mlp"
    w, x_ = base.weight.astype(np.float64), base.extra.astype(np.float64)
    for layer in untied:
        inn, _ = _incoming_norms(base, w, base.bias.astype(np.float64), x_, {layer})
        out = _outgoing_norms(base, w, x_, {layer})
        nodes = base.node_layer == layer
        np.testing.assert_allclose(inn[nodes], out[nodes], rtol=2e-2)
    sq = lambda g: float((g.weight.astype(np.float64) ** 2).sum() + (g.bias.astype(np.float64) ** 2).sum())  # noqa: E731
    assert sq(base) <= sq(conv.graph) * (1 + 1e-6) or not untied


def test_a_dead_neuron_keeps_its_scale_and_the_forms_stay_finite():
    """A collapsed network (one development zoo had hidden neurons with incoming norms of 1e-27):
    dividing by such a norm overflowed float32 and turned a whole training run into NaN. A neuron
    whose incoming coefficients are all below DEAD is left unscaled, so the forms stay finite and
    the network computes the same function. (What such a neuron feeds is then only as invariant as
    the neuron itself: float noise is not a direction.)"""
    spec, model, conv = _convert("relu_res_cnn", 1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    w = state["layers.0.weight"]                   # the first conv: its channel 2 dies
    w[2] = 1e-28 * torch.sign(w[2])
    state["layers.0.bias"][2] = 0.0
    model.load_state_dict(state)
    conv = convert_state_dict(model.state_dict(), spec)
    for form in (canonical_scaling(conv.graph, conv.plan.steps)[0], balanced_scaling(conv.graph, conv.plan.steps)):
        assert np.isfinite(form.weight).all() and np.isfinite(form.bias).all()
        assert np.isfinite(form.extra[~np.isnan(conv.graph.extra)]).all()
        x = sample_input(spec, n=8, seed=0)
        with torch.no_grad():
            assert _rel(_run(spec, form, x), model(x)) < 1e-4
