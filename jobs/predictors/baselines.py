"""The features and learners of the tabular predictors (jobs.predictors.tabular): what StatNN and the flat
MLP read from the catalog, and how a scikit-learn learner is tuned on validation.

- StatNN (Unterthiner et al., 2020): statistics of weights and biases (mean, variance, quantiles
  0/25/50/75/100) by layer index and by position (first, middle, last) and of the norm layers'
  weights, computed in DuckDB, not in a Python loop over models; shape descriptors (parameter
  count, depth, widths, kernel sizes, norm and residual layers, activations) where a selection
  holds more than one architecture: a baseline must see what NG-GNN sees.
- Flat weights: every weight and bias of a model in one vector, for models of one shape.
- Learners: gradient boosting or an MLP (its feature scaler, standard or quantile-to-normal, chosen
  too), hyperparameters chosen on the validation split (Kendall tau for regression, accuracy for
  classification) as carefully as NG-GNN's early stopping; regression predictions clipped to the
  training targets' range.
"""
from __future__ import annotations

import math
import os
from typing import Sequence

import numpy as np
import pyarrow as pa

from jobs.training.tasks import task_named
from pipeline.neural_graph.vocabulary import UNIT_RELATIONS

QUANTILES = [0.0, 0.25, 0.5, 0.75, 1.0]
STAT_NAMES = ["mean", "var"] + [f"q{int(q * 100)}" for q in QUANTILES]
MAX_LAYERS = 16
# Besides the slots by layer index, slots by position: a wild zoo's layer 3 is a head in one model and
# a middle convolution in another, but every model has a first and a last layer.
POSITION_SLOTS = ("first", "middle", "last")

WEIGHT_STATS = (
    "SELECT model_id, layer, avg(x), var_pop(x), quantile_cont(x, [0.0, 0.25, 0.5, 0.75, 1.0]) FROM "
    "(SELECT model_id, layer, unnest(weight) AS x FROM edges JOIN _sel USING (model_id) "
    f" WHERE CAST(relation AS VARCHAR) NOT IN ({', '.join(repr(r) for r in UNIT_RELATIONS)})) WHERE x <> 0"
    " GROUP BY model_id, layer")
BIAS_STATS = (
    "SELECT model_id, layer, avg(bias), var_pop(bias), quantile_cont(bias, [0.0, 0.25, 0.5, 0.75, 1.0]) "
    "FROM nodes JOIN _sel USING (model_id) WHERE CAST(node_type AS VARCHAR) <> 'input' GROUP BY model_id, layer")
NORM_STATS = (
    "SELECT model_id, avg(x), var_pop(x), quantile_cont(x, [0.0, 0.25, 0.5, 0.75, 1.0]) FROM "
    "(SELECT model_id, unnest(weight) AS x FROM edges JOIN _sel USING (model_id) "
    "WHERE CAST(relation AS VARCHAR) = 'norm') GROUP BY model_id")


def by_slot(layers: dict[int, list[float]], width: int, positions: bool = True) -> np.ndarray:
    """(MAX_LAYERS + 3, width): one model's values per layer by layer index, then by position
    (first, mean over the middle layers, last; left NaN without ``positions``); NaN where empty."""
    out = np.full((MAX_LAYERS + len(POSITION_SLOTS), width), np.nan)
    for layer, values in layers.items():
        if layer < MAX_LAYERS:
            out[layer] = values
    if layers and positions:
        order = sorted(layers)
        out[MAX_LAYERS] = layers[order[0]]
        out[MAX_LAYERS + 2] = layers[order[-1]]
        if len(order) > 2:
            out[MAX_LAYERS + 1] = np.mean([layers[o] for o in order[1:-1]], axis=0)
    return out


def _assemble(per_layer: list[list[dict[int, list[float]]]], norm: list[list[float] | None]) -> np.ndarray:
    """The StatNN feature rows: for weights and for biases, the 7 statistics by layer index
    (``MAX_LAYERS`` slots) and by position (first, mean over the middle layers, last), then the
    statistics of every norm-layer weight; NaN where a model has no such slot."""
    width = len(STAT_NAMES)
    n_pos = len(POSITION_SLOTS)
    out = np.full((len(norm), 2, MAX_LAYERS + n_pos, width), np.nan)
    for i, kinds in enumerate(per_layer):
        for k, layers in enumerate(kinds):
            out[i, k] = by_slot(layers, width)
    norms = np.full((len(norm), width), np.nan)
    for i, stats in enumerate(norm):
        if stats is not None:
            norms[i] = stats
    return np.hstack([out.reshape(len(norm), 2 * (MAX_LAYERS + n_pos) * width), norms])


def _index_columns() -> np.ndarray:
    """The feature columns of the slots by layer index (the rest: by position, and norm layers)."""
    slots = np.zeros((2, MAX_LAYERS + len(POSITION_SLOTS), len(STAT_NAMES)), bool)
    slots[:, :MAX_LAYERS] = True
    return np.concatenate([slots.ravel(), np.zeros(len(STAT_NAMES), bool)])


INDEX_COLUMNS = _index_columns()


def statnn_features(con, model_ids: Sequence[str]) -> np.ndarray:
    """(n_models, 2 * (MAX_LAYERS + 3) * 7 + 7) features (``_assemble``), computed in DuckDB."""
    cur = con.cursor()
    cur.register("_sel", pa.table({"model_id": pa.array(list(model_ids), pa.string())}))
    index = {m: i for i, m in enumerate(model_ids)}
    per_layer: list[list[dict]] = [[{}, {}] for _ in model_ids]
    for k, q in enumerate((WEIGHT_STATS, BIAS_STATS)):
        for mid, layer, mean, var, qs in cur.execute(q).fetchall():
            per_layer[index[mid]][k][layer] = [mean, var, *qs]
    norm: list = [None] * len(model_ids)
    for mid, mean, var, qs in cur.execute(NORM_STATS).fetchall():
        norm[index[mid]] = [mean, var, *qs]
    cur.close()
    return _assemble(per_layer, norm)


def statnn_features_of_graphs(graphs: Sequence) -> np.ndarray:
    """``statnn_features`` of in-memory NeuralGraphs (e.g. rescaled test models), computed as the
    SQL does: weights by operation without the edges of weight 1 (``UNIT_RELATIONS``), non-zero
    values only; biases by neuron layer without input nodes; population variance, linearly
    interpolated quantiles."""
    from pipeline.neural_graph.vocabulary import NODE_TYPES, RELATIONS, UNIT_RELATIONS

    unit, inp, norm_rel = [RELATIONS.index(r) for r in UNIT_RELATIONS], NODE_TYPES.index("input"), \
        RELATIONS.index("norm")

    def stats(x):
        return [x.mean(), x.var(), *np.quantile(x, QUANTILES)]

    per_layer, norm = [], []
    for g in graphs:
        weights, biases = {}, {}
        keep = ~np.isin(g.relation, unit)
        for op in np.unique(g.edge_op[keep]):
            x = g.weight[keep & (g.edge_op == op)].astype(np.float64).ravel()
            x = x[x != 0]
            if len(x):
                weights[int(op)] = stats(x)
        nodes = g.node_type != inp
        for layer in np.unique(g.node_layer[nodes]):
            biases[int(layer)] = stats(g.bias[nodes & (g.node_layer == layer)].astype(np.float64))
        per_layer.append([weights, biases])
        x = g.weight[g.relation == norm_rel].astype(np.float64).ravel()
        norm.append(stats(x) if len(x) else None)
    return _assemble(per_layer, norm)


SHAPE_QUERY = (
    "SELECT m.model_id, ln(m.num_params), a.num_layers, a.num_ops, ln(a.num_nodes), m.kernel_h, m.kernel_w, "
    "count(*) FILTER (WHERE l.relation = 'norm'), count(*) FILTER (WHERE l.relation = 'residual'), "
    "avg(l.out_size) FILTER (WHERE l.relation NOT IN ('norm', 'residual', 'gate')), "
    "max(l.out_size) FILTER (WHERE l.relation NOT IN ('norm', 'residual', 'gate')), "
    "min(l.out_size) FILTER (WHERE l.relation NOT IN ('norm', 'residual', 'gate')), "
    "string_agg(DISTINCT l.activation, ',') "
    "FROM models m JOIN _sel USING (model_id) JOIN architectures a USING (architecture_id) "
    "JOIN layers l USING (model_id) GROUP BY ALL")


def shape_features(con, model_ids: Sequence[str], activations: Sequence[str] | None = None) -> np.ndarray:
    """(n_models, 11 + len(activations)) architecture descriptors: log parameter count, layers,
    operations, log neurons, kernel size, norm and residual layers, mean / max / min width, and one
    column per activation (``activations``: default, those the models use but identity)."""
    rows = _shape_rows(con, model_ids)
    acts = shape_activations(rows.values()) if activations is None else list(activations)
    out = np.full((len(model_ids), 11 + len(acts)), np.nan)
    for i, m in enumerate(model_ids):
        if m in rows:
            r = rows[m]
            present = set((r[-1] or "").split(","))
            out[i] = [*(np.nan if v is None else float(v) for v in r[:-1]), *(float(a in present) for a in acts)]
    return out


def _shape_rows(con, model_ids: Sequence[str]) -> dict[str, tuple]:
    cur = con.cursor()
    cur.register("_sel", pa.table({"model_id": pa.array(list(model_ids), pa.string())}))
    rows = {r[0]: r[1:] for r in cur.execute(SHAPE_QUERY).fetchall()}
    cur.close()
    return rows


def shape_activations(rows) -> list[str]:
    """The activations named in ``_shape_rows`` values, identity aside, sorted."""
    return sorted({a for r in rows for a in (r[-1] or "").split(",") if a and a != "identity"})


def model_activations(con, model_ids: Sequence[str]) -> list[str]:
    """The activations the models use (identity aside): the activation columns of ``shape_features``."""
    return shape_activations(_shape_rows(con, model_ids).values())


GBT_GRID = [{"learning_rate": lr, "max_leaf_nodes": leaves, "l2_regularization": l2}
            for lr in (0.03, 0.1) for leaves in (7, 31) for l2 in (0.0, 1.0)]
# Wide nets with light decay suit a fixed-architecture zoo, narrow ones with strong decay a diverse one
# (project dev zoos, 3 folds: cnn 0.476 -> 0.514 with both, cnn-fixed 0.556 either way): validation picks.
MLP_GRID = ([{"hidden_layer_sizes": h, "alpha": a, "scaler": sc} for h in ((128, 128), (256, 256, 256))
             for a in (1e-4, 1e-2) for sc in ("standard", "quantile")]
            + [{"hidden_layer_sizes": h, "alpha": a, "scaler": sc} for h in ((64,), (128,), (128, 128))
               for a in (1e-2, 1e-1, 1.0, 10.0) for sc in ("standard", "quantile")])


class Clipped:
    """A fitted regressor whose predictions are clipped to the training targets' range: an MLP on
    statistics extrapolates far outside [0, 1] on a model unlike the training ones (R^2 of -48 was
    measured before this), and no accuracy lies outside what training saw by much."""

    def __init__(self, estimator, low: float, high: float):
        self.estimator, self.low, self.high = estimator, float(low), float(high)

    def predict(self, x: np.ndarray) -> np.ndarray:
        return np.clip(self.estimator.predict(x), self.low, self.high)


def _scaler(kind: str, n_train: int):
    from sklearn.preprocessing import QuantileTransformer, StandardScaler

    if kind == "quantile":          # heavy-tailed statistics (variances, extreme quantiles) to a normal shape
        return QuantileTransformer(n_quantiles=max(2, min(1000, n_train)), output_distribution="normal",
                                   random_state=0)
    return StandardScaler()


def _estimator(learner: str, task: str, params: dict, n_train: int, seed: int):
    from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor
    from sklearn.impute import SimpleImputer
    from sklearn.neural_network import MLPClassifier, MLPRegressor
    from sklearn.pipeline import make_pipeline

    if callable(learner):           # a predictor's own learner (jobs.predictors.tabular: ``learner`` as a function)
        return learner(task, params, n_train, seed)
    params = dict(params)
    scaler = params.pop("scaler", "standard")
    if learner == "gbt":
        # the default leaf of 20 samples leaves a small zoo no split at all (a constant prediction)
        leaf = int(min(20, max(2, n_train // 10)))
        cls = HistGradientBoostingRegressor if task_named(task).numeric else HistGradientBoostingClassifier
        return cls(max_iter=300, min_samples_leaf=leaf, random_state=seed, **params)
    cls = MLPRegressor if task_named(task).numeric else MLPClassifier
    # missing slots (shallower models, no norm layer) become 0 plus an indicator column, then scaled
    return make_pipeline(SimpleImputer(strategy="constant", fill_value=0.0, add_indicator=True),
                         _scaler(scaler, n_train),
                         cls(learning_rate_init=1e-3, max_iter=500, early_stopping=n_train >= 50,
                             n_iter_no_change=20, random_state=seed, **params))


def _val_score(task: str, y: np.ndarray, p: np.ndarray) -> float:
    """The task's selection metric on the validation split (-1 when it cannot be computed)."""
    t = task_named(task)
    score = t.score(t.metrics(y, p))
    return score if math.isfinite(score) else -1.0


def fit_tuned(x: np.ndarray, y: np.ndarray, train: np.ndarray, val: np.ndarray, task: str, learner: str = "gbt",
              seed: int = 0, grid: list[dict] | None = None) -> tuple[object, np.ndarray, dict]:
    """A ``learner`` (gbt | mlp) with its hyperparameters chosen on the validation rows (Kendall tau
    for regression, accuracy for classification) from ``grid`` (default GBT_GRID / MLP_GRID), then
    fitted on the training rows: the care every tabular baseline gets (StatNN, the flat-weights MLP,
    WeightWatcher's per-layer metrics in jobs.predictors.peers).

    Args:
        x: (n, k) features, NaN where missing; y: (n,) targets; train, val: (n,) bool masks.
    Returns:
        the fitted estimator, the (k,) bool mask of columns it reads (``est.predict(x[:, columns])``),
        and the chosen hyperparameters.
    """
    import warnings

    # columns that (almost) no training model has, or that never vary, carry no signal and break the binning
    xt = x[train]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)          # all-NaN columns: nan > nan is False
        varies = np.nanmax(xt, 0) > np.nanmin(xt, 0)
    columns = (np.isfinite(xt).sum(0) >= 2) & varies
    x = x[:, columns]
    grid = grid or (GBT_GRID if learner == "gbt" else MLP_GRID)
    best, best_score = grid[0], -np.inf
    if len(grid) > 1 and val.sum() >= 2:
        for params, score in zip(grid, grid_scores(x, y, train, val, task, learner, grid, seed)):
            if score > best_score:
                best, best_score = params, score
    return fit_params(x[train], y[train], task, learner, best, seed), columns, best


GRID_WORKERS = min(4, os.cpu_count() or 1)     # threads fitting a grid's settings side by side


def grid_scores(x, y, train, val, task: str, learner: str, grid: list[dict], seed: int) -> list[float]:
    """Each setting's validation score, ``GRID_WORKERS`` fits at a time (each fit one-threaded and
    seeded, so the scores, and the choice, are those of fitting them one after another)."""
    from concurrent.futures import ThreadPoolExecutor

    from threadpoolctl import threadpool_limits

    fit = fit_params.__wrapped__           # one thread limit around them all: nested limits do not nest across threads

    def score(params: dict) -> float:
        return _val_score(task, y[val], fit(x[train], y[train], task, learner, params, seed).predict(x[val]))

    with threadpool_limits(limits=1):
        if GRID_WORKERS < 2:
            return [score(p) for p in grid]
        with ThreadPoolExecutor(GRID_WORKERS) as pool:
            return list(pool.map(score, grid))


def single_threaded(fn):
    """Run ``fn`` with one OpenMP and one BLAS thread. The learners here fit a few thousand rows at
    most, where threads only add overhead, and on a machine busy with other work (a metanetwork
    training on the other core) OpenMP's spinning threads slowed gradient boosting down 17 times:
    StatNN on a 48-model zoo took 94 s with the default threads and 5.5 s with one."""
    import functools

    @functools.wraps(fn)
    def run(*args, **kwargs):
        from threadpoolctl import threadpool_limits

        with threadpool_limits(limits=1):
            return fn(*args, **kwargs)

    return run


@single_threaded
def fit_params(x: np.ndarray, y: np.ndarray, task: str, learner: str, params: dict, seed: int):
    """A ``learner`` with these hyperparameters fitted on all rows of ``x``; regressors clipped to
    the range of ``y``. Deterministic given ``seed``: a saved run refits it (jobs.predictors.tabular)."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning

    est = _estimator(learner, task, params, len(y), seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        est.fit(x, y)
    return Clipped(est, np.min(y), np.max(y)) if task_named(task).numeric else est


def flat_weights(con, model_ids: Sequence[str]) -> np.ndarray:
    """(n, P) vectors: every edge weight (canonical order) and every bias, for models of one shape."""
    cur = con.cursor()
    cur.register("_sel", pa.table({"model_id": pa.array(list(model_ids), pa.string())}))
    w = cur.execute("SELECT model_id, list(x ORDER BY layer, dst, src, i) FROM (SELECT model_id, layer, dst, src, "
                    "unnest(weight) AS x, generate_subscripts(weight, 1) AS i FROM edges JOIN _sel USING (model_id)) "
                    "GROUP BY model_id").fetchall()
    b = cur.execute("SELECT model_id, list(bias ORDER BY node) FROM nodes JOIN _sel USING (model_id) "
                    "GROUP BY model_id").fetchall()
    cur.close()
    wd, bd = dict(w), dict(b)
    return np.array([np.concatenate([wd[m], bd[m]]) for m in model_ids], dtype=np.float32)


# wide inputs (every parameter) on few models: smaller nets and stronger weight decay than StatNN's grid
FLAT_GRID = [{"hidden_layer_sizes": h, "alpha": a} for h in ((64,), (128, 128), (256, 256, 256))
             for a in (1e-3, 1e-1, 1.0)]


SHAPES_QUERY = ("SELECT model_id, string_agg(concat(weight_key, '=', CAST(weight_shape AS VARCHAR)), ';' "
                "ORDER BY layer) FROM layers JOIN _sel USING (model_id) GROUP BY model_id")


def parameter_shapes(con, model_ids: Sequence[str]) -> list[str]:
    """Each model's parameter shapes as one string (``layers.0.weight=[8, 1, 3, 3];...``): models
    that differ only in activations (two architectures of the ``cnn-fixed`` zoo) share it."""
    cur = con.cursor()
    cur.register("_sel", pa.table({"model_id": pa.array(list(model_ids), pa.string())}))
    rows = dict(cur.execute(SHAPES_QUERY).fetchall())
    cur.close()
    return [rows.get(m) or "" for m in model_ids]
