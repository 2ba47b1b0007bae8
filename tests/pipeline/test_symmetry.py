"""Scaling and sign symmetries: function-preserving transforms and the scale canonicalisation, and
the fast preparation's agreement, bit for bit, with the reference implementation (today's code)."""
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from pipeline.neural_graph.build import state_dict_from_graph
from pipeline.neural_graph.convert import convert_state_dict
from pipeline.neural_graph.graph import NeuralGraph
from pipeline.neural_graph.vocabulary import NODE_TYPES
from pipeline.neural_graph.symmetry import (DEAD, SCALE, SIGN, _incoming_norms, _outgoing_norms, apply_neuron_factors,
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


# --------------------------------------------------------------------------- bit-for-bit against today's code
#
# The reference implementation: pipeline/neural_graph/symmetry.py's apply_neuron_factors, norms,
# canonical_scaling and balanced_scaling as they were before issue #56 (item 1) made preparation
# linear in the graph, copied verbatim (only renamed; scale_classes, unchanged, is shared). Every
# layer (canonical) and every sweep (balanced) recomputes norms over the whole graph and copies it:
# slow, but it defines the representative. The rewrite must give the same float32 arrays, bit for
# bit (signed zeros and NaN payloads included), not merely close ones.

def _ref_apply_neuron_factors(graph, factors):
    s = np.asarray(factors, dtype=np.float64)
    if s.shape != (graph.num_nodes,) or not np.isfinite(s).all() or (s == 0).any():
        raise ValueError(f"factors must be {graph.num_nodes} finite non-zero numbers")
    hidden = graph.node_type == NODE_TYPES.index("hidden")
    if not np.allclose(s[~hidden], 1.0):
        raise ValueError("input and output neurons cannot be rescaled")
    weight = graph.weight.astype(np.float64)
    bias = graph.bias.astype(np.float64) * s
    extra = graph.extra.astype(np.float64)
    for i, op in enumerate(graph.ops):
        e = np.flatnonzero(graph.edge_op == i)
        op.rescale(i, s, graph.src[e], graph.dst[e], e, weight, extra)
    return NeuralGraph(
        node_type=graph.node_type, node_layer=graph.node_layer, node_position=graph.node_position,
        bias=bias.astype(np.float32), extra=extra.astype(np.float32), layer_activation=list(graph.layer_activation),
        src=graph.src, dst=graph.dst, relation=graph.relation, edge_op=graph.edge_op,
        weight=weight.astype(np.float32), kernel_shape=graph.kernel_shape, ops=graph.ops, buffers=dict(graph.buffers))


def _ref_incoming_norms(graph, weight, bias, extra, layers):
    sq = np.zeros(graph.num_nodes)
    total = np.zeros(graph.num_nodes)
    for i, op in enumerate(graph.ops):
        if op.dst_layer not in layers:
            continue
        e = np.flatnonzero(graph.edge_op == i)
        dst = graph.dst[e]
        parts = op.incoming(weight[e], dst, extra)
        if parts is None:
            continue
        np.add.at(sq, dst, parts[0])
        np.add.at(total, dst, parts[1])
    return np.sqrt(sq + bias ** 2), total + bias


def _ref_canonical_scaling(graph, steps=None):
    reps, groups = scale_classes(graph, steps)
    sizes, offsets = graph.layer_sizes(), graph.layer_offsets()
    s = np.ones(graph.num_nodes)
    done = set()
    current = graph
    for layer, rep in enumerate(reps):
        group = groups[rep]
        if not group or rep in done:
            continue
        done.add(rep)
        norm, total = _ref_incoming_norms(current, current.weight.astype(np.float64),
                                          current.bias.astype(np.float64), current.extra.astype(np.float64), {layer})
        sl = slice(offsets[layer], offsets[layer] + sizes[layer])
        f = np.ones(int(sizes[layer]))
        if SCALE in group:
            live = norm[sl] > DEAD
            f = np.where(live, 1.0 / np.where(live, norm[sl], 1.0), 1.0)
        if SIGN in group:
            f = f * np.where(total[sl] < 0, -1.0, 1.0)
        step = np.ones(graph.num_nodes)
        for other, r in enumerate(reps):
            if r == rep:
                step[offsets[other]:offsets[other] + sizes[other]] = f
        current = _ref_apply_neuron_factors(current, step)
        s *= step
    return current, s


def _ref_outgoing_norms(graph, weight, extra, layers):
    sq = np.zeros(graph.num_nodes)
    for i, op in enumerate(graph.ops):
        if op.src_layer not in layers and not op.get("src_segments"):
            continue
        e = np.flatnonzero(graph.edge_op == i)
        src, dst = graph.src[e], graph.dst[e]
        parts = op.incoming(weight[e], dst, extra)
        if parts is None:
            continue
        keep = np.isin(graph.node_layer[src], list(layers))
        np.add.at(sq, src[keep], parts[0][keep])
    return np.sqrt(sq)


def _ref_balanced_scaling(graph, steps=None, sweeps=30, tolerance=1e-7):
    current, _ = _ref_canonical_scaling(graph, steps)
    reps, groups = scale_classes(current, steps)
    sizes, offsets = current.layer_sizes(), current.layer_offsets()
    classes = {}
    for layer, rep in enumerate(reps):
        if SCALE in groups[rep]:
            classes.setdefault(rep, []).append(layer)
    layers = {layer for members in classes.values() for layer in members}
    for _ in range(sweeps if classes else 0):
        w, x = current.weight.astype(np.float64), current.extra.astype(np.float64)
        inn, _ = _ref_incoming_norms(current, w, current.bias.astype(np.float64), x, layers)
        out = _ref_outgoing_norms(current, w, x, layers)
        step = np.ones(current.num_nodes)
        for rep, members in classes.items():
            n = int(sizes[rep])
            si, so = np.zeros(n), np.zeros(n)
            for layer in members:
                sl = slice(offsets[layer], offsets[layer] + sizes[layer])
                si += inn[sl] ** 2
                so += out[sl] ** 2
            ok = (si > DEAD ** 2) & (so > DEAD ** 2)
            f = np.where(ok, (np.where(ok, so, 1.0) / np.where(ok, si, 1.0)) ** 0.25, 1.0)
            for layer in members:
                step[offsets[layer]:offsets[layer] + sizes[layer]] = f
        current = _ref_apply_neuron_factors(current, step)
        if np.abs(step - 1.0).max() < tolerance:
            break
    return current


_ARRAYS = ("node_type", "node_layer", "node_position", "bias", "extra", "src", "dst", "relation", "edge_op", "weight")


def assert_same_graph(got, want):
    """Every array equal bit for bit (np.array_equal on the raw bits: -0.0 is not 0.0, NaN equals
    itself), and the same dtypes, shapes and structure."""
    for name in _ARRAYS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        bits = np.dtype(f"u{a.dtype.itemsize}")
        assert np.array_equal(np.ascontiguousarray(a).view(bits), np.ascontiguousarray(b).view(bits)), \
            f"{name}: {int((a != b).sum())} entries differ"
    assert got.layer_activation == want.layer_activation and tuple(got.kernel_shape) == tuple(want.kernel_shape)
    assert got.ops is want.ops and got.buffers == want.buffers


def assert_same_norms(graph, steps):
    """The per-neuron norms a balancing sweep reads (float64, summed edge by edge in today's order),
    bit for bit: rounding to float32 can hide a changed summation order, these cannot."""
    from pipeline.neural_graph.scaled_edges import BalanceSums, ScaledGraph

    reps, groups = scale_classes(graph, steps)
    layers = {layer for layer, rep in enumerate(reps) if SCALE in groups[rep]}
    if not layers:
        return
    sq_in, sq_out = BalanceSums(ScaledGraph(graph), layers)()
    w, x, b = graph.weight.astype(np.float64), graph.extra.astype(np.float64), graph.bias.astype(np.float64)
    inn, _ = _ref_incoming_norms(graph, w, b, x, layers)
    bits = np.dtype(np.uint64)
    assert np.array_equal(np.sqrt(sq_in + b ** 2).view(bits), inn.view(bits))
    assert np.array_equal(np.sqrt(sq_out).view(bits), _ref_outgoing_norms(graph, w, x, layers).view(bits))


def assert_same_preparation(graph, steps, sweeps=(30,)):
    """canonical_scaling (graph and factors), balanced_scaling and apply_neuron_factors agree with the
    reference implementation bit for bit."""
    got, s = canonical_scaling(graph, steps)
    want, s_ref = _ref_canonical_scaling(graph, steps)
    assert_same_graph(got, want)
    assert np.array_equal(s.view(np.uint64), s_ref.view(np.uint64))
    assert_same_norms(graph, steps)
    assert_same_norms(got, steps)
    for n in sweeps:
        assert_same_graph(balanced_scaling(graph, steps, sweeps=n), _ref_balanced_scaling(graph, steps, sweeps=n))
    factors = random_factors(graph, np.random.default_rng(7), 1e3, steps)
    assert_same_graph(apply_neuron_factors(graph, factors), _ref_apply_neuron_factors(graph, factors))


def _shuffled_edges(graph, seed=0):
    """The same graph with its edges in a random order (edge_op no longer sorted)."""
    p = np.random.default_rng(seed).permutation(graph.num_edges)
    return NeuralGraph(
        node_type=graph.node_type, node_layer=graph.node_layer, node_position=graph.node_position, bias=graph.bias,
        extra=graph.extra, layer_activation=list(graph.layer_activation), src=graph.src[p], dst=graph.dst[p],
        relation=graph.relation[p], edge_op=graph.edge_op[p], weight=graph.weight[p], kernel_shape=graph.kernel_shape,
        ops=graph.ops, buffers=dict(graph.buffers))


@pytest.mark.parametrize("name", sorted(CASES))
def test_preparation_is_todays_bit_for_bit_on_the_test_networks(name):
    """Plain, with batch norms, residuals, depthwise and grouped convs, tanh (signs) and sin: the
    graphs as converted, rescaled and sign-flipped (so padded kernel entries hold signed zeros),
    with the plan's steps and without, and with edges not stored operation by operation."""
    for seed in (0, 1):
        spec, model, conv = _convert(name, seed)
        steps = conv.plan.steps
        assert_same_preparation(conv.graph, steps, sweeps=(30, 200))
        moved = random_rescaling(conv.graph, np.random.default_rng(seed), 1e3, steps=steps)
        assert_same_preparation(moved, steps, sweeps=(30, 3))
        assert_same_preparation(moved, None)
    assert_same_preparation(_shuffled_edges(moved), steps, sweeps=(30, 3))


def test_preparation_is_todays_bit_for_bit_with_a_dead_neuron():
    spec, model, conv = _convert("relu_res_cnn", 1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["layers.0.weight"][2] = 1e-28 * torch.sign(state["layers.0.weight"][2])
    state["layers.0.bias"][2] = 0.0
    model.load_state_dict(state)
    conv = convert_state_dict(model.state_dict(), spec)
    assert_same_preparation(conv.graph, conv.plan.steps)


def test_preparation_is_todays_bit_for_bit_when_the_fast_paths_do_not_apply(monkeypatch):
    """Non-zero padding (kept in full), operations whose rows are kept whole (a pattern numpy does
    not sum as expected, a ``rescale`` hook not known to multiply rows by one factor), edges that
    do not run destination by destination: the slower paths give the same graphs."""
    from pipeline.neural_graph import scaled_edges

    spec, model, conv = _convert("relu_res_cnn", 0)
    steps = conv.plan.steps
    moved = random_rescaling(conv.graph, np.random.default_rng(0), 1e3, steps=steps)
    padded = _shuffled_edges(moved)
    padded.weight[::7, 0] = 1e-3                 # outside every 3x3 and 1x1 kernel of the 5x5 frame
    assert_same_preparation(padded, steps, sweeps=(30,))
    monkeypatch.setattr(scaled_edges, "row_sum_tree", lambda width, cols: None)
    assert_same_preparation(moved, steps, sweeps=(30,))
    monkeypatch.undo()
    monkeypatch.setattr(scaled_edges, "_ROW_FACTOR_HOOKS", set())
    assert_same_preparation(moved, steps, sweeps=(30,))


@settings(max_examples=40, deadline=None)
@given(width=st.sampled_from([1, 3, 9, 25, 49, 81, 121, 169, 300]), data=st.data())
def test_row_sum_tree_is_numpys_row_sum(width, data):
    """The additions numpy makes summing a padded row, on its non-zero entries only (bit for bit)."""
    from pipeline.neural_graph.scaled_edges import evaluate, row_sum_tree

    cols = sorted(data.draw(st.sets(st.integers(0, width - 1), min_size=1, max_size=width)))
    tree = row_sum_tree(width, tuple(cols))
    assert tree is not None
    rng = np.random.default_rng(width)
    rows = np.zeros((64, width))
    rows[:, cols] = rng.standard_normal((64, len(cols))) * 10.0 ** rng.uniform(-8, 8, (64, len(cols)))
    assert np.array_equal(evaluate(tree, rows[:, cols].T), rows.sum(1))
    assert np.array_equal(evaluate(tree, (rows[:, cols] ** 2).T), (rows ** 2).sum(1))


def _downsample(cin, cout, stride=1):
    from torch import nn
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


def _tiny_resnet():
    """torchvision's BasicBlock: residuals, batch norms, a strided 1x1 downsample."""
    from torch import nn
    from torchvision.models.resnet import BasicBlock
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         BasicBlock(16, 16), BasicBlock(16, 32, 2, _downsample(16, 32, 2)),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def _tiny_resnext():
    """torchvision's Bottleneck with grouped 3x3 convs (ResNeXt's block)."""
    from torch import nn
    from torchvision.models.resnet import Bottleneck
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         Bottleneck(16, 8, downsample=_downsample(16, 32), groups=4, base_width=32),
                         Bottleneck(32, 8, groups=4, base_width=32),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def _tiny_mobilenet_v2():
    """Depthwise convs, inverted residuals, ReLU6 (no scale symmetry) between ReLU-free projections."""
    from torchvision.models import MobileNetV2
    return MobileNetV2(num_classes=10, width_mult=0.5, inverted_residual_setting=[[1, 16, 1, 1], [6, 16, 2, 2]])


def _tiny_mobilenet_v3():
    """Squeeze-excitation gates, hardswish, 5x5 depthwise convs (a 5x5 kernel frame)."""
    from functools import partial

    from torchvision.models.mobilenetv3 import InvertedResidualConfig, MobileNetV3
    conf = partial(InvertedResidualConfig, width_mult=1.0)
    return MobileNetV3([conf(16, 3, 16, 16, True, "RE", 2, 1), conf(16, 3, 32, 16, False, "RE", 1, 1),
                        conf(16, 5, 32, 24, True, "HS", 2, 1)], last_channel=32, num_classes=10)


def _tiny_shufflenet():
    """Concatenations and channel shuffles: operations reading ``src_segments``."""
    from torchvision.models.shufflenetv2 import ShuffleNetV2
    return ShuffleNetV2([1, 2, 1], [8, 16, 32, 64, 64], num_classes=10)


TORCHVISION = {"resnet": _tiny_resnet, "resnext": _tiny_resnext, "mobilenet_v2": _tiny_mobilenet_v2,
               "mobilenet_v3": _tiny_mobilenet_v3, "shufflenet": _tiny_shufflenet}


def torchvision_graph(model, image=32, seed=0):
    """(graph, steps) of a torchvision model, its parameters and statistics drawn at random."""
    from pipeline.neural_graph.build import graph_from_plan
    from pipeline.neural_graph.plan import plan_from_module

    model = randomize(model, seed)
    plan = plan_from_module(model, torch.randn(2, 3, image, image))
    return graph_from_plan(plan, dict(model.state_dict())), plan.steps


@pytest.mark.slow          # seconds each, most of it in the reference implementation
@pytest.mark.parametrize("name", sorted(TORCHVISION))
def test_preparation_is_todays_bit_for_bit_on_torchvision_blocks(name):
    graph, steps = torchvision_graph(TORCHVISION[name]())
    assert_same_preparation(graph, steps)
    assert_same_preparation(random_rescaling(graph, np.random.default_rng(0), 1e3, steps=steps), steps, sweeps=(5,))


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ZOOGRAPH_LARGE_TESTS") != "1",
                    reason="two minutes, nearly all in the reference implementation; the torchvision blocks above "
                           "cover ResNet-18's operations (set ZOOGRAPH_LARGE_TESTS=1 to run it)")
def test_preparation_is_todays_bit_for_bit_on_resnet18():
    """The default input of every run, at random init (the reference takes minutes: a few sweeps)."""
    import torchvision

    graph, steps = torchvision_graph(torchvision.models.resnet18(weights=None), image=64)
    assert_same_preparation(graph, steps, sweeps=(2,))


@pytest.mark.slow
def test_preparation_is_todays_bit_for_bit_on_the_development_zoos(catalog_dir):
    """Every model of the CNN and MLP zoos the tests train, as stored in the catalog."""
    from graphstore import duck
    from pipeline.graph_codec import read_graphs, read_plans

    con = duck.connect(catalog_dir)
    ids = [m for m, in con.execute("SELECT model_id FROM models ORDER BY model_id").fetchall()]
    arch, plans = read_plans(con, ids)
    for m, graph in zip(ids, read_graphs(con, ids, plans=plans)):
        assert_same_preparation(graph, plans[arch[m]].steps)
