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
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from pipeline.datasets import MLP_DATASETS, digit_images, digits, digits_split, tabular
from pipeline.spec import build_module
from pipeline.zoo.equivariant import SETTINGS as EQUIVARIANT_SETTINGS, mlp_equivariant_recipe
from pipeline.zoo.training import ModelRecipe, fit_classifier, init_weights
from zoocore.settings import typed_pairs
from zoocore.errors import ZooGraphError


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
        init_weights(model, hp["init"], gen)
        x, y = digits()
        test, pool_idx = digits_split()
        sub = np.random.default_rng(seed).permutation(pool_idx)[:max(64, int(hp["train_fraction"] * len(pool_idx)))]
        return fit_classifier(model, x[sub], y[sub], x[test], y[test], optimizer=hp["optimizer"], lr=hp["lr"],
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
        x, y = digits()
        test, pool_idx = digits_split()
        sub = np.random.default_rng(seed).permutation(pool_idx)[:max(64, int(hp["train_fraction"] * len(pool_idx)))]
        return fit_classifier(model, x[sub], y[sub], x[test], y[test], optimizer=hp["optimizer"], lr=hp["lr"],
                               wd=hp["weight_decay"], epochs=hp["epochs"], batch=hp["batch_size"], gen=gen)

    return ModelRecipe(fixed_cnn_spec(act, hp["dropout"]), train, meta)




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
        init_weights(model, hp["init"], gen)
        xtr, ytr, xte, yte = tabular(dataset)
        return fit_classifier(model, xtr, ytr, xte, yte, optimizer=hp["optimizer"], lr=hp["lr"], wd=0.0,
                               epochs=hp["epochs"], batch=hp["batch_size"], gen=gen)

    return ModelRecipe(spec, train, meta)


def inr_spec(width: int = 16) -> dict:
    """A SIREN: 2 coordinates -> two sine layers of ``width`` -> one intensity."""
    return {"format": "zoograph.spec/1", "input_shape": [2], "layers": [
        {"type": "linear", "out_features": width}, {"type": "activation", "fn": "sin"},
        {"type": "linear", "out_features": width}, {"type": "activation", "fn": "sin"},
        {"type": "linear", "out_features": 1}]}


INR_SPEC = inr_spec()
# the inr zoo's settings (``pipeline zoo make inr --set side=28``) and their defaults per side: 8x8 digits as
# they ship, or digits upsampled to side x side (28: the size of the MNIST INR benchmarks) fitted by wider SIRENs
INR_SETTINGS = {"side": int, "width": int, "steps": int, "w0": float}
INR_DEFAULTS = {8: {"width": 16, "steps": 300, "w0": 10.0}, "other": {"width": 32, "steps": 1000, "w0": 30.0}}


def inr_recipe(rng: np.random.Generator, seed: int, side: int | None = None, width: int | None = None,
               steps: int | None = None, w0: float | None = None) -> ModelRecipe:
    side = 8 if side is None else int(side)
    default = INR_DEFAULTS[8] if side == 8 else INR_DEFAULTS["other"]
    x = digit_images(side)
    y = digits()[1]
    index = int(rng.integers(0, len(x)))
    meta = {"dataset": "digits-inr", "label": int(y[index]), "image_index": index,
            "steps": int(steps or default["steps"]), "lr": 1e-3, "w0": float(w0 or default["w0"]), "optimizer": "adam"}
    width = int(width or default["width"])
    if side != 8:               # the 8x8 zoo's records stay as they were; jobs.editing reads a missing side as 8
        meta.update(side=side, width=width)

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
        g = torch.linspace(-1, 1, side)
        coords = torch.stack(torch.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2)
        target = torch.from_numpy(x[index].reshape(-1, 1).copy())
        opt = torch.optim.Adam(model.parameters(), lr=meta["lr"])
        for _ in range(meta["steps"]):
            opt.zero_grad()
            loss = ((model(coords) - target) ** 2).mean()
            loss.backward()
            opt.step()
        with torch.no_grad():
            mse = float(((model(coords) - target) ** 2).mean())
        return {"mse": mse, "psnr": float(10 * math.log10(1.0 / max(mse, 1e-12)))}

    return ModelRecipe(inr_spec(width), train, meta)


RECIPES: dict[str, Callable[[np.random.Generator, int], ModelRecipe]] = {
    "cnn": cnn_recipe, "cnn-fixed": cnn_fixed_recipe, "mlp": mlp_recipe, "inr": inr_recipe,
    "mlp-equivariant": mlp_equivariant_recipe}


# the training-recipe settings a kind takes (``pipeline zoo make KIND --set KEY=VALUE``): name -> type
RECIPE_SETTINGS: dict[str, dict[str, type]] = {"mlp-equivariant": EQUIVARIANT_SETTINGS, "inr": INR_SETTINGS}


def recipe_settings(kind: str, pairs: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """``KEY=VALUE`` strings -> the kind's recipe settings, typed; unknown keys and bad values refused."""
    try:
        out = typed_pairs(pairs, RECIPE_SETTINGS.get(kind, {}), kind)
    except ValueError as exc:
        raise ZooGraphError(str(exc)) from None
    for key, value in out.items():
        if value < 0 or (key in ("epochs", "steps", "width") and value < 1):
            raise ZooGraphError(f"{key}={value}: {key} must be "
                                f"{'at least 1' if key in ('epochs', 'steps', 'width') else 'non-negative'}")
        if key == "side" and not 8 <= value <= 128:
            raise ZooGraphError(f"side={value}: digit images are made at 8 to 128 pixels a side")
        if key == "w0" and value <= 0:
            raise ZooGraphError(f"w0={value}: w0 must be positive")
    return out


def make_model(kind: str, seed: int, init_seed: int | None = None,
               settings: dict[str, Any] | None = None) -> tuple[nn.Module, ModelRecipe, dict[str, Any]]:
    """Build and train model number ``seed`` of a zoo kind; deterministic. ``init_seed`` (default
    ``seed``) draws the initialisation and the batch order only: models of one ``seed`` and
    different ``init_seed`` share architecture, hyper-parameters and data (replicas). ``settings``
    (``recipe_settings``) change the kind's training recipe."""
    init_seed = seed if init_seed is None else init_seed
    rng = np.random.default_rng(seed)
    recipe = RECIPES[kind](rng, seed, **(settings or {}))
    torch.manual_seed(init_seed)
    model = build_module(recipe.spec)
    metrics = recipe.train(model, init_seed)
    return model.eval(), recipe, metrics
