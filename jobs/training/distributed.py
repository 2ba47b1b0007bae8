"""Data-parallel training under ``torchrun``: process group, shards, gathered inference.

``torchrun --nproc-per-node K -m jobs.cli train-heterognn ...`` starts K processes; each joins
the process group (gloo on CPU, NCCL with ``--device cuda``, one GPU per local rank), streams
only its own shard of the selected models from DuckDB, and DistributedDataParallel all-reduces
the gradients. Global batches are the single-process batches split between the ranks (rank r
takes every K-th model of the shuffled order), so K processes follow the same optimisation path
as one. Rank 0 writes the results. Without torchrun's environment everything here is the
single-process identity.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from zoocore.errors import JobError


@dataclass
class DistContext:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


def init_from_env(device: str) -> tuple[DistContext, torch.device]:
    """Join the process group torchrun describes (WORLD_SIZE > 1), or stay single-process.

    Returns the context and the device this rank trains on (``cuda`` becomes ``cuda:LOCAL_RANK``).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise JobError("--device cuda was asked for, but torch sees no CUDA device")
    if world <= 1:
        return DistContext(), dev
    ctx = DistContext(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))
    if dev.type == "cuda":
        dev = torch.device("cuda", ctx.local_rank)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return ctx, dev


def shard(indices: np.ndarray, ctx: DistContext, seed: int | None = None) -> np.ndarray:
    """This rank's share of ``indices``: shuffled with ``seed`` (identically on every rank),
    padded by wrapping around to a multiple of the world size, then every ``world``-th entry
    from ``rank`` on; every rank gets the same count, so no rank waits in an all-reduce."""
    idx = np.asarray(indices, dtype=np.int64)
    if seed is not None:
        idx = np.random.default_rng(seed).permutation(idx)
    if ctx.world == 1:
        return idx
    if len(idx) == 0:
        return idx
    pad = (-len(idx)) % ctx.world
    idx = np.concatenate([idx, np.resize(idx, pad)]) if pad else idx
    return idx[ctx.rank::ctx.world]


def local_batch_size(batch_size: int, ctx: DistContext) -> int:
    """Per-rank batch so that a global batch is ``batch_size`` models (rounded up)."""
    return max(1, -(-batch_size // ctx.world))


def gather_rows(ctx: DistContext, full: np.ndarray, local: np.ndarray, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """Rows each rank computed for its ``local`` share (``shard(full, ctx)``), in the order of
    ``full``; the identity on one process."""
    if not ctx.active:
        return arrays
    parts: list = [None] * ctx.world
    dist.all_gather_object(parts, (np.asarray(local), arrays))
    order = np.concatenate([p[0] for p in parts])
    stacked = [np.concatenate([p[1][k] for p in parts]) for k in range(len(arrays))]
    first: dict[int, int] = {}
    for pos, i in enumerate(order.tolist()):        # the padding repeats a few indices: keep one
        first.setdefault(i, pos)
    take = np.array([first[int(i)] for i in full], dtype=np.int64)
    return tuple(a[take] for a in stacked)


class _GatheredRows(torch.autograd.Function):
    """Every rank's rows of an equal-sized tensor, concatenated in rank order, with a gradient:
    each rank's rows receive the sum over ranks of the gradients for them."""

    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        ctx.rank, ctx.n = dist.get_rank(), len(x)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n]


def global_batch(x: torch.Tensor) -> torch.Tensor:
    """Under torchrun, the rows of the whole global batch (every rank's share of it is equal in
    size: ``shard`` pads them), so that a loss over pairs of a batch sees the pairs that span
    ranks; the identity on one process. Every rank then computes the same loss, and the gradient
    each rank's rows get back is ``world`` times theirs, which DDP's averaging of parameter
    gradients divides out: the single-process gradient."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    return _GatheredRows.apply(x)


def broadcast(ctx: DistContext, value):
    """Rank 0's ``value`` on every rank."""
    if not ctx.active:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(ctx: DistContext) -> None:
    if ctx.active:
        dist.barrier()
