"""Convolutions (``aten.convolution``, ``nn.Conv1d`` / ``nn.Conv2d``): a (kh x kw) edge per
(output channel, input channel of its group) pair."""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.neural_graph.concat import in_size, source_layers
from pipeline.neural_graph.ops.base import DenseOp, OpKind, register


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


register(Conv)
