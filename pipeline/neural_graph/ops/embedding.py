"""Embeddings: a table of vectors read by integer ids. Each id (token, position, class token) is an
input neuron with one edge per embedding channel; ``nn.Embedding`` here, class tokens and learned
positions (``tokens.py`` traces them) in their own kinds."""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.neural_graph.ops.base import DenseOp, OpKind, optional, register


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
    kind = OpKind.EMBEDDING


register(Embedding)
