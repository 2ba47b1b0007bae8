"""Linear layers (``aten.addmm`` / ``mm`` / ``linear``, ``nn.Linear``, GPT-2's ``Conv1D``) and the
attention projections, which are linear layers whose relation says their role (``attn_q`` ...)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pipeline.neural_graph.ops.base import DenseOp, as_numpy, optional, register
from pipeline.neural_graph.ops.conv import describe_dense
from pipeline.spec import layer_value

aten = torch.ops.aten

QKV = ("attn_q", "attn_k", "attn_v")


@dataclass(kw_only=True)
class Linear(DenseOp):
    """``rows``: this op's row block of a fused in-projection of ``param_shape``; ``transposed``:
    the weight is stored (in, out); ``heads``: attention heads of a projection;
    ``zeroed_bias_rows``: rows of the bias parameter the network zeroes at call time (Swin V2's key
    bias): the graph still carries the parameter's values, so it inverts bit for bit."""

    kind = "linear"
    groups: int = 1
    transposed: bool | None = optional()
    rows: list[int] | None = optional()
    param_shape: list[int] | None = optional()
    heads: int | None = optional()
    zeroed_bias_rows: list[int] | None = optional()

    def raw_weight(self, state):
        w = as_numpy(state[self.weight_key])
        if self.transposed:                 # GPT-2's Conv1D keeps its weight as (in, out)
            w = w.T
        if self.rows is not None:           # q / k / v: row blocks of one in-projection tensor
            w = w[self.rows[0]:self.rows[1]]
        return w

    def weight_blocks(self, w, src_size):
        kh, kw = self.kernel
        return w.reshape(w.shape[0], src_size, kh, kw)

    def store_weight(self, out, weight):
        if self.rows is not None:           # one row block of a shared in-projection tensor
            r0, r1 = self.rows
            full = out.setdefault(self.weight_key, torch.zeros(self.param_shape))
            if self.transposed:
                full[:, r0:r1] = torch.from_numpy(np.ascontiguousarray(weight.T))
            else:
                full[r0:r1] = torch.from_numpy(np.ascontiguousarray(weight))
        else:
            weight = weight.T if self.transposed else weight
            out[self.weight_key] = torch.from_numpy(np.ascontiguousarray(weight))

    def bias_values(self, state):
        b = super().bias_values(state)
        if b is not None and self.rows is not None:
            b = b[self.rows[0]:self.rows[1]]
        return b

    def invert_bias(self, out, b):
        if not self.bias_key:
            return
        if self.rows is not None:
            r0, r1 = self.rows
            rows = self.param_shape[1 if self.transposed else 0]
            out.setdefault(self.bias_key, torch.zeros(rows))[r0:r1] = b
        else:
            out[self.bias_key] = b

    def permutation_ties(self, sizes):
        if self.src_segments is None and self.relation in QKV:
            return [], {self.dst_layer}             # head structure: q/k/v neurons stay put
        return [], set()

    def scaling_ties(self):
        return ([], {self.dst_layer}) if self.relation.startswith("attn_") else ([], set())

    def describe(self, sizes) -> str:
        return describe_dense(self, sizes)


class LinearTracing:
    """Tracer handlers for matrix products with a parameter and the bias added after them
    (mixed into plan._Tracer)."""

    def linear(self, node) -> None:
        if node.target is aten.addmm.default:
            b, x, wt = node.args[:3]
            if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
                raise self.unsupported(node, "scaled addmm")
        elif node.target is aten.mm.default:
            x, wt = node.args
            b = None
        else:
            x, w, b = (list(node.args) + [None])[:3]
            wt = ("direct", w)
        ref = self.vals.get(wt.name) if isinstance(wt, torch.fx.Node) else wt
        if isinstance(wt, torch.fx.Node) and wt.name in self.param_of:
            ref = ("in_out", wt)                # x @ W with W stored (in, out): GPT-2's Conv1D
        if not (isinstance(ref, tuple) and ref[0] in ("param_t", "direct", "in_out")):
            raise self.unsupported(node, "matrix product with a non-parameter operand")
        wkey = self.key(ref[1])
        bkey = self.key(b)
        if wkey is None:
            raise self.unsupported(node, "linear layer whose weight is not a parameter")
        v = self.val(node, x)
        out_f, in_f = (int(s) for s in self.state[wkey].shape)
        transposed = ref[0] == "in_out"
        if transposed:
            out_f, in_f = in_f, out_f
        size = self.width(v)
        if v.folded is not None and v.nmap is not None:
            raise self.unsupported(node, "linear layer on a flattened map of concatenated channels")
        if v.folded is not None:
            fold = v.folded
            if transposed:
                raise self.unsupported(node, "(in, out) weight on a flattened map")
            if size * math.prod(fold) != in_f:
                raise self.unsupported(node, "linear layer whose inputs do not match the flattened map")
            kh, kw = (1, fold[0]) if len(fold) == 1 else (fold[0], fold[1]) if len(fold) == 2 else (1, 1)
            relation = "conv"   # a linear layer after pooling + flatten is a (kh x kw) "valid" conv
        else:
            if size != in_f:
                raise self.unsupported(node, "linear layer whose inputs do not match the neurons",
                                   f"{in_f} inputs, {size} neurons")
            kh, kw, relation = 1, 1, "linear"
        src = self.source(node, v)
        dst = self.new_layer(out_f, "linear")
        self.add_op(node, kind="linear", relation=relation, **src, dst_layer=dst, weight_key=wkey,
                    bias_key=bkey, weight_shape=[out_f, in_f], kernel=[kh, kw], groups=1,
                    **({"transposed": True} if transposed else {}))
        self.vals[node.name] = self.Val(dst, True, v.spatial if v.channels_last else ())

    def bias_add(self, node, v, b) -> None:
        """``mm`` then ``+ bias``: how a linear layer on 3-d input exports; fold the bias into it."""
        key = self.key(b)
        op = self.ops[-1] if self.ops else None
        if (op is None or v.layer is None or op["dst_layer"] != v.layer or op.get("bias_key") is not None
                or not isinstance(op, Linear) or tuple(self.state[key].shape) != (self.layers[v.layer].size,)):
            raise self.unsupported(node, "addition of a parameter that is not the bias of the layer before it")
        op["bias_key"] = key
        self.vals[node.name] = v



class LinearSpec:
    """Spec-planner rule for ``nn.Linear`` (mixed into spec_plan._SpecPlanner)."""

    def linear(self, mod, path: str, v, x: torch.Tensor, y: torch.Tensor):
        if not v.channels_last or v.spatial:
            raise self.NotCovered("linear layer on maps or tokens")
        size = self.layers[v.layer].size
        out_f, in_f = mod.out_features, mod.in_features
        if v.folded is not None:
            fold = v.folded
            if size * math.prod(fold) != in_f or len(fold) > 2:
                raise self.NotCovered("linear input")
            kh, kw = (1, fold[0]) if len(fold) == 1 else fold
            relation = "conv"
        else:
            if size != in_f:
                raise self.NotCovered("linear input")
            kh, kw, relation = 1, 1, "linear"
        dst = self.new_layer(out_f, "linear")
        self.add_op(path, kind="linear", relation=relation, src_layer=v.layer, dst_layer=dst,
                    weight_key=f"{path}.weight", bias_key=self.key(path, "bias"), weight_shape=[out_f, in_f],
                    kernel=[int(kh), int(kw)], groups=1)
        return self.Val(dst, True, ())


def linear_layer(layer: dict, x: torch.Tensor, where: str) -> nn.Module:
    """The spec layer ``linear``: out_features, bias [true]."""
    return nn.Linear(x.shape[-1], int(layer_value(layer, "out_features", where)), bias=bool(layer.get("bias", True)))


register(Linear, tracer=LinearTracing, aten=dict.fromkeys((aten.addmm.default, aten.mm.default, aten.linear.default),
                                                          "linear"),
         spec=LinearSpec, modules={(nn.Linear,): "linear"}, spec_layers={"linear": linear_layer})
