"""bench_calibration refits the calibration modes on a run's saved validation predictions: the
order (tau) is the same under both, and the monotone map straightens a curved relation."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_calibration  # noqa: E402


def test_rescoring_keeps_the_order_and_straightens_a_curve():
    rng = np.random.default_rng(0)

    def split(n):
        p = rng.uniform(0.1, 0.9, n)                 # saved (already linearly calibrated) predictions
        return 0.5 + 0.4 * np.tanh(4 * (p - 0.5)) + rng.normal(0, 0.01, n), p

    res = bench_calibration.rescore(split(300), split(500))
    assert set(res) == {"linear", "monotone"}
    assert res["monotone"]["kendall_tau"] == pytest.approx(res["linear"]["kendall_tau"], abs=1e-12)
    assert res["monotone"]["mae"] < 0.6 * res["linear"]["mae"] and res["monotone"]["r2"] > res["linear"]["r2"]


def test_it_asks_for_runs(catalog_dir):
    with pytest.raises(SystemExit):
        bench_calibration.main([str(catalog_dir)])
