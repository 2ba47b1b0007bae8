"""Elementwise products: multiplicative gates ``x * g`` and learned per-channel scales.

A gate (squeeze-excitation's ``scale * input``, or any product of two neuron tensors) makes a new
neuron layer ``P`` of the gated channels: ``p_c = x_c * g_c``. It is two diagonal operations, a
``residual`` edge ``x_c -> p_c`` (the value that is gated) and a ``gate`` edge ``g_c -> p_c`` (the
multiplicative relation of its own); neither carries a weight of the network, so both have
weight 1. A value is the sum of its additive (residual) inputs times the product of its gates.

A product with a parameter of one value per channel (ConvNeXt's layer scale) is a diagonal
``norm`` edge whose weight is that parameter, into a new neuron layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.neural_graph.concat import source_layers
from pipeline.neural_graph.ops.base import ChannelParams, UnitOp, register

aten = torch.ops.aten


@dataclass(kw_only=True)
class Gate(UnitOp):
    kind = "gate"

    def scaling_ties(self):
        return [], set(source_layers(self))     # the gate's own layer takes no factor

    def rescale(self, i, s, src, dst, e, weight, extra):
        if not np.allclose(s[src], 1.0):
            raise ValueError(f"op {i} (gate) cannot take factors on its gate neurons")


@dataclass(kw_only=True)
class Scale(ChannelParams):
    kind = "scale"


GATE = "gate"


class GateOps:
    """Tracer handler for ``aten.mul.Tensor`` (registered below)."""

    def mul(self, node) -> None:
        a, b = node.args[:2]
        for param, other in ((a, b), (b, a)):
            if isinstance(param, torch.fx.Node) and param.name in self.param_of:
                return self.channel_scale(node, param, other)
        if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
            raise self.unsupported(node, "product with a constant")
        va, vb = self.val(node, a), self.val(node, b)
        out = tuple(int(s) for s in node.meta["val"].shape)
        # The gate is the operand broadcast over the other's positions (else the second operand).
        x, g = (vb, va) if (tuple(a.meta["val"].shape) != out and tuple(b.meta["val"].shape) == out) else (va, vb)
        if (self.width(x) != self.width(g) or x.folded is not None or g.folded is not None or x.tokens or g.tokens
                or x.channels_last != g.channels_last or math.prod(g.spatial) not in (1, math.prod(x.spatial))):
            raise self.unsupported(node, "product of tensors that are not matching neuron layers",
                                   f"shapes {list(a.meta['val'].shape)} and {list(b.meta['val'].shape)}")
        srcs = [self.source(node, x), self.source(node, g)]
        dst = self.new_layer(self.width(x), "gate")
        self.add_op(node, kind="residual", relation="residual", **srcs[0], dst_layer=dst, kernel=[1, 1])
        self.add_op(node, kind=GATE, relation=GATE, **srcs[1], dst_layer=dst, kernel=[1, 1])
        self.vals[node.name] = type(x)(dst, x.channels_last, x.spatial)

    def channel_scale(self, node, param, other) -> None:
        v = self.val(node, other)
        key = self.key(param)
        shape = [int(s) for s in self.state[key].shape]
        c = self.width(v)
        want = [c] if v.channels_last else [c] + [1] * len(v.spatial)
        trimmed = shape[next((i for i, s in enumerate(shape) if s != 1), len(shape)):]
        if trimmed != want or v.folded is not None or v.tokens:
            raise self.unsupported(node, "product with a parameter that is not one value per channel",
                                   f"parameter shape {shape}")
        src = self.source(node, v)
        dst = self.new_layer(c, "norm")
        self.add_op(node, kind="scale", relation="norm", **src, dst_layer=dst, weight_key=key, bias_key=None,
                    param_shape=shape, kernel=[1, 1])
        self.vals[node.name] = type(v)(dst, v.channels_last, v.spatial)


register(Gate, Scale, tracer=GateOps, aten={aten.mul.Tensor: "mul"})
