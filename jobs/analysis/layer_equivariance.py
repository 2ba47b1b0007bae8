"""``jobs layer-equivariance``: which layers of which MLPs are equivariant to an input transform,
and to what (Identifiable Equivariant Networks are Layerwise Equivariant, ICML 2026).

For a model f with layer outputs f_1 ... f_L (each hidden layer after its activation, and the
output) and an input transform g (``pipeline.zoo.transforms``: mirror-lr, mirror-ud,
perm-input[:SEED]):

1. Noise inputs y: ``samples`` vectors of i.i.d. N(0, noise_std^2) entries, standard normal by
   default (``pipeline.zoo.transforms.noise``: a law invariant under every input permutation, so
   g y is distributed like y, and large enough for the activations to be non-linear). The first
   half fits, the third quarter validates (picks the ridge), the last quarter tests. The network
   runs in float64.
2. For each layer i, the linear map A_i with ``A_i f_i(y) ~ f_i(g y)``: ridge regression
   ``min ||F A^T - F_g||^2 + ridge * m * ||A||^2`` (m the mean eigenvalue of F^T F, so ``ridge`` is
   scale-free), ridge from {0, 1e-6, ..., 1e-1} with the lowest validation error (reported; 0 is plain
   least squares). ``condition`` is the condition number of F on the fit half: layer outputs on
   noise are often nearly collinear (64 neurons on the 10-30 input directions that weight decay
   leaves in a first layer, near-linear tanh units, an autoencoder's output confined to the digits'
   subspace), and then many A fit almost equally well, so A's entries say little (plain least
   squares gave entries in the tens and, for output layers, ||A - P|| of 1e5; the ridge barely
   helps, since the spread is what fits best).
3. ``error``: the median over the test quarter of ``|f_i(g y) - A_i f_i(y)| / |f_i(y)|``;
   ``identity_error`` is the same with A = I (how much g moves the layer at all).
4. ``signed_perm_error`` / ``perm_error``: the same error with A restricted to the group the paper
   expects, a signed permutation (tanh's intertwiner group: tanh is odd) / a permutation (GELU's),
   the one with the least squared residual on the fit half (exact: Hungarian on |F_g^T F|, see
   ``best_group_map``). This is the measure of "A_i is close to a signed permutation" that does not
   depend on how well A's entries are identified: near ``error`` when the layer is equivariant with
   a signed permutation, near ``identity_error`` or above when it is not. ``signed_perm_neurons`` /
   ``perm_neurons``: the share of neurons i that this S maps onto their image, ``||f_i(g y) -
   s_i f_S(i)(y)|| / ||f_i(g y)|| <= 0.1`` over the test quarter (``NEURON_TOLERANCE``): the layer-wide
   error can be dominated by a few neurons that g mixes while most have an exact signed image.
5. On the fitted A: ``signed_perm_rel_dist`` = ``min_{c, P} ||A - c P||_F / ||A||_F`` over signed
   permutations P and scales c (0: A is a scaled signed permutation; 1: A has no mass on any
   permutation; about 0.95 for a 64 x 64 Gaussian matrix), ``perm_rel_dist`` the same over
   permutations, and ``signed_perm_share``, the median over rows of the share of the row's squared
   mass on the nearest P's entry (1: every row is one entry). Scale-free and bounded, unlike
   ``||A - P||_F``, but only meaningful where ``condition`` is moderate.
6. ``match_corr``: the median over neurons of |corr(f_pi(j)(g y), f_j(y))| under the best signed
   matching pi (Hungarian on |corr|, test quarter): whether g maps each neuron onto one neuron up to
   sign at the level of correlation; ``match_negations`` counts the neurons it maps onto a negated
   neuron. A correlation of 0.95 still leaves a relative residual of about sqrt(2 (1 - 0.95)) = 0.32.

How the paper quantifies "close to a signed permutation" we could not find (its text was not
available to us beyond the abstract), so the measures of steps 4 and 5 are ours. ``signed_perm`` /
``signs`` of a row are the signed permutation of step 4: what each neuron is mapped to, itself (a
mirror-symmetric filter), its negation (an antisymmetric filter: tanh is odd, so this is still
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
from jobs.analysis.catalog_models import load_model
from jobs.training.data import select_models
from pipeline.neural_graph.runnable import Network
from pipeline.zoo.transforms import NOISE_STD, check_transform, noise, transform_index
from zoocore.errors import JobError

# the LayerFit fields that become columns of the layer_equivariance relation (and of the report rows)
FIT_COLUMNS = ("layer", "width", "activation", "error", "identity_error", "signed_perm_error", "perm_error",
               "signed_perm_neurons", "perm_neurons", "signed_perm_rel_dist", "perm_rel_dist", "signed_perm_share",
               "ridge", "condition", "match_corr", "match_negations")


RIDGE_GRID = (0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
NEURON_TOLERANCE = 0.1      # a neuron "has a (signed) image" when ||f_i(gy) - s f_p(i)(y)|| / ||f_i(gy)|| is below


@dataclass
class LayerFit:
    """One layer's fitted map and how equivariant it is (see the module docstring)."""

    layer: int                       # 1-based: f_1 is the first hidden layer after its activation
    width: int
    activation: str | None           # the layer's activation (None for a linear output)
    error: float                     # median test |f(gy) - A f(y)| / |f(y)|, A the ridge fit
    identity_error: float            # the same with A = I
    signed_perm_error: float         # the same with A = the best signed permutation S
    perm_error: float                # the same with A = the best permutation
    signed_perm_neurons: float       # share of neurons S maps within NEURON_TOLERANCE of their image
    perm_neurons: float              # the same for the best permutation
    signed_perm_rel_dist: float      # min over c, P of ||A - c P||_F / ||A||_F, P signed permutations
    perm_rel_dist: float             # the same over permutations
    signed_perm_share: float         # median over rows of A_{i,p(i)}^2 / sum_j A_ij^2
    ridge: float                     # the chosen regulariser (relative to the mean eigenvalue of F^T F)
    condition: float                 # condition number of the fit half's f_i (how ill-posed plain LS is)
    match_corr: float                # median |corr(f_pi(j)(gy), f_j(y))| over neurons, best signed matching
    match_negations: int             # neurons that matching maps onto a negated neuron
    matrix: np.ndarray               # A (width x width)
    signed_perm: np.ndarray          # S: the neuron each neuron's image is (column of each row)
    signs: np.ndarray                # its signs (+1 / -1)


def as_network(net: nn.Module, input_shape: Sequence[int]) -> Network:
    """``net`` as a :class:`Network` (a catalog model's already is one; a module is exported once)."""
    if isinstance(net, Network):
        return net
    from pipeline.neural_graph.plan import export_module

    module = copy.deepcopy(net).float().eval()
    return Network(export_module(module, torch.zeros(2, *input_shape)), module.state_dict()).eval()


def _input_shape(spec_or_shape) -> list[int]:
    return [int(s) for s in (spec_or_shape["input_shape"] if isinstance(spec_or_shape, dict) else spec_or_shape)]


def check_input(input_shape: Sequence[int], transform: str, model_id: str = "?") -> None:
    """Refuse, in one line, a transform that has no meaning on this model's input."""
    base = transform.partition(":")[0]
    if len(input_shape) == 1:
        transform_index(transform, int(input_shape[0]))      # a flat input: a square image grid for mirrors
    elif base == "perm-input":
        raise JobError(f"model {model_id} takes inputs of shape {list(input_shape)}: {transform} has no "
                       "counterpart on its feature maps (use mirror-lr or mirror-ud)")
    elif len(input_shape) == 2 and base == "mirror-ud":
        raise JobError(f"model {model_id} takes 1-d inputs of shape {list(input_shape)}: mirror-ud needs a 2-d grid")


def _transform(y: torch.Tensor, transform: str, index: torch.Tensor | None) -> torch.Tensor:
    """g y: a flat input permuted by ``index``; a map (C, H, W) or (C, L) mirrored."""
    if index is not None:
        return y[:, index]
    return y.flip(-1) if transform.partition(":")[0] == "mirror-lr" else y.flip(-2)


def _rows(f: torch.Tensor, fg: torch.Tensor, transform: str, pos: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """One (f(y), f(g y)) row pair per sample: a vector layer as it is; a feature-map layer at one
    position p per sample, f(g y)[p] against f(y)[g p] (the per-layer map acts on channels)."""
    if f.dim() == 2:
        return f.numpy(), fg.numpy()
    moved = _transform(f, transform, None)                     # moved[p] = f(y)[g p]
    flat, flat_g = moved.flatten(2), fg.flatten(2)
    idx = (pos % flat.shape[2]).view(-1, 1, 1).expand(-1, flat.shape[1], 1)
    return flat.gather(2, idx)[..., 0].numpy(), flat_g.gather(2, idx)[..., 0].numpy()


def layer_outputs(net: Network, y: torch.Tensor) -> dict[int, torch.Tensor]:
    """f_1(y) ... f_L(y): each neuron layer after its activation (the input, layer 0, left out)."""
    return {k: v for k, v in net.taps(y).items() if k > 0}


def nearest_signed_permutation(a: np.ndarray, signed: bool = True) -> tuple[np.ndarray, np.ndarray, float]:
    """(columns, signs, relative distance) of the (signed) permutation P nearest to ``a`` up to a
    scale: P[i, columns[i]] = signs[i], and ``min_c ||a - c P||_F / ||a||_F`` (1 for a zero ``a``).

    For a fixed P the best scale is c = <a, P> / n, leaving ``||a||^2 - <a, P>^2 / n``; so the best P
    maximises <a, P>: the assignment maximising ``sum |a_{i,pi(i)}|`` with the signs of a for signed
    permutations, ``sum a_{i,pi(i)}`` for permutations (Hungarian, exact). The distance is in [0, 1]:
    0 when a is c times a (signed) permutation, whatever c; about 0.95 for a 64 x 64 Gaussian matrix."""
    rows, cols = linear_sum_assignment(-np.abs(a) if signed else -a)
    perm = cols[np.argsort(rows)]
    picked = a[np.arange(len(a)), perm]
    signs = np.where(picked < 0, -1, 1).astype(np.int8) if signed else np.ones(len(a), np.int8)
    total = float((a ** 2).sum())
    if total == 0:
        return perm, signs, 1.0
    inner = float((picked * signs).sum())
    return perm, signs, float(np.sqrt(max(0.0, 1.0 - inner ** 2 / (len(a) * total))))


def nearest_permutation_distance(a: np.ndarray) -> float:
    """``min_{c, P} ||a - c P||_F / ||a||_F`` over permutation matrices P (see nearest_signed_permutation)."""
    return nearest_signed_permutation(a, signed=False)[2]


def matched_row_share(a: np.ndarray, columns: np.ndarray) -> float:
    """Median over rows i of ``a[i, columns[i]]^2 / sum_j a[i, j]^2``: the share of each row's mass on
    its matched entry (1: every row is one scaled entry; a zero row counts 0)."""
    mass = (a ** 2).sum(1)
    picked = a[np.arange(len(a)), columns] ** 2
    return float(np.median(np.where(mass > 0, picked / np.where(mass > 0, mass, 1.0), 0.0)))


def best_group_map(f: np.ndarray, fg: np.ndarray, signed: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(columns, signs): the (signed) permutation S minimising ``sum ||fg - f S^T||^2`` over the
    samples, exactly: ``||fg_i - s f_j||^2 = ||fg_i||^2 + ||f_j||^2 - 2 s <fg_i, f_j>`` and the
    ``||f_j||^2`` add up to the same total for every permutation, so S is the assignment maximising
    ``sum |<fg_i, f_pi(i)>|`` (signs of the inner products) or, unsigned, ``sum <fg_i, f_pi(i)>``."""
    cross = fg.T @ f
    rows, cols = linear_sum_assignment(-np.abs(cross) if signed else -cross)
    perm = cols[np.argsort(rows)]
    picked = cross[np.arange(len(cross)), perm]
    signs = np.where(picked < 0, -1, 1).astype(np.int8) if signed else np.ones(len(cross), np.int8)
    return perm, signs


def ridge_fit(f: np.ndarray, fg: np.ndarray, fv: np.ndarray, fgv: np.ndarray,
              grid: Sequence[float] = RIDGE_GRID) -> tuple[np.ndarray, float]:
    """(A, ridge): ``A = argmin ||f A^T - fg||^2 + ridge * m * ||A||^2`` with m the mean eigenvalue of
    f^T f (so ridge is scale-free), ridge picked from ``grid`` by the lowest median relative error on
    the validation pair (fv, fgv). Ridge 0 is plain least squares (solved by SVD, minimum norm)."""
    gram, rhs = f.T @ f, f.T @ fg
    scale = float(np.trace(gram)) / len(gram) or 1.0
    best = None
    vnorm = np.maximum(np.linalg.norm(fv, axis=1), 1e-12)
    for lam in grid:
        if lam == 0:
            sol = np.linalg.lstsq(f, fg, rcond=None)[0]
        else:
            sol = np.linalg.solve(gram + lam * scale * np.eye(len(gram)), rhs)
        err = float(np.median(np.linalg.norm(fgv - fv @ sol, axis=1) / vnorm))
        if best is None or err < best[0]:
            best = (err, sol.T.copy(), float(lam))
    return best[1], best[2]


def _median_rel_error(f: np.ndarray, fg: np.ndarray, a: np.ndarray) -> float:
    norm = np.maximum(np.linalg.norm(f, axis=1), 1e-12)
    return float(np.median(np.linalg.norm(fg - f @ a.T, axis=1) / norm))


def neuron_share(f: np.ndarray, fg: np.ndarray, columns: np.ndarray, signs: np.ndarray,
                 tolerance: float = NEURON_TOLERANCE) -> float:
    """Share of neurons i whose image is ``signs[i] * f[:, columns[i]]`` up to a relative residual
    ``||fg_i - s_i f_p(i)||_2 / ||fg_i||_2`` (over the samples) below ``tolerance``; a constant-zero
    neuron counts as mapped."""
    res = np.linalg.norm(fg - f[:, columns] * signs, axis=0)
    norm = np.linalg.norm(fg, axis=0)
    return float(np.mean(res <= tolerance * norm))


def _signed_perm_matrix(columns: np.ndarray, signs: np.ndarray) -> np.ndarray:
    p = np.zeros((len(columns), len(columns)))
    p[np.arange(len(columns)), columns] = signs
    return p


def fit_layers(net: nn.Module, spec_or_shape: dict | Sequence[int], transform: str, samples: int = 100_000,
               seed: int = 0, model_id: str = "?", noise_std: float = NOISE_STD, batch: int = 50_000,
               activations: Sequence[str] | None = None) -> list[LayerFit]:
    """Fit A_i for every neuron layer of a network (see the module docstring); deterministic in
    ``seed``. ``net``: a catalog model's :class:`Network`, or a module (exported here) whose input
    shape is ``spec_or_shape`` (a spec or the shape). Convolutional layers are read at one random
    position per noise sample, so their A acts on channels. ``activations``: per neuron layer (the
    plan's), else read from the graph's taps."""
    if not noise_std > 0:
        raise JobError("--noise-std must be positive")
    if samples < 8:
        raise JobError("--samples must be at least 8 (half fit, a quarter validates, a quarter tests)")
    shape = _input_shape(spec_or_shape)
    check_input(shape, transform, model_id)
    index = torch.from_numpy(transform_index(transform, shape[0])) if len(shape) == 1 else None
    net = as_network(net, shape).double()
    activations = net.activations() if activations is None else activations
    rng = torch.Generator().manual_seed(seed)
    y = noise(samples, int(np.prod(shape)), rng, noise_std, torch.float64).view(samples, *shape)
    pos = torch.randint(0, 2**31 - 1, (samples,), generator=rng)
    with torch.no_grad():
        per_sample = sum(v[0].numel() for v in net.taps(y[:1]).values())
        step = max(1, min(batch, 2**24 // max(1, per_sample)))
        pairs: dict[int, list] = {}
        for i in range(0, samples, step):
            out, out_g = layer_outputs(net, y[i:i + step]), layer_outputs(net, _transform(y[i:i + step], transform, index))
            for k in out:
                pairs.setdefault(k, []).append(_rows(out[k], out_g[k], transform, pos[i:i + step]))
    half, test = samples // 2, samples // 2 + samples // 4
    fits = []
    for k in sorted(pairs):
        act = activations[k]
        f = np.concatenate([p[0] for p in pairs[k]])
        fg = np.concatenate([p[1] for p in pairs[k]])
        fit, fit_g = f[:half], fg[:half]
        a, lam = ridge_fit(fit, fit_g, f[half:test], fg[half:test])
        ft, fgt = f[test:], fg[test:]
        sv = np.linalg.svd(fit, compute_uv=False)
        cond = float(sv[0] / sv[-1]) if sv[-1] > 0 else float("inf")
        s_cols, s_signs = best_group_map(fit, fit_g)
        p_cols, p_signs = best_group_map(fit, fit_g, signed=False)
        near_cols, _, s_dist = nearest_signed_permutation(a)
        fits.append(LayerFit(
            k, a.shape[0], None if act in (None, "identity") else act,
            _median_rel_error(ft, fgt, a), _median_rel_error(ft, fgt, np.eye(len(a))),
            _median_rel_error(ft, fgt, _signed_perm_matrix(s_cols, s_signs)),
            _median_rel_error(ft, fgt, _signed_perm_matrix(p_cols, p_signs)),
            neuron_share(ft, fgt, s_cols, s_signs), neuron_share(ft, fgt, p_cols, p_signs),
            s_dist, nearest_permutation_distance(a), matched_row_share(a, near_cols), lam, cond,
            *matched_correlation(ft, fgt), a, s_cols, s_signs))
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
             "sperm_error", "perm_error", "sperm_neurons", "perm_neurons", "sperm_dist", "sperm_share", "ridge",
             "match_corr", "match_neg")

    def table(self) -> tuple[list[str], list[list]]:
        rows = [[r["checkpoint"], r["model_activation"], r["task"], r["trained"], r["transform"], r["layer"],
                 r["error"], r["identity_error"], r["signed_perm_error"], r["perm_error"], r["signed_perm_neurons"],
                 r["perm_neurons"], r["signed_perm_rel_dist"],
                 r["signed_perm_share"], r["ridge"], r["match_corr"], r["match_negations"]]
                for r in self.rows]
        return list(self.TABLE), rows

    SUMMARY = ("error", "identity_error", "signed_perm_error", "perm_error", "signed_perm_neurons", "perm_neurons",
               "signed_perm_rel_dist", "signed_perm_share", "match_corr", "match_negations")

    def summary_table(self) -> tuple[list[str], list[list]]:
        """Medians over models per activation, task, trained transform, analysed transform and layer
        (columns abbreviated: sperm = signed permutation)."""
        groups: dict[tuple, list[dict]] = {}
        for r in self.rows:
            key = (r["model_activation"], r["task"], r["trained"], r["transform"], r["layer"])
            groups.setdefault(key, []).append(r)
        cols = ["activation", "task", "trained", "analysed", "layer", "models", "error", "identity_error",
                "sperm_error", "perm_error", "sperm_neurons", "perm_neurons", "sperm_dist", "sperm_share",
                "match_corr", "match_neg"]
        out = []
        for key in sorted(groups, key=lambda k: tuple(str(v) for v in k)):
            g = groups[key]
            out.append([*key, len(g), *(_median(g, c) for c in self.SUMMARY)])
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
            if m.plan.input_dtype.startswith("int"):
                raise JobError(f"model {mid} reads token ids: layer-equivariance transforms float inputs")
            for t in transforms:                        # refuse what cannot be analysed before any work
                check_input(m.plan.input_shape, t, mid)
            models.append(m)
    finally:
        con.close()
    analysis_id = f"leq-{now_utc():%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"
    rows: list[dict[str, Any]] = []
    from tqdm import tqdm

    for m in tqdm(models, desc="layer equivariance", unit="model", disable=not progress):
        net = m.network()
        acts = [layer.activation for layer in m.plan.layers]
        meta = info.get(m.model_id, {})
        for t in transforms:
            for fit in fit_layers(net, m.plan.input_shape, t, samples, seed, m.model_id, noise_std,
                                  activations=acts):
                rows.append({"model_id": m.model_id, "checkpoint": meta.get("checkpoint", m.checkpoint),
                             "model_activation": meta.get("activation"), "task": meta.get("task"),
                             "trained": meta.get("equivariance"), "transform": t, "fit": fit,
                             **{k: getattr(fit, k) for k in FIT_COLUMNS}})
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
        **{c: [r[c] for r in rows] for c in FIT_COLUMNS if c not in ("layer", "width", "activation")},
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
