"""The zoo kinds: what each model's architecture and training recipe is, drawn from a seed.

All data ships with scikit-learn (nothing is downloaded):
- ``cnn``: small CNNs on the 8x8 digits images; width, depth, activation, batch norm, residual
  blocks, kernel size, optimizer, learning rate, weight decay, epochs, training fraction and
  initialisation vary, so test accuracy spreads from chance to about 95%.
- ``cnn-fixed``: one CNN architecture on the digits (in the manner of the Small CNN Zoo): three 3x3
  convs of 8 channels, ReLU or tanh, a linear head after 2x2 pooling; optimizer, learning rate,
  weight decay, initialisation scale, dropout, training fraction and epochs vary.
- ``mlp``: MLPs on iris, wine, breast cancer and digits, each reduced to 4 PCA features with a
  10-way output, so all share one architecture and the dataset must be read from the weights.
- ``inr``: SIRENs fitted to single digit images (pixel coordinates -> intensity), labelled by digit.
- ``mlp-equivariant``: depth-4 MLPs on the flattened digits (autoencoders and classifiers, tanh or
  GELU first), some trained with a soft mirror-equivariance loss (``pipeline.zoo.equivariant``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from pipeline.spec import build_module


@dataclass
class ModelRecipe:
    spec: dict
    train: Callable[[nn.Module, int], dict[str, Any]]   # (model, init seed): trains in place, returns metrics
    metadata: dict[str, Any] = field(default_factory=dict)


@lru_cache(maxsize=None)
def _digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]   # (1797, 1, 8, 8)
    return x, d.target.astype(np.int64)


@lru_cache(maxsize=None)
def _tabular(name: str):
    from sklearn import datasets
    from sklearn.decomposition import PCA
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    loader = {"iris": datasets.load_iris, "wine": datasets.load_wine,
              "breast_cancer": datasets.load_breast_cancer, "digits": datasets.load_digits}[name]
    d = loader()
    xtr, xte, ytr, yte = train_test_split(d.data, d.target, test_size=0.3, random_state=0, stratify=d.target)
    scaler = StandardScaler().fit(xtr)
    pca = PCA(n_components=4, random_state=0).fit(scaler.transform(xtr))
    f = lambda a: pca.transform(scaler.transform(a)).astype(np.float32)  # noqa: E731
    return f(xtr), ytr.astype(np.int64), f(xte), yte.astype(np.int64)


def _digits_split() -> tuple[np.ndarray, np.ndarray]:
    """The CNN zoo's fixed split of the digits images: 500 test indices, the rest to train from."""
    perm = np.random.default_rng(0).permutation(len(_digits()[0]))
    return perm[:500], perm[500:]


def evaluation_data(dataset: str, input_shape: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test) a zoo model of ``dataset`` and input shape was trained
    and tested on: the digits images for CNNs, the PCA-reduced tabular sets for MLPs."""
    if dataset == "digits" and list(input_shape) == [1, 8, 8]:
        x, y = _digits()
        test, train = _digits_split()
        return x[train], y[train], x[test], y[test]
    if dataset in MLP_DATASETS and list(input_shape) == [4]:
        return _tabular(dataset)
    raise KeyError(f"no evaluation data for dataset {dataset!r} with input shape {list(input_shape)}")


def _init(model: nn.Module, scheme: str, gen: torch.Generator) -> None:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                if scheme == "kaiming":
                    nn.init.kaiming_uniform_(m.weight, a=math.sqrt(5), generator=gen)
                elif scheme == "xavier":
                    nn.init.xavier_normal_(m.weight, generator=gen)
                else:
                    m.weight.normal_(0.0, 0.05, generator=gen)
                if m.bias is not None:
                    m.bias.zero_()


def _optimizer(name: str, params, lr: float, wd: float):
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=wd)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, weight_decay=wd)
    return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=wd)


def _fit_classifier(model, xtr, ytr, xte, yte, *, optimizer, lr, wd, epochs, batch, gen) -> dict[str, Any]:
    opt = _optimizer(optimizer, model.parameters(), lr, wd)
    xtr_t, ytr_t = torch.from_numpy(xtr), torch.from_numpy(ytr)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(xtr_t), generator=gen)
        for i in range(0, len(order), batch):
            idx = order[i:i + batch]
            opt.zero_grad()
            loss = loss_fn(model(xtr_t[idx]), ytr_t[idx])
            if not torch.isfinite(loss):
                break
            loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        for p in model.parameters():             # a diverged model still yields a finite graph
            torch.nan_to_num_(p.data, nan=0.0, posinf=1e3, neginf=-1e3)
        test_logits = model(torch.from_numpy(xte))
        train_logits = model(xtr_t)
        test_loss = float(loss_fn(test_logits, torch.from_numpy(yte)))
    return {"test_accuracy": float((test_logits.argmax(1).numpy() == yte).mean()),
            "train_accuracy": float((train_logits.argmax(1).numpy() == ytr).mean()),
            "test_loss": test_loss if math.isfinite(test_loss) else None}


def cnn_recipe(rng: np.random.Generator, seed: int) -> ModelRecipe:
    width = int(rng.choice([4, 8, 12, 16]))
    depth = int(rng.integers(1, 4))
    act = str(rng.choice(["relu", "tanh", "silu", "gelu", "sigmoid"]))
    bn = bool(rng.random() < 0.5)
    residual = bool(rng.random() < 0.4)
    kernel = int(rng.choice([3, 5]))
    pool = int(rng.choice([2, 2, 2, 1]))
    layers: list[dict] = []
    for i in range(depth):
        layers.append({"type": "conv2d", "out_channels": width, "kernel_size": kernel, "padding": kernel // 2})
        if bn:
            layers.append({"type": "batchnorm"})
        layers.append({"type": "activation", "fn": act})
        if i == 0 and residual:
            body = [{"type": "conv2d", "out_channels": width, "kernel_size": 3, "padding": 1}]
            if bn:
                body.append({"type": "batchnorm"})
            layers += [{"type": "residual", "body": body}, {"type": "activation", "fn": act}]
        if i == 0 and depth > 1:
            layers.append({"type": "maxpool", "kernel_size": 2})
    layers += [{"type": "adaptive_avgpool", "output_size": pool}, {"type": "flatten"},
               {"type": "linear", "out_features": 10}]
    spec = {"format": "zoograph.spec/1", "input_shape": [1, 8, 8], "layers": layers}
    hp = {"optimizer": str(rng.choice(["adam", "sgd", "rmsprop"])), "lr": float(10 ** rng.uniform(-3.7, -1.0)),
          "weight_decay": float(rng.choice([0.0, 10 ** rng.uniform(-6, -2)])), "epochs": int(rng.integers(1, 11)),
          "train_fraction": float(rng.uniform(0.1, 1.0)), "init": str(rng.choice(["kaiming", "xavier", "normal"])),
          "batch_size": 64}
    meta = {"dataset": "digits", "activation": act, "width": width, "depth": depth, "batchnorm": bn,
            "residual": residual, "kernel_size": kernel, "pool": pool, **hp}

    def train(model: nn.Module, init_seed: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(init_seed)
        _init(model, hp["init"], gen)
        x, y = _digits()
        test, pool_idx = _digits_split()
        sub = np.random.default_rng(seed).permutation(pool_idx)[:max(64, int(hp["train_fraction"] * len(pool_idx)))]
        return _fit_classifier(model, x[sub], y[sub], x[test], y[test], optimizer=hp["optimizer"], lr=hp["lr"],
                               wd=hp["weight_decay"], epochs=hp["epochs"], batch=hp["batch_size"], gen=gen)

    return ModelRecipe(spec, train, meta)


def fixed_cnn_spec(act: str, dropout: float = 0.0) -> dict:
    """The ``cnn-fixed`` architecture (dropout changes no parameter: one architecture for all)."""
    conv = {"type": "conv2d", "out_channels": 8, "kernel_size": 3, "padding": 1}
    a = {"type": "activation", "fn": act}
    return {"format": "zoograph.spec/1", "input_shape": [1, 8, 8], "layers": [
        conv, a, {"type": "maxpool", "kernel_size": 2}, conv, a, conv, a,
        {"type": "adaptive_avgpool", "output_size": 2}, {"type": "flatten"},
        {"type": "dropout", "p": dropout}, {"type": "linear", "out_features": 10}]}


def cnn_fixed_recipe(rng: np.random.Generator, seed: int) -> ModelRecipe:
    act = str(rng.choice(["relu", "tanh"]))
    hp = {"optimizer": str(rng.choice(["adam", "sgd", "rmsprop"])), "lr": float(10 ** rng.uniform(-3.5, -1.0)),
          "weight_decay": float(rng.choice([0.0, 10 ** rng.uniform(-6, -2)])),
          "init_std": float(10 ** rng.uniform(-2.5, -0.3)), "dropout": float(rng.choice([0.0, rng.uniform(0, 0.5)])),
          "train_fraction": float(rng.uniform(0.05, 1.0)), "epochs": int(rng.integers(1, 13)), "batch_size": 64}
    meta = {"dataset": "digits", "activation": act, **hp}

    def train(model: nn.Module, init_seed: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(init_seed)
        with torch.no_grad():            # truncated normal of the drawn scale, zero biases
            for m in model.modules():
                if isinstance(m, (nn.Conv2d, nn.Linear)):
                    nn.init.trunc_normal_(m.weight, 0.0, hp["init_std"], -2 * hp["init_std"], 2 * hp["init_std"],
                                          generator=gen)
                    m.bias.zero_()
        x, y = _digits()
        test, pool_idx = _digits_split()
        sub = np.random.default_rng(seed).permutation(pool_idx)[:max(64, int(hp["train_fraction"] * len(pool_idx)))]
        return _fit_classifier(model, x[sub], y[sub], x[test], y[test], optimizer=hp["optimizer"], lr=hp["lr"],
                               wd=hp["weight_decay"], epochs=hp["epochs"], batch=hp["batch_size"], gen=gen)

    return ModelRecipe(fixed_cnn_spec(act, hp["dropout"]), train, meta)


MLP_DATASETS = ("iris", "wine", "breast_cancer", "digits")


def mlp_recipe(rng: np.random.Generator, seed: int) -> ModelRecipe:
    dataset = str(MLP_DATASETS[seed % len(MLP_DATASETS)])
    act = str(rng.choice(["relu", "tanh"]))
    spec = {"format": "zoograph.spec/1", "input_shape": [4], "layers": [
        {"type": "linear", "out_features": 16}, {"type": "activation", "fn": act},
        {"type": "linear", "out_features": 16}, {"type": "activation", "fn": act},
        {"type": "linear", "out_features": 10}]}
    hp = {"optimizer": str(rng.choice(["adam", "sgd"])), "lr": float(10 ** rng.uniform(-3, -1.5)),
          "weight_decay": 0.0, "epochs": int(rng.integers(20, 61)), "init": "kaiming", "batch_size": 32}
    meta = {"dataset": dataset, "activation": act, **hp}

    def train(model: nn.Module, init_seed: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(init_seed)
        _init(model, hp["init"], gen)
        xtr, ytr, xte, yte = _tabular(dataset)
        return _fit_classifier(model, xtr, ytr, xte, yte, optimizer=hp["optimizer"], lr=hp["lr"], wd=0.0,
                               epochs=hp["epochs"], batch=hp["batch_size"], gen=gen)

    return ModelRecipe(spec, train, meta)


INR_SPEC = {"format": "zoograph.spec/1", "input_shape": [2], "layers": [
    {"type": "linear", "out_features": 16}, {"type": "activation", "fn": "sin"},
    {"type": "linear", "out_features": 16}, {"type": "activation", "fn": "sin"},
    {"type": "linear", "out_features": 1}]}


def inr_recipe(rng: np.random.Generator, seed: int) -> ModelRecipe:
    x, y = _digits()
    index = int(rng.integers(0, len(x)))
    meta = {"dataset": "digits-inr", "label": int(y[index]), "image_index": index, "steps": 300, "lr": 1e-3,
            "w0": 10.0, "optimizer": "adam"}

    def train(model: nn.Module, init_seed: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(init_seed)
        lin = [m for m in model.modules() if isinstance(m, nn.Linear)]
        with torch.no_grad():                       # SIREN initialisation, w0 folded into the first layer
            for i, m in enumerate(lin):
                bound = 1.0 / m.in_features if i == 0 else math.sqrt(6.0 / m.in_features) / meta["w0"]
                m.weight.uniform_(-bound, bound, generator=gen)
                m.bias.uniform_(-bound, bound, generator=gen)
            lin[0].weight.mul_(meta["w0"])
            lin[0].bias.mul_(meta["w0"])
        g = torch.linspace(-1, 1, 8)
        coords = torch.stack(torch.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2)
        target = torch.from_numpy(x[index, 0].reshape(-1, 1))
        opt = torch.optim.Adam(model.parameters(), lr=meta["lr"])
        for _ in range(meta["steps"]):
            opt.zero_grad()
            loss = ((model(coords) - target) ** 2).mean()
            loss.backward()
            opt.step()
        with torch.no_grad():
            mse = float(((model(coords) - target) ** 2).mean())
        return {"mse": mse, "psnr": float(10 * math.log10(1.0 / max(mse, 1e-12)))}

    return ModelRecipe(INR_SPEC, train, meta)


def _mlp_equivariant(rng: np.random.Generator, seed: int) -> ModelRecipe:
    from pipeline.zoo.equivariant import mlp_equivariant_recipe

    return mlp_equivariant_recipe(rng, seed)


RECIPES: dict[str, Callable[[np.random.Generator, int], ModelRecipe]] = {
    "cnn": cnn_recipe, "cnn-fixed": cnn_fixed_recipe, "mlp": mlp_recipe, "inr": inr_recipe,
    "mlp-equivariant": _mlp_equivariant}


def make_model(kind: str, seed: int, init_seed: int | None = None) -> tuple[nn.Module, ModelRecipe, dict[str, Any]]:
    """Build and train model number ``seed`` of a zoo kind; deterministic. ``init_seed`` (default
    ``seed``) draws the initialisation and the batch order only: models of one ``seed`` and
    different ``init_seed`` share architecture, hyper-parameters and data (replicas)."""
    init_seed = seed if init_seed is None else init_seed
    rng = np.random.default_rng(seed)
    recipe = RECIPES[kind](rng, seed)
    torch.manual_seed(init_seed)
    model = build_module(recipe.spec)
    metrics = recipe.train(model, init_seed)
    return model.eval(), recipe, metrics
