"""Fixed CNN zoo: one CNN architecture on 8x8 digits, only training varies.

Every model is the same network (identical parameter shapes and graph)::

    input (1, 1, 8, 8)
    conv1 3x3, 1->16, pad 1 -> relu -> max pool 2x2        (16 x 4 x 4)
    conv2 3x3, 16->16, pad 1 -> relu -> avg pool to 2x2    (16 x 2 x 2)
    flatten (64) -> fc Linear(64, 10)

Varied per model: ``optimizer`` (sgd with momentum 0.9, adam, rmsprop,
adamw), ``lr`` (log-uniform, optimizer-specific wide range),
``weight_decay``, ``init`` (weight initialisation of conv/linear layers,
seven schemes), ``input_dropout`` (training-time dropout on the input
pixels, so it leaves the exported graph unchanged), ``data_fraction`` and
``epochs`` (log-uniform in 1..50, capped at :data:`MAX_STEPS` optimizer
steps; the CSV holds the epochs actually run). Batch size is fixed at
:data:`BATCH_SIZE` and the activation is always ReLU.

Usage (from the repository root)::

    python -m benchmarks.blind.fixed_cnn --out DIR --n N --seed S [--workers W]
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from . import common as C

#: Importable name of this module (also when run with ``python -m``).
_MODULE = __spec__.name

OPTIMIZERS = ["sgd", "adam", "rmsprop", "adamw"]
INITS = ["default", "kaiming_normal", "kaiming_uniform", "xavier_normal",
         "xavier_uniform", "orthogonal", "small_normal"]
BATCH_SIZE = 64
#: Cap on optimizer steps per model.
MAX_STEPS = 500
#: SGD learning rates: with momentum 0.9 the useful range sits lower than plain SGD's.
LR_RANGES = {**C.LR_RANGES, "sgd": C.LR_RANGES["momentum"]}

COLUMNS = ["optimizer", "lr", "weight_decay", "init", "input_dropout", "data_fraction", "epochs"]


class FixedCNN(nn.Module):
    """conv-relu-maxpool, conv-relu-avgpool(2x2), flatten, linear."""

    def __init__(self, n_classes: int = 10, width: int = 16):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.act1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.act2 = nn.ReLU()
        self.pool2 = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(width * 4, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool1(self.act1(self.conv1(x)))
        x = self.pool2(self.act2(self.conv2(x)))
        return self.fc(torch.flatten(x, 1))


def init_weights(model: nn.Module, scheme: str) -> None:
    """Re-initialise conv/linear weights with ``scheme`` (biases to zero).

    ``default`` keeps PyTorch's own initialisation (biases included);
    ``small_normal`` is N(0, 0.01^2), which starts ReLU nets nearly dead.
    """
    if scheme == "default":
        return
    for m in model.modules():
        if not isinstance(m, (nn.Conv2d, nn.Linear)):
            continue
        w = m.weight
        if scheme == "kaiming_normal":
            nn.init.kaiming_normal_(w, nonlinearity="relu")
        elif scheme == "kaiming_uniform":
            nn.init.kaiming_uniform_(w, nonlinearity="relu")
        elif scheme == "xavier_normal":
            nn.init.xavier_normal_(w)
        elif scheme == "xavier_uniform":
            nn.init.xavier_uniform_(w)
        elif scheme == "orthogonal":
            nn.init.orthogonal_(w)
        elif scheme == "small_normal":
            nn.init.normal_(w, std=0.01)
        else:
            raise ValueError(f"unknown init {scheme!r}")
        nn.init.zeros_(m.bias)


def make_model(hp: dict, data: C.Data) -> FixedCNN:
    """The fixed network, initialised with ``hp['init']``."""
    model = FixedCNN(data.n_classes)
    init_weights(model, hp["init"])
    return model


def sample(rng: np.random.Generator) -> dict:
    """Draw the training hyperparameters of one model."""
    hp = C.sample_optim(rng, OPTIMIZERS, LR_RANGES)
    hp["init"] = C.choice(rng, INITS)
    hp["input_dropout"] = C.maybe(rng, 0.4, lambda: C.sig(rng.uniform(0.05, 0.5), 3))
    hp["data_fraction"] = C.sig(rng.uniform(0.1, 1.0), 3)
    n_used = C.n_used_of(len(C.digits_images().y_train), hp["data_fraction"], 10)
    steps_per_epoch = -(-n_used // BATCH_SIZE)
    hp["epochs"] = max(1, min(C.log_int(rng, 1, 50), MAX_STEPS // steps_per_epoch))
    return hp


def build_one(seed: int, index: int, out: Path) -> dict:
    """Make model ``index`` of the zoo with seed ``seed``; return its metrics row."""
    return C.build_checkpoint(
        seed, index, out,
        sample=sample,
        data_of=lambda hp: C.digits_images(),
        make_model=make_model,
        columns=COLUMNS,
        train_extra={"batch_size": BATCH_SIZE, "sgd_momentum": 0.9},
    )


def make(out: Path, n: int, seed: int, workers: int = 1) -> Path:
    """Make (or complete) a fixed-CNN zoo of ``n`` models in ``out``."""
    return C.run_zoo(_MODULE, out, n, seed, workers)


if __name__ == "__main__":
    C.cli(_MODULE, __doc__.split("\n\n")[0])
