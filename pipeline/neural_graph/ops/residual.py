"""Residual sums: a diagonal edge of weight 1 from each summand's channel c to the sum's channel c
(``tokens``: the token range a summand fills when a class token is prepended)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.neural_graph.concat import source_layers
from pipeline.neural_graph.ops.base import DiagonalOp, OpKind, optional, register


@dataclass(kw_only=True)
class Residual(DiagonalOp):
    kind = OpKind.RESIDUAL
    tokens: list[int] | None = optional()

    def scaling_ties(self):
        if self.src_segments is not None:
            return [], set(source_layers(self) + [self.dst_layer])
        return [(self.src_layer, self.dst_layer)], set()

    def rescale(self, i, s, src, dst, e, weight, extra):
        if not np.allclose(s[src], s[dst]):
            raise ValueError(f"op {i} (residual) joins neurons with different factors")

    def incoming(self, w, dst, extra):
        return None

    def describe(self, sizes) -> str:
        return f"{self.kind.value}({'+'.join(str(s) for s in source_layers(self))}->{self.dst_layer})"


register(Residual)
