"""Class tokens, learned positional embeddings and token selection (ViT and its kind).

A learned positional embedding ``x[t, c] += P[t, c]`` is an embedding of the position index:
a layer of ``T`` position neurons (inputs, one-hot by position) joined to the ``C`` channel
neurons by ``embedding`` edges of weight ``P[t, c]``. A class token prepended to the patch
tokens (``cat([cls.expand(N, -1, -1), x], dim=1)``) is the same with one class neuron and
weight ``cls[c]``, applied to token 0: the concatenation makes a new neuron layer of the C
channels, fed by the patch channels (``residual`` edges, tokens 1..T) and by the class neuron
(``embedding`` edges, token 0). The token ranges live in the op (``tokens``); the weights are
the parameters, so the inverse is exact. ``x[:, i]`` (reading one token) is a step, like a pool.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pipeline.neural_graph.ops.base import optional, register
from pipeline.neural_graph.ops.embedding import EmbeddingTable

aten = torch.ops.aten


@dataclass(kw_only=True)
class ClassToken(EmbeddingTable):
    """``tokens``: the token range the class tokens fill."""

    kind = "class_token"
    tokens: list[int] | None = optional()


@dataclass(kw_only=True)
class Position(EmbeddingTable):
    kind = "position"
    channels_last: bool | None = optional()


class TokenOps:
    """Tracer handlers for class tokens, positional embeddings and token selection."""

    def expand(self, node) -> None:
        x = node.args[0]
        if isinstance(x, torch.fx.Node) and x.name in self.param_of:
            self.vals[node.name] = ("param_expand", x)
            return
        raise self.unsupported(node, "expand of a neuron tensor")

    def token_cat(self, node, parts: list, dim: int) -> None:
        """``cat`` along the token axis of channels-last tokens, with parameter tokens (class tokens)."""
        vals = [p for p in parts if not isinstance(p, tuple)]
        if len(vals) != 1 or not vals[0].channels_last or len(vals[0].spatial) != 1 or vals[0].folded is not None \
                or dim % 3 != 1:
            raise self.unsupported(node, "concatenation of tokens other than class tokens and one token tensor")
        v = vals[0]
        c = self.width(v)
        src = self.source(node, v)
        total = int(node.meta["val"].shape[1])
        dst = self.new_layer(c, "tokens")
        start = 0
        for p in parts:
            if isinstance(p, tuple):
                key = self.key(p[1])
                shape = [int(s) for s in self.state[key].shape]
                n = math.prod(shape) // c
                if len(shape) != 3 or shape[0] != 1 or shape[2] != c:
                    raise self.unsupported(node, "class token that is not (1, tokens, channels)", f"shape {shape}")
                inp = self.new_layer(n, "input")
                self.add_op(node, kind="class_token", relation="embedding", src_layer=inp, dst_layer=dst,
                            weight_key=key, bias_key=None, weight_shape=[n, c], param_shape=shape, kernel=[1, 1],
                            tokens=[start, start + n])
            else:
                n = v.spatial[0]
                self.add_op(node, kind="residual", relation="residual", **src, dst_layer=dst, kernel=[1, 1],
                            tokens=[start, start + n])
            start += n
        self.vals[node.name] = type(v)(dst, True, (total,))

    def position_add(self, node, v, param) -> None:
        """``x + P`` with P one value per (position, channel): a positional embedding."""
        key = self.key(param)
        shape = [int(s) for s in self.state[key].shape]
        c = self.width(v)
        positions = math.prod(v.spatial)
        trimmed = shape[next((i for i, s in enumerate(shape) if s != 1), len(shape)):]
        want = list(v.spatial) + [c] if v.channels_last else [c] + list(v.spatial)
        if trimmed != want or v.folded is not None or positions < 2:
            raise self.unsupported(node, "addition of a parameter that is neither a bias nor a positional embedding",
                                   f"parameter shape {shape}")
        target = v.layer
        layer = self.layers[target] if target is not None else None
        users = len(node.args[0].users) if isinstance(node.args[0], torch.fx.Node) else 2
        if layer is None or layer.kind != "tokens" or layer.activation != "identity" or users != 1:
            src = self.source(node, v)
            target = self.new_layer(c, "tokens")
            self.add_op(node, kind="residual", relation="residual", **src, dst_layer=target, kernel=[1, 1])
        inp = self.new_layer(positions, "input")
        self.add_op(node, kind="position", relation="embedding", src_layer=inp, dst_layer=target, weight_key=key,
                    bias_key=None, weight_shape=[positions, c], param_shape=shape, kernel=[1, 1],
                    channels_last=bool(v.channels_last))
        self.vals[node.name] = type(v)(target, v.channels_last, v.spatial)

    def select(self, node) -> None:
        x, dim, index = node.args[:3]
        v = self.val(node, x)
        ndim = len(x.meta["val"].shape)
        if not v.channels_last or len(v.spatial) != 1 or dim % ndim != 1 or v.folded is not None:
            raise self.unsupported(node, "indexing other than picking one token", f"dim={dim}")
        for layer in self.layers_of(v):
            self.steps.append({"step": "select_token", "layer": layer, "index": int(index)})
        self.vals[node.name] = type(v)(v.layer, True, (), nmap=v.nmap)


register(ClassToken, Position, tracer=TokenOps, aten={aten.expand.default: "expand", aten.select.int: "select"})
