"""Peer methods of accuracy prediction, run by ``benchmarks/bench_accuracy.py`` beside NG-GNN and
StatNN on the same folds (issue #13). Their packages are the optional extra ``peers`` (``pip install
'.[peers]'``: nfn, weightwatcher), imported here lazily and nowhere else.

- NFN (Zhou et al., 2023, PyPI ``nfn``) with NP and with HNP layers: a neural functional over the
  weights of one fixed architecture. Weights come from the catalog (the graph codec's exact
  inverse, ``state_dict_from_graph``) as nfn's ``WeightSpaceFeatures``: conv weights
  ``(B, 1, out, in, kh, kw)``, biases ``(B, 1, out)``; a linear layer after pooling to ``s x s``
  (the ``cnn-fixed`` head after 2x2 average pooling) is an ``s x s`` conv kernel, its columns
  ``(channel, row, col)`` in torch's flatten order, so permuting a channel moves its kernel whole.
  The predictor follows the authors' generalisation-prediction setup (``experiments/models.py``:
  hidden channels 16, 16, 5, ReLU, HNP pooling, an MLP head of width 1000, a sigmoid output, binary
  cross-entropy, Adam; NP with input/output position embeddings and per-position input
  standardisation); the learning rate is chosen on the validation split (``NFN_GRID``) and the
  epoch by validation Kendall tau, as the authors select by validation tau. Batches of 32, not the
  authors' 8: on 2 CPU cores a step of 8 costs half a step of 32.
- WeightWatcher (Martin & Mahoney, PyPI ``weightwatcher``): data-free spectral metrics of every conv
  and linear layer. Its summary metrics (``WW_SUMMARY``) are zero-training predictors whose sign is
  chosen on the training split (Kendall tau), mapped to accuracy by a least-squares line on the
  training split so R^2 and MAE mean something (tau does not depend on the line); its per-layer
  metrics (``WW_LAYER``, padded per layer position) go to gradient boosting tuned on validation
  like StatNN (``jobs.predictors.baselines.fit_tuned``, with StatNN's shape descriptors on mixed zoos).
- The flat-weights MLP is a baseline of every run (``jobs.predictors.baselines.run_flat_mlp``), not here.

Every method returns ``{model_id: prediction}`` for the selection's models; the benchmark scores
the test models of each fold.
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
import torch
from torch import nn

from jobs.training.data import Selection
from jobs.training.tasks import task_named
from zoocore.errors import JobError

WW_SUMMARY = ("alpha", "alpha_weighted", "log_alpha_norm", "log_norm", "log_spectral_norm", "stable_rank")
WW_LAYER = ("alpha", "alpha_weighted", "log_alpha_norm", "log_norm", "log_spectral_norm", "stable_rank",
            "entropy", "D", "num_pl_spikes")
WW_MAX_LAYERS = 16


def _require(package: str):
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError as exc:
        raise JobError(f"the peer methods need the optional extra: pip install 'zoograph[peers]' ({exc})") from None


# ---------------------------------------------------------------- weights out of the catalog

def catalog_state_dicts(con, ids: Sequence[str], chunk: int = 256) -> Iterator[tuple[str, dict, dict]]:
    """(model_id, architecture spec, state dict) of ``ids`` in order, rebuilt from the catalog's nodes
    and edges (bit-exact for float32 weights), read ``chunk`` models at a time."""
    from pipeline.graph_codec import read_graphs
    from pipeline.neural_graph.build import state_dict_from_graph

    specs = {a: json.loads(s) if s else None for a, s in con.execute(
        "SELECT architecture_id, spec_json FROM architectures").fetchall()}
    arch_of = dict(con.execute("SELECT model_id, architecture_id FROM models").fetchall())
    plans: dict = {}
    for start in range(0, len(ids), chunk):
        part = list(ids[start:start + chunk])
        for mid, graph in zip(part, read_graphs(con, part, plans=plans)):
            yield mid, specs[arch_of[mid]], state_dict_from_graph(graph)


def _module(spec: dict | None, state: dict) -> nn.Module:
    from pipeline.spec import build_module

    if spec is None:
        raise JobError("this model was ingested without a JSON spec; the peers need the module")
    net = build_module(spec)
    net.load_state_dict(state)
    return net.eval()


# ---------------------------------------------------------------- NFN

def nfn_arrays(spec: dict, states: Sequence[dict]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The weights of models of one parameter shape as nfn's weight-space layout.

    Args:
        spec: the JSON spec of one of them (conv2d and linear layers with biases; no norm layers);
            the others may differ in activations only.
        states: the models' state dicts.
    Shapes:
        weights[l]: (n, 1, out_l, in_l, kh_l, kw_l); a linear layer after convs becomes an
        ``s x s`` kernel with ``in_l`` the channels of the conv before it (``s * s`` positions each).
        biases[l]: (n, 1, out_l).
    """
    module = _module(spec, states[0])
    params = [(name, m) for name, m in module.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    other = [name for name, m in module.named_modules()
             if len(list(m.parameters(recurse=False))) and not isinstance(m, (nn.Conv2d, nn.Linear))]
    if other or any(m.bias is None for _, m in params):
        raise JobError(f"NFN takes conv and linear layers with biases only; this architecture also has {other}")
    shapes = {k: v.shape for k, v in states[0].items()}
    if any({k: v.shape for k, v in s.items()} != shapes for s in states):
        raise JobError("NFN needs models of one parameter shape")
    weights, biases = [], []
    prev_channels = None
    for name, m in params:
        w = np.stack([s[f"{name}.weight"].numpy() for s in states]).astype(np.float32)
        if isinstance(m, nn.Linear):
            if prev_channels is None:
                w = w[..., None, None]
            else:        # columns (channel, row, col) of a flattened s x s feature map
                side = int(round((m.in_features / prev_channels) ** 0.5))
                if side * side * prev_channels != m.in_features:
                    raise JobError(f"linear layer {name} reads {m.in_features} features after {prev_channels} "
                                   "channels: not a square pooled map, so not a conv kernel")
                w = w.reshape(len(states), m.out_features, prev_channels, side, side)
        weights.append(w[:, None])
        biases.append(np.stack([s[f"{name}.bias"].numpy() for s in states]).astype(np.float32)[:, None])
        prev_channels = m.out_channels if isinstance(m, nn.Conv2d) else m.out_features
    return weights, biases


def wsfeat(weights: Sequence[np.ndarray], biases: Sequence[np.ndarray], rows, device="cpu"):
    """nfn ``WeightSpaceFeatures`` of the models ``rows``."""
    common = _require("nfn.common")
    return common.WeightSpaceFeatures([torch.as_tensor(w[rows], device=device) for w in weights],
                                      [torch.as_tensor(b[rows], device=device) for b in biases])


def nfn_predictor(network_spec, mode: str = "HNP", hchannels: Sequence[int] = (16, 16, 5), head: int = 1000,
                  standardise: tuple[list, list, list, list] | None = None) -> nn.Module:
    """An invariant NFN: ``mode`` (NP | HNP) layers with ReLU, HNP pooling, an MLP head, a sigmoid.
    ``standardise``: per-layer arrays (weight means, weight stds, bias means, bias stds), each of a
    layer's shape without the batch axis, to subtract and divide by (the authors' NP input
    standardisation; per position, so it does not commute with neuron permutations)."""
    layers = _require("nfn.layers")

    class InvariantNFN(nn.Module):
        def __init__(self):
            super().__init__()
            body, prev = [], 1
            for ch in hchannels:
                body.append(layers.NPLinear(network_spec, prev, ch, io_embed=True) if mode == "NP"
                            else layers.HNPLinear(network_spec, prev, ch))
                body += [layers.TupleOp(nn.ReLU())]
                prev = ch
            self.body = nn.Sequential(*body)
            pooled = prev * layers.HNPPool.get_num_outs(network_spec)
            self.head = nn.Sequential(layers.HNPPool(network_spec), nn.Flatten(start_dim=-2),
                                      nn.Linear(pooled, head), nn.ReLU(), nn.Linear(head, head), nn.ReLU(),
                                      nn.Linear(head, 1), nn.Sigmoid())
            self.stats = None
            if standardise is not None:
                self.stats = nn.ParameterList([nn.Parameter(torch.as_tensor(a), requires_grad=False)
                                               for pair in standardise for a in pair])

        def forward(self, ws):
            if self.stats is not None:
                n = len(ws.weights)
                mw, sw, mb, sb = (self.stats[k * n:(k + 1) * n] for k in range(4))
                ws = type(ws)([(w - m) / s for w, m, s in zip(ws.weights, mw, sw)],
                              [(b - m) / s for b, m, s in zip(ws.biases, mb, sb)])
            return self.head(self.body(ws)).squeeze(-1)

    return InvariantNFN()


NFN_GRID = [{"lr": lr, "hchannels": (16, 16, 5)} for lr in (1e-3, 3e-4)]


def _tau(y, p) -> float:
    from jobs.training.compare import kendall_tau

    return kendall_tau(y, p)


def run_nfn(weights, biases, sel: Selection, mode: str, epochs: int = 20, seed: int = 0, device: str = "cpu",
            batch_size: int = 32, grid: list[dict] | None = None, log=None) -> tuple[np.ndarray, str]:
    """NFN-``mode`` trained on the selection's training models, hyperparameters (``NFN_GRID``) and
    epoch chosen by validation Kendall tau; predictions for every selected model and a note."""
    common = _require("nfn.common")
    if not task_named(sel.task).numeric:
        raise JobError("the NFN peer predicts a number in [0, 1] (an accuracy)")
    train, val = np.nonzero(sel.mask("train"))[0], np.nonzero(sel.mask("val"))[0]
    spec = common.network_spec_from_wsfeat(wsfeat(weights, biases, train[:1]))
    standardise = None
    if mode == "NP":        # the authors standardise NP's inputs per position over the training set
        std = lambda a: np.where(a.std(0) < 1e-5, 1.0, a.std(0)).astype(np.float32)   # noqa: E731
        standardise = ([w[train].mean(0) for w in weights], [std(w[train]) for w in weights],
                       [b[train].mean(0) for b in biases], [std(b[train]) for b in biases])
    y = torch.as_tensor(sel.targets, dtype=torch.float32)
    all_rows = np.arange(len(sel.model_ids))

    def predict(model, rows):
        model.eval()
        with torch.no_grad():
            return torch.cat([model(wsfeat(weights, biases, rows[i:i + 256], device)).cpu()
                              for i in range(0, len(rows), 256)]).numpy()

    best = (-np.inf, None, None, 0)          # val tau, hyperparameters, weights, epochs
    for params in grid or NFN_GRID:
        torch.manual_seed(seed)
        model = nfn_predictor(spec, mode, params["hchannels"], standardise=standardise).to(device)
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=params["lr"])
        rng = np.random.default_rng(seed)
        t = time.perf_counter()
        for epoch in range(epochs):
            model.train()
            for b in np.array_split(rng.permutation(train), max(1, len(train) // batch_size)):
                opt.zero_grad()
                loss = nn.functional.binary_cross_entropy(model(wsfeat(weights, biases, b, device)),
                                                          y[b].to(device).clamp(0, 1))
                loss.backward()
                opt.step()
            tau = _tau(sel.targets[val], predict(model, val))
            if tau > best[0]:
                best = (tau, params, copy.deepcopy(model.state_dict()), epoch + 1)
        if log:
            log(f"    nfn_{mode.lower()} lr={params['lr']}: best val tau so far {best[0]:.3f} "
                f"({time.perf_counter() - t:.0f}s)")
    tau, params, state, epoch = best
    model = nfn_predictor(spec, mode, params["hchannels"], standardise=standardise).to(device)
    model.load_state_dict(state)
    return (predict(model, all_rows).astype(np.float64),
            f"chosen on val: lr={params['lr']}, epoch {epoch} of {epochs} (val tau {tau:.3f})")


# ---------------------------------------------------------------- WeightWatcher

def ww_metrics(spec: dict | None, state: dict) -> tuple[dict[str, float], list[dict[str, float]]]:
    """WeightWatcher's summary and per-layer metrics of one model (every conv and linear layer:
    ``min_evals=1`` keeps the small layers of small CNNs that the default of 8 eigenvalues drops)."""
    ww = _require("weightwatcher")
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
    sign = 1.0 if _tau(y[train], x[train]) >= 0 else -1.0
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
                    if "nfn" not in self._cache:
                        spec_json, = con.execute("SELECT spec_json FROM architectures WHERE architecture_id = ?",
                                                 [sel.architectures[0]]).fetchone()
                        states = [s for _, _, s in catalog_state_dicts(con, sel.model_ids)]
                        self._cache["nfn"] = nfn_arrays(json.loads(spec_json), states)
                    for m in nfn_modes:
                        t = time.perf_counter()
                        with _threads(self.threads):
                            pred, note = run_nfn(*self._cache["nfn"], sel, m.split("_")[1].upper(),
                                                 self.nfn_epochs, self.seed, self.device, log=self.log)
                        out[m] = dict(zip(sel.model_ids, pred))
                        self.log(f"  fold {fold} {m}: {note} ({time.perf_counter() - t:.0f}s)")
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
