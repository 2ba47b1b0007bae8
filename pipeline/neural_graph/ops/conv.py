"""Convolutions (``aten.convolution``, ``nn.Conv1d`` / ``nn.Conv2d``): a (kh x kw) edge per
(output channel, input channel of its group) pair."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pipeline.neural_graph.concat import in_size, source_layers
from pipeline.neural_graph.ops.base import DenseOp, OpKind, node_shape, register

aten = torch.ops.aten


def describe_dense(op: DenseOp, sizes) -> str:
    """``kind(in->out kh x kw gG)``: the summary of a weight layer (conv, linear)."""
    k = f" {op.kernel[0]}x{op.kernel[1]}" if op.relation == "conv" else ""
    g = f" g{op.groups}" if op.groups > 1 else ""
    return f"{op.kind.value}({in_size(op, sizes)}->{sizes[op.dst_layer]}{k}{g})"


@dataclass(kw_only=True)
class Conv(DenseOp):
    kind = OpKind.CONV
    groups: int = 1
    stride: list[int]
    padding: list[int]
    dilation: list[int]

    @property
    def n_groups(self) -> int:
        return self.groups

    @property
    def channelwise(self) -> bool:
        return self.groups > 1 and self.weight_shape[1] == 1     # depthwise
    def permutation_ties(self, sizes):
        if self.groups <= 1:
            return [], set()
        s, d = self.src_layer, self.dst_layer
        if self.src_segments is not None:
            return [], set(source_layers(self) + [d])
        if self.weight_shape[1] == 1 and self.weight_shape[0] == sizes[s]:
            return [(s, d)], set()                   # depthwise: channel c -> channel c
        return [], {s, d}

    def describe(self, sizes) -> str:
        return describe_dense(self, sizes)


class ConvTracing:
    """Tracer handler for ``aten.convolution`` (mixed into plan._Tracer)."""

    def conv(self, node) -> None:
        x, w, b, stride, padding, dilation, transposed, _out_pad, groups = node.args
        if transposed:
            raise self.unsupported(node, "transposed convolution")
        v = self.val(node, x)
        wkey = self.key(w)
        if wkey is None:
            raise self.unsupported(node, "convolution whose weight is not a parameter")
        wshape = list(self.state[wkey].shape)
        cout, cin_g = wshape[0], wshape[1]
        kernel = wshape[2:]
        kh, kw = (1, kernel[0]) if len(kernel) == 1 else (kernel[0], kernel[1])
        if cin_g * groups != self.width(v) or v.folded is not None:
            raise self.unsupported(node, "convolution whose input channels do not match the neurons")
        src = self.source(node, v)
        dst = self.new_layer(cout, "conv")
        self.add_op(node, kind="conv", relation="conv", **src, dst_layer=dst, weight_key=wkey,
                    bias_key=self.key(b), weight_shape=wshape, kernel=[kh, kw], groups=int(groups),
                    stride=list(stride), padding=list(padding), dilation=list(dilation))
        self.vals[node.name] = self.Val(dst, False, node_shape(node)[2:])


class ConvSpec:
    """Spec-planner rule for ``nn.Conv1d`` / ``nn.Conv2d`` (mixed into spec_plan._SpecPlanner)."""

    def conv(self, mod, path: str, v, x: torch.Tensor, y: torch.Tensor):
        if v.channels_last or v.folded is not None or mod.in_channels != self.layers[v.layer].size:
            raise self.NotCovered("conv input")
        if isinstance(mod.padding, str):     # ATen receives 'same' / 'valid' in shapes of its own
            raise self.NotCovered("string padding")
        wshape = list(mod.weight.shape)
        kernel = wshape[2:]
        kh, kw = (1, kernel[0]) if len(kernel) == 1 else (kernel[0], kernel[1])
        dst = self.new_layer(wshape[0], "conv")
        self.add_op(path, kind="conv", relation="conv", src_layer=v.layer, dst_layer=dst,
                    weight_key=f"{path}.weight", bias_key=self.key(path, "bias"), weight_shape=wshape,
                    kernel=[kh, kw], groups=int(mod.groups), stride=list(mod.stride), padding=list(mod.padding),
                    dilation=list(mod.dilation))
        return self.Val(dst, False, tuple(y.shape[2:]))


register(Conv, tracer=ConvTracing, aten={aten.convolution.default: "conv"},
         spec=ConvSpec, modules={(nn.Conv1d, nn.Conv2d): "conv"})
