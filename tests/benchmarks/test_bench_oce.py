"""bench_oce's capacity floor: SIRENs fitted directly to each target, the best an edited network of
that width can do."""
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from jobs.editing.targets import target_pixels

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_oce import capacity_floor  # noqa: E402


def test_a_wider_directly_fitted_siren_reaches_a_lower_floor():
    targets = torch.from_numpy(target_pixels([0, 7, 11, 23], "dilate"))
    data = SimpleNamespace(side=8, targets=targets)
    idx = np.arange(4)
    narrow = capacity_floor(data, idx, width=2, steps=300, w0=10.0)
    wide = capacity_floor(data, idx, width=32, steps=300, w0=10.0)
    blank = ((targets - targets.mean(-1, keepdim=True)) ** 2).mean(-1).numpy()
    assert narrow.shape == wide.shape == (4,)
    assert (wide < narrow).all() and (wide < 0.1 * blank).all()
