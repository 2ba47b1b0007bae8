"""Predictors that read one feature row per model: StatNN (gradient boosting or an MLP) and the
flat-weights MLP. jobs.predictors registers them beside the metanetworks.

One interface:
- ``fit(con, sel)``: the features of the selected models (jobs.predictors.baselines), hyperparameters chosen
  on the validation split, the learner fitted on the training split; a ``Prediction`` for every
  selected model.
- ``predict(con, model_ids)``: any models of the catalog.
- ``save()``: a JSON state and the training rows as arrays; ``load(state, arrays)`` refits the
  chosen learner on those rows (scikit-learn fits are deterministic given the seed). Nothing is
  pickled, so a run folder from someone else never runs code.

A new tabular predictor is a subclass that says how to read its features (``features``) and, if
it needs to, what it fixes on the training selection (``settle``), plus one entry in
jobs.predictors.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from jobs.predictors.baselines import (FLAT_GRID, INDEX_COLUMNS, fit_params, fit_tuned, flat_weights, model_activations,
                                      parameter_shapes, shape_features, single_threaded, statnn_features,
                                      statnn_features_of_graphs)
from jobs.predictors.spectra import spectral_features_of_graphs
from jobs.training.data import Selection, hash_unit

MIN_TRAIN = 5               # fewer training models than this and a tabular predictor abstains
OOF_FOLDS = 5               # parts of the training split for out-of-fold predictions (TabularPredictor.out_of_fold)
GRAPH_CHUNK = 256           # graphs read at a time where features need them (jobs.predictors.spectra)


@dataclass
class Prediction:
    """A predictor's answers for every selected model (NaN where it does not apply)."""
    name: str
    predictions: np.ndarray
    applicable: np.ndarray               # bool mask
    note: str = ""


class TabularPredictor:
    """Features of each model into a scikit-learn learner tuned on validation (see the module)."""
    name = ""
    learner = "gbt"                      # gbt | mlp (jobs.predictors.baselines.fit_tuned), or a staticmethod
                                         # (task, params, n_train, seed) -> an unfitted scikit-learn estimator
    grid: list[dict] | None = None       # None: the learner's default grid

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.task = "regression"
        self.target = ""
        self.classes: list[str] = []
        self.settings: dict = {}          # what fit fixed on the selection (JSON); features read it
        self.params: dict = {}
        self.columns: np.ndarray | None = None
        self.estimator = None
        self._x = self._y = None

    # --- what a predictor defines
    def settle(self, con, sel: Selection) -> dict:
        """Choices fixed on the training selection and reused for every later input."""
        return {}

    reads_spectra = False                # its features include the spectral descriptors (jobs.predictors.spectra)

    def features(self, con, model_ids: Sequence[str], blocks: "FeatureReads | None" = None
                 ) -> tuple[np.ndarray, np.ndarray]:
        """(n, k) features (NaN where missing) and the (n,) bool mask of models it can read;
        ``blocks``: parts already read for these models (``FeatureReads``), to use and fill."""
        raise NotImplementedError

    def note(self) -> str:
        return "chosen on val: " + ", ".join(f"{k}={v}" for k, v in self.params.items())

    # --- shared
    def fit(self, con, sel: Selection, features: tuple[np.ndarray, np.ndarray] | None = None,
            settings: dict | None = None) -> Prediction:
        """Fit on ``sel``'s training split (``features``: already read with ``settings``, see ``fit_all``)."""
        self.task, self.target, self.classes = sel.task, sel.target, list(sel.classes)
        if features is None:
            self.settings = self.settle(con, sel)
            features = self.features(con, sel.model_ids)
        else:
            self.settings = dict(settings or {})
        x, ok = features
        train, val = sel.mask("train") & ok, sel.mask("val") & ok
        if train.sum() < MIN_TRAIN:
            return Prediction(self.name, np.full(len(ok), np.nan), np.zeros(len(ok), bool),
                              f"only {int(train.sum())} training models it can read")
        self.estimator, self.columns, self.params = fit_tuned(x, sel.targets, train, val, sel.task, self.learner,
                                                              self.seed, self.grid)
        self._x, self._y = x[train][:, self.columns], sel.targets[train].astype(np.float64)
        return Prediction(self.name, self.predict_features(x, ok), ok, self.note())

    @single_threaded
    def out_of_fold(self, x: np.ndarray, ok: np.ndarray, sel: Selection, folds: int = OOF_FOLDS) -> np.ndarray:
        """Predictions for ``sel``'s models (``x``, ``ok``: the features ``fit`` was given) in which each
        training model's comes from a learner fitted without it (``folds`` parts by a hash of model_id;
        the hyperparameters and columns ``fit`` chose), every other model's from the fitted learner:
        what a model trained on this predictor's residuals may see, without its fit to their own targets."""
        out = self.predict_features(x, ok)
        train = np.flatnonzero(sel.mask("train") & ok)
        part = np.array([int(hash_unit("oof:", sel.model_ids[i]) * folds) for i in train], dtype=np.int64)
        for k in range(folds):
            held, kept = train[part == k], train[part != k]
            if len(held) and len(kept) >= MIN_TRAIN:
                est = fit_params(x[kept][:, self.columns], sel.targets[kept].astype(np.float64), self.task,
                                 self.learner, self.params, self.seed)
                out[held] = est.predict(x[held][:, self.columns])
        return out

    def predict(self, con, model_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Predictions for ``model_ids`` (NaN where it does not apply) and the applicable mask."""
        x, ok = self.features(con, model_ids)
        return self.predict_features(x, ok), ok

    @single_threaded
    def predict_features(self, x: np.ndarray, ok: np.ndarray | None = None) -> np.ndarray:
        ok = np.ones(len(x), bool) if ok is None else ok
        out = np.full(len(x), np.nan)
        if ok.any():
            out[ok] = self.estimator.predict(x[ok][:, self.columns])
        return out

    def save(self) -> tuple[dict, dict[str, np.ndarray]]:
        """The JSON state and the arrays ``load`` refits from."""
        state = {"name": self.name, "seed": self.seed, "task": self.task, "target": self.target,
                 "classes": self.classes, "settings": self.settings,
                 "params": self.params, "columns": np.nonzero(self.columns)[0].tolist(),
                 "width": int(len(self.columns))}
        return state, {"x_train": np.ascontiguousarray(self._x), "y_train": np.ascontiguousarray(self._y)}

    @classmethod
    def load(cls, state: dict, arrays: dict[str, np.ndarray]) -> "TabularPredictor":
        """The predictor ``save`` described, refitted on its saved training rows."""
        p = cls(int(state["seed"]))
        p.task, p.target, p.classes = state["task"], str(state["target"]), list(state.get("classes") or [])
        p.settings = dict(state["settings"])
        p.params = {k: tuple(v) if isinstance(v, list) else v for k, v in state["params"].items()}
        p.columns = np.zeros(int(state["width"]), bool)
        p.columns[np.asarray(state["columns"], dtype=np.int64)] = True
        p._x, p._y = np.asarray(arrays["x_train"], np.float64), np.asarray(arrays["y_train"], np.float64)
        if p._x.shape != (len(p._y), int(p.columns.sum())):
            raise ValueError(f"training rows of shape {p._x.shape} for {int(p.columns.sum())} columns")
        p.estimator = fit_params(p._x, p._y, p.task, p.learner, p.params, p.seed)
        return p


class StatNN(TabularPredictor):
    """StatNN with gradient boosting: per-layer weight and bias statistics (by position and of norm
    layers only where parameter shapes differ), with shape descriptors where the selection holds
    more than one architecture."""
    name = "statnn"

    def settle(self, con, sel: Selection) -> dict:
        shape = len(set(sel.architectures)) > 1
        return {"shape": shape, "activations": model_activations(con, sel.model_ids) if shape else [],
                # one parameter shape: the position and norm slots repeat index slots, which costs the MLP tau
                # (dev zoo cnn-fixed, 3 folds: 0.583 without them, 0.556 with); learners drop empty columns
                "index_only": len(set(parameter_shapes(con, sel.model_ids))) == 1}

    def features(self, con, model_ids, blocks: "FeatureReads | None" = None):
        """``blocks``: a ``FeatureReads`` of these models (``read_once`` passes its own), whose blocks
        (statistics and spectra, by preparation) are read at most once: one pass over the graphs
        reads every block a pass can, including the spectra when the cache says they will be wanted."""
        blocks = FeatureReads() if blocks is None else blocks
        flags = json.dumps(self.settings.get("prepare") or {}, sort_keys=True)
        index_only, spectral = bool(self.settings.get("index_only")), bool(self.settings.get("spectral"))
        stats_key, spectra_key = ("statistics", flags), ("spectra", flags, index_only)
        prepare = self.preparation()
        if (prepare is not None and stats_key not in blocks) or (spectral and spectra_key not in blocks):
            self._read_graph_blocks(con, model_ids, blocks, prepare, stats_key,
                                    spectra_key if spectral or blocks.spectra else None)
        if stats_key not in blocks:      # the checkpoints' own weights: the catalog's statistics, no graph
            blocks[stats_key] = statnn_features(con, model_ids)
        stats = blocks[stats_key]
        stats = np.hstack([stats, blocks[spectra_key]]) if spectral else stats.copy()
        return self._with_shape(con, model_ids, stats)

    def _read_graph_blocks(self, con, model_ids, blocks: "FeatureReads", prepare, stats_key, spectra_key) -> None:
        """One pass over the graphs of ``model_ids`` (a chunk at a time), prepared with ``prepare``:
        the statistics block when missing, and the spectra block when ``spectra_key`` is not None."""
        from jobs.training.preparation import read_prepared

        want_stats = stats_key not in blocks
        want_spectra = spectra_key is not None and spectra_key not in blocks
        stats, spectra = [], []
        for start in range(0, len(model_ids), GRAPH_CHUNK):
            ids = list(model_ids[start:start + GRAPH_CHUNK])
            graphs = read_prepared(con, ids, prepare)
            if want_stats:
                stats.append(statnn_features(con, ids) if prepare is None else statnn_features_of_graphs(graphs))
            if want_spectra:
                spectra.append(spectral_features_of_graphs(graphs, spectra_key[2]))
        if want_stats:
            blocks[stats_key] = np.vstack(stats) if stats else statnn_features_of_graphs([])
        if want_spectra:
            blocks[spectra_key] = np.vstack(spectra) if spectra else spectral_features_of_graphs([], spectra_key[2])

    def features_of_graphs(self, con, model_ids, graphs) -> np.ndarray:
        """The features of in-memory graphs of ``model_ids`` (e.g. rescaled copies: their statistics
        change, their shape does not), prepared as the predictor's own inputs are."""
        flags = self.settings.get("prepare")
        if flags:
            from jobs.training.preparation import prepared_graphs

            graphs = prepared_graphs(con, model_ids, graphs, dict(flags))
        return self._with_shape(con, model_ids, self._with_spectra(statnn_features_of_graphs(graphs), graphs))[0]

    def preparation(self):
        """The graph preparation its statistics are read after (``settings["prepare"]``: the
        symmetry part of a run's preparation, e.g. ``{"balanced": True}``, so that a blend with a
        balanced metanetwork is as invariant as it is), or None: the checkpoint's own weights."""
        flags = self.settings.get("prepare")
        if not flags:
            return None
        from jobs.training.preparation import run_preparation

        return run_preparation(dict(flags))

    def _with_spectra(self, stats: np.ndarray, graphs) -> np.ndarray:
        """The statistics, then (``settings["spectral"]``) the weight matrices' spectral descriptors."""
        if not self.settings.get("spectral"):
            return stats
        return np.hstack([stats, spectral_features_of_graphs(graphs, bool(self.settings.get("index_only")))])

    def _with_shape(self, con, model_ids, stats: np.ndarray):
        if self.settings.get("index_only"):
            stats[:, :len(INDEX_COLUMNS)][:, ~INDEX_COLUMNS] = np.nan
        if self.settings.get("shape"):
            stats = np.hstack([stats, shape_features(con, model_ids, self.settings["activations"])])
        return stats, np.ones(len(stats), bool)

    def note(self) -> str:
        prepared = "".join(f"on {k} graphs; " for k, v in (self.settings.get("prepare") or {}).items() if v)
        return (prepared + ("with spectral descriptors; " if self.settings.get("spectral") else "")
                + ("with shape descriptors; " if self.settings.get("shape") else "") + super().note())


class StatNNMLP(StatNN):
    """StatNN with an MLP, as the paper ran it (its scaler chosen on validation too)."""
    name = "statnn_mlp"
    learner = "mlp"


class SpectralStatNN(StatNN):
    """StatNN's statistics plus each weight matrix's spectral descriptors (jobs.predictors.spectra) into
    gradient boosting: the features ``--head-spectral`` gives a metanetwork's head, without the graph.
    A blend partner (jobs.predictors.stacking) and so one of the statistics a metanetwork must beat."""
    name = "statnn_spectral"
    reads_spectra = True

    def settle(self, con, sel: Selection) -> dict:
        return {**super().settle(con, sel), "spectral": True}


class FlatMLP(TabularPredictor):
    """An MLP on every weight and bias of a model in one vector: only defined for one parameter
    shape, so it reads the models of the training split's most common shape (all of a
    fixed-architecture zoo, whatever their activations)."""
    name = "flat_mlp"
    learner = "mlp"
    grid = FLAT_GRID

    def settle(self, con, sel: Selection) -> dict:
        shapes = np.array(parameter_shapes(con, sel.model_ids))
        values, counts = np.unique(shapes[sel.mask("train")], return_counts=True)
        return {"parameter_shapes": str(values[np.argmax(counts)]) if len(values) else None}

    def features(self, con, model_ids, blocks=None):
        ok = np.array(parameter_shapes(con, model_ids)) == self.settings.get("parameter_shapes")
        x = flat_weights(con, [m for m, keep in zip(model_ids, ok) if keep]).astype(np.float64)
        out = np.full((len(model_ids), x.shape[1] if len(x) else 0), np.nan)
        out[ok] = x
        return out, ok

    def note(self) -> str:
        return "one parameter shape; " + super().note()


def settled(p: TabularPredictor, con, sel: Selection, prepare: dict | None = None) -> TabularPredictor:
    """``p`` with its feature settings chosen on ``sel`` (``settle``); the StatNN family also reads
    its statistics after the preparation flags ``prepare`` (see ``StatNN.preparation``)."""
    p.settings = p.settle(con, sel)
    if prepare and isinstance(p, StatNN):
        p.settings["prepare"] = dict(prepare)
    return p


def fit_all(con, sel: Selection, names: Sequence[str], seed: int = 0, prepare: dict | None = None,
            read: dict | None = None) -> dict[str, tuple[TabularPredictor, Prediction]]:
    """These predictors (jobs.predictors names, tabular or weight-space) fitted on one selection;
    tabular ones that read the same features with the same settings (StatNN's two learners) read
    them once. ``prepare``: see ``settled``. ``read``: features already read for ``sel``'s models
    (``read_once``'s cache; e.g. the head statistics'), filled in as they are read."""
    from jobs.predictors import fitted_predictor

    read = feature_reads(names) if read is None else read
    out = {}
    for name in names:
        p = fitted_predictor(name, seed)
        if not isinstance(p, TabularPredictor):
            out[name] = (p, p.fit(con, sel))
            continue
        settled(p, con, sel, prepare)
        out[name] = (p, p.fit(con, sel, read_once(read, p, con, sel.model_ids), p.settings))
    return out


def predict_all(con, predictors: Sequence[TabularPredictor], model_ids: Sequence[str]) -> list[np.ndarray]:
    """Each fitted predictor's predictions for ``model_ids`` (NaN where it does not apply); those
    that read the same features with the same settings read them once."""
    read = FeatureReads()
    return [p.predict_features(*read_once(read, p, con, model_ids)) if isinstance(p, TabularPredictor)
            else p.predict(con, model_ids)[0] for p in predictors]


class FeatureReads(dict):
    """What has been read of one list of models: each predictor's features (by its feature reader and
    settings, ``read_once``) and the blocks they are made of (``StatNN.features``). ``spectra``: a
    predictor of these models will want the spectral descriptors, so a pass over the graphs for
    anything else reads them too (one pass over each preparation of the graphs per run)."""

    def __init__(self, spectra: bool = False):
        super().__init__()
        self.spectra = spectra


def feature_reads(names: Sequence[str], head_spectral: bool = False) -> FeatureReads:
    """The cache for a run that fits the predictors ``names`` (jobs.predictors) and whose head reads
    the spectra when ``head_spectral``."""
    from jobs.predictors import entry, predictor_class

    spectral = any(entry(n).family == "tabular" and predictor_class(n).reads_spectra for n in names)
    return FeatureReads(spectra=spectral or head_spectral)


def read_once(read: dict, p: TabularPredictor, con, model_ids) -> tuple[np.ndarray, np.ndarray]:
    """``p``'s features of ``model_ids``, from ``read`` (a ``FeatureReads``) when a predictor of the same
    features and settings already read them (no predictor changes the arrays it is given); one
    cache serves one list of models."""
    if not isinstance(read, FeatureReads):
        raise TypeError("read_once caches in a FeatureReads")
    key = (type(p).features, json.dumps(p.settings, sort_keys=True))
    if key not in read:
        read[key] = p.features(con, model_ids, read)
    return read[key]
