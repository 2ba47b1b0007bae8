"""Gates (``x * g``) and layer scales (``gamma * x``), traced by ``pipeline.neural_graph.gate``:
a ``gate`` edge of weight 1 per channel, and a diagonal ``norm`` edge whose weight is the scale."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.neural_graph.concat import source_layers
from pipeline.neural_graph.gate import GateOps
from pipeline.neural_graph.ops.base import ChannelParams, UnitOp, register

aten = torch.ops.aten


@dataclass(kw_only=True)
class Gate(UnitOp):
    kind = "gate"

    def scaling_ties(self):
        return [], set(source_layers(self))     # the gate's own layer takes no factor

    def rescale(self, i, s, src, dst, e, weight, extra):
        if not np.allclose(s[src], 1.0):
            raise ValueError(f"op {i} (gate) cannot take factors on its gate neurons")


@dataclass(kw_only=True)
class Scale(ChannelParams):
    kind = "scale"


register(Gate, Scale, tracer=GateOps, aten={aten.mul.Tensor: "mul"})
