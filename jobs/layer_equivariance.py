"""``jobs layer-equivariance``: which layers of which MLPs are equivariant to an input transform,
and to what (Identifiable Equivariant Networks are Layerwise Equivariant, ICML 2026).

For a model f with layer outputs f_1 ... f_L (each hidden layer after its activation, and the
output) and an input transform g (``pipeline.zoo.transforms``: mirror-lr, mirror-ud,
perm-input[:SEED]):

1. Noise inputs y: ``samples`` vectors of i.i.d. N(0, noise_std^2) entries, standard normal by
   default (``pipeline.zoo.transforms.noise``: a law invariant under every input permutation, so
   g y is distributed like y, and large enough for the activations to be non-linear).
2. For each layer i, the linear map A_i with ``A_i f_i(y) ~ f_i(g y)`` by least squares
   (``torch.linalg.lstsq`` in float64; the network also runs in float64), fitted on the first half
   of the samples.
3. ``error``: the median over the *other* half (held out) of ``|f_i(g y) - A_i f_i(y)| / |f_i(y)|``.
   ``identity_error`` is the same with A = I (how much g moves the layer at all).
4. The distance of A_i to the nearest signed permutation and to the nearest permutation:
   ``min_P ||A - P||_F / sqrt(n)`` over n x n (signed) permutation matrices P, unscaled, so 0 means
   A is exactly one and a zero map is at distance 1. The minimiser is exact: for signed
   permutations ``||A - P||^2 = ||A||^2 + n - 2 sum_i |A_{i,pi(i)}|`` with the signs of A, so it is
   the assignment maximising ``sum |A_{i,pi(i)}|`` (Hungarian on |A|,
   ``scipy.optimize.linear_sum_assignment``); for permutations, the one maximising
   ``sum A_{i,pi(i)}`` (Hungarian on A).
5. ``match_corr``: least squares spreads A over neurons that are nearly collinear, so A can be far
   from a signed permutation while g still maps each neuron onto one other neuron up to sign; the
   median over neurons of |corr(f_pi(j)(g y), f_j(y))| under the best signed matching pi (Hungarian
   on |corr|, held-out half) says whether it does (1: every neuron has a signed image);
   ``match_negations`` counts the neurons it maps onto a negated neuron.

The nearest signed permutation of A_1 says what each first-layer neuron is mapped to: itself
(a mirror-symmetric filter), its negation (an antisymmetric filter: tanh is odd, so this is still
equivariant), or another neuron (its filter's mirror image), possibly negated.

Rows go to the catalog's ``layer_equivariance`` relation (one results folder per analysis,
committed atomically), joinable with ``models``; the graph store gets, per model, the newest
error of each layer as ``equivariance_<transform>_f<i>`` (``graphstore sync`` restores them).
"""
from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import torch
from scipy.optimize import linear_sum_assignment
from torch import nn

from graphstore import duck
from graphstore.catalog import Catalog, now_utc
from graphstore.schema import LAYER_EQUIVARIANCE
from jobs.catalog_models import load_model
from jobs.data import select_models
from pipeline.spec import build_module
from pipeline.zoo.transforms import NOISE_STD, check_transform, noise, transform_index
from zoocore.errors import JobError

_MLP_LAYERS = {"linear", "activation", "dropout", "flatten"}


@dataclass
class LayerFit:
    """One layer's fitted map and how equivariant it is."""

    layer: int                       # 1-based: f_1 is the first hidden layer after its activation
    width: int
    activation: str | None           # the layer's activation (None for a linear output)
    error: float                     # median held-out |f(gy) - A f(y)| / |f(y)|
    identity_error: float            # the same with A = I
    signed_perm_distance: float
    perm_distance: float
    match_corr: float                # median |corr(f_pi(j)(gy), f_j(y))| over neurons, best signed matching
    match_negations: int             # neurons that matching maps onto a negated neuron
    matrix: np.ndarray               # A (width x width)
    signed_perm: np.ndarray          # column of the nearest signed permutation in each row
    signs: np.ndarray                # its signs (+1 / -1)


def mlp_stages(spec: dict, model_id: str = "?") -> list[tuple[int, str | None]]:
    """For an MLP spec: per layer output f_i, (index of the last module computing it, activation).
    Anything but linear layers and activations (and dropout / flatten) is refused."""
    layers = spec.get("layers", [])
    other = sorted({layer.get("type") for layer in layers} - _MLP_LAYERS)
    if other or len(spec.get("input_shape", [])) != 1:
        what = f"has {', '.join(map(str, other))} layers" if other else \
            f"takes inputs of shape {spec.get('input_shape')}"
        raise JobError(f"model {model_id} {what}: layer-equivariance analyses MLPs only (linear layers and "
                       "activations on a flat input)")
    stages: list[tuple[int, str | None]] = []
    for i, layer in enumerate(layers):
        if layer["type"] == "linear":
            stages.append((i, None))
        elif layer["type"] == "activation" and stages and stages[-1][1] is None:
            stages[-1] = (i, layer["fn"])
    if not stages:
        raise JobError(f"model {model_id} has no linear layer")
    return stages


def layer_outputs(net: nn.Module, spec: dict, y: torch.Tensor, model_id: str = "?") -> list[torch.Tensor]:
    """f_1(y) ... f_L(y): each linear layer's output after its activation (if any)."""
    stages = {end: k for k, (end, _) in enumerate(mlp_stages(spec, model_id))}
    outs: list[torch.Tensor] = [None] * len(stages)   # type: ignore[list-item]
    x = y
    for i, mod in enumerate(net.layers):
        x = mod(x)
        if i in stages:
            outs[stages[i]] = x
    return outs


def nearest_signed_permutation(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """(columns, signs, distance): the signed permutation P nearest to ``a`` in Frobenius norm
    (P[i, columns[i]] = signs[i]) and ``||a - P||_F / sqrt(n)``."""
    rows, cols = linear_sum_assignment(-np.abs(a))
    perm = cols[np.argsort(rows)]
    picked = a[np.arange(len(a)), perm]
    signs = np.where(picked < 0, -1, 1).astype(np.int8)
    p = np.zeros_like(a)
    p[np.arange(len(a)), perm] = signs
    return perm, signs, float(np.linalg.norm(a - p) / np.sqrt(len(a)))


def nearest_permutation_distance(a: np.ndarray) -> float:
    """``min_P ||a - P||_F / sqrt(n)`` over permutation matrices (Hungarian on a)."""
    rows, cols = linear_sum_assignment(-a)
    p = np.zeros_like(a)
    p[rows, cols] = 1.0
    return float(np.linalg.norm(a - p) / np.sqrt(len(a)))


def fit_layers(net: nn.Module, spec: dict, transform: str, samples: int = 100_000, seed: int = 0,
               model_id: str = "?", noise_std: float = NOISE_STD, batch: int = 50_000) -> list[LayerFit]:
    """Fit A_i for every layer of an MLP (see the module docstring); deterministic in ``seed``."""
    if not noise_std > 0:
        raise JobError("--noise-std must be positive")
    if samples < 4:
        raise JobError("--samples must be at least 4 (half fit, half held out)")
    stages = mlp_stages(spec, model_id)
    size = int(spec["input_shape"][0])
    index = torch.from_numpy(transform_index(transform, size))
    net = copy.deepcopy(net).double().eval()
    y = noise(samples, size, torch.Generator().manual_seed(seed), noise_std, torch.float64)
    with torch.no_grad():
        chunks = [(layer_outputs(net, spec, y[i:i + batch], model_id),
                   layer_outputs(net, spec, y[i:i + batch][:, index], model_id))
                  for i in range(0, samples, batch)]
    half = samples // 2
    fits = []
    for k, (_, act) in enumerate(stages):
        f = torch.cat([c[0][k] for c in chunks])
        fg = torch.cat([c[1][k] for c in chunks])
        sol = torch.linalg.lstsq(f[:half], fg[:half], driver="gelsd").solution      # f A^T ~ f(g y)
        a = sol.T.contiguous()
        ft, fgt = f[half:], fg[half:]
        norm = ft.norm(dim=1).clamp_min(1e-12)
        err = float(((fgt - ft @ sol).norm(dim=1) / norm).median())
        ident = float(((fgt - ft).norm(dim=1) / norm).median())
        an = a.numpy()
        perm, signs, sdist = nearest_signed_permutation(an)
        fits.append(LayerFit(k + 1, an.shape[0], act, err, ident, sdist, nearest_permutation_distance(an),
                             *matched_correlation(ft.numpy(), fgt.numpy()), an, perm, signs))
    return fits


def matched_correlation(f: np.ndarray, fg: np.ndarray) -> tuple[float, int]:
    """(median over neurons j of |corr(f_pi(j)(g y), f_j(y))|, number of negative matches) for the
    signed matching pi that maximises the summed |corr| (Hungarian): near 1 when g moves every
    neuron onto one neuron, up to sign, whatever least squares does with neurons that are nearly
    collinear; negative matches are neurons mapped onto a negated neuron (tanh can, GELU cannot).
    Constant neurons count as 0."""
    def z(x):
        sd = x.std(0)
        return np.where(sd > 1e-12, (x - x.mean(0)) / np.where(sd > 1e-12, sd, 1.0), 0.0)

    c = z(fg).T @ z(f) / len(f)
    rows, cols = linear_sum_assignment(-np.abs(c))
    return float(np.median(np.abs(c[rows, cols]))), int((c[rows, cols] < 0).sum())


def neuron_roles(fit: LayerFit) -> list[str]:
    """What A maps each neuron to: itself, negation (itself with sign -1), mirror (another
    neuron), negated mirror (another neuron, sign -1)."""
    own = fit.signed_perm == np.arange(fit.width)
    neg = fit.signs < 0
    return [("negation" if n else "itself") if o else ("negated mirror" if n else "mirror")
            for o, n in zip(own, neg)]


# ------------------------------------------------------------------ the job over the catalog

@dataclass
class EquivarianceReport:
    analysis_id: str
    transforms: list[str]
    samples: int
    rows: list[dict[str, Any]]                     # one per model, transform and layer
    store_warning: str | None = None

    TABLE = ("checkpoint", "activation", "task", "trained", "transform", "layer", "error", "identity_error",
             "signed_perm_dist", "perm_dist", "match_corr", "match_neg")

    def table(self) -> tuple[list[str], list[list]]:
        rows = [[r["checkpoint"], r["model_activation"], r["task"], r["trained"], r["transform"], r["layer"],
                 r["error"], r["identity_error"], r["signed_perm_distance"], r["perm_distance"], r["match_corr"],
                 r["match_negations"]]
                for r in self.rows]
        return list(self.TABLE), rows

    def summary_table(self) -> tuple[list[str], list[list]]:
        """Median of errors (and of the distances of A to signed permutations) per activation,
        task, trained transform, analysed transform and layer."""
        groups: dict[tuple, list[dict]] = {}
        for r in self.rows:
            key = (r["model_activation"], r["task"], r["trained"], r["transform"], r["layer"])
            groups.setdefault(key, []).append(r)
        cols = ["activation", "task", "trained", "analysed", "layer", "models", "median_error",
                "median_identity_error", "median_signed_perm_dist", "median_perm_dist", "median_match_corr",
                "median_match_neg"]
        out = []
        for key in sorted(groups, key=lambda k: tuple(str(v) for v in k)):
            g = groups[key]
            out.append([*key, len(g), _median(g, "error"), _median(g, "identity_error"),
                        _median(g, "signed_perm_distance"), _median(g, "perm_distance"),
                        _median(g, "match_corr"), _median(g, "match_negations")])
        return cols, out


def _median(rows: Sequence[dict], key: str) -> float:
    return float(np.median([r[key] for r in rows]))


def _model_info(con, model_ids: Sequence[str]) -> dict[str, dict]:
    cols = {r[0] for r in con.execute("DESCRIBE models").fetchall()}
    pick = [c for c in ("activation", "task", "equivariance") if c in cols]
    sel = ", ".join(["model_id", "checkpoint"] + [f'"{c}"' for c in pick])
    con.register("_leq_ids", pa.table({"model_id": list(model_ids)}))
    rows = con.execute(f"SELECT {sel} FROM models JOIN _leq_ids USING (model_id)").fetchall()
    con.unregister("_leq_ids")
    return {r[0]: dict(zip(["model_id", "checkpoint"] + pick, r)) for r in rows}


def analyse_catalog(catalog: Catalog | str, where: str | None, transforms: Sequence[str], samples: int = 100_000,
                    seed: int = 0, store=None, progress: bool = False,
                    noise_std: float = NOISE_STD) -> EquivarianceReport:
    """Fit every layer of every selected MLP for each transform, write the ``layer_equivariance``
    rows (one atomic results commit) and, with ``store``, the newest errors as model properties."""
    catalog = (catalog if isinstance(catalog, Catalog) else Catalog(catalog)).require()
    transforms = [check_transform(t) for t in transforms]
    if not transforms:
        raise JobError("give at least one --transform")
    con = duck.connect(catalog)
    try:
        sel = select_models(con, None, where, catalog=catalog)
        info = _model_info(con, sel.model_ids)
        models = []
        for mid in sel.model_ids:
            m = load_model(con, mid)
            if m.spec is None:
                raise JobError(f"model {mid} was ingested without a JSON spec; its layers cannot be rebuilt")
            mlp_stages(m.spec, mid)                     # refuse non-MLPs before any work
            models.append(m)
    finally:
        con.close()
    analysis_id = f"leq-{now_utc():%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"
    rows: list[dict[str, Any]] = []
    from tqdm import tqdm

    for m in tqdm(models, desc="layer equivariance", unit="model", disable=not progress):
        net = build_module(m.spec)
        net.load_state_dict(m.state_dict())
        meta = info.get(m.model_id, {})
        for t in transforms:
            for fit in fit_layers(net, m.spec, t, samples, seed, m.model_id, noise_std):
                rows.append({"model_id": m.model_id, "checkpoint": meta.get("checkpoint", m.checkpoint),
                             "model_activation": meta.get("activation"), "task": meta.get("task"),
                             "trained": meta.get("equivariance"), "transform": t, "fit": fit,
                             **{k: getattr(fit, k) for k in ("layer", "width", "activation", "error",
                                                             "identity_error", "signed_perm_distance",
                                                             "perm_distance", "match_corr",
                                                             "match_negations")}})
    report = EquivarianceReport(analysis_id, list(transforms), samples, rows)
    table = results_table(analysis_id, samples, seed, noise_std, rows)
    catalog.commit_results(analysis_id, {"layer_equivariance": table})
    if store is not None:
        try:
            for t in transforms:
                store.write_layer_equivariance(t, [(r["model_id"], r["layer"], r["error"]) for r in rows
                                                   if r["transform"] == t], analysis_id)
        except Exception as exc:
            report.store_warning = str(exc).splitlines()[0]
    return report


def results_table(analysis_id: str, samples: int, seed: int, noise_std: float, rows: Sequence[dict]) -> pa.Table:
    """The ``layer_equivariance`` rows of one analysis (schema graphstore.schema.LAYER_EQUIVARIANCE)."""
    created = now_utc()

    def matrix(a: np.ndarray) -> list[float]:
        return a.astype(np.float32).reshape(-1).tolist()

    cols = {
        "analysis_id": [analysis_id] * len(rows), "model_id": [r["model_id"] for r in rows],
        "transform": [r["transform"] for r in rows], "layer": [r["layer"] for r in rows],
        "width": [r["width"] for r in rows], "activation": [r["activation"] for r in rows],
        "samples": [samples] * len(rows), "seed": [seed] * len(rows),
        "noise_std": [float(noise_std)] * len(rows),
        "error": [r["error"] for r in rows], "identity_error": [r["identity_error"] for r in rows],
        "signed_perm_distance": [r["signed_perm_distance"] for r in rows],
        "perm_distance": [r["perm_distance"] for r in rows], "match_corr": [r["match_corr"] for r in rows],
        "match_negations": [r["match_negations"] for r in rows],
        "matrix": [matrix(r["fit"].matrix) for r in rows],
        "signed_perm": [r["fit"].signed_perm.astype(np.int32).tolist() for r in rows],
        "signs": [r["fit"].signs.astype(np.int8).tolist() for r in rows],
        "created_at": [created] * len(rows)}
    return pa.table(cols, schema=LAYER_EQUIVARIANCE)


def small_equivariance_catalog(workdir, n: int = 8, transforms: Sequence[str] = ("mirror-lr", "mirror-ud"),
                               samples: int = 10_000, seed: int = 0, workers: int = 2) -> Path:
    """A small mlp-equivariant zoo made on the spot, ingested (with the embedded graph store) and
    analysed for ``transforms`` (the notebook's data); reused when ``workdir`` already holds it."""
    from jobs.demo import made_catalog

    def analyse(catalog, store) -> str:
        return analyse_catalog(catalog, None, transforms, samples, seed, store=store).analysis_id

    return made_catalog(workdir, "mlp-equivariant", n, "layer-equivariance.txt", seed=seed, workers=workers,
                        then=analyse)[0]
