"""The one training loop: every trained thing (a predicting metanetwork, an INR editor) is a model
plus an *objective*, and this loop fits it.

An objective says what a round's batches are, the loss of one batch and the validation score of
the model (higher is better); the loop owns the rest: AdamW, the cosine schedule, gradient
clipping, keeping the state of the best validation score, patience and the progress bar.

- Predicting (``jobs.training.train``): a round is an epoch over the training models, the
  schedule steps once per epoch, patience stops early; the score is the task's (Kendall tau,
  accuracy).
- Editing INRs (``jobs.editing.train``): a round is ``eval_every`` steps, the schedule steps per
  batch, no patience; the score is minus the validation MSE of the edited functions.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

import torch
from tqdm import tqdm


class Objective(Protocol):
    def batches(self, round_: int) -> Iterable[Any]:
        """The batches of one round."""

    def loss(self, model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
        """(loss of ``batch`` under ``model`` in training mode, number of examples in it)."""

    def score(self, model: torch.nn.Module) -> float:
        """The validation score of ``model`` (higher is better)."""


@dataclass
class Schedule:
    rounds: int                    # epochs, or evaluation windows of steps
    lr: float
    weight_decay: float
    clip: float                    # gradient norm clip
    per_step: bool = False         # the cosine schedule advances per batch (else per round)
    total_steps: int | None = None     # its length in batches when per_step
    patience: int | None = None    # rounds without improvement before stopping (None: never stop early)
    min_delta: float = 0.0         # an improvement must beat the best score by more than this


@dataclass
class Fitted:
    model: torch.nn.Module
    history: list[dict[str, float]]
    rounds_run: int
    best_score: float


def fit(model: torch.nn.Module, objective: Objective, schedule: Schedule, desc: str = "train",
        progress: bool = True, step_model: torch.nn.Module | None = None) -> Fitted:
    """Fit ``model`` to ``objective``; the state of the best validation score is kept and loaded.
    ``step_model``: what computes the training loss (a DistributedDataParallel wrapper of ``model``)."""
    step_model = step_model or model
    opt = torch.optim.AdamW(model.parameters(), lr=schedule.lr, weight_decay=schedule.weight_decay)
    length = (schedule.total_steps if schedule.per_step else schedule.rounds) or 1
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(length, 1), eta_min=schedule.lr * 0.05)
    best, best_state, bad, history, rounds_run = -math.inf, None, 0, [], 0
    bar = tqdm(range(schedule.rounds), desc=desc, unit="round" if schedule.per_step else "epoch",
               disable=not progress)
    for r in bar:
        model.train()
        total, n, last = 0.0, 0, float("nan")
        started = time.perf_counter()
        for batch in objective.batches(r):
            loss, count = objective.loss(step_model, batch)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), schedule.clip)
            opt.step()
            if schedule.per_step:
                sched.step()
            last = float(loss)
            total += last * count
            n += count
        if not schedule.per_step:
            sched.step()
        seconds = time.perf_counter() - started
        rounds_run = r + 1
        score = objective.score(model)
        history.append({"round": r, "train_loss": total / max(n, 1), "last_loss": last, "val_score": score,
                        "train_examples": n, "train_seconds": seconds})
        bar.set_postfix(loss=f"{total / max(n, 1):.4f}", val=f"{score:.4f}")
        if score > best + schedule.min_delta:
            best, best_state, bad = score, copy.deepcopy(model.state_dict()), 0
        else:
            bad += 1
            if schedule.patience is not None and bad >= schedule.patience:
                break
    bar.close()
    if best_state is not None:
        model.load_state_dict(best_state)
    return Fitted(model, history, rounds_run, best)
