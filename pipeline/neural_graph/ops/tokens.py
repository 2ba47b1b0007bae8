"""Class tokens and learned positional embeddings (traced by ``pipeline.neural_graph.tokens``):
embedding tables whose ids are token slots and positions."""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.neural_graph.ops.base import optional, register
from pipeline.neural_graph.ops.embedding import EmbeddingTable


@dataclass(kw_only=True)
class ClassToken(EmbeddingTable):
    """``tokens``: the token range the class tokens fill."""

    kind = "class_token"
    tokens: list[int] | None = optional()


@dataclass(kw_only=True)
class Position(EmbeddingTable):
    kind = "position"
    channels_last: bool | None = optional()


register(ClassToken, Position)
