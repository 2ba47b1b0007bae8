"""Tabular MLP zoo: MLPs on iris, wine, breast_cancer and digits (64 features).

Architecture of one model (all choices sampled per model)::

    input (1, F), features standardised with train-split statistics
    1-4 hidden blocks, each: Linear(width) -> [LayerNorm] -> act -> [Dropout]
    Linear(n_classes)

All hidden layers of a model share ``width`` (8..64), ``activation`` (one of
seven), ``layernorm`` (0/1) and ``dropout`` (0 or 0.05..0.5).

Training varies optimizer, learning rate (log-uniform, optimizer-specific
wide range), weight decay, batch size, epochs, data fraction, label noise and
input noise. ``epochs`` is drawn log-uniformly in 5..200 and then capped at
:data:`MAX_STEPS` optimizer steps; the CSV holds the epochs actually run.
Chance level differs per data set (iris 1/3, wine ~0.40, breast_cancer
~0.63, digits 0.1), which the ``dataset`` column records.

Usage (from the repository root)::

    python -m benchmarks.blind.tabular_mlp --out DIR --n N --seed S [--workers W]
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from . import common as C

#: Importable name of this module (also when run with ``python -m``).
_MODULE = __spec__.name

DATASETS = ["iris", "wine", "breast_cancer", "digits"]
WIDTHS = [8, 12, 16, 24, 32, 48, 64]
ACTS = ["relu", "leaky_relu", "gelu", "tanh", "sigmoid", "silu", "elu"]
OPTIMIZERS = ["sgd", "momentum", "adam", "adamw", "rmsprop"]
BATCH_SIZES = [8, 16, 32, 64, 128]
#: Cap on optimizer steps per model.
MAX_STEPS = 600

COLUMNS = ["dataset", "depth", "width", "activation", "layernorm", "dropout",
           "optimizer", "lr", "weight_decay", "epochs", "batch_size",
           "data_fraction", "label_noise", "input_noise"]


class Block(nn.Module):
    """Linear -> optional LayerNorm -> activation -> optional Dropout."""

    def __init__(self, fin: int, fout: int, act: str, layernorm: bool, dropout: float):
        super().__init__()
        self.linear = nn.Linear(fin, fout)
        self.norm = nn.LayerNorm(fout) if layernorm else None
        self.act = C.ACTIVATIONS[act]()
        self.drop = nn.Dropout(dropout) if dropout > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        if self.norm is not None:
            x = self.norm(x)
        x = self.act(x)
        if self.drop is not None:
            x = self.drop(x)
        return x


class MLP(nn.Module):
    """Hidden blocks in ``blocks`` followed by the Linear classifier ``out``."""

    def __init__(self, hp: dict, n_features: int, n_classes: int):
        super().__init__()
        widths = [n_features] + [hp["width"]] * hp["depth"]
        self.blocks = nn.ModuleList(
            Block(a, b, hp["activation"], bool(hp["layernorm"]), hp["dropout"])
            for a, b in zip(widths[:-1], widths[1:])
        )
        self.out = nn.Linear(widths[-1], n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def sample(rng: np.random.Generator) -> dict:
    """Draw the hyperparameters of one model."""
    hp: dict = {
        "dataset": C.choice(rng, DATASETS),
        "depth": int(rng.integers(1, 5)),
        "width": C.choice(rng, WIDTHS),
        "activation": C.choice(rng, ACTS),
        "layernorm": int(rng.random() < 0.4),
        "dropout": C.maybe(rng, 0.5, lambda: C.sig(rng.uniform(0.05, 0.5), 3)),
    }
    hp.update(C.sample_optim(rng, OPTIMIZERS, C.WIDE_LR_RANGES))
    hp["batch_size"] = C.choice(rng, BATCH_SIZES)
    hp["data_fraction"] = C.sig(rng.uniform(0.1, 1.0), 3)
    hp["label_noise"] = C.maybe(rng, 0.7, lambda: C.sig(rng.uniform(0.05, 0.5), 3))
    hp["input_noise"] = C.maybe(rng, 0.7, lambda: C.sig(rng.uniform(0.05, 1.0), 3))
    data = C.tabular(hp["dataset"])
    n_used = C.n_used_of(len(data.y_train), hp["data_fraction"], data.n_classes)
    steps_per_epoch = -(-n_used // hp["batch_size"])
    hp["epochs"] = max(1, min(C.log_int(rng, 5, 200), MAX_STEPS // steps_per_epoch))
    return hp


def build_one(seed: int, index: int, out: Path) -> dict:
    """Make model ``index`` of the zoo with seed ``seed``; return its metrics row."""
    return C.build_checkpoint(
        seed, index, out,
        sample=sample,
        data_of=lambda hp: C.tabular(hp["dataset"]),
        make_model=lambda hp, data: MLP(hp, data.input_shape[0], data.n_classes),
        columns=COLUMNS,
    )


def make(out: Path, n: int, seed: int, workers: int = 1) -> Path:
    """Make (or complete) a tabular-MLP zoo of ``n`` models in ``out``."""
    return C.run_zoo(_MODULE, out, n, seed, workers)


if __name__ == "__main__":
    C.cli(_MODULE, __doc__.split("\n\n")[0])
