"""Peer methods of accuracy prediction, run by ``benchmarks/bench_accuracy.py`` beside NG-GNN and
StatNN on the same folds (issue #13). Their packages are the optional extra ``peers`` (``pip install
'.[peers]'``: nfn, weightwatcher), imported lazily.

- NFN with NP and with HNP layers: the registry's predictors ``nfn_np`` and ``nfn_hnp``
  (jobs.predictors.nfn); here they are fitted per fold on weights read once per zoo.
- WeightWatcher (Martin & Mahoney, PyPI ``weightwatcher``): data-free spectral metrics of every conv
  and linear layer. Its summary metrics (``WW_SUMMARY``) are zero-training predictors whose sign is
  chosen on the training split (Kendall tau), mapped to accuracy by a least-squares line on the
  training split so R^2 and MAE mean something (tau does not depend on the line); its per-layer
  metrics (``WW_LAYER``, padded per layer position) go to gradient boosting tuned on validation
  like StatNN (``jobs.predictors.baselines.fit_tuned``, with StatNN's shape descriptors on mixed zoos).
- The flat-weights MLP is a baseline of every run (``jobs.predictors.tabular.FlatMLP``), not here.

Every method returns ``{model_id: prediction}`` for the selection's models; the benchmark scores
the test models of each fold.
"""
from __future__ import annotations

import contextlib
import io
import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from torch import nn

from jobs.analysis.catalog_models import catalog_state_dicts
from jobs.predictors.nfn import require_extra
from jobs.training.compare import kendall_tau
from jobs.training.data import Selection
from zoocore.errors import JobError

WW_SUMMARY = ("alpha", "alpha_weighted", "log_alpha_norm", "log_norm", "log_spectral_norm", "stable_rank")
WW_LAYER = ("alpha", "alpha_weighted", "log_alpha_norm", "log_norm", "log_spectral_norm", "stable_rank",
            "entropy", "D", "num_pl_spikes")
WW_MAX_LAYERS = 16


# ---------------------------------------------------------------- weights out of the catalog

def _module(spec: dict | None, state: dict) -> nn.Module:
    from pipeline.spec import build_module

    if spec is None:
        raise JobError("this model was ingested without a JSON spec; the peers need the module")
    net = build_module(spec)
    net.load_state_dict(state)
    return net.eval()


# ---------------------------------------------------------------- WeightWatcher

def ww_metrics(spec: dict | None, state: dict) -> tuple[dict[str, float], list[dict[str, float]]]:
    """WeightWatcher's summary and per-layer metrics of one model (every conv and linear layer:
    ``min_evals=1`` keeps the small layers of small CNNs that the default of 8 eigenvalues drops)."""
    ww = require_extra("weightwatcher", "WeightWatcher")
    logging.getLogger("weightwatcher").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        watcher = ww.WeightWatcher(model=_module(spec, state))
        details = watcher.analyze(min_evals=1)
        summary = watcher.get_summary(details)
    layers = [{k: float(r[k]) for k in WW_LAYER} for _, r in details.sort_values("layer_id").iterrows()]
    return {k: float(summary.get(k, np.nan)) for k in WW_SUMMARY}, layers


@dataclass
class WWTable:
    """WeightWatcher's metrics of a list of models (data-free: computed once, shared by every fold)."""
    model_ids: list[str]
    summary: np.ndarray                      # (n, len(WW_SUMMARY))
    layers: np.ndarray                       # (n, WW_MAX_LAYERS * len(WW_LAYER)), NaN past a model's depth
    seconds: float = 0.0

    @classmethod
    def of(cls, con, ids: Sequence[str], progress=None) -> "WWTable":
        t = time.perf_counter()
        summary = np.full((len(ids), len(WW_SUMMARY)), np.nan)
        layers = np.full((len(ids), WW_MAX_LAYERS, len(WW_LAYER)), np.nan)
        for i, (mid, spec, state) in enumerate(catalog_state_dicts(con, ids)):
            s, per_layer = ww_metrics(spec, state)
            summary[i] = [s[k] for k in WW_SUMMARY]
            for j, row in enumerate(per_layer[:WW_MAX_LAYERS]):
                layers[i, j] = [row[k] for k in WW_LAYER]
            if progress and (i + 1) % 200 == 0:
                progress(f"    weightwatcher: {i + 1}/{len(ids)} models ({time.perf_counter() - t:.0f}s)")
        return cls(list(ids), summary, layers.reshape(len(ids), -1), time.perf_counter() - t)

    def rows(self, ids: Sequence[str]) -> np.ndarray:
        index = {m: i for i, m in enumerate(self.model_ids)}
        return np.array([index[m] for m in ids])


def zero_training(metric: np.ndarray, y: np.ndarray, train: np.ndarray) -> tuple[np.ndarray, str]:
    """A metric as a predictor with no training: its sign chosen by Kendall tau on the training rows,
    then a least-squares line on the training rows (slope >= 0) so the prediction reads as the
    target; NaNs take the training median. Returns predictions for every row and a note."""
    x = metric.astype(np.float64).copy()
    finite = np.isfinite(x)
    if not finite[train].any():
        return np.full(len(x), np.nan), "no finite value on the training split"
    x[~finite] = np.median(x[train & finite])
    sign = 1.0 if kendall_tau(y[train], x[train]) >= 0 else -1.0
    z = sign * x
    slope, icept = np.polyfit(z[train], y[train], 1) if np.ptp(z[train]) > 0 else (0.0, y[train].mean())
    if slope <= 0:        # the line disagrees with the rank sign: keep the order, predict the mean
        slope, icept = 1e-12, y[train].mean() - 1e-12 * z[train].mean()
    return icept + slope * z, f"sign {'+' if sign > 0 else '-'} on train"


def run_ww(table: WWTable, con, sel: Selection, seed: int = 0) -> dict[str, tuple[np.ndarray, str]]:
    """WeightWatcher's predictors on the selection: ``ww_<metric>`` per summary metric (zero
    training) and ``ww_gbt`` (per-layer metrics into tuned gradient boosting)."""
    from jobs.predictors.baselines import fit_tuned, shape_features

    rows = table.rows(sel.model_ids)
    train, val = sel.mask("train"), sel.mask("val")
    out = {f"ww_{k}": zero_training(table.summary[rows, j], sel.targets, train) for j, k in enumerate(WW_SUMMARY)}
    x = table.layers[rows]
    shape = len(set(sel.architectures)) > 1
    if shape:
        x = np.hstack([x, shape_features(con, sel.model_ids)])
    est, columns, best = fit_tuned(x, sel.targets, train, val, sel.task, "gbt", seed)
    out["ww_gbt"] = (est.predict(x[:, columns]).astype(np.float64),
                     ("with shape descriptors; " if shape else "") + "chosen on val: "
                     + ", ".join(f"{k}={v}" for k, v in best.items()))
    return out


# ---------------------------------------------------------------- all peers of one zoo

@contextlib.contextmanager
def _threads(n: int | None):
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


PEERS = ("nfn_np", "nfn_hnp", "ww")


@dataclass
class PeerRunner:
    """The peers on one catalog: inputs read once (all models of the zoo), methods run per fold."""
    catalog: object
    methods: Sequence[str] = PEERS
    seed: int = 0
    device: str = "cpu"
    nfn_epochs: int = 20
    threads: int | None = 1     # torch threads while NFN trains: its ops are tiny, and on 2 shared cores
                                # a step of batch 8 took 0.6 s with 1 thread and 8 s with 2
    log: object = print
    _cache: dict = field(default_factory=dict)

    def fold(self, folds: int, fold: int, target: str = "test_accuracy") -> dict[str, dict[str, float]]:
        """method -> {model_id: prediction} for every selected model of fold ``fold`` of ``folds``."""
        from graphstore import duck
        from jobs.predictors import predictor_class
        from jobs.predictors.baselines import parameter_shapes
        from jobs.training.data import select_models

        unknown = set(self.methods) - set(PEERS)
        if unknown:
            raise JobError(f"unknown peer method(s) {sorted(unknown)}; known: {', '.join(PEERS)}")
        con = duck.connect(self.catalog)
        try:
            sel = select_models(con, target, folds=(folds, fold))
            out: dict[str, dict[str, float]] = {}
            nfn_modes = [m for m in self.methods if m.startswith("nfn_")]
            if nfn_modes:
                shapes = set(parameter_shapes(con, sel.model_ids))
                if len(shapes) > 1:
                    self.log(f"    nfn: skipped, the zoo holds {len(shapes)} parameter shapes (NFN needs one)")
                else:
                    for m in nfn_modes:
                        t = time.perf_counter()
                        nfn = predictor_class(m)(self.seed, self.device)
                        nfn.epochs = self.nfn_epochs
                        try:
                            settings = nfn.settle(con, sel)
                        except JobError as exc:
                            self.log(f"    {m}: skipped, {exc}")
                            continue
                        key = ("nfn", settings["parameter_shapes"], tuple(sel.model_ids))
                        if key not in self._cache:       # the weights of the zoo, read once for every fold
                            self._cache[key] = nfn.features(con, sel.model_ids)
                        with _threads(self.threads):
                            fitted = nfn.fit(con, sel, self._cache[key], settings, log=self.log)
                        out[m] = dict(zip(sel.model_ids, fitted.predictions))
                        self.log(f"  fold {fold} {m}: {fitted.note} ({time.perf_counter() - t:.0f}s)")
            if "ww" in self.methods:
                if "ww" not in self._cache:
                    self._cache["ww"] = WWTable.of(con, sel.model_ids, progress=self.log)
                    self.log(f"    weightwatcher: {len(sel.model_ids)} models in {self._cache['ww'].seconds:.0f}s")
                for name, (pred, note) in run_ww(self._cache["ww"], con, sel, self.seed).items():
                    out[name] = dict(zip(sel.model_ids, pred))
                self.log(f"  fold {fold} ww_gbt: {note}")
            return out
        finally:
            con.close()
