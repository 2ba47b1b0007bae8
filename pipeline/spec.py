"""The JSON architecture spec that accompanies a state-dict checkpoint.

A spec is a JSON object::

    {"format": "zoograph.spec/1",
     "input_shape": [1, 8, 8],            # one sample, no batch dim; [T] with "input_dtype": "int64" for tokens
     "layers": [
        {"type": "conv2d", "out_channels": 8, "kernel_size": 3, "padding": 1},
        {"type": "batchnorm"},
        {"type": "activation", "fn": "relu"},
        {"type": "residual", "body": [ ...layers that keep the shape... ]},
        {"type": "adaptive_avgpool", "output_size": 2},
        {"type": "flatten"},
        {"type": "linear", "out_features": 10}
     ]}

Layer types and their keys (defaults in brackets):
    linear: out_features, bias [true]
    conv1d / conv2d: out_channels, kernel_size, stride [1], padding [0], dilation [1], groups [1], bias [true]
    batchnorm: eps [1e-5], momentum [0.1]        (1d or 2d from the input rank)
    layernorm: eps [1e-5]                        (over the last dimension)
    activation: fn in relu, gelu, silu, tanh, sigmoid, leaky_relu, relu6, hardswish, hardsigmoid, sin, elu, identity
    maxpool / avgpool: kernel_size, stride [kernel_size]
    zeropad: padding (one int, or [left, right, top, bottom]: TensorFlow's 'SAME' padding of a
             strided convolution is asymmetric, the extra row and column after)
    adaptive_avgpool: output_size
    flatten; dropout: p [0.0]
    embedding: num_embeddings, embedding_dim     (first layer only, input_dtype "int64")
    residual: body (a list of layers whose output has the input's shape); computes x + body(x)

Input sizes (in_features, in_channels) are inferred by running a zero tensor through the layers.
State-dict keys are ``layers.<i>...`` with ``layers.<i>.body.<j>...`` inside residual blocks.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import nn

from pipeline.neural_graph.vocabulary import spec_activations
from zoocore.errors import SpecError

SPEC_FORMAT = "zoograph.spec/1"



class Residual(nn.Module):
    """x + body(x)."""

    def __init__(self, body: nn.Sequential):
        super().__init__()
        self.body = body

    def forward(self, x):
        return x + self.body(x)


_ACTIVATIONS = spec_activations()


class SpecNet(nn.Module):
    """A network built from a spec; ``layers`` is an nn.Sequential."""

    def __init__(self, layers: nn.Sequential):
        super().__init__()
        self.layers = layers

    def forward(self, x):
        return self.layers(x)


def layer_value(layer: dict, key: str, where: str, default: Any = ...) -> Any:
    """``layer[key]`` of a JSON spec layer, or ``default``; a one-line SpecError when it is required."""
    if key in layer:
        return layer[key]
    if default is ...:
        raise SpecError(f"{where}: layer of type {layer.get('type')!r} needs {key!r}")
    return default


def _activation(layer: dict, x: torch.Tensor, where: str) -> nn.Module:
    fn = layer_value(layer, "fn", where)
    if fn not in _ACTIVATIONS:
        raise SpecError(f"{where}: unknown activation {fn!r}; known: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[fn]()


def _pool(layer: dict, x: torch.Tensor, where: str) -> nn.Module:
    k = layer_value(layer, "kernel_size", where)
    cls = {("maxpool", True): nn.MaxPool2d, ("maxpool", False): nn.MaxPool1d,
           ("avgpool", True): nn.AvgPool2d, ("avgpool", False): nn.AvgPool1d}[(layer["type"], x.dim() == 4)]
    return cls(k, stride=layer.get("stride", k))


def _zeropad(layer: dict, x: torch.Tensor, where: str) -> nn.Module:
    pad = layer_value(layer, "padding", where)
    sides = pad if isinstance(pad, list) and len(pad) == 4 else [pad]
    if not all(isinstance(p, int) and p >= 0 for p in sides):
        raise SpecError(f"{where}: zeropad 'padding' is one int or [left, right, top, bottom], "
                        f"non-negative; got {pad!r}")
    if x.dim() != 4:
        raise SpecError(f"{where}: zeropad needs a (C, H, W) input, got shape {list(x.shape[1:])}")
    return nn.ZeroPad2d(tuple(sides) if len(sides) == 4 else pad)


def _adaptive_avgpool(layer: dict, x: torch.Tensor, where: str) -> nn.Module:
    cls = nn.AdaptiveAvgPool2d if x.dim() == 4 else nn.AdaptiveAvgPool1d
    return cls(layer_value(layer, "output_size", where))


# layer types that are steps between operations (no edges); the operation kinds' own layer types
# (linear, conv, norms, embedding, residual) are registered by their modules (ops.base.SPEC_LAYERS)
STEP_LAYERS = {"activation": _activation, "maxpool": _pool, "avgpool": _pool, "zeropad": _zeropad,
               "adaptive_avgpool": _adaptive_avgpool, "flatten": lambda layer, x, where: nn.Flatten(),
               "dropout": lambda layer, x, where: nn.Dropout(layer.get("p", 0.0))}


def _make(layer: dict, x: torch.Tensor, where: str) -> nn.Module:
    from pipeline.neural_graph.ops import SPEC_LAYERS

    if not isinstance(layer, dict) or "type" not in layer:
        raise SpecError(f"{where}: each layer is an object with a 'type'")
    build = STEP_LAYERS.get(layer["type"]) or SPEC_LAYERS.get(layer["type"])
    if build is None:
        raise SpecError(f"{where}: unknown layer type {layer['type']!r}; known: "
                        f"{', '.join(sorted({*STEP_LAYERS, *SPEC_LAYERS}))}")
    return build(layer, x, where)


def build_sequence(layers: list, x: torch.Tensor, where: str) -> nn.Sequential:
    if not isinstance(layers, list) or not layers:
        raise SpecError(f"{where}: 'layers' must be a non-empty list")
    mods = []
    for i, layer in enumerate(layers):
        try:
            mod = _make(layer, x, f"{where}[{i}]")
        except (ValueError, TypeError) as exc:     # torch's own checks, e.g. strided 'same' padding
            raise SpecError(f"{where}[{i}]: invalid {layer.get('type')!r} layer: {exc}") from exc
        with torch.no_grad():
            try:
                x = mod.eval()(x)
            except RuntimeError as exc:
                raise SpecError(f"{where}[{i}]: layer of type {layer['type']!r} does not fit its input "
                                f"of shape {list(x.shape[1:])}: {str(exc).splitlines()[0]}") from exc
        mods.append(mod)
    return nn.Sequential(*mods)


def example_input(spec: dict, batch: int = 2) -> torch.Tensor:
    """A deterministic example input of the spec's shape (zeros; token ids 0 for int inputs)."""
    shape = [batch] + [int(s) for s in spec["input_shape"]]
    if spec.get("input_dtype", "float32").startswith("int"):
        return torch.zeros(shape, dtype=torch.int64)
    return torch.zeros(shape)


def validate_spec(spec: Any) -> dict:
    """Check the top-level keys of a spec; returns it."""
    if not isinstance(spec, dict):
        raise SpecError("an architecture spec is a JSON object")
    if spec.get("format", SPEC_FORMAT) != SPEC_FORMAT:
        raise SpecError(f"unknown spec format {spec.get('format')!r}, expected {SPEC_FORMAT!r}")
    shape = spec.get("input_shape")
    if not isinstance(shape, list) or not shape or not all(isinstance(s, int) and s > 0 for s in shape):
        raise SpecError("'input_shape' must be a list of positive integers (one sample, no batch dimension)")
    if "layers" not in spec:
        raise SpecError("a spec needs 'layers'")
    return spec


def build_module(spec: dict) -> SpecNet:
    """Build the (randomly initialised) network a spec describes."""
    validate_spec(spec)
    return SpecNet(build_sequence(spec["layers"], example_input(spec, 1), "layers")).eval()


def spec_hash(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
