"""Residual sums: a diagonal edge of weight 1 from each summand's channel c to the sum's channel c
(``tokens``: the token range a summand fills when a class token is prepended)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pipeline.neural_graph.concat import source_layers
from pipeline.neural_graph.ops.base import UnitOp, optional, register
from pipeline.spec import Residual as ResidualModule, build_sequence, layer_value
from zoocore.errors import SpecError

aten = torch.ops.aten


@dataclass(kw_only=True)
class Residual(UnitOp):
    kind = "residual"
    tokens: list[int] | None = optional()

    def scaling_ties(self):
        if self.src_segments is not None:
            return [], set(source_layers(self) + [self.dst_layer])
        return [(self.src_layer, self.dst_layer)], set()

    def rescale(self, i, s, src, dst, e, weight, extra):
        if not np.allclose(s[src], s[dst]):
            raise ValueError(f"op {i} (residual) joins neurons with different factors")


class ResidualTracing:
    """Tracer handler for ``aten.add.Tensor`` (mixed into plan._Tracer): a sum of two neuron tensors;
    a parameter added is a bias (``ops.linear``) or a positional embedding (``tokens.py``)."""

    def add(self, node) -> None:
        a, b = node.args[:2]
        for x, p in ((a, b), (b, a)):
            if (isinstance(p, torch.fx.Node) and p.name in self.param_of and isinstance(x, torch.fx.Node)
                    and isinstance(self.vals.get(x.name), self.Val)):
                v = self.vals[x.name]
                if len(self.state[self.param_of[p.name]].shape) > 1:
                    return self.position_add(node, v, p)
                return self.bias_add(node, v, p)
        if node.kwargs.get("alpha", 1) != 1 or not isinstance(b, torch.fx.Node):
            raise self.unsupported(node, "addition of a constant or a scaled tensor")
        va, vb = self.val(node, a), self.val(node, b)
        if (self.width(va) != self.width(vb) or va.folded or vb.folded
                or va.channels_last != vb.channels_last or (va.layer == vb.layer and va.layer is not None)):
            raise self.unsupported(node, "addition of tensors that are not matching neuron layers")
        # Fold the skip into an operand that nothing else reads and whose activation is not yet applied.
        for target, other, fx in ((va, vb, a), (vb, va, b)):
            if target.layer is None:
                continue
            layer = self.layers[target.layer]
            if target.layer != 0 and layer.activation == "identity" and len(fx.users) == 1 and layer.kind != "input":
                self.add_op(node, kind="residual", relation="residual", **self.source(node, other),
                            dst_layer=target.layer, kernel=[1, 1])
                self.vals[node.name] = target
                return
        srcs = [self.source(node, v) for v in (va, vb)]
        dst = self.new_layer(self.width(va), "add")
        for src in srcs:
            self.add_op(node, kind="residual", relation="residual", **src, dst_layer=dst, kernel=[1, 1])
        self.vals[node.name] = self.Val(dst, va.channels_last, va.spatial)


class ResidualSpec:
    """Spec-planner rule for the spec's ``Residual`` block (mixed into spec_plan._SpecPlanner)."""

    def residual(self, mod: ResidualModule, path: str, v, x: torch.Tensor, y: torch.Tensor):
        if not mod.body or isinstance(mod.body[0], (nn.Identity, nn.Dropout, ResidualModule)):
            raise self.NotCovered("residual body that does not start with an operation")
        # x is read by the body and by the sum: an activation right on it is not representable
        inner = self.Val(v.layer, v.channels_last, v.spatial, v.folded, fresh=False)
        body, _ = self.sequence(mod.body, f"{path}.body", inner, x)
        if (self.layers[v.layer].size != self.layers[body.layer].size or v.folded or body.folded
                or v.channels_last != body.channels_last or v.layer == body.layer):
            raise self.NotCovered("residual operands")
        target = self.layers[body.layer]
        if body.layer != 0 and target.activation == "identity" and body.fresh and target.kind != "input":
            self.add_op(path, kind="residual", relation="residual", src_layer=v.layer, dst_layer=body.layer,
                        kernel=[1, 1])
            return self.Val(body.layer, body.channels_last, body.spatial)
        dst = self.new_layer(self.layers[v.layer].size, "add")
        for src in (v, body):
            self.add_op(path, kind="residual", relation="residual", src_layer=src.layer, dst_layer=dst, kernel=[1, 1])
        return self.Val(dst, v.channels_last, v.spatial)


def residual_layer(layer: dict, x: torch.Tensor, where: str) -> nn.Module:
    """The spec layer ``residual``: body, a list of layers whose output has the input's shape;
    computes x + body(x)."""
    body = build_sequence(layer_value(layer, "body", where), x, where + ".body")
    with torch.no_grad():
        y = body(x)
    if y.shape != x.shape:
        raise SpecError(f"{where}: a residual body must keep the shape {list(x.shape[1:])}, "
                        f"it gives {list(y.shape[1:])}")
    return ResidualModule(body)


register(Residual, tracer=ResidualTracing, aten={aten.add.Tensor: "add"},
         spec=ResidualSpec, modules={(ResidualModule,): "residual"}, spec_layers={"residual": residual_layer})
