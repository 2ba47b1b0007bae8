"""A trained metanetwork (or an ensemble of them) applied to streamed graphs: raw outputs and
embeddings, in the order asked, under torchrun too.
"""
from __future__ import annotations

import dgl
import numpy as np
import torch

from jobs.metanets.ngnn import NGGNN
from jobs.training.data import GraphStream
from jobs.training.distributed import DistContext, gather_rows, shard
from jobs.training.tasks import Task


def _batch(graphs, device):
    return dgl.batch(graphs).to(device)


def apply(model: NGGNN, stream, idx, graphs, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The model on one batch of ``stream`` (``idx``: the indices it served, ``graphs``: their
    graphs), with the stream's per-model inputs beside the graphs when it has them."""
    side = getattr(stream, "side", None)
    if side is None:
        return model(_batch(graphs, device))
    return model(_batch(graphs, device), torch.as_tensor(side[np.asarray(idx)], device=device))


@torch.no_grad()
def infer(model: NGGNN, stream: GraphStream, indices, batch_size: int, device,
          ctx: DistContext | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Raw outputs (n, out_dim) and embeddings (n, d) for ``indices``, in that order; under
    torchrun each rank infers its shard and every rank gets all rows."""
    ctx = ctx or DistContext()
    model.eval()
    local = shard(indices, ctx)
    outs, embs = [], []
    for idx, graphs in stream.batches(local, batch_size):   # batches come back in order
        out, z = apply(model, stream, idx, graphs, device)
        outs.append(out.cpu().numpy())
        embs.append(z.cpu().numpy())
    out = np.concatenate(outs) if outs else np.zeros((0, model.cfg.out_dim), np.float32)
    emb = np.concatenate(embs) if embs else np.zeros((0, model.readout_dim), np.float32)
    return gather_rows(ctx, np.asarray(indices, dtype=np.int64), local, out, emb)


def infer_ensemble(models: list[NGGNN], stream: GraphStream, indices, batch_size: int, device,
                   task: Task, ctx: DistContext | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The members' outputs combined by the task (regression: mean; classification: log of the
    mean softmax) and their embeddings side by side (still invariant)."""
    outs, embs = zip(*(infer(m, stream, indices, batch_size, device, ctx) for m in models))
    return task.combine(list(outs)), np.concatenate(embs, axis=1)
