"""Training losses that are more than torch's own (jobs.training.tasks picks one per task)."""
from __future__ import annotations

import torch

from jobs.training.distributed import global_batch


class RankedMSE(torch.nn.Module):
    """Squared error plus ``weight`` times RankNet's pairwise logistic loss over the batch: for every
    pair of models whose targets differ, ``log(1 + exp(-(p_hi - p_lo)))`` on the standardised outputs.
    Squared error spends its effort on the size of every error; Kendall tau, what model selection and
    the benchmark score, only counts pairs put in the wrong order, which the second term penalises."""

    def __init__(self, weight: float):
        super().__init__()
        self.weight = weight

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        mse = torch.nn.functional.mse_loss(out, target)
        p, t = global_batch(out[:, 0]), global_batch(target[:, 0])     # under DDP: pairs across ranks too
        above = (t.unsqueeze(1) - t.unsqueeze(0)) > 0          # [i, j]: model i's target above model j's
        if not bool(above.any()):
            return mse
        margin = (p.unsqueeze(1) - p.unsqueeze(0))[above]
        return mse + self.weight * torch.nn.functional.softplus(-margin).mean()
