"""Shared helpers for the blind model-zoo generators.

Every generator in this package follows the same contract:

* a module-level ``COLUMNS`` list (hyperparameter columns of ``metrics.csv``,
  in order, excluding ``file``, the accuracies and ``fold``), and
* a module-level ``build_one(seed: int, index: int, out: Path) -> dict``
  that samples the hyperparameters of model ``index`` from ``seed`` alone,
  trains the model, writes its ``.pt2`` checkpoint atomically and returns
  its metrics row.

:func:`run_zoo` drives such a module: it skips finished models, fans the rest
out over worker processes and rewrites ``metrics.csv`` atomically after every
finished model, so an interrupted run can simply be started again.

Data: only data sets that scikit-learn ships offline are used. Each data set
is split once, with a fixed seed that does not depend on the zoo seed, into
60 % train / 20 % validation / 20 % test (stratified). Models are trained on
(a subset of) the train split only; the test split is used solely to measure
``test_accuracy``. The validation split is held back and not used by these
generators (nothing is selected on it), so it stays available to a user.
"""

from __future__ import annotations

import csv
import functools
import importlib
import math
import multiprocessing as mp
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

#: Seed of the fixed train/val/test split; independent of any zoo seed.
SPLIT_SEED = 20240601
#: File name of the metrics table inside a zoo folder.
METRICS = "metrics.csv"
#: Prefix of temporary checkpoint files (hidden, and without a ``.pt2`` suffix).
TMP_PREFIX = ".tmp-"
#: Gradient-norm clip applied in every training run (keeps huge learning
#: rates from producing inf/nan weights; the models can still be ruined).
GRAD_CLIP = 10.0

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "leaky_relu": lambda: nn.LeakyReLU(0.1),
    "gelu": nn.GELU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "silu": nn.SiLU,
    "elu": nn.ELU,
}


# --------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Data:
    """A data set split into train / validation / test tensors.

    ``x_*`` are float32 tensors (``(N, 1, 8, 8)`` images or ``(N, F)``
    features), ``y_*`` are int64 class labels.
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    n_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one example without the batch dimension."""
        return tuple(self.x_train.shape[1:])


def _raw(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Return features and labels of a scikit-learn bundled data set."""
    from sklearn import datasets

    loaders = {
        "iris": datasets.load_iris,
        "wine": datasets.load_wine,
        "breast_cancer": datasets.load_breast_cancer,
        "digits": datasets.load_digits,
    }
    bunch = loaders[name]()
    return bunch.data.astype(np.float64), bunch.target.astype(np.int64)


def split_indices(y: np.ndarray, seed: int = SPLIT_SEED) -> tuple[np.ndarray, ...]:
    """Stratified 60/20/20 train/val/test index split with a fixed seed."""
    from sklearn.model_selection import train_test_split

    idx = np.arange(len(y))
    train, rest = train_test_split(idx, test_size=0.4, stratify=y, random_state=seed)
    val, test = train_test_split(rest, test_size=0.5, stratify=y[rest], random_state=seed)
    return np.sort(train), np.sort(val), np.sort(test)


def _make_data(name: str, x: np.ndarray, y: np.ndarray) -> Data:
    tr, va, te = split_indices(y)

    def t(a: np.ndarray, dtype=torch.float32) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)

    return Data(
        name=name,
        x_train=t(x[tr]), y_train=t(y[tr], torch.int64),
        x_val=t(x[va]), y_val=t(y[va], torch.int64),
        x_test=t(x[te]), y_test=t(y[te], torch.int64),
        n_classes=int(y.max()) + 1,
    )


@functools.lru_cache(maxsize=None)
def digits_images() -> Data:
    """8x8 digits as ``(N, 1, 8, 8)`` images.

    Pixels are standardised with one scalar mean/std computed on the train
    split (a per-pixel standardisation would be odd for a CNN).
    """
    x, y = _raw("digits")
    tr, _, _ = split_indices(y)
    mean, std = x[tr].mean(), x[tr].std()
    x = ((x - mean) / std).reshape(-1, 1, 8, 8)
    return _make_data("digits", x, y)


@functools.lru_cache(maxsize=None)
def tabular(name: str) -> Data:
    """A tabular data set (``digits`` flattened to 64 features) as ``(N, F)``.

    Each feature is standardised with the mean/std of the train split
    (constant features get std 1).
    """
    x, y = _raw(name)
    tr, _, _ = split_indices(y)
    mean, std = x[tr].mean(0), x[tr].std(0)
    std[std == 0] = 1.0
    return _make_data(name, (x - mean) / std, y)


# --------------------------------------------------------------------------
# sampling helpers
# --------------------------------------------------------------------------


def rng_for(seed: int, index: int, attempt: int = 0) -> np.random.Generator:
    """Independent random stream for one model (and one retry attempt)."""
    return np.random.default_rng(np.random.SeedSequence([seed, index, attempt]))


def sig(x: float, digits: int = 4) -> float:
    """Round to ``digits`` significant digits (so the CSV holds the value used)."""
    if x == 0 or not math.isfinite(x):
        return float(x)
    return float(f"{x:.{digits - 1}e}")


def log_uniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    """A log-uniform sample in ``[lo, hi]``, rounded to 4 significant digits."""
    return sig(float(np.exp(rng.uniform(np.log(lo), np.log(hi)))))


def log_int(rng: np.random.Generator, lo: int, hi: int) -> int:
    """An integer in ``[lo, hi]`` drawn log-uniformly."""
    return int(min(hi, max(lo, round(np.exp(rng.uniform(np.log(lo), np.log(hi + 0.5)))))))


def choice(rng: np.random.Generator, options: Sequence):
    """Uniform choice that returns a plain Python value."""
    v = options[int(rng.integers(len(options)))]
    return v.item() if hasattr(v, "item") else v


def maybe(rng: np.random.Generator, p_zero: float, draw: Callable[[], float]) -> float:
    """``0.0`` with probability ``p_zero``, otherwise ``draw()``."""
    return 0.0 if rng.random() < p_zero else draw()


#: Learning-rate ranges per optimizer (log-uniform). Deliberately wide: the
#: low end leaves short runs nearly untrained, the high end often ruins them.
LR_RANGES = {
    "sgd": (1e-2, 1.0),
    "momentum": (1e-3, 0.3),
    "adam": (1e-4, 3e-2),
    "adamw": (1e-4, 3e-2),
    "rmsprop": (3e-5, 1e-2),
}

#: Ten times wider at the low end; for the cheap MLPs, which see many epochs.
WIDE_LR_RANGES = {k: (lo / 10, hi) for k, (lo, hi) in LR_RANGES.items()}


def sample_optim(rng: np.random.Generator, optimizers: Sequence[str],
                 lr_ranges: dict[str, tuple[float, float]] = LR_RANGES) -> dict:
    """Sample ``optimizer``, ``lr`` (log-uniform in its range) and
    ``weight_decay`` (0 with probability 0.3, else log-uniform in 1e-6..1e-1)."""
    opt = choice(rng, optimizers)
    return {
        "optimizer": opt,
        "lr": log_uniform(rng, *lr_ranges[opt]),
        "weight_decay": maybe(rng, 0.3, lambda: log_uniform(rng, 1e-6, 1e-1)),
    }


def make_optimizer(name: str, params, lr: float, weight_decay: float,
                   sgd_momentum: float = 0.0) -> torch.optim.Optimizer:
    """Build an optimizer by name.

    ``sgd`` is SGD with momentum ``sgd_momentum`` (plain SGD by default),
    ``momentum`` is SGD with Nesterov momentum 0.9; ``weight_decay`` is L2
    regularisation except for ``adamw`` where it is decoupled.
    """
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=sgd_momentum, weight_decay=weight_decay)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, nesterov=True, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}")


# --------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Accuracy of ``model`` (in eval mode) on ``(x, y)``."""
    model.eval()
    return float((model(x).argmax(1) == y).float().mean())


def finite(model: nn.Module) -> bool:
    """True when every parameter and buffer of ``model`` is finite."""
    return all(bool(torch.isfinite(t).all()) for t in list(model.parameters()) + list(model.buffers()))


def n_used_of(n_train: int, data_fraction: float, n_classes: int) -> int:
    """Number of training examples used for a given ``data_fraction``."""
    return min(n_train, max(2 * n_classes, int(round(data_fraction * n_train))))


@dataclass
class TrainResult:
    """Outcome of :func:`train`; ``ok`` is False when weights went non-finite."""

    ok: bool
    train_accuracy: float = float("nan")
    test_accuracy: float = float("nan")


def train(
    model: nn.Module,
    data: Data,
    *,
    torch_seed: int,
    rng: np.random.Generator,
    optimizer: str,
    lr: float,
    weight_decay: float,
    epochs: int,
    batch_size: int,
    data_fraction: float = 1.0,
    label_noise: float = 0.0,
    input_noise: float = 0.0,
    input_dropout: float = 0.0,
    sgd_momentum: float = 0.0,
) -> TrainResult:
    """Train ``model`` with plain cross-entropy minibatch training.

    * ``data_fraction``: a random subset of that fraction of the train split
      is used (at least ``2 * n_classes`` examples).
    * ``label_noise``: that fraction of the used examples gets a label drawn
      uniformly from all classes (fixed for the whole run).
    * ``input_noise``: std of Gaussian noise added to every training batch.
    * ``input_dropout``: each input value of a training batch is zeroed with
      this probability and the rest scaled by ``1 / (1 - p)`` (a training-time
      augmentation, so the exported graph does not depend on it).
    * ``sgd_momentum``: momentum for ``optimizer == "sgd"``.

    ``train_accuracy`` is measured on the used subset with the labels that
    were trained on (noisy ones included); ``test_accuracy`` on the test split.
    """
    g = torch.Generator().manual_seed(torch_seed)
    n_all = len(data.y_train)
    n_used = n_used_of(n_all, data_fraction, data.n_classes)
    idx = torch.from_numpy(np.sort(rng.permutation(n_all)[:n_used]))
    x, y = data.x_train[idx], data.y_train[idx].clone()
    if label_noise > 0:
        flip = torch.from_numpy(rng.random(n_used) < label_noise)
        y[flip] = torch.from_numpy(rng.integers(0, data.n_classes, int(flip.sum())))

    opt = make_optimizer(optimizer, model.parameters(), lr, weight_decay, sgd_momentum)
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(epochs):
        model.train()
        perm = torch.randperm(n_used, generator=g)
        for start in range(0, n_used, batch_size):
            b = perm[start:start + batch_size]
            if len(b) < 2 and start > 0:  # avoid a size-1 batch (BatchNorm)
                continue
            xb = x[b]
            if input_noise > 0:
                xb = xb + input_noise * torch.randn(xb.shape, generator=g)
            if input_dropout > 0:
                keep = torch.rand(xb.shape, generator=g) >= input_dropout
                xb = xb * keep / (1.0 - input_dropout)
            loss = loss_fn(model(xb), y[b])
            if not torch.isfinite(loss):
                return TrainResult(ok=False)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            opt.step()
    if not finite(model):
        return TrainResult(ok=False)
    return TrainResult(
        ok=True,
        train_accuracy=sig(accuracy(model, x, y)),
        test_accuracy=sig(accuracy(model, data.x_test, data.y_test)),
    )


#: Hyperparameter keys that :func:`build_checkpoint` forwards to :func:`train`.
TRAIN_KEYS = ("optimizer", "lr", "weight_decay", "epochs", "batch_size",
              "data_fraction", "label_noise", "input_noise", "input_dropout")


def build_checkpoint(
    seed: int,
    index: int,
    out: Path,
    *,
    sample: Callable[[np.random.Generator], dict],
    data_of: Callable[[dict], Data],
    make_model: Callable[[dict, Data], nn.Module],
    columns: Sequence[str],
    train_extra: dict | None = None,
    max_attempts: int = 20,
) -> dict:
    """Sample, build, train and export model ``index``; return its metrics row.

    ``sample(rng)`` draws the hyperparameters (a dict holding at least the
    ``columns`` and the :data:`TRAIN_KEYS` the zoo uses), ``data_of(hp)``
    gives the data set and ``make_model(hp, data)`` the untrained model.
    If training produces non-finite weights the draw is discarded and a new
    one is made from the next attempt's random stream (deterministically),
    so every checkpoint written holds finite weights.
    """
    for attempt in range(max_attempts):
        rng = rng_for(seed, index, attempt)
        hp = sample(rng)
        data = data_of(hp)
        torch_seed = int(rng.integers(2**31 - 1))
        torch.manual_seed(torch_seed)
        model = make_model(hp, data)
        kwargs = {k: hp[k] for k in TRAIN_KEYS if k in hp}
        res = train(model, data, torch_seed=torch_seed, rng=rng, **kwargs, **(train_extra or {}))
        if res.ok:
            break
    else:
        raise RuntimeError(f"model {index}: no finite run in {max_attempts} attempts")
    export_pt2(model, torch.zeros(1, *data.input_shape), out / ckpt_name(index))
    return {"test_accuracy": res.test_accuracy, "train_accuracy": res.train_accuracy,
            **{c: hp[c] for c in columns}}


# --------------------------------------------------------------------------
# checkpoints and the zoo driver
# --------------------------------------------------------------------------


def ckpt_name(index: int) -> str:
    """Checkpoint file name of model ``index``."""
    return f"model_{index:05d}.pt2"


def export_pt2(model: nn.Module, example: torch.Tensor, path: Path) -> None:
    """Export ``model`` (eval mode) with ``torch.export`` and save it atomically.

    The program is written to a hidden temporary name in the same folder and
    then renamed, so a partially written ``.pt2`` is never visible.
    """
    model.eval()
    program = torch.export.export(model, (example,))
    tmp = path.with_name(f"{TMP_PREFIX}{os.getpid()}-{path.name}.part")
    try:
        torch.export.save(program, str(tmp))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def fold_of(seed: int, index: int) -> str:
    """Fold (``a``/``b``/``c``) of model ``index``.

    Models are taken in consecutive blocks of three and each block gets a
    seeded random permutation of ``a, b, c``. The folds are therefore
    balanced (sizes differ by at most one), random, and - unlike a single
    shuffle of all ``n`` models - stable when a zoo is later extended.
    """
    block = index // 3
    perm = np.random.default_rng(np.random.SeedSequence([seed, block, 0xF01D])).permutation(3)
    return "abc"[int(perm[index % 3])]


def _fmt(v) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, float):
        return repr(v)
    return str(v)


def write_metrics(out: Path, rows: dict[int, dict], columns: Sequence[str]) -> None:
    """Atomically (re)write ``metrics.csv`` with ``rows`` sorted by index."""
    header = metrics_header(columns)
    tmp = out / f"{TMP_PREFIX}{METRICS}"
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for i in sorted(rows):
            w.writerow([_fmt(rows[i][c]) for c in header])
    os.replace(tmp, out / METRICS)


def metrics_header(columns: Sequence[str]) -> list[str]:
    """Full ``metrics.csv`` header for a generator with hyperparameter ``columns``."""
    return ["file", "test_accuracy", "train_accuracy", *columns, "fold"]


def read_metrics(out: Path, columns: Sequence[str]) -> dict[str, dict[str, str]]:
    """Rows of an existing ``metrics.csv`` keyed by file name (values as text).

    Raises ``ValueError`` when the file was written by another generator
    (different header), so zoos are never silently mixed.
    """
    path = out / METRICS
    if not path.exists():
        return {}
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames != metrics_header(columns):
            raise ValueError(f"{path} has other columns than this generator writes; "
                             "use a fresh --out folder")
        return {r["file"]: r for r in reader}


def _init_worker() -> None:
    """Pool initializer: one intra-op thread per worker process."""
    torch.set_num_threads(1)


def _work(task: tuple[str, int, int, str]) -> tuple[int, dict]:
    """Build one model in the current process; ``task`` is (module, seed, index, out)."""
    module, seed, index, out = task
    return index, importlib.import_module(module).build_one(seed, index, Path(out))


def run_zoo(module: str, out: Path, n: int, seed: int, workers: int = 1, every: int = 10) -> Path:
    """Make (or complete) the zoo of generator ``module`` in ``out``.

    ``module`` is the importable name of a generator module (see the module
    docstring). Models whose checkpoint exists *and* which have a row in
    ``metrics.csv`` are skipped; others are (re)built. ``metrics.csv`` is
    rewritten atomically after each finished model. A resumed run must use
    the same ``seed`` (it is not recorded). One run per folder at a time.
    With ``workers > 1`` models are built in ``spawn``-ed processes; results
    do not depend on ``workers``. Returns ``out``.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(f"{TMP_PREFIX}*"):
        stale.unlink()
    gen = importlib.import_module(module)
    columns = list(gen.COLUMNS)
    name = module.rsplit(".", 1)[-1]

    old = read_metrics(out, columns)
    rows: dict[int, dict] = {}
    todo: list[int] = []
    for i in range(n):
        f = ckpt_name(i)
        if f in old and (out / f).exists():
            rows[i] = old[f]
        else:
            todo.append(i)
    extra = [f for f in old if f not in {ckpt_name(i) for i in range(n)}]
    if extra:
        print(f"[{name}] note: dropping {len(extra)} metrics rows beyond n={n}", file=sys.stderr)
    write_metrics(out, rows, columns)
    print(f"[{name}] {out}: {n} models, {len(rows)} already done, {len(todo)} to make, "
          f"workers={workers}", flush=True)

    t0 = time.perf_counter()
    tasks = [(module, seed, i, str(out)) for i in todo]
    done = 0

    def record(index: int, row: dict) -> None:
        nonlocal done
        row = {"file": ckpt_name(index), **row, "fold": fold_of(seed, index)}
        rows[index] = row
        write_metrics(out, rows, columns)
        done += 1
        if done % every == 0 or done == len(todo):
            el = time.perf_counter() - t0
            eta = el / done * (len(todo) - done)
            print(f"[{name}] {done}/{len(todo)} made ({len(rows)}/{n} in zoo), "
                  f"{el:.1f}s elapsed, {el / done:.2f}s/model, eta {eta:.0f}s", flush=True)

    if workers <= 1:
        prev = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for task in tasks:
                record(*_work(task))
        finally:
            torch.set_num_threads(prev)
    elif tasks:
        ctx = mp.get_context("spawn")
        with ctx.Pool(workers, initializer=_init_worker) as pool:
            for index, row in pool.imap_unordered(_work, tasks):
                record(index, row)
            pool.close()  # let workers exit normally (no leaked-semaphore warnings)
            pool.join()
    return out


def cli(module: str, doc: str, argv: Sequence[str] | None = None) -> Path:
    """Command-line entry point shared by the generators."""
    import argparse

    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc)
    p.add_argument("--out", type=Path, required=True, help="zoo folder (created if missing)")
    p.add_argument("--n", type=int, required=True, help="number of models")
    p.add_argument("--seed", type=int, default=0, help="zoo seed (default 0)")
    p.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    a = p.parse_args(argv)
    # Turn SIGTERM into a normal exit so the worker pool is shut down cleanly;
    # finished models are on disk and in metrics.csv, a rerun resumes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    return run_zoo(module, a.out, a.n, a.seed, a.workers)
