"""The data zoo models are trained and evaluated on; all of it ships with scikit-learn (nothing is
downloaded). One home for it: the zoo recipes train on it and merging evaluates on it."""
from __future__ import annotations

from functools import lru_cache

import numpy as np

MLP_DATASETS = ("iris", "wine", "breast_cancer", "digits")


@lru_cache(maxsize=None)
def digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]   # (1797, 1, 8, 8)
    return x, d.target.astype(np.int64)


@lru_cache(maxsize=4)
def digit_images(side: int = 8) -> np.ndarray:
    """(1797, side, side) scikit-learn's digits as intensities in [0, 1]. At another side than 8 they
    are upsampled bicubically (``scipy.ndimage.zoom``, order 3, clipped to [0, 1]): scikit-learn's
    8x8 digits are the only digit images available offline, so a 28x28 "MNIST-sized" grid is made
    from them."""
    x = digits()[0][:, 0]
    if side != 8:
        from scipy import ndimage

        if not 8 <= side <= 128:
            raise ValueError(f"side {side}: digit images are made at 8 to 128 pixels a side")
        x = np.clip(ndimage.zoom(x, (1, side / 8, side / 8), order=3, mode="nearest", grid_mode=True), 0.0, 1.0)
        if x.shape[1:] != (side, side):
            raise ValueError(f"upsampling gave {x.shape[1:]}, not {side}x{side}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    x.flags.writeable = False
    return x


@lru_cache(maxsize=None)
def tabular(name: str):
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


def digits_split() -> tuple[np.ndarray, np.ndarray]:
    """The CNN zoo's fixed split of the digits images: 500 test indices, the rest to train from."""
    perm = np.random.default_rng(0).permutation(len(digits()[0]))
    return perm[:500], perm[500:]


def evaluation_data(dataset: str, input_shape: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test) a zoo model of ``dataset`` and input shape was trained
    and tested on: the digits images for CNNs, the PCA-reduced tabular sets for MLPs."""
    if dataset == "digits" and list(input_shape) == [1, 8, 8]:
        x, y = digits()
        test, train = digits_split()
        return x[train], y[train], x[test], y[test]
    if dataset in MLP_DATASETS and list(input_shape) == [4]:
        return tabular(dataset)
    raise KeyError(f"no evaluation data for dataset {dataset!r} with input shape {list(input_shape)}")
