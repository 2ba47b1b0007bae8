"""Embeddings: a table of vectors read by integer ids. Each id (token, position, class token) is an
input neuron with one edge per embedding channel; ``nn.Embedding`` here, class tokens and learned
positions (``tokens.py`` traces them) in their own kinds."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.neural_graph.ops.base import DenseOp, node_shape, optional, register
from pipeline.spec import layer_value

aten = torch.ops.aten


@dataclass(kw_only=True)
class EmbeddingTable(DenseOp):
    """A weight of (ids, channels): the edge id -> channel carries entry (id, channel)."""

    param_shape: list[int] | None = optional()

    def weight_blocks(self, w, src_size):       # dst = embedding dim, src = token / position / class neuron
        w = w.reshape(self.weight_shape)
        return w.T.reshape(w.shape[1], w.shape[0], 1, 1)

    def weight_from_blocks(self, blocks, c, cin):
        return blocks.reshape(c, cin).T.copy().reshape(self.param_shape or self.weight_shape)

    def scaling_ties(self):
        return [], {self.dst_layer}


@dataclass(kw_only=True)
class Embedding(EmbeddingTable):
    kind = "embedding"


class EmbeddingTracing:
    """Tracer handler for ``aten.embedding`` (mixed into plan._Tracer)."""

    def embedding(self, node) -> None:
        w, idx = node.args[:2]
        v = self.vals.get(idx.name)
        wkey = self.key(w)
        if not ((isinstance(v, self.Val) and v.tokens) or v == self.CONST) or wkey is None:
            raise self.unsupported(node, "embedding of something other than the input tokens or constant ids",
                               "positions, token types")
        num, dim = (int(s) for s in self.state[wkey].shape)
        src = self.new_layer(num, "input")
        dst = self.new_layer(dim, "embedding")
        self.add_op(node, kind="embedding", relation="embedding", src_layer=src, dst_layer=dst, weight_key=wkey,
                    bias_key=None, weight_shape=[num, dim], kernel=[1, 1])
        self.vals[node.name] = self.Val(dst, True, tuple(node_shape(node)[1:-1]))


def embedding_layer(layer: dict, x: torch.Tensor, where: str) -> torch.nn.Module:
    """The spec layer ``embedding``: num_embeddings, embedding_dim (first layer only, int64 input)."""
    return torch.nn.Embedding(int(layer_value(layer, "num_embeddings", where)),
                              int(layer_value(layer, "embedding_dim", where)))


register(Embedding, tracer=EmbeddingTracing, aten={aten.embedding.default: "embedding"},
         spec_layers={"embedding": embedding_layer})
