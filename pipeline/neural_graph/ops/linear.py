"""Linear layers (``aten.addmm`` / ``mm`` / ``linear``, ``nn.Linear``, GPT-2's ``Conv1D``) and the
attention projections, which are linear layers whose relation says their role (``attn_q`` ...)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.neural_graph.ops.base import DenseOp, OpKind, as_numpy, optional, register
from pipeline.neural_graph.ops.conv import describe_dense

QKV = ("attn_q", "attn_k", "attn_v")


@dataclass(kw_only=True)
class Linear(DenseOp):
    """``rows``: this op's row block of a fused in-projection of ``param_shape``; ``transposed``:
    the weight is stored (in, out); ``heads``: attention heads of a projection."""

    kind = OpKind.LINEAR
    groups: int = 1
    transposed: bool | None = optional()
    rows: list[int] | None = optional()
    param_shape: list[int] | None = optional()
    heads: int | None = optional()

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


register(Linear)
