"""Comparing methods on the same test models: per-fold metrics and a paired bootstrap interval.

A margin between two methods is a claim only when its interval excludes zero. The interval here
resamples test models (with replacement, within each fold, the same draw for both methods), so
the noise that two equally good predictors show on a finite test set is in it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


def kendall_tau(y: np.ndarray, p: np.ndarray) -> float:
    from scipy.stats import kendalltau

    tau = kendalltau(y, p).statistic
    return 0.0 if np.isnan(tau) else float(tau)


@dataclass
class PairedDifference:
    mean: float        # mean over folds of tau(a) - tau(b), on the observed test sets
    low: float         # bootstrap 95% interval of that mean
    high: float

    def __str__(self) -> str:
        return f"{self.mean:+.3f} [{self.low:+.3f}, {self.high:+.3f}]"

    @property
    def significant(self) -> bool:
        return self.low > 0 or self.high < 0


def paired_bootstrap(y: Sequence[np.ndarray], a: Sequence[np.ndarray], b: Sequence[np.ndarray],
                     resamples: int = 1000, seed: int = 0, metric=kendall_tau) -> PairedDifference:
    """Difference ``metric(a) - metric(b)`` averaged over folds (``y[k], a[k], b[k]`` are the targets
    and the two methods' predictions on fold k's test models), with a 95% percentile interval from
    ``resamples`` paired resamplings of the test models of every fold."""
    if not (len(y) == len(a) == len(b)) or not len(y):
        raise ValueError("one array of targets and of each method's predictions per fold")
    for yk, ak, bk in zip(y, a, b):
        if not (len(yk) == len(ak) == len(bk)):
            raise ValueError("the two methods must be scored on the same test models")
    observed = float(np.mean([metric(yk, ak) - metric(yk, bk) for yk, ak, bk in zip(y, a, b)]))
    rng = np.random.default_rng(seed)
    draws = np.empty(resamples)
    for r in range(resamples):
        diffs = []
        for yk, ak, bk in zip(y, a, b):
            i = rng.integers(0, len(yk), len(yk))
            diffs.append(metric(yk[i], ak[i]) - metric(yk[i], bk[i]))
        draws[r] = np.mean(diffs)
    low, high = np.percentile(draws, [2.5, 97.5])
    return PairedDifference(observed, float(low), float(high))
