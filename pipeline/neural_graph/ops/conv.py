"""Convolutions (``aten.convolution``, ``nn.Conv1d`` / ``nn.Conv2d``): a (kh x kw) edge per
(output channel, input channel of its group) pair."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pipeline.neural_graph.concat import in_size, source_layers
from pipeline.neural_graph.ops.base import DenseOp, node_shape, register
from pipeline.spec import layer_value
from zoocore.errors import SpecError

aten = torch.ops.aten


def describe_dense(op: DenseOp, sizes) -> str:
    """``kind(in->out kh x kw gG)``: the summary of a weight layer (conv, linear)."""
    k = f" {op.kernel[0]}x{op.kernel[1]}" if op.relation == "conv" else ""
    g = f" g{op.groups}" if op.groups > 1 else ""
    return f"{op.kind}({in_size(op, sizes)}->{sizes[op.dst_layer]}{k}{g})"


@dataclass(kw_only=True)
class Conv(DenseOp):
    kind = "conv"
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


def conv_layer(layer: dict, x: torch.Tensor, where: str) -> nn.Module:
    """The spec layers ``conv1d`` / ``conv2d``: out_channels, kernel_size, stride [1], padding [0],
    dilation [1], groups [1], bias [true]."""
    kind = layer["type"]
    cls = nn.Conv1d if kind == "conv1d" else nn.Conv2d
    if x.dim() != (3 if kind == "conv1d" else 4):
        raise SpecError(f"{where}: {kind} needs a {'(C, L)' if kind == 'conv1d' else '(C, H, W)'} input, "
                        f"got shape {list(x.shape[1:])}")
    return cls(x.shape[1], int(layer_value(layer, "out_channels", where)), layer_value(layer, "kernel_size", where),
               stride=layer.get("stride", 1), padding=layer.get("padding", 0), dilation=layer.get("dilation", 1),
               groups=int(layer.get("groups", 1)), bias=bool(layer.get("bias", True)))


register(Conv, tracer=ConvTracing, aten={aten.convolution.default: "conv"},
         spec=ConvSpec, modules={(nn.Conv1d, nn.Conv2d): "conv"},
         spec_layers={"conv1d": conv_layer, "conv2d": conv_layer})
