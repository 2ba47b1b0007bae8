"""Wild CNN zoo: small CNNs on 8x8 digits whose stages vary freely.

Architecture of one model (all choices sampled per model)::

    input (1, 1, 8, 8)
    1-3 stages, each:
        conv(k in {1,3,5}, padding k//2, stride 1|2) -> norm -> act
        [residual: conv(k, stride 1) -> norm, add skip (identity, or a
         1x1 conv projection when channels or stride change), act]
        [max pool 2x2]
    adaptive average pool to 2x2 (mostly) or 1x1
    flatten -> 1-3 Linear layers (hidden ones followed by act and dropout)

``norm`` is none, BatchNorm2d or GroupNorm (groups = 4, 2 or 1, the largest
dividing the channel count), ``act`` one of six activations per stage (the
head draws from the same list without sigmoid). Channels are 4..32, kernel
1/3/5 with probabilities 0.2/0.5/0.3; stride 2 and max pooling are only
drawn while the feature map stays at least 2x2.

Training varies optimizer (sgd, momentum = SGD+Nesterov 0.9, adam, adamw,
rmsprop), learning rate (log-uniform over an optimizer-specific range of
two decades or more), weight decay, batch size, data fraction, label noise
and input noise. ``epochs`` is drawn log-uniformly in 8..60 and then capped
so that one model costs at most :data:`MAC_BUDGET` forward MACs and
:data:`MAX_STEPS` optimizer steps (see :func:`cap_epochs`); the CSV holds
the epochs actually run, so big architectures tend to get fewer epochs.

CSV columns per stage ``s`` (1..3): ``s{s}_channels``, ``s{s}_kernel``,
``s{s}_stride``, ``s{s}_norm``, ``s{s}_act``, ``s{s}_residual`` (0/1),
``s{s}_pool`` (0/1). Stages beyond ``n_stages`` hold 0 / ``none``.

Usage (from the repository root)::

    python -m benchmarks.blind.wild_cnn --out DIR --n N --seed S [--workers W]
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from . import common as C

CHANNELS = [4, 6, 8, 12, 16, 24, 32]
KERNELS = [1, 3, 5]
KERNEL_P = [0.2, 0.5, 0.3]
NORMS = ["none", "batch", "group"]
ACTS = ["relu", "leaky_relu", "gelu", "tanh", "sigmoid", "silu"]
HEAD_ACTS = [a for a in ACTS if a != "sigmoid"]  # a sigmoid MLP head rarely trains at all
OPTIMIZERS = ["sgd", "momentum", "adam", "adamw", "rmsprop"]
BATCH_SIZES = [32, 64, 128]
#: Learning-rate ranges (log-uniform, two decades or more each); the low ends
#: are higher than :data:`common.LR_RANGES` because runs here are short.
LR_RANGES = {
    "sgd": (1e-2, 1.0),
    "momentum": (1e-3, 0.3),
    "adam": (3e-4, 3e-2),
    "adamw": (3e-4, 3e-2),
    "rmsprop": (1e-4, 1e-2),
}
MAX_STAGES = 3
#: Importable name of this module (also when run with ``python -m``).
_MODULE = __spec__.name

STAGE_KEYS = ["channels", "kernel", "stride", "norm", "act", "residual", "pool"]
COLUMNS = (
    ["n_stages"]
    + [f"s{s}_{k}" for s in range(1, MAX_STAGES + 1) for k in STAGE_KEYS]
    + ["global_pool", "head_layers", "head_width", "head_act", "head_dropout"]
    + ["optimizer", "lr", "weight_decay", "epochs", "batch_size",
       "data_fraction", "label_noise", "input_noise"]
)

#: Compute budget per model, in multiply-accumulates of forward passes over
#: training examples (backward ~2x more); keeps a model around a second.
MAC_BUDGET = 2.5e9
#: Cap on optimizer steps per model (per-step Python overhead dominates for
#: tiny models and small batches).
MAX_STEPS = 400


def _norm(kind: str, channels: int) -> nn.Module | None:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        groups = next(g for g in (4, 2, 1) if channels % g == 0)
        return nn.GroupNorm(groups, channels)
    return None


class Stage(nn.Module):
    """conv -> norm -> act, optionally a residual second conv, optionally max pool."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, norm: str,
                 act: str, residual: bool, pool: bool):
        super().__init__()
        pad = kernel // 2
        self.conv1 = nn.Conv2d(cin, cout, kernel, stride, pad, bias=norm == "none")
        self.norm1 = _norm(norm, cout)
        self.act1 = C.ACTIVATIONS[act]()
        self.residual = residual
        if residual:
            self.conv2 = nn.Conv2d(cout, cout, kernel, 1, pad, bias=norm == "none")
            self.norm2 = _norm(norm, cout)
            needs_proj = cin != cout or stride != 1
            self.proj = nn.Conv2d(cin, cout, 1, stride, 0, bias=False) if needs_proj else None
            self.act2 = C.ACTIVATIONS[act]()
        self.pool = nn.MaxPool2d(2) if pool else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv1(x)
        if self.norm1 is not None:
            y = self.norm1(y)
        y = self.act1(y)
        if self.residual:
            y = self.conv2(y)
            if self.norm2 is not None:
                y = self.norm2(y)
            skip = x if self.proj is None else self.proj(x)
            y = self.act2(y + skip)
        if self.pool is not None:
            y = self.pool(y)
        return y


class WildCNN(nn.Module):
    """Stages in ``blocks``, adaptive average pool, Linear head in ``head``."""

    def __init__(self, hp: dict, n_classes: int):
        super().__init__()
        stages, cin = [], 1
        for s in range(1, hp["n_stages"] + 1):
            st = {k: hp[f"s{s}_{k}"] for k in STAGE_KEYS}
            stages.append(Stage(cin, st["channels"], st["kernel"], st["stride"], st["norm"],
                                st["act"], bool(st["residual"]), bool(st["pool"])))
            cin = st["channels"]
        self.blocks = nn.ModuleList(stages)
        self.gpool = nn.AdaptiveAvgPool2d(hp["global_pool"])
        widths = [cin * hp["global_pool"] ** 2] + [hp["head_width"]] * (hp["head_layers"] - 1) + [n_classes]
        self.head = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.head_act = C.ACTIVATIONS[hp["head_act"]]() if hp["head_layers"] > 1 else None
        self.head_drop = nn.Dropout(hp["head_dropout"]) if hp["head_dropout"] > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.blocks:
            x = stage(x)
        x = torch.flatten(self.gpool(x), 1)
        last = len(self.head) - 1
        for i, lin in enumerate(self.head):
            x = lin(x)
            if i < last:
                x = self.head_act(x)
                if self.head_drop is not None:
                    x = self.head_drop(x)
        return x


def forward_macs(hp: dict, n_classes: int = 10) -> int:
    """Multiply-accumulates of one forward pass of one example."""
    macs, cin, side = 0, 1, 8
    for s in range(1, hp["n_stages"] + 1):
        c, k, st = hp[f"s{s}_channels"], hp[f"s{s}_kernel"], hp[f"s{s}_stride"]
        side = (side + 2 * (k // 2) - k) // st + 1
        macs += side * side * c * cin * k * k
        if hp[f"s{s}_residual"]:
            macs += side * side * c * c * k * k
            if c != cin or st != 1:
                macs += side * side * c * cin  # 1x1 projection
        if hp[f"s{s}_pool"]:
            side //= 2
        cin = c
    widths = [cin * hp["global_pool"] ** 2] + [hp["head_width"]] * (hp["head_layers"] - 1) + [n_classes]
    return macs + sum(a * b for a, b in zip(widths[:-1], widths[1:]))


def cap_epochs(epochs: int, n_used: int, batch_size: int, macs: int) -> int:
    """Largest epoch count <= ``epochs`` that fits :data:`MAC_BUDGET` and :data:`MAX_STEPS`."""
    steps_per_epoch = -(-n_used // batch_size)
    by_macs = int(MAC_BUDGET // max(1, n_used * macs))
    by_steps = MAX_STEPS // steps_per_epoch
    return max(1, min(epochs, by_macs, by_steps))


def sample(rng: np.random.Generator) -> dict:
    """Draw the hyperparameters of one model."""
    hp: dict = {"n_stages": int(rng.integers(1, MAX_STAGES + 1))}
    side = 8
    for s in range(1, MAX_STAGES + 1):
        if s > hp["n_stages"]:
            hp.update({f"s{s}_{k}": 0 for k in ("channels", "kernel", "stride", "residual", "pool")})
            hp.update({f"s{s}_{k}": "none" for k in ("norm", "act")})
            continue
        stride = 2 if side // 2 >= 2 and rng.random() < 0.35 else 1
        side //= stride
        pool = side // 2 >= 2 and rng.random() < 0.3
        side //= 2 if pool else 1
        hp.update({
            f"s{s}_channels": C.choice(rng, CHANNELS),
            f"s{s}_kernel": int(rng.choice(KERNELS, p=KERNEL_P)),
            f"s{s}_stride": stride,
            f"s{s}_norm": C.choice(rng, NORMS),
            f"s{s}_act": C.choice(rng, ACTS),
            f"s{s}_residual": int(rng.random() < 0.4),
            f"s{s}_pool": int(pool),
        })
    hp["global_pool"] = 2 if rng.random() < 0.85 else 1
    hp["head_layers"] = int(rng.integers(1, 4))
    hp["head_width"] = C.choice(rng, [16, 32, 64, 128]) if hp["head_layers"] > 1 else 0
    hp["head_act"] = C.choice(rng, HEAD_ACTS) if hp["head_layers"] > 1 else "none"
    hp["head_dropout"] = (C.maybe(rng, 0.5, lambda: C.sig(rng.uniform(0.05, 0.5), 3))
                          if hp["head_layers"] > 1 else 0.0)
    hp.update(C.sample_optim(rng, OPTIMIZERS, LR_RANGES))
    hp["batch_size"] = C.choice(rng, BATCH_SIZES)
    hp["data_fraction"] = C.sig(rng.uniform(0.1, 1.0), 3)
    hp["label_noise"] = C.maybe(rng, 0.7, lambda: C.sig(rng.uniform(0.05, 0.6), 3))
    hp["input_noise"] = C.maybe(rng, 0.6, lambda: C.sig(rng.uniform(0.05, 1.0), 3))
    n_used = C.n_used_of(len(C.digits_images().y_train), hp["data_fraction"], 10)
    hp["epochs"] = cap_epochs(C.log_int(rng, 8, 60), n_used, hp["batch_size"], forward_macs(hp))
    return hp


def build_one(seed: int, index: int, out: Path) -> dict:
    """Make model ``index`` of the zoo with seed ``seed``; return its metrics row."""
    return C.build_checkpoint(
        seed, index, out,
        sample=sample,
        data_of=lambda hp: C.digits_images(),
        make_model=lambda hp, data: WildCNN(hp, data.n_classes),
        columns=COLUMNS,
    )


def make(out: Path, n: int, seed: int, workers: int = 1) -> Path:
    """Make (or complete) a wild-CNN zoo of ``n`` models in ``out``."""
    return C.run_zoo(_MODULE, out, n, seed, workers)


if __name__ == "__main__":
    C.cli(_MODULE, __doc__.split("\n\n")[0])
