"""NFN (Zhou et al., 2023, PyPI ``nfn``, the optional extra ``peers``) as a predictor of the registry:
a neural functional over the weights of one parameter shape, with NP or with HNP layers.

- **Layout.** The weights come from the catalog (the graph codec's exact inverse) in nfn's
  ``WeightSpaceFeatures`` layout, read off the architecture's plan, so ``.pt2`` zoos work as well as
  spec'd ones: conv weights ``(B, 1, out, in, kh, kw)``, biases ``(B, 1, out)``; a linear layer
  after pooling to ``s x s`` (a fixed CNN's head after 2x2 average pooling) is an ``s x s`` conv
  kernel, its columns ``(channel, row, col)`` in torch's flatten order, so permuting a channel
  moves its kernel whole. Only a chain of conv and linear layers with biases is read; anything
  else (norms, residuals, attention) is refused by name.
- **Model.** The authors' generalisation-prediction setup (``experiments/models.py``): hidden
  channels 16, 16, 5, ReLU, HNP pooling, an MLP head of width 1000, a sigmoid output, binary
  cross-entropy, Adam; NP with input/output position embeddings and per-position input
  standardisation. The learning rate is chosen on the validation split (``NFN_GRID``) and the epoch
  by validation Kendall tau, as the authors select by validation tau. Batches of 32, not the
  authors' 8: on 2 CPU cores a step of 8 costs half a step of 32.
- **Scope.** Models of the training split's parameter shape only (NaN for the others, as the flat
  MLP); numeric targets in [0, 1] (an accuracy).
- **Saving.** A JSON state (layout, chosen hyperparameters) and the trained network's tensors as
  safetensors; ``load`` rebuilds the network and loads them: nothing is pickled.

It is not a default baseline of every run (its grid trains for minutes); ``jobs train-heterognn
--model nfn_hnp`` trains it as a run's answer and ``benchmarks/bench_accuracy.py --peers nfn_hnp``
beside the others.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import nn

from jobs.analysis.catalog_models import catalog_state_dicts
from jobs.predictors.tabular import MIN_TRAIN, Prediction
from jobs.training.compare import kendall_tau
from jobs.training.data import Selection
from jobs.training.tasks import task_named
from zoocore.errors import JobError

NFN_GRID = [{"lr": lr, "hchannels": [16, 16, 5]} for lr in (1e-3, 3e-4)]


def require_extra(module: str = "nfn", name: str = "NFN"):
    """``module`` of the optional extra ``peers`` (nfn, weightwatcher), or a JobError saying how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise JobError(f"{name} needs the optional extra: pip install 'zoograph[peers]' ({exc})") from None


@dataclass(frozen=True)
class NFNLayer:
    """One weight-space layer: the state-dict keys and nfn's kernel shape ``(out, in, kh, kw)``."""
    weight_key: str
    bias_key: str
    shape: tuple[int, int, int, int]


def nfn_layout(plan) -> list[NFNLayer]:
    """The nfn layers of an architecture's plan (see the module docstring), or a JobError naming
    what NFN cannot read."""
    layers: list[NFNLayer] = []
    at, channels = 0, None
    from pipeline.neural_graph.ops.conv import Conv
    from pipeline.neural_graph.ops.linear import Linear

    for op in plan.ops:
        where = f"{op.kind} operation {op.path or '?'}"
        if not isinstance(op, (Conv, Linear)):
            raise JobError(f"NFN reads chains of conv and linear layers only; this architecture has a {where}")
        if op.src_layer != at or op.get("src_segments"):
            raise JobError(f"NFN reads chains of conv and linear layers only; the {where} does not read the "
                           "layer before it")
        if op.bias_key is None:
            raise JobError(f"NFN reads layers with biases only; the {where} has none")
        if isinstance(op, Conv):
            if op.get("groups", 1) != 1:
                raise JobError(f"NFN reads dense convolutions only; the {where} has {op['groups']} groups")
            out, inn, kh, kw = op.weight_shape
        else:
            out, inn = op.weight_shape
            kh, kw = op.kernel
            if channels is None or kh * kw == 1:
                kh = kw = 1
            elif inn != channels * kh * kw:
                raise JobError(f"the {where} reads {inn} features after {channels} channels: not a pooled "
                               f"{kh}x{kw} map, so not a conv kernel")
            else:
                inn = channels
        layers.append(NFNLayer(op.weight_key, op.bias_key, (int(out), int(inn), int(kh), int(kw))))
        at, channels = op.dst_layer, int(out)
    if not layers or at != plan.output_layer:
        raise JobError("NFN reads chains of conv and linear layers only; this architecture's output is not "
                       "its last such layer")
    return layers


def weight_arrays(layout: Sequence[NFNLayer], states: Sequence[dict]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The state dicts as nfn arrays: ``weights[l]`` ``(n, 1, out, in, kh, kw)``, ``biases[l]`` ``(n, 1, out)``."""
    weights, biases = [], []
    for layer in layout:
        n = len(states)
        weights.append(np.stack([s[layer.weight_key].numpy() for s in states]).astype(np.float32)
                       .reshape(n, 1, *layer.shape))
        biases.append(np.stack([s[layer.bias_key].numpy() for s in states]).astype(np.float32)
                      .reshape(n, 1, layer.shape[0]))
    return weights, biases


def wsfeat(weights: Sequence[np.ndarray], biases: Sequence[np.ndarray], rows, device="cpu"):
    """nfn ``WeightSpaceFeatures`` of the models ``rows``."""
    common = require_extra("nfn.common")
    return common.WeightSpaceFeatures([torch.as_tensor(w[rows], device=device) for w in weights],
                                      [torch.as_tensor(b[rows], device=device) for b in biases])


def network_spec(layout: Sequence[NFNLayer]):
    """nfn's ``NetworkSpec`` of a layout (from one all-zero model of its shapes)."""
    common = require_extra("nfn.common")
    zeros = common.WeightSpaceFeatures([torch.zeros(1, 1, *layer.shape) for layer in layout],
                                       [torch.zeros(1, 1, layer.shape[0]) for layer in layout])
    return common.network_spec_from_wsfeat(zeros)


def nfn_predictor(spec, mode: str = "HNP", hchannels: Sequence[int] = (16, 16, 5), head: int = 1000,
                  standardise: tuple[list, list, list, list] | None = None) -> nn.Module:
    """An invariant NFN: ``mode`` (NP | HNP) layers with ReLU, HNP pooling, an MLP head, a sigmoid.
    ``standardise``: per-layer arrays (weight means, weight stds, bias means, bias stds), each of a
    layer's shape without the batch axis, to subtract and divide by (the authors' NP input
    standardisation; per position, so it does not commute with neuron permutations)."""
    layers = require_extra("nfn.layers")

    class InvariantNFN(nn.Module):
        def __init__(self):
            super().__init__()
            body, prev = [], 1
            for ch in hchannels:
                body.append(layers.NPLinear(spec, prev, ch, io_embed=True) if mode == "NP"
                            else layers.HNPLinear(spec, prev, ch))
                body += [layers.TupleOp(nn.ReLU())]
                prev = ch
            self.body = nn.Sequential(*body)
            pooled = prev * layers.HNPPool.get_num_outs(spec)
            self.head = nn.Sequential(layers.HNPPool(spec), nn.Flatten(start_dim=-2),
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


@dataclass
class WeightSpace:
    """The nfn arrays of some models (rows of ``ok`` only; NaN-free) and which models they are."""
    weights: list[np.ndarray]
    biases: list[np.ndarray]
    ok: np.ndarray                      # (n_models,) bool: of the parameter shape, so read
    rows: np.ndarray                    # index into the arrays of each model (-1 where not ok)


class NFN:
    """NFN as a predictor (see the module docstring): ``fit`` on a split, ``predict`` any catalog
    models, ``save`` / ``load`` without pickle."""
    name = ""
    mode = ""
    epochs = 20
    batch_size = 32
    grid = NFN_GRID

    def __init__(self, seed: int = 0, device: str = "cpu"):
        self.seed, self.device = seed, device
        self.task, self.target, self.classes = "regression", "", []
        self.settings: dict = {}           # parameter_shapes (the one it reads), layout
        self.params: dict = {}
        self.model: nn.Module | None = None

    # --- inputs
    def settle(self, con, sel: Selection) -> dict:
        """The training split's commonest parameter shape and its layout (from its plan)."""
        from jobs.analysis.catalog_models import plan_of
        from jobs.predictors.baselines import parameter_shapes

        shapes = np.array(parameter_shapes(con, sel.model_ids))
        values, counts = np.unique(shapes[sel.mask("train")], return_counts=True)
        if not len(values):
            raise JobError("NFN: no training models")
        shape = str(values[np.argmax(counts)])
        first = sel.model_ids[int(np.nonzero(shapes == shape)[0][0])]
        layout = nfn_layout(plan_of(con, first))
        return {"parameter_shapes": shape, "layout": [[x.weight_key, x.bias_key, list(x.shape)] for x in layout]}

    def layout(self) -> list[NFNLayer]:
        return [NFNLayer(w, b, tuple(s)) for w, b, s in self.settings["layout"]]

    def features(self, con, model_ids: Sequence[str]) -> WeightSpace:
        from jobs.predictors.baselines import parameter_shapes

        ok = np.array(parameter_shapes(con, model_ids)) == self.settings["parameter_shapes"]
        ids = [m for m, keep in zip(model_ids, ok) if keep]
        weights, biases = weight_arrays(self.layout(), [s for _, _, s in catalog_state_dicts(con, ids)])
        rows = np.full(len(model_ids), -1)
        rows[ok] = np.arange(int(ok.sum()))
        return WeightSpace(weights, biases, ok, rows)

    # --- fit and predict
    def fit(self, con, sel: Selection, features: WeightSpace | None = None, settings: dict | None = None,
            log=None) -> Prediction:
        """Fit on ``sel``'s training split (``features``: already read with ``settings``)."""
        require_extra()
        if not task_named(sel.task).numeric:
            raise JobError(f"{self.name} predicts a number in [0, 1] (an accuracy), not a {sel.task} target")
        self.task, self.target, self.classes = sel.task, sel.target, list(sel.classes)
        self.settings = dict(settings) if settings is not None else self.settle(con, sel)
        ws = features if features is not None else self.features(con, sel.model_ids)
        train = np.nonzero(sel.mask("train") & ws.ok)[0]
        val = np.nonzero(sel.mask("val") & ws.ok)[0]
        if len(train) < MIN_TRAIN or not len(val):
            return Prediction(self.name, np.full(len(ws.ok), np.nan), np.zeros(len(ws.ok), bool),
                              f"only {len(train)} training and {len(val)} validation models of one parameter shape")
        tr, va = ws.rows[train], ws.rows[val]
        standardise = None
        if self.mode == "NP":        # the authors standardise NP's inputs per position over the training set
            std = lambda a: np.where(a.std(0) < 1e-5, 1.0, a.std(0)).astype(np.float32)   # noqa: E731
            standardise = ([w[tr].mean(0) for w in ws.weights], [std(w[tr]) for w in ws.weights],
                           [b[tr].mean(0) for b in ws.biases], [std(b[tr]) for b in ws.biases])
        spec = network_spec(self.layout())
        y = torch.as_tensor(sel.targets[train], dtype=torch.float32).clamp(0, 1)
        best = (-np.inf, None, None, 0)          # val tau, hyperparameters, weights, epoch
        for params in self.grid:
            torch.manual_seed(self.seed)
            model = nfn_predictor(spec, self.mode, params["hchannels"], standardise=standardise).to(self.device)
            opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=params["lr"])
            rng = np.random.default_rng(self.seed)
            t = time.perf_counter()
            for epoch in range(self.epochs):
                model.train()
                for b in np.array_split(rng.permutation(len(tr)), max(1, len(tr) // self.batch_size)):
                    opt.zero_grad()
                    out = model(wsfeat(ws.weights, ws.biases, tr[b], self.device))
                    nn.functional.binary_cross_entropy(out, y[b].to(self.device)).backward()
                    opt.step()
                tau = kendall_tau(sel.targets[val], self._run(model, ws, va))
                if tau > best[0]:
                    best = (tau, params, copy.deepcopy(model.state_dict()), epoch + 1)
            if log:
                log(f"    {self.name} lr={params['lr']}: best val tau so far {best[0]:.3f} "
                    f"({time.perf_counter() - t:.0f}s)")
        tau, params, state, epoch = best
        self.params = {"lr": params["lr"], "hchannels": list(params["hchannels"]), "epoch": epoch,
                       "val_tau": round(float(tau), 4)}
        self.model = nfn_predictor(spec, self.mode, params["hchannels"], standardise=standardise).to(self.device)
        self.model.load_state_dict(state)
        return Prediction(self.name, self.predict_features(ws), ws.ok.copy(), self.note())

    def note(self) -> str:
        return (f"chosen on val: lr={self.params['lr']}, epoch {self.params['epoch']} of {self.epochs} "
                f"(val tau {self.params['val_tau']:.3f})")

    def _run(self, model: nn.Module, ws: WeightSpace, rows: np.ndarray) -> np.ndarray:
        model.eval()
        with torch.no_grad():
            return torch.cat([model(wsfeat(ws.weights, ws.biases, rows[i:i + 256], self.device)).cpu()
                              for i in range(0, len(rows), 256)] or [torch.zeros(0)]).numpy().astype(np.float64)

    def predict_features(self, ws: WeightSpace) -> np.ndarray:
        out = np.full(len(ws.ok), np.nan)
        if ws.ok.any():
            out[ws.ok] = self._run(self.model, ws, ws.rows[ws.ok])
        return out

    def predict(self, con, model_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Predictions for ``model_ids`` (NaN where the parameter shape differs) and the applicable mask."""
        ws = self.features(con, model_ids)
        return self.predict_features(ws), ws.ok

    # --- save and load
    def save(self) -> tuple[dict, dict[str, np.ndarray]]:
        state = {"name": self.name, "seed": self.seed, "task": self.task, "target": self.target,
                 "classes": self.classes, "settings": self.settings, "params": self.params,
                 "standardised": self.mode == "NP"}
        return state, {k: v.detach().cpu().numpy().copy() for k, v in self.model.state_dict().items()}

    @classmethod
    def load(cls, state: dict, arrays: dict[str, np.ndarray]) -> "NFN":
        p = cls(int(state["seed"]))
        p.task, p.target, p.classes = state["task"], str(state["target"]), list(state.get("classes") or [])
        p.settings, p.params = dict(state["settings"]), dict(state["params"])
        layout = p.layout()
        standardise = None
        if p.mode == "NP":
            zeros = lambda shape: np.zeros(shape, np.float32)   # noqa: E731
            standardise = ([zeros((1, *x.shape)) for x in layout], [zeros((1, *x.shape)) for x in layout],
                           [zeros((1, x.shape[0])) for x in layout], [zeros((1, x.shape[0])) for x in layout])
        p.model = nfn_predictor(network_spec(layout), p.mode, p.params["hchannels"], standardise=standardise)
        p.model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in arrays.items()})
        p.model.eval()
        return p


class NFNNP(NFN):
    name = "nfn_np"
    mode = "NP"


class NFNHNP(NFN):
    name = "nfn_hnp"
    mode = "HNP"
