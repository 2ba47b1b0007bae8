"""Autograd kernels of the NG-GNN layer (jobs.metanets.ngnn) over all relations' edges at once.

On CPU the per-relation layer spent as much time joining and splitting small tensors (``cat`` /
``chunk`` forward and backward) and summing the gradients of three separate reductions as in its
products; each function here is one autograd node with a hand-written backward that makes one pass:
PNA's segment sum / sum of squares / max, FiLM's ``gamma * x + beta``, and per-relation affine maps
of rows grouped by relation written straight into one output.
"""
from __future__ import annotations

import torch


def segment_stats(x: torch.Tensor, seg: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sum, sum of squares and maximum of the rows of ``x`` (E, H) per segment (``seg``: segment of
    each row; every one of the ``n`` segments non-empty)."""
    return SegmentStats.apply(x, seg, n)


def segment_max(x: torch.Tensor, seg: torch.Tensor, n: int) -> torch.Tensor:
    """The maximum of the rows of ``x`` per segment (``segment_stats``' third output)."""
    return segment_stats(x, seg, n)[2]


class SegmentStats(torch.autograd.Function):
    """PNA's segment statistics in one autograd node: the backward of the three reductions is one
    pass over the edges (``g_sum + 2 x g_sq + hit * g_max``) instead of three gradients summed. The
    max's gradient goes to the rows that attain it (shared evenly on ties, like ``torch.amax``);
    ``scatter_reduce``'s own backward and DGL's segment max are several times slower on CPU."""

    @staticmethod
    def forward(ctx, x, seg, n):
        total = x.new_zeros(n, x.shape[1]).index_add_(0, seg, x)
        squares = x.new_zeros(n, x.shape[1]).index_add_(0, seg, x * x)
        top = x.new_empty(n, x.shape[1]).scatter_reduce_(0, seg.unsqueeze(-1).expand_as(x), x, "amax",
                                                         include_self=False)
        ctx.save_for_backward(x, seg, top)
        return total, squares, top

    @staticmethod
    def backward(ctx, g_sum, g_sq, g_max):
        x, seg, top = ctx.saved_tensors
        grad = g_sum.index_select(0, seg) if g_sum is not None else torch.zeros_like(x)
        if g_sq is not None:
            grad.addcmul_(x, g_sq.index_select(0, seg), value=2.0)
        if g_max is not None:
            # eq written into a float tensor: several times faster on CPU than eq, then a cast
            hit = torch.eq(x, top.index_select(0, seg), out=torch.empty_like(x))
            count = torch.zeros_like(top).index_add_(0, seg, hit)      # > 1 only on ties
            grad.addcmul_(hit, (g_max / count).index_select(0, seg))
        return grad, None, None


class FiLM(torch.autograd.Function):
    """``gamma * x + beta`` in one pass, with the two-product backward (``torch.addcmul``'s backward
    multiplies each gradient by its ``value`` once more)."""

    @staticmethod
    def forward(ctx, gamma, x, beta):
        ctx.save_for_backward(gamma, x)
        return torch.addcmul(beta, gamma, x)

    @staticmethod
    def backward(ctx, grad):
        gamma, x = ctx.saved_tensors
        return grad * x, grad * gamma, grad


def rel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rel: list[int],
                rows: list[int]) -> torch.Tensor:
    """Per-relation affine maps of rows grouped by relation: the ``rows[i]`` rows of block i are
    mapped by ``weight[rel[i]]`` (in, out) plus ``bias[rel[i]]``."""
    return RelLinear.apply(x, weight, bias, rel, rows)


class RelLinear(torch.autograd.Function):
    """``rel_linear`` with every block's product written straight into one output (and the
    gradients into one tensor each), instead of per-block results joined by ``cat`` forward and
    split-and-joined again backward: on CPU those copies cost as much as the products."""

    @staticmethod
    def forward(ctx, x, weight, bias, rel, rows):
        out = x.new_empty(x.shape[0], weight.shape[-1])
        start = 0
        for r, n in zip(rel, rows):
            if bias is None:
                torch.mm(x[start:start + n], weight[r], out=out[start:start + n])
            else:
                torch.addmm(bias[r], x[start:start + n], weight[r], out=out[start:start + n])
            start += n
        ctx.save_for_backward(x, weight)
        ctx.rel, ctx.rows, ctx.has_bias = rel, rows, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        gx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        gw = torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device) if ctx.needs_input_grad[1] else None
        gb = (grad.new_zeros(weight.shape[0], weight.shape[-1])
              if ctx.has_bias and ctx.needs_input_grad[2] else None)
        start = 0
        for r, n in zip(ctx.rel, ctx.rows):
            g = grad[start:start + n]
            if gx is not None:
                torch.mm(g, weight[r].T, out=gx[start:start + n])
            if gw is not None:
                torch.mm(x[start:start + n].T, g, out=gw[r])
            if gb is not None:
                torch.sum(g, 0, out=gb[r])
            start += n
        if gx is not None and start < x.shape[0]:
            gx[start:].zero_()
        return gx, gw, gb, None, None
