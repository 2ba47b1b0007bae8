"""Learned per-head score terms of windowed attention (Swin, MaxViT), traced by
``pipeline.neural_graph.position_bias``: a relative-position bias table or a Swin V2 logit scale
read as embedding tables into one neuron per head, and the per-head edges that take those neurons
into the queries of their head.

- ``relative_position``: R relative-position input neurons -> H bias neurons, ``embedding`` edges
  of weight ``B[r, h]`` (the table, ``weight_key``); the fixed index map is kept in ``buffers``
  (or ``constants``, when it is not a state-dict entry).
- ``logit_scale``: one input neuron -> H scale neurons, ``embedding`` edges of weight ``s_h``;
  ``clamp`` and ``fn`` say what is applied to it (``exp(min(s, c))``).
- ``attention_bias`` / ``attention_scale``: each head's bias / scale neuron -> the query neurons of
  its head (``src_segments`` with step 0), weight 1 and no parameter; ``scale``: a constant factor
  applied to the bias first (Swin V2's 16 * sigmoid).
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.neural_graph.concat import source_layers
from pipeline.neural_graph.ops.base import UnitOp, optional, register
from pipeline.neural_graph.ops.embedding import EmbeddingTable


@dataclass(kw_only=True)
class RelativePosition(EmbeddingTable):
    kind = "relative_position"


@dataclass(kw_only=True)
class LogitScale(EmbeddingTable):
    kind = "logit_scale"
    clamp: list[float | None] | None = optional()
    fn: str | None = optional()


@dataclass(kw_only=True)
class PerHeadTerm(UnitOp):
    """A head's neuron joined to each query neuron of that head by an edge of weight 1."""

    def scaling_ties(self):
        # the edge carries no parameter to absorb a factor, and the queries keep their head structure
        return [], set(source_layers(self) + [self.dst_layer])


@dataclass(kw_only=True)
class AttentionBias(PerHeadTerm):
    kind = "attention_bias"
    scale: float | None = optional()


@dataclass(kw_only=True)
class AttentionScale(PerHeadTerm):
    kind = "attention_scale"


register(RelativePosition, LogitScale, AttentionBias, AttentionScale)
