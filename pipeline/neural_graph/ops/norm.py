"""Batch norm and layer norm: a diagonal ``norm`` edge per channel whose weight is gamma (beta is
the node bias); batch norm's running mean and variance are the node's two extra features."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pipeline.neural_graph.concat import source_layers
from pipeline.neural_graph.ops.base import ChannelParams, as_numpy, register

aten = torch.ops.aten


@dataclass(kw_only=True)
class BatchNorm(ChannelParams):
    kind = "batch_norm"
    running_stats = True
    mean_key: str | None = None
    var_key: str | None = None
    nbt_key: str | None = None
    eps: float
    momentum: float | None = None

    def node_stats(self, state, extra, do, c):
        extra[do:do + c, 0] = as_numpy(state[self.mean_key])
        extra[do:do + c, 1] = as_numpy(state[self.var_key])

    def invert(self, out, w, dst, c, *, graph, e, do, inputs, local, frame, i):
        super().invert(out, w, dst, c, graph=graph, e=e, do=do, inputs=inputs, local=local, frame=frame, i=i)
        out[self.mean_key] = torch.from_numpy(graph.extra[do:do + c, 0].copy())
        out[self.var_key] = torch.from_numpy(graph.extra[do:do + c, 1].copy())
        if self.nbt_key:
            out[self.nbt_key] = torch.tensor(graph.buffers[self.nbt_key], dtype=torch.int64)

    def scaling_ties(self):
        if not self.weight_key:     # without gamma, eps makes the normalisation non-homogeneous
            return [], {self.src_layer, self.dst_layer}
        return [], set()

    def rescale(self, i, s, src, dst, e, weight, extra):
        ks, ls = s[src], s[dst]
        eps = float(self.eps if self.eps is not None else 1e-5)
        mean, var = extra[dst, 0], extra[dst, 1]
        gamma_factor = ls * np.sqrt(ks ** 2 * var + eps) / (ks * np.sqrt(var + eps))
        weight[e] *= gamma_factor[:, None]
        extra[dst, 0] = mean * ks
        extra[dst, 1] = var * ks ** 2

    def incoming(self, w, dst, extra):
        eps = float(self.eps if self.eps is not None else 1e-5)
        a = w.sum(1) / np.sqrt(extra[dst, 1] + eps)
        c = -a * extra[dst, 0]
        return a ** 2 + c ** 2, a + c


@dataclass(kw_only=True)
class LayerNorm(ChannelParams):
    kind = "layer_norm"
    eps: float

    def scaling_ties(self):
        return [], set(source_layers(self))     # does not commute with per-neuron factors of its input

    def rescale(self, i, s, src, dst, e, weight, extra):
        if not np.allclose(s[src], 1.0):
            raise ValueError(f"op {i} (layer norm) cannot absorb factors on its input neurons")
        weight[e] *= s[dst][:, None]


class NormTracing:
    """Tracer handlers for batch norm (eval) and layer norm (mixed into plan._Tracer)."""

    def _norm_target(self, node, v, kind: str) -> int:
        if v.folded is not None or v.tokens:
            raise self.unsupported(node, f"{kind} over a flattened map")
        return self.new_layer(self.width(v), "norm")

    def batch_norm(self, node) -> None:
        x, w, b, rm, rv, momentum, eps = node.args
        v = self.val(node, x)
        src = self.source(node, v)
        dst = self._norm_target(node, v, "batch norm")
        wkey = self.key(w)
        prefix = (wkey or self.key(rm) or "").rsplit(".", 1)[0]
        nbt = prefix + ".num_batches_tracked" if prefix + ".num_batches_tracked" in self.state else None
        if nbt:
            self.used_keys.add(nbt)
        self.add_op(node, kind="batch_norm", relation="norm", **src, dst_layer=dst, weight_key=wkey,
                    bias_key=self.key(b), mean_key=self.key(rm), var_key=self.key(rv), nbt_key=nbt,
                    eps=float(eps), momentum=float(momentum), kernel=[1, 1])
        self.vals[node.name] = (self.Val(dst, v.channels_last, v.spatial),)

    def layer_norm(self, node) -> None:
        x, shape, w, b, eps = node.args
        v = self.val(node, x)
        if not v.channels_last or list(shape) != [self.width(v)]:
            raise self.unsupported(node, "layer norm over more than the neuron axis", f"normalized_shape={list(shape)}")
        src = self.source(node, v)
        dst = self._norm_target(node, v, "layer norm")
        self.add_op(node, kind="layer_norm", relation="norm", **src, dst_layer=dst,
                    weight_key=self.key(w), bias_key=self.key(b), eps=float(eps), kernel=[1, 1])
        self.vals[node.name] = (self.Val(dst, v.channels_last, v.spatial),)


class NormSpec:
    """Spec-planner rule for ``nn.BatchNorm1d`` / ``nn.BatchNorm2d`` (mixed into spec_plan._SpecPlanner)."""

    def batch_norm(self, mod, path: str, v, x: torch.Tensor, y: torch.Tensor):
        if v.folded is not None or not mod.track_running_stats or not mod.affine:
            raise self.NotCovered("batch norm variant")
        dst = self.new_layer(self.layers[v.layer].size, "norm")
        self.add_op(path, kind="batch_norm", relation="norm", src_layer=v.layer, dst_layer=dst,
                    weight_key=f"{path}.weight", bias_key=f"{path}.bias", mean_key=f"{path}.running_mean",
                    var_key=f"{path}.running_var", nbt_key=f"{path}.num_batches_tracked", eps=float(mod.eps),
                    momentum=float(mod.momentum), kernel=[1, 1])
        return self.Val(dst, v.channels_last, v.spatial)


def batchnorm_layer(layer: dict, x: torch.Tensor, where: str) -> nn.Module:
    """The spec layer ``batchnorm``: eps [1e-5], momentum [0.1] (1d or 2d from the input rank)."""
    cls = nn.BatchNorm2d if x.dim() == 4 else nn.BatchNorm1d
    return cls(x.shape[1], eps=layer.get("eps", 1e-5), momentum=layer.get("momentum", 0.1))


def layernorm_layer(layer: dict, x: torch.Tensor, where: str) -> nn.Module:
    """The spec layer ``layernorm``: eps [1e-5], over the last dimension."""
    return nn.LayerNorm(x.shape[-1], eps=layer.get("eps", 1e-5))


register(BatchNorm, LayerNorm, tracer=NormTracing,
         aten={aten._native_batch_norm_legit_no_training.default: "batch_norm",
               aten.native_layer_norm.default: "layer_norm"},
         spec=NormSpec, modules={(nn.BatchNorm1d, nn.BatchNorm2d): "batch_norm"},
         spec_layers={"batchnorm": batchnorm_layer, "layernorm": layernorm_layer})
