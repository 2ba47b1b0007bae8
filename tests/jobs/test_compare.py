"""The paired bootstrap sees a real margin and does not invent one."""
import numpy as np
import pytest

from jobs.training.compare import kendall_tau, paired_bootstrap


def _folds(rng, n=150, k=3):
    return [rng.normal(size=n) for _ in range(k)]


def test_a_clearly_better_method_has_an_interval_above_zero():
    rng = np.random.default_rng(0)
    y = _folds(rng)
    good = [t + 0.3 * rng.normal(size=len(t)) for t in y]
    poor = [t + 1.5 * rng.normal(size=len(t)) for t in y]
    d = paired_bootstrap(y, good, poor, resamples=300)
    assert d.low > 0 and d.significant
    assert d.mean == pytest.approx(np.mean([kendall_tau(t, g) - kendall_tau(t, p) for t, g, p in zip(y, good, poor)]))
    assert d.low <= d.mean <= d.high


def test_two_equally_good_methods_are_not_told_apart():
    rng = np.random.default_rng(1)
    y = _folds(rng)
    a = [t + rng.normal(size=len(t)) for t in y]
    b = [t + rng.normal(size=len(t)) for t in y]
    d = paired_bootstrap(y, a, b, resamples=300)
    assert d.low < 0 < d.high and not d.significant
    same = paired_bootstrap(y, a, a, resamples=50)
    assert same.mean == same.low == same.high == 0


def test_methods_must_be_scored_on_the_same_models():
    y = [np.arange(5.0)]
    with pytest.raises(ValueError, match="same test models"):
        paired_bootstrap(y, [np.arange(5.0)], [np.arange(4.0)])
