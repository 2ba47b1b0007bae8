"""Input transforms g that permute the entries of a flattened input: mirrors of a square image
grid and random pixel permutations.

A transform is named ``mirror-lr`` (left-right: column c -> side-1-c), ``mirror-ud`` (up-down:
row r -> side-1-r), or ``perm-input[:SEED]`` (a fixed random permutation of all inputs, seed 0 by
default). Inputs are flattened row-major, so pixel (r, c) of an 8x8 digit is entry 8 r + c; the
mirrors need an input size that is a perfect square. ``g x`` is ``x[..., index]``.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from zoocore.errors import ZooGraphError

TRANSFORMS = ("mirror-lr", "mirror-ud", "perm-input")
NOISE_STD = 1.0


def noise(samples: int, size: int, generator: torch.Generator, std: float = NOISE_STD,
          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Noise inputs: i.i.d. N(0, std^2) entries, a law invariant under every permutation of the
    inputs (g y is distributed like y). Standard normal by default: on the digits' [0, 1] pixel
    scale it drives tanh and GELU into their non-linear range, where a layer's equivariance is
    identifiable (near 0 both are close to linear, and a linear layer W is 'equivariant' with
    A = W Q W^+ for any invertible W)."""
    return std * torch.randn(samples, size, generator=generator, dtype=dtype)


def check_transform(name: str) -> str:
    """``name`` if it names a transform, else a ZooGraphError listing the known ones."""
    base, _, arg = name.partition(":")
    if base not in TRANSFORMS or (arg and base != "perm-input"):
        raise ZooGraphError(f"unknown transform {name!r}; choose mirror-lr, mirror-ud or perm-input[:SEED]")
    if arg:
        try:
            int(arg)
        except ValueError:
            raise ZooGraphError(f"perm-input takes an integer seed (perm-input:3), got {arg!r}") from None
    return name


def transform_index(name: str, size: int) -> np.ndarray:
    """The permutation ``index`` with ``g x = x[..., index]`` for inputs of ``size`` entries."""
    base, _, arg = check_transform(name).partition(":")
    if base == "perm-input":
        return np.random.default_rng(int(arg or 0)).permutation(size)
    side = math.isqrt(size)
    if side * side != size:
        raise ZooGraphError(f"{name} mirrors a square image grid; an input of {size} entries is not a "
                            "flattened square image (8x8 digits have 64)")
    grid = np.arange(size).reshape(side, side)
    return (grid[:, ::-1] if base == "mirror-lr" else grid[::-1, :]).reshape(-1).copy()
