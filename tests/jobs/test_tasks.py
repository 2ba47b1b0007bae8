"""The task interface: targets in, predictions and metrics out, without the training loop."""
import numpy as np
import pytest
import torch

from jobs.training.losses import RankedMSE
from jobs.training.tasks import TASKS, Classification, Regression, task_named
from zoocore.errors import JobError


def test_regression_standardises_and_decodes_back():
    task = Regression()
    y = np.array([0.2, 0.4, 0.9, np.nan])
    targets, classes = task.read_targets([0.2, 0.4, 0.9, None], None, "test_accuracy")
    assert classes == [] and np.array_equal(np.isnan(targets), [False, False, False, True])
    scale = task.fit_scale(y[:3])
    encoded = task.encode(y[:3], scale, "cpu")
    assert encoded.shape == (3, 1) and float(encoded.mean()) == pytest.approx(0.0, abs=1e-6)
    assert task.decode(encoded.numpy().astype(np.float64), scale) == pytest.approx(y[:3])
    assert task.known(targets).tolist() == [True, True, True, False]
    m = task.metrics(y[:3], np.array([0.1, 0.5, 0.7]))
    assert m["kendall_tau"] == pytest.approx(1.0) and m["mae"] == pytest.approx(0.4 / 3)
    assert task.score(task.metrics(y[:3], np.array([0.7, 0.5, 0.1]))) == pytest.approx(-1.0)
    assert task.labels(np.array([1.0]), []) == [None] and task.store_values(np.array([0.5]), []) == [0.5]


def test_classification_reads_labels_combines_softmax_and_names_classes():
    task = Classification()
    targets, classes = task.read_targets(["relu", "tanh", None, 3.0], None, "activation")
    assert classes == ["3", "relu", "tanh"] and targets.tolist() == [1, 2, -1, 0]
    # a trained run's classes: an unseen label is unknown (-1), not a new class
    assert task.read_targets(["gelu", "tanh"], ["relu", "tanh"], "activation")[0].tolist() == [-1, 1]
    with pytest.raises(JobError, match="single class"):
        task.read_targets(["relu", "relu"], None, "activation")
    a = np.log(np.array([[0.9, 0.1], [0.2, 0.8]]))
    b = np.log(np.array([[0.5, 0.5], [0.6, 0.4]]))
    assert np.exp(task.combine([a, b])) == pytest.approx(np.array([[0.7, 0.3], [0.4, 0.6]]))
    pred = task.decode(task.combine([a, b]), task.fit_scale(np.array([0, 1])))
    assert pred.tolist() == [0.0, 1.0] and task.labels(pred, ["relu", "tanh"]) == ["relu", "tanh"]
    assert task.metrics(np.array([0, 1, 1]), np.array([0.0, 1.0, 0.0]))["accuracy"] == pytest.approx(2 / 3)
    out = torch.tensor([[2.0, 0.0]], requires_grad=True)
    assert float(task.loss()(out, task.encode(np.array([0]), None, "cpu"))) < float(
        task.loss()(out, task.encode(np.array([1]), None, "cpu")))


def test_tasks_by_name():
    assert set(TASKS) == {"regression", "classification"} and task_named("regression").numeric
    with pytest.raises(ValueError, match="unknown task"):
        task_named("segmentation")


def test_regression_calibration_is_a_positive_linear_map_folded_into_the_scale():
    task, rng = Regression(), np.random.default_rng(0)
    scale = task.fit_scale(np.array([0.2, 0.5, 0.8]))
    out = rng.normal(size=(50, 1))
    raw = task.decode(out, scale)
    y = 1.5 * raw - 0.1 + rng.normal(scale=1e-3, size=50)
    y[3] = np.nan                                        # unknown targets are left out of the fit
    cal = task.calibrate(out, y, scale)
    assert task.decode(out, cal) == pytest.approx(1.5 * raw - 0.1, abs=2e-3)
    ok = ~np.isnan(y)
    assert np.mean((task.decode(out, cal) - y)[ok] ** 2) < np.mean((raw - y)[ok] ** 2)
    # the order (hence Kendall tau) is kept
    assert np.array_equal(np.argsort(task.decode(out, cal)), np.argsort(raw))
    # nothing to fit on, a constant prediction or a reversing slope: the training scale stays
    assert task.calibrate(out[:5], y[:5], scale) == scale
    assert task.calibrate(np.zeros((50, 1)), y, scale) == scale
    assert task.calibrate(out, -y, scale) == scale
    # a classifier's outputs are not calibrated
    assert Classification().calibrate(out, y, scale) == scale


def test_the_ranking_term_penalises_misordered_pairs_that_squared_error_cannot_tell_apart():
    task = Regression()
    y = torch.tensor([[-1.0], [0.0], [1.0]])
    # two predictions with the same squared error (each off by 0.6): one keeps the order, one swaps a pair
    ordered = torch.tensor([[-0.4], [0.6], [1.6]])
    swapped = torch.tensor([[-1.6], [0.6], [0.4]])
    mse = task.loss()
    assert float(mse(ordered, y)) == pytest.approx(float(mse(swapped, y)))
    ranked = task.loss(rank_weight=1.0)
    assert float(ranked(ordered, y)) < float(ranked(swapped, y))
    # its gradient pushes the swapped pair back into order
    out = swapped.clone().requires_grad_(True)
    (ranked(out, y) - mse(out, y)).backward()
    assert float(out.grad[1, 0]) > 0 > float(out.grad[2, 0])
    # equal targets make no pair: the term vanishes and the loss is the squared error
    flat = torch.zeros(4, 1)
    assert float(ranked(ordered[:1].expand(4, 1), flat)) == pytest.approx(float(mse(ordered[:1].expand(4, 1), flat)))


def test_classes_have_no_order_so_no_ranking_term():
    assert isinstance(Classification().loss(rank_weight=3.0), torch.nn.CrossEntropyLoss)
    assert not isinstance(Classification().loss(rank_weight=3.0), RankedMSE)


def test_a_monotone_calibration_straightens_a_curve_and_never_reorders():
    task, rng = Regression(), np.random.default_rng(1)
    scale = task.fit_scale(np.array([0.2, 0.5, 0.8]))
    out = np.sort(rng.normal(size=(300, 1)), axis=0)
    raw = task.decode(out, scale)
    y = 0.5 + 0.3 * np.tanh(3 * (raw - 0.5)) + rng.normal(scale=0.01, size=300)   # a curve, not a line
    linear = task.calibrate(out, y, scale, "linear")
    monotone = task.calibrate(out, y, scale, "monotone")
    assert not linear.knots_x and len(monotone.knots_x) >= 2
    err = lambda s: float(np.abs(task.decode(out, s) - y).mean())  # noqa: E731
    assert err(monotone) < 0.6 * err(linear)
    # strictly increasing everywhere, also where the isotonic fit is flat and beyond its knots
    wide = np.linspace(-6, 6, 2001)[:, None]
    assert (np.diff(task.decode(wide, monotone)) > 0).all()
    test_out = rng.normal(size=(200, 1))
    assert task.metrics(y[:200], task.decode(test_out, monotone))["kendall_tau"] == pytest.approx(
        task.metrics(y[:200], task.decode(test_out, linear))["kendall_tau"], abs=1e-12)
    with pytest.raises(JobError, match="one of linear, monotone"):
        task.calibrate(out, y, scale, "spline")


def test_tasks_own_their_names_choices_and_detection():
    """The CLI offers the registered tasks, ``auto`` asks each task whether it takes the column's
    type, and the single-class refusal belongs to classification."""
    import numpy as np
    import pytest

    from jobs.cli import train_heterognn_cmd
    from jobs.training.tasks import TASKS, task_for_column, task_named
    from zoocore.errors import JobError

    choice = next(p for p in train_heterognn_cmd.params if p.name == "task").type
    assert list(choice.choices) == ["auto", *TASKS]
    assert [task_for_column(t) for t in ("DOUBLE", "BIGINT", "DECIMAL(8,2)", "VARCHAR", "BOOLEAN")] == \
        ["regression"] * 3 + ["classification"] * 2
    task_named("regression").check_training(np.array([0.1, 0.1]), [], "acc")
    with pytest.raises(JobError, match="single class of 'optimizer' \\(adam\\)"):
        task_named("classification").check_training(np.array([0, 0, -1]), ["adam", "sgd"], "optimizer")
