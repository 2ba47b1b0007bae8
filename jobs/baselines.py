"""Baselines run beside NG-GNN on the same split.

- StatNN (Unterthiner et al., 2020): per-layer statistics of weights and biases (mean, variance,
  quantiles 0/25/50/75/100) into scikit-learn gradient boosting. The statistics are computed in
  DuckDB, not in a Python loop over models.
- Flat-weights MLP: every weight and bias of a model in one vector; only defined where models
  share one shape, so it runs on the most common architecture of the selection.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyarrow as pa

from jobs.data import Selection

QUANTILES = [0.0, 0.25, 0.5, 0.75, 1.0]
STAT_NAMES = ["mean", "var"] + [f"q{int(q * 100)}" for q in QUANTILES]
MAX_LAYERS = 16

WEIGHT_STATS = (
    "SELECT model_id, layer, avg(x), var_pop(x), quantile_cont(x, [0.0, 0.25, 0.5, 0.75, 1.0]) FROM "
    "(SELECT model_id, layer, unnest(weight) AS x FROM edges JOIN _sel USING (model_id) "
    " WHERE CAST(relation AS VARCHAR) <> 'residual') WHERE x <> 0 GROUP BY model_id, layer")
BIAS_STATS = (
    "SELECT model_id, layer, avg(bias), var_pop(bias), quantile_cont(bias, [0.0, 0.25, 0.5, 0.75, 1.0]) "
    "FROM nodes JOIN _sel USING (model_id) WHERE CAST(node_type AS VARCHAR) <> 'input' GROUP BY model_id, layer")


def statnn_features(con, model_ids: Sequence[str]) -> np.ndarray:
    """(n_models, 2 * MAX_LAYERS * 7) features; NaN where a model has fewer layers."""
    cur = con.cursor()
    cur.register("_sel", pa.table({"model_id": pa.array(list(model_ids), pa.string())}))
    index = {m: i for i, m in enumerate(model_ids)}
    width = len(STAT_NAMES)
    feats = np.full((len(model_ids), 2, MAX_LAYERS, width), np.nan)
    for k, q in enumerate((WEIGHT_STATS, BIAS_STATS)):
        for mid, layer, mean, var, qs in cur.execute(q).fetchall():
            if layer < MAX_LAYERS:
                feats[index[mid], k, layer] = [mean, var, *qs]
    cur.close()
    return feats.reshape(len(model_ids), -1)


def statnn_features_of_graphs(graphs: Sequence) -> np.ndarray:
    """``statnn_features`` of in-memory NeuralGraphs (e.g. rescaled test models), computed as the
    SQL does: weights by operation without residual edges, non-zero values only; biases by neuron
    layer without input nodes; population variance, linearly interpolated quantiles."""
    from pipeline.neural_graph.graph import NODE_TYPES, RELATIONS

    width = len(STAT_NAMES)
    feats = np.full((len(graphs), 2, MAX_LAYERS, width), np.nan)
    residual, inp = RELATIONS.index("residual"), NODE_TYPES.index("input")

    def stats(x):
        return [x.mean(), x.var(), *np.quantile(x, QUANTILES)]

    for i, g in enumerate(graphs):
        keep = g.relation != residual
        for op in np.unique(g.edge_op[keep]):
            if op < MAX_LAYERS:
                x = g.weight[keep & (g.edge_op == op)].astype(np.float64).ravel()
                x = x[x != 0]
                if len(x):
                    feats[i, 0, op] = stats(x)
        nodes = g.node_type != inp
        for layer in np.unique(g.node_layer[nodes]):
            if layer < MAX_LAYERS:
                feats[i, 1, layer] = stats(g.bias[nodes & (g.node_layer == layer)].astype(np.float64))
    return feats.reshape(len(graphs), -1)


@dataclass
class BaselineResult:
    name: str
    predictions: np.ndarray          # for every selected model (NaN / -1 where not applicable)
    applicable: np.ndarray           # bool mask
    note: str = ""
    estimator: object = None         # the fitted model, to score other inputs (e.g. rescaled models)
    columns: np.ndarray | None = None   # the feature columns it was fitted on


def run_statnn(con, sel: Selection, seed: int = 0) -> BaselineResult:
    from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor

    x = statnn_features(con, sel.model_ids)
    train = sel.mask("train")
    # layers that (almost) no training model has carry no signal and break the binning
    columns = np.isfinite(x[train]).sum(0) >= 2
    x = x[:, columns]
    # the default leaf of 20 samples leaves a small zoo no split at all (a constant prediction)
    leaf = int(min(20, max(2, train.sum() // 10)))
    if sel.task == "regression":
        est = HistGradientBoostingRegressor(max_iter=300, learning_rate=0.05, min_samples_leaf=leaf,
                                            random_state=seed)
    else:
        est = HistGradientBoostingClassifier(max_iter=300, learning_rate=0.05, min_samples_leaf=leaf,
                                             random_state=seed)
    est.fit(x[train], sel.targets[train])
    return BaselineResult("statnn", est.predict(x).astype(np.float64), np.ones(len(x), bool), estimator=est,
                          columns=columns)


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


def run_flat_mlp(con, sel: Selection, seed: int = 0) -> BaselineResult:
    from sklearn.neural_network import MLPClassifier, MLPRegressor
    from sklearn.preprocessing import StandardScaler

    archs = np.array(sel.architectures)
    values, counts = np.unique(archs[sel.mask("train")], return_counts=True)
    preds = np.full(len(sel.model_ids), np.nan)
    if len(values) == 0:
        return BaselineResult("flat_mlp", preds, np.zeros(len(preds), bool), "no training models")
    arch = values[np.argmax(counts)]
    mask = archs == arch
    idx = np.nonzero(mask)[0]
    x = flat_weights(con, [sel.model_ids[i] for i in idx])
    train = sel.mask("train")[idx]
    if train.sum() < 5:
        return BaselineResult("flat_mlp", preds, np.zeros(len(preds), bool),
                              f"only {int(train.sum())} training models share one architecture")
    scaler = StandardScaler().fit(x[train])
    xs = np.nan_to_num(scaler.transform(x))
    cls = MLPRegressor if sel.task == "regression" else MLPClassifier
    est = cls(hidden_layer_sizes=(128, 64), alpha=1e-3, max_iter=500, early_stopping=train.sum() >= 20,
              random_state=seed)
    est.fit(xs[train], sel.targets[idx][train])
    preds[idx] = est.predict(xs)
    note = f"architecture {arch}: {int(mask.sum())} of {len(mask)} models"
    return BaselineResult("flat_mlp", preds, mask, note)
