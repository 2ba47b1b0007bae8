"""Group norm (``nn.GroupNorm``, ``aten.native_group_norm``): like layer norm, a diagonal ``norm``
edge per channel whose weight is gamma (beta is the node bias); the statistics are taken over
``groups`` runs of consecutive channels, so with several groups a permutation that mixes channels
across groups changes the function, and the two layers stay put."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.neural_graph.ops.base import register
from pipeline.neural_graph.ops.norm import LayerNorm

aten = torch.ops.aten


@dataclass(kw_only=True)
class GroupNorm(LayerNorm):
    kind = "group_norm"
    groups: int

    def permutation_ties(self, sizes):
        pairs, fixed = super().permutation_ties(sizes)
        if self.groups not in (1, int(sizes[self.dst_layer])):
            return [], fixed | {self.src_layer, self.dst_layer}
        return pairs, fixed

    def describe(self, sizes) -> str:
        return f"{self.kind}({sizes[self.dst_layer]} g{self.groups})"


class GroupNormTracing:
    """Tracer handler for ``aten.native_group_norm`` (mixed into plan._Tracer)."""

    def group_norm(self, node) -> None:
        x, w, b, _n, c, _hw, groups, eps = node.args
        v = self.val(node, x)
        if (v.channels_last and v.spatial) or v.folded is not None or v.tokens or c != self.width(v):
            raise self.unsupported(node, "group norm whose channels are not the neurons")
        src = self.source(node, v)
        dst = self.new_layer(self.width(v), "norm")
        self.add_op(node, kind="group_norm", relation="norm", **src, dst_layer=dst, weight_key=self.key(w),
                    bias_key=self.key(b), eps=float(eps), groups=int(groups), kernel=[1, 1])
        self.vals[node.name] = (self.Val(dst, v.channels_last, v.spatial),)


register(GroupNorm, tracer=GroupNormTracing, aten={aten.native_group_norm.default: "group_norm"})
