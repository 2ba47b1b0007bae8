"""What a run learns to output, one class per kind of target: regression and classification.

A task says how many numbers the metanetwork's head outputs, the loss, how catalog targets become
training targets and outputs become predictions, how an ensemble's outputs combine, which metrics
score it (and which one early stopping and model selection maximise), and what reaches the result
relations (``predictions.predicted`` / ``predicted_label``, the graph store's ``predicted_<target>``).
The training loop (jobs.training.train) asks the task and never compares task names. A task whose output
is a network (editing) implements the same questions with node and edge outputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from jobs.training.compare import kendall_tau
from zoocore.errors import JobError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TargetScale:
    """The standardisation of regression targets fitted on the training split (identity otherwise),
    and, after a monotone calibration, the knots of the increasing map applied on top (``knots_x`` ->
    ``knots_y``, interpolated linearly and held constant outside; blended with the identity so that
    the whole map is strictly increasing and no two models trade places)."""
    mean: float = 0.0
    std: float = 1.0
    knots_x: tuple[float, ...] = ()
    knots_y: tuple[float, ...] = ()


CALIBRATIONS = ("linear", "monotone")
MONOTONE_IDENTITY_SHARE = 0.1   # the monotone map is 0.9 * isotonic fit + 0.1 * identity: strictly increasing
MIN_LINE_MODELS = 10            # fewer known targets than this: no calibration line is fitted


def increasing_line(p: np.ndarray, y: np.ndarray, min_models: int = MIN_LINE_MODELS) -> tuple[float, float] | None:
    """``(a, b)`` of the least-squares line ``a * p + b`` to targets ``y`` (known pairs only), or
    None with fewer than ``min_models`` pairs, constant predictions or a slope that is not positive
    (it would reverse the order). Both the metanetwork's calibration and the blend's use it."""
    if len(y) < min_models or np.ptp(p) <= 1e-12 * max(1.0, float(np.abs(p).max())):
        return None
    a, b = np.polyfit(p, y, 1)
    if not (np.isfinite(a) and np.isfinite(b)) or a <= 0:
        return None
    return float(a), float(b)


class Task:
    name: str = ""
    metric_keys: tuple[str, ...] = ()
    selection_metric: str = ""             # maximised by early stopping and hyperparameter choice
    numeric: bool = False                  # one number per model (a regressor), else a class (a classifier)

    def read_targets(self, values: list, classes: list[str] | None, target: str | None
                     ) -> tuple[np.ndarray, list[str]]:
        """A models column's values -> (targets, class names): floats with NaN where missing, or
        class indices with -1 where missing or unknown (``classes``: a trained run's classes)."""
        raise NotImplementedError

    def output_size(self, classes: list[str]) -> int:
        raise NotImplementedError

    def loss(self, rank_weight: float = 0.0) -> torch.nn.Module:
        """The training loss; ``rank_weight`` > 0 adds a pairwise ranking term where the task has an
        order (regression); a task without one (classification) ignores it, as it ignores calibration."""
        raise NotImplementedError

    def fit_scale(self, train_targets: np.ndarray) -> TargetScale:
        return TargetScale()

    def takes_column(self, sql_type: str) -> bool:
        """Whether a models column of this DuckDB type is this task's target by default (``auto``)."""
        return False

    def check_training(self, targets: np.ndarray, classes: list[str], target: str) -> None:
        """Refuse (JobError) a training split this task cannot learn from; ``targets``: its values."""

    def calibrate(self, out: np.ndarray, targets: np.ndarray, scale: TargetScale, mode: str = "linear"
                  ) -> TargetScale:
        """The scale that decodes ``out`` closest to ``targets`` (the validation split's), given the
        training scale; the training scale itself where the task has nothing to calibrate."""
        return scale

    def encode(self, targets: np.ndarray, scale: TargetScale, device) -> torch.Tensor:
        """Catalog targets of a batch -> what the loss compares the head's output with."""
        raise NotImplementedError

    def decode(self, out: np.ndarray, scale: TargetScale) -> np.ndarray:
        """Head outputs (n, output_size) -> one prediction per model (float; class index for labels)."""
        raise NotImplementedError

    def combine(self, outs: list[np.ndarray]) -> np.ndarray:
        """The outputs of an ensemble's members -> one output per model."""
        raise NotImplementedError

    def known(self, targets: np.ndarray) -> np.ndarray:
        """Which models have a target to score against."""
        raise NotImplementedError

    def metrics(self, y: np.ndarray, p: np.ndarray) -> dict[str, float]:
        raise NotImplementedError

    def score(self, metrics: dict[str, float]) -> float:
        """The selection metric of ``metrics`` (-inf when it could not be computed)."""
        return float(metrics.get(self.selection_metric, -math.inf))

    def numbers(self, pred: np.ndarray) -> list[float | None]:
        """``predictions.predicted`` and what the graph store gets for a numeric target."""
        return [None if np.isnan(v) else float(v) for v in pred]

    def labels(self, pred: np.ndarray, classes: list[str]) -> list[str | None]:
        """``predictions.predicted_label``: the class names, None for a numeric target."""
        return [None] * len(pred)

    def store_values(self, pred: np.ndarray, classes: list[str]) -> list:
        """What the graph store's ``predicted_<target>`` property gets."""
        return self.numbers(pred)


class Regression(Task):
    name = "regression"

    def takes_column(self, sql_type: str) -> bool:
        return any(t in sql_type.upper() for t in ("DOUBLE", "FLOAT", "INT", "DECIMAL"))
    metric_keys = ("kendall_tau", "r2", "mae")
    selection_metric = "kendall_tau"
    numeric = True

    def read_targets(self, values, classes, target):
        return np.array([np.nan if v is None else float(v) for v in values], dtype=np.float64), []

    def output_size(self, classes):
        return 1

    def loss(self, rank_weight=0.0):
        import torch

        from jobs.training.losses import RankedMSE

        return RankedMSE(rank_weight) if rank_weight > 0 else torch.nn.MSELoss()

    def fit_scale(self, train_targets):
        return TargetScale(float(np.mean(train_targets)), float(np.std(train_targets) or 1.0))

    def calibrate(self, out, targets, scale, mode="linear", min_models: int = MIN_LINE_MODELS):
        """Least squares ``a * p + b`` from decoded outputs ``p`` to the targets, folded into the scale
        (``out * a * std + a * mean + b``), so a saved run decodes calibrated predictions unchanged.
        A linear map with a > 0 keeps every ranking (Kendall tau) and can only lower the squared error
        where it was fitted; an ensemble's mean, and a member stopped early, are often too narrow.
        The training scale is kept when fewer than ``min_models`` targets are known, when the
        predictions are constant, or when the fitted slope is not positive (it would reverse the order).

        ``mode="monotone"`` then fits an isotonic (non-decreasing) regression from the line's
        predictions to the targets and decodes through ``0.9 * isotonic + 0.1 * identity``: strictly
        increasing, so every ranking (tau) is still unchanged, while a curved relation between
        predictions and targets (a ranking loss spreads near-equal models apart) is straightened."""
        if mode not in CALIBRATIONS:
            raise JobError(f"calibration {mode!r}: one of {', '.join(CALIBRATIONS)}")
        p, y = self.decode(out, scale), targets.astype(np.float64)
        ok = ~np.isnan(y) & np.isfinite(p)
        p, y = p[ok], y[ok]
        fit = increasing_line(p, y, min_models)
        if fit is None:
            return scale
        a, b = fit
        line = TargetScale(float(a * scale.mean + b), float(a * scale.std))
        if mode == "linear":
            return line
        from sklearn.isotonic import IsotonicRegression

        iso = IsotonicRegression(out_of_bounds="clip").fit(a * p + b, y)
        if len(iso.X_thresholds_) < 2:
            return line
        return TargetScale(line.mean, line.std, tuple(float(v) for v in iso.X_thresholds_),
                           tuple(float(v) for v in iso.y_thresholds_))

    def encode(self, targets, scale, device):
        import torch

        return torch.tensor((targets - scale.mean) / scale.std, dtype=torch.float32, device=device).unsqueeze(-1)

    def decode(self, out, scale):
        p = out[:, 0] * scale.std + scale.mean
        if scale.knots_x:
            w = MONOTONE_IDENTITY_SHARE
            p = (1 - w) * np.interp(p, scale.knots_x, scale.knots_y) + w * p
        return p

    def combine(self, outs):
        return np.mean(outs, axis=0)

    def known(self, targets):
        return ~np.isnan(targets.astype(float))

    def metrics(self, y, p):
        from sklearn.metrics import mean_absolute_error, r2_score

        ok = ~np.isnan(p.astype(float))
        y, p = y[ok], p[ok]
        if len(y) < 2:
            return {"n": int(len(y))}
        return {"kendall_tau": kendall_tau(y, p), "r2": float(r2_score(y, p)),
                "mae": float(mean_absolute_error(y, p)), "n": int(len(y))}


class Classification(Task):
    name = "classification"
    metric_keys = ("accuracy", "macro_f1")
    selection_metric = "accuracy"

    def takes_column(self, sql_type: str) -> bool:
        return True                     # anything a regression does not take: text, booleans, ...

    def check_training(self, targets, classes, target):
        seen = sorted({classes[i] for i in targets if i >= 0})
        if len(seen) < 2:
            raise JobError(f"the training split has a single class of {target!r} ({', '.join(seen) or 'none'}): "
                           "a classifier of one class scores perfectly without learning anything; select more "
                           "models (--where) or another --target")

    def read_targets(self, values, classes, target):
        labels = [None if v is None else _label(v) for v in values]
        class_list = list(classes) if classes else sorted({lab for lab in labels if lab is not None})
        index = {c: i for i, c in enumerate(class_list)}
        targets = np.array([index.get(lab, -1) if lab is not None else -1 for lab in labels], dtype=np.int64)
        if not classes and len(class_list) < 2:
            raise JobError(f"{target!r} has {'a single class ' + repr(class_list[0]) if class_list else 'no values'} "
                           f"among the {len(values)} selected models: there is nothing to classify (widen --where, "
                           "or choose a --target with at least two values)")
        return targets, class_list

    def output_size(self, classes):
        return len(classes)

    def loss(self, rank_weight=0.0):
        import torch

        return torch.nn.CrossEntropyLoss()          # classes have no order: no ranking term

    def encode(self, targets, scale, device):
        import torch

        return torch.tensor(targets, dtype=torch.int64, device=device)

    def decode(self, out, scale):
        return out.argmax(1).astype(np.float64)

    def combine(self, outs):
        """The log of the members' mean softmax."""
        probs = [np.exp(o - o.max(1, keepdims=True)) for o in outs]
        return np.log(np.mean([p / p.sum(1, keepdims=True) for p in probs], axis=0))

    def known(self, targets):
        return targets >= 0

    def metrics(self, y, p):
        from sklearn.metrics import accuracy_score, f1_score

        ok = ~np.isnan(p.astype(float))
        y, p = y[ok], p[ok]
        if len(y) < 2:
            return {"n": int(len(y))}
        p = p.astype(np.int64)
        return {"accuracy": float(accuracy_score(y, p)), "macro_f1": float(f1_score(y, p, average="macro")),
                "n": int(len(y))}

    def labels(self, pred, classes):
        return [classes[int(v)] if not np.isnan(v) and 0 <= int(v) < len(classes) else None for v in pred]

    def store_values(self, pred, classes):
        return self.labels(pred, classes)


def _label(v) -> str:
    """A class name: 3.0 and 3 are the class "3"."""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


TASKS: dict[str, Task] = {t.name: t for t in (Regression(), Classification())}   # in auto-detection order


def task_for_column(sql_type: str) -> str:
    """The task ``auto`` picks for a target column of this DuckDB type: the first that takes it."""
    return next(t.name for t in TASKS.values() if t.takes_column(sql_type))


def task_named(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(TASKS)}") from None
