"""``probegen``: learned probes drawn from a shared deep linear generator, the answers into an MLP
(ProbeGen, Kahana, Horwitz, Shuval, Hoshen, ICLR 2025).

- **Probes.** ``PROBES`` learned latent codes, one set per input signature of the zoo, go through
  a generator of three linear layers *without* activations (the paper's finding: a deep linear
  generator regularises the probes better than free inputs or a non-linear one) to inputs of
  the signature's shape. Every model of one signature sees the same probes.
- **Models run as programs.** Each model runs only through its own checked program
  (jobs.analysis.probing.Prober.network: the architecture's export from the catalog, on the
  state dict the exact inverse rebuilds), and the gradient flows through it into the probes.
  Token inputs are not differentiable: their models are not read (NaN), and the note says so.
- **Head.** The answers, probe by probe (``sign(x) log(1 + |x|)``; outputs padded with zeros or
  cut to the training models' most common count), into an MLP to the standardised target. Adam,
  the epoch chosen by validation Kendall tau, as NFN's (jobs.predictors.nfn).
- **Saving.** A JSON state (signatures, widths, the chosen epoch) and the generator, codes and
  head as safetensors; nothing is pickled.

A registry predictor usable alone (``jobs train-heterognn --model probegen``, ``--device cuda``
unchanged); it trains for a minute or more, so it is not a default baseline of every run.
"""
from __future__ import annotations

import copy
import math
from typing import Sequence

import numpy as np
import torch
from torch import nn

from jobs.analysis.probing import Prober
from jobs.predictors.tabular import MIN_TRAIN, Prediction
from jobs.training.compare import kendall_tau
from jobs.training.data import Selection
from jobs.training.tasks import task_named
from pipeline.graph_codec import read_graphs
from zoocore.errors import JobError

PROBES = 32
LATENT = 32
WIDTH = 128


KEPT_BYTES = 2 << 30        # weights of the networks kept in memory between steps (the rest are read again)


class Rebuilt:
    """A network read from the catalog again on every call (past ``KEPT_BYTES``)."""

    def __init__(self, prober: Prober, model_id: str, device: str):
        self.prober, self.model_id, self.device = prober, model_id, device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        graph, = read_graphs(self.prober.con.cursor(), [self.model_id])
        net, _ = self.prober.network(self.model_id, graph)
        return net.to(self.device)(x)

    def requires_grad_(self, flag: bool) -> "Rebuilt":
        return self


def _signature(spec) -> str:
    return "x".join(map(str, spec.shape)) + f":{str(spec.dtype).removeprefix('torch.')}"


class DeepLinear(nn.Module):
    """Latent codes (``PROBES`` x ``LATENT``) through three linear layers, no activation, to probes
    of ``shape``."""

    def __init__(self, shape: Sequence[int], probes: int = PROBES, latent: int = LATENT, width: int = WIDTH):
        super().__init__()
        self.shape = tuple(int(s) for s in shape)
        self.codes = nn.Parameter(torch.randn(probes, latent))
        self.net = nn.Sequential(nn.Linear(latent, width), nn.Linear(width, width),
                                 nn.Linear(width, math.prod(self.shape)))

    def forward(self) -> torch.Tensor:
        return self.net(self.codes).view(len(self.codes), *self.shape)


class ProbeGenModel(nn.Module):
    def __init__(self, shapes: dict[str, Sequence[int]], width: int, probes: int = PROBES):
        super().__init__()
        self.width, self.probes = width, probes
        self.generators = nn.ModuleDict({k.replace(".", "_"): DeepLinear(s, probes) for k, s in shapes.items()})
        self.head = nn.Sequential(nn.Linear(probes * width, WIDTH), nn.SiLU(), nn.Linear(WIDTH, WIDTH), nn.SiLU(),
                                  nn.Linear(WIDTH, 1))

    def answers(self, net: nn.Module, signature: str) -> torch.Tensor:
        """(PROBES * width,) squashed answers of ``net`` on its signature's generated probes."""
        out = net(self.generators[signature.replace(".", "_")]()).reshape(self.probes, -1)
        k = min(out.shape[1], self.width)
        padded = out.new_zeros(self.probes, self.width)
        padded[:, :k] = out[:, :k]
        return (torch.sign(padded) * torch.log1p(padded.abs())).reshape(-1)

    def forward(self, nets: Sequence[nn.Module], signatures: Sequence[str]) -> torch.Tensor:
        return self.head(torch.stack([self.answers(n, s) for n, s in zip(nets, signatures)])).squeeze(-1)


class ProbeGen:
    """See the module docstring: ``fit`` on a split, ``predict`` any catalog models, ``save`` /
    ``load`` without pickle."""
    name = "probegen"
    epochs = 30
    batch_size = 32
    lr = 1e-3

    def __init__(self, seed: int = 0, device: str = "cpu"):
        self.seed, self.device = seed, device
        self.task, self.target, self.classes = "regression", "", []
        self.settings: dict = {}          # signatures (name -> shape), width, target mean and scale
        self.params: dict = {}
        self.model: ProbeGenModel | None = None
        self.skipped: list[str] = []

    # --- inputs
    def networks(self, con, model_ids: Sequence[str]) -> tuple[list, list[str | None], dict[str, list[int]]]:
        """Each model's network (None where it cannot run or takes tokens), its input signature, and
        the shape of each signature. Networks are kept in memory up to ``KEPT_BYTES`` of weights; past
        that, an entry is a ``Rebuilt`` that reads the model's graph again whenever it runs."""
        prober = Prober(con, PROBES)
        nets, sigs, reasons, shapes, kept = [], [], {}, {}, 0
        ids = list(model_ids)
        prober._locate(ids)
        for start in range(0, len(ids), 256):
            chunk = ids[start:start + 256]
            for mid, graph in zip(chunk, read_graphs(con, chunk)):
                try:
                    net, spec = prober.network(mid, graph)
                    if not spec.dtype.is_floating_point:
                        raise JobError("token inputs: learned probes need inputs a gradient can move")
                    size = sum(b.numel() * b.element_size() for b in net.buffers())
                    kept += size
                    nets.append(net.to(self.device) if kept <= KEPT_BYTES else Rebuilt(prober, mid, self.device))
                    sigs.append(_signature(spec))
                    shapes[_signature(spec)] = list(spec.shape)
                except JobError as exc:
                    nets.append(None)
                    sigs.append(None)
                    reasons.setdefault(str(exc).split(": ", 1)[-1], mid)
        self.skipped = list(reasons)
        return nets, sigs, shapes

    def settle(self, con, sel: Selection) -> dict:
        outs, _ = Prober(con, 4).outputs(sel.ids("train"))
        widths = [o.shape[1] for o in outs if o is not None]
        y = sel.targets[sel.mask("train")].astype(float)
        return {"width": int(np.bincount(widths).argmax()) if widths else 1,
                "mean": float(np.nanmean(y)) if len(y) else 0.0, "scale": float(np.nanstd(y) or 1.0) if len(y) else 1.0}

    # --- fit and predict
    def fit(self, con, sel: Selection, features=None, settings: dict | None = None, log=None) -> Prediction:
        if not task_named(sel.task).numeric:          # beside a classification run: it abstains, and says why
            return Prediction(self.name, np.full(len(sel.model_ids), np.nan), np.zeros(len(sel.model_ids), bool),
                              f"predicts a number, not a {sel.task} target")
        self.task, self.target, self.classes = sel.task, sel.target, list(sel.classes)
        self.settings = dict(settings) if settings is not None else self.settle(con, sel)
        nets, sigs, shapes = self.networks(con, sel.model_ids)
        ok = np.array([n is not None for n in nets])
        train = np.flatnonzero(sel.mask("train") & ok)
        val = np.flatnonzero(sel.mask("val") & ok)
        if len(train) < MIN_TRAIN or not len(val):
            return Prediction(self.name, np.full(len(ok), np.nan), np.zeros(len(ok), bool),
                              f"only {len(train)} training and {len(val)} validation models it can run")
        self.settings["signatures"] = shapes
        torch.manual_seed(self.seed)
        model = ProbeGenModel(shapes, self.settings["width"]).to(self.device)
        opt = torch.optim.Adam(model.parameters(), lr=self.lr)
        y = torch.as_tensor((sel.targets - self.settings["mean"]) / self.settings["scale"], dtype=torch.float32)
        rng = np.random.default_rng(self.seed)
        for n in nets:
            if n is not None:
                n.requires_grad_(False)
        best = (-np.inf, None, 0)
        for epoch in range(self.epochs):
            model.train()
            for b in np.array_split(rng.permutation(train), max(1, len(train) // self.batch_size)):
                opt.zero_grad()
                out = model([nets[i] for i in b], [sigs[i] for i in b])
                nn.functional.mse_loss(out, y[b].to(self.device)).backward()
                opt.step()
            tau = kendall_tau(sel.targets[val], self._run(model, [nets[i] for i in val], [sigs[i] for i in val]))
            if tau > best[0]:
                best = (tau, copy.deepcopy(model.state_dict()), epoch + 1)
            if log:
                log(f"    {self.name} epoch {epoch + 1}: val tau {tau:.3f}")
        self.params = {"epoch": best[2], "epochs": self.epochs, "val_tau": round(float(best[0]), 4)}
        model.load_state_dict(best[1])
        self.model = model.eval()
        out = np.full(len(ok), np.nan)
        idx = np.flatnonzero(ok)
        out[idx] = self._run(self.model, [nets[i] for i in idx], [sigs[i] for i in idx])
        return Prediction(self.name, out, ok, self.note())

    def note(self) -> str:
        text = (f"{PROBES} learned probes per input signature ({len(self.settings.get('signatures', {}))}); "
                f"chosen on val: epoch {self.params.get('epoch')} of {self.epochs}")
        return text + (f"; not read: {'; '.join(self.skipped)}" if self.skipped else "")

    def _run(self, model: ProbeGenModel, nets, sigs) -> np.ndarray:
        model.eval()
        with torch.no_grad():
            parts = [model(nets[i:i + 256], sigs[i:i + 256]).cpu() for i in range(0, len(nets), 256)]
        z = torch.cat(parts).numpy().astype(np.float64) if parts else np.zeros(0)
        return z * self.settings["scale"] + self.settings["mean"]

    def features_of_graphs(self, con, model_ids: Sequence[str], graphs) -> tuple[list, list]:
        """The networks of in-memory graphs of ``model_ids`` (e.g. rescaled copies), for ``predict_features``."""
        prober = Prober(con, PROBES)
        nets, sigs = [], []
        for mid, graph in zip(model_ids, graphs):
            net, spec = prober.network(mid, graph)
            nets.append(net.to(self.device) if spec.dtype.is_floating_point else None)
            sigs.append(_signature(spec))
        return nets, sigs

    def predict_features(self, features: tuple[list, list]) -> np.ndarray:
        nets, sigs = features
        known = self.settings["signatures"]
        idx = [i for i, (n, s) in enumerate(zip(nets, sigs)) if n is not None and s in known]
        out = np.full(len(nets), np.nan)
        if idx:
            out[idx] = self._run(self.model, [nets[i] for i in idx], [sigs[i] for i in idx])
        return out

    def predict(self, con, model_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        nets, sigs, _ = self.networks(con, model_ids)
        known = self.settings["signatures"]
        ok = np.array([n is not None and s in known for n, s in zip(nets, sigs)])
        out = np.full(len(ok), np.nan)
        idx = np.flatnonzero(ok)
        if len(idx):
            out[idx] = self._run(self.model, [nets[i] for i in idx], [sigs[i] for i in idx])
        return out, ok

    # --- save and load
    def save(self) -> tuple[dict, dict[str, np.ndarray]]:
        state = {"name": self.name, "seed": self.seed, "task": self.task, "target": self.target,
                 "classes": self.classes, "settings": self.settings, "params": self.params}
        return state, {k: v.detach().cpu().numpy().copy() for k, v in self.model.state_dict().items()}

    @classmethod
    def load(cls, state: dict, arrays: dict[str, np.ndarray]) -> "ProbeGen":
        p = cls(int(state["seed"]))
        p.task, p.target, p.classes = state["task"], str(state["target"]), list(state.get("classes") or [])
        p.settings, p.params = dict(state["settings"]), dict(state["params"])
        p.model = ProbeGenModel(p.settings["signatures"], int(p.settings["width"]))
        p.model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in arrays.items()})
        p.model.eval()
        return p


__all__ = ["DeepLinear", "ProbeGen"]
