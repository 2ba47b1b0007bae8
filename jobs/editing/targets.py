"""What an edited INR should compute: an image transformation of the digit its INR was fitted to.

The ``inr`` zoo fits one SIREN per scikit-learn digit (``image_index`` in the model metadata,
intensities in [0, 1]) on an 8x8 grid, or on a ``side`` x ``side`` grid of the digit upsampled
bicubically (``pipeline.datasets.digit_images``); a target is the transformed image on the same grid:

- ``dilate``: grey-scale morphological dilation with a 3x3 square (the standard INR-editing
  benchmark, usually on MNIST), borders by the nearest pixel;
- ``blur``: Gaussian blur, sigma 1 pixel, borders by the nearest pixel;
- ``contrast``: intensities stretched about 0.5 by a factor 2, clipped to [0, 1].
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from scipy import ndimage

from zoocore.errors import JobError

EDITS = ("dilate", "blur", "contrast")


def transform_images(images: np.ndarray, edit: str) -> np.ndarray:
    """``edit`` applied to every image of a stack.

    Shapes:
        images: (N, H, W) float intensities in [0, 1]; returns (N, H, W) float32.
    Example:
        >>> transform_images(np.eye(3)[None], "dilate")[0].min()
        1.0
    """
    x = np.asarray(images, dtype=np.float32)
    if x.ndim != 3:
        raise JobError(f"images must be a (N, H, W) stack, got shape {x.shape}")
    if edit == "dilate":
        out = ndimage.grey_dilation(x, size=(1, 3, 3), mode="nearest")
    elif edit == "blur":
        out = ndimage.gaussian_filter(x, sigma=(0, 1.0, 1.0), mode="nearest")
    elif edit == "contrast":
        out = np.clip(2.0 * (x - 0.5) + 0.5, 0.0, 1.0)
    else:
        raise JobError(f"unknown edit {edit!r}; choose one of {', '.join(EDITS)}")
    return out.astype(np.float32)


def digit_images(image_indices: Sequence[int], side: int = 8) -> np.ndarray:
    """(N, side, side) the digits the ``inr`` zoo's SIRENs were fitted to, in [0, 1]."""
    from pipeline.datasets import digit_images as all_digits

    x = all_digits(side)
    idx = np.asarray(image_indices, dtype=np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= len(x)):
        raise JobError(f"image_index {int(idx.max())} out of range for the {len(x)} digits")
    return x[idx]


def target_pixels(image_indices: Sequence[int], edit: str, side: int = 8) -> np.ndarray:
    """(N, side * side) the transformed digits flattened in the pixel-grid order of ``siren.pixel_grid``
    (row-major: pixel k is row k // side, column k % side)."""
    imgs = transform_images(digit_images(image_indices, side), edit)
    return imgs.reshape(len(imgs), -1)
