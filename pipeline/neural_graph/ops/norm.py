"""Batch norm and layer norm: a diagonal ``norm`` edge per channel whose weight is gamma (beta is
the node bias); batch norm's running mean and variance are the node's two extra features."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.neural_graph.concat import source_layers
from pipeline.neural_graph.ops.base import ChannelParams, OpKind, as_numpy, register


@dataclass(kw_only=True)
class BatchNorm(ChannelParams):
    kind = OpKind.BATCH_NORM
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
    kind = OpKind.LAYER_NORM
    eps: float

    def scaling_ties(self):
        return [], set(source_layers(self))     # does not commute with per-neuron factors of its input

    def rescale(self, i, s, src, dst, e, weight, extra):
        if not np.allclose(s[src], 1.0):
            raise ValueError(f"op {i} (layer norm) cannot absorb factors on its input neurons")
        weight[e] *= s[dst][:, None]


register(BatchNorm, LayerNorm)
