"""``jobs merge``: merge two models of one architecture by aligning their neurons first.

B's hidden neurons are put in A's order (``jobs.analysis.align``: NG-GNN node embeddings, activation
matching or weight matching), B is permuted through the exact graph inverse, and the weights are
interpolated. Both parents, naive averaging and every available alignment are evaluated on the
models' own test data, with the loss barrier along the interpolation path
``max_t [L((1-t) A + t B) - ((1-t) L(A) + t L(B))]``. Models with batch norm get their running
statistics recomputed on training data after interpolation (``reset_bn``), as averaged
statistics no longer describe the averaged network.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from graphstore import duck
from graphstore.catalog import Catalog
from jobs.analysis.align import METHODS, activation_matching, check_same_architecture, embedding_matching, weight_matching
from jobs.analysis.catalog_models import CatalogModel, load_model
from zoocore.errors import JobError

LATEST_RUN = "SELECT run_id FROM runs WHERE run_id NOT LIKE '%-predict-%' ORDER BY created_at DESC"


@dataclass
class MergeConfig:
    method: str = "embeddings"          # the alignment whose merge is written: embeddings | activations | weights
    alpha: float = 0.5                  # weight of B: merged = (1 - alpha) A + alpha B'
    run_id: str | None = None           # NG-GNN run for embedding matching (default: the newest usable)
    points: int = 11                    # interpolation points for the loss barrier
    reset_bn: bool = True
    probe_samples: int = 512            # training inputs for activation matching
    seed: int = 0
    device: str = "cpu"


@dataclass
class MergeRow:
    name: str
    test_accuracy: float | None
    test_loss: float | None
    barrier: float | None = None
    note: str = ""


@dataclass
class MergeReport:
    model_a: str
    model_b: str
    method: str
    alpha: float
    rows: list[MergeRow]
    state: dict[str, torch.Tensor]
    spec: dict
    out: Path | None = None
    merged_id: str | None = None
    run_id: str | None = None
    notes: list[str] = field(default_factory=list)

    def row(self, name: str) -> MergeRow:
        return next(r for r in self.rows if r.name == name)

    def summary(self) -> str:
        fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
        lines = [f"merge of {self.model_a} and {self.model_b} (alpha {self.alpha}, written: {self.method})",
                 f"  {'model':26s} {'test_acc':>9s} {'test_loss':>10s} {'barrier':>9s}"]
        for r in self.rows:
            lines.append(f"  {r.name:26s} {fmt(r.test_accuracy):>9s} {fmt(r.test_loss):>10s} {fmt(r.barrier):>9s}"
                         + (f"   {r.note}" if r.note else ""))
        lines += [f"  {n}" for n in self.notes]
        if self.out:
            lines.append(f"  wrote {self.out}" + (f", ingested as model {self.merged_id}" if self.merged_id else ""))
        return "\n".join(lines)


# --------------------------------------------------------------------------- evaluation
class Evaluator:
    """Test accuracy / loss of state dicts of one architecture on the models' own data."""

    def __init__(self, model: CatalogModel, device: str = "cpu"):
        from pipeline.datasets import evaluation_data

        self.model, self.device = model, torch.device(device)
        try:
            xtr, ytr, xte, yte = evaluation_data(str(model.metadata.get("dataset")), model.plan.input_shape)
        except KeyError as exc:
            raise JobError(f"cannot evaluate model {model.model_id}: {exc.args[0]} (merging evaluates on the "
                           "data of the zoo kinds `pipeline zoo make` trains: cnn and mlp)") from None
        self.x_train = torch.from_numpy(xtr).to(self.device)
        self.x_test = torch.from_numpy(xte).to(self.device)
        self.y_test = torch.from_numpy(yte).to(self.device)
        self.has_bn = any(op.running_stats for op in model.plan.ops)

    def module(self, state: dict[str, torch.Tensor], reset_bn: bool) -> torch.nn.Module:
        if reset_bn and self.has_bn and self.model.spec is None:
            state = self.settle(state, True)
        net = self.model.module(state).to(self.device)
        if reset_bn and self.has_bn and self.model.spec is not None:
            reset_batch_norm(net, self.x_train)
        return net

    def settle(self, state: dict[str, torch.Tensor], reset_bn: bool) -> dict[str, torch.Tensor]:
        """``state`` with its batch-norm running statistics recomputed on training data (when
        asked and the architecture has batch norm); every other entry unchanged."""
        if not (reset_bn and self.has_bn):
            return state
        if self.model.spec is None:         # an exported graph has no batch-norm modules to run in training mode
            return batch_norm_statistics(self.model, state, self.x_train)
        stats = self.module(state, True).state_dict()
        return {**state, **{k: v.cpu() for k, v in stats.items() if "running_" in k}}

    @torch.no_grad()
    def __call__(self, state: dict[str, torch.Tensor], reset_bn: bool = False) -> tuple[float, float]:
        out = self.module(state, reset_bn)(self.x_test)
        loss = torch.nn.functional.cross_entropy(out, self.y_test)
        return float((out.argmax(1) == self.y_test).float().mean()), float(loss)


@torch.no_grad()
def reset_batch_norm(net: torch.nn.Module, x: torch.Tensor, batch: int = 256) -> None:
    """Recompute every batch norm's running mean / variance on ``x`` (cumulative average)."""
    bns = [m for m in net.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
    net.train()
    for i in range(0, len(x), batch):
        net(x[i:i + batch])
    net.eval()


@torch.no_grad()
def batch_norm_statistics(model: CatalogModel, state: dict[str, torch.Tensor], x: torch.Tensor,
                          batch: int = 256) -> dict[str, torch.Tensor]:
    """``state`` with every batch norm's running mean / variance recomputed on ``x`` through the
    exported graph, exactly as :func:`reset_batch_norm` does with modules: each batch runs with
    the norms in training mode, and the batches' means and unbiased variances are averaged."""
    net = model.network(state)
    sums: dict[str, list] = {}
    for i in range(0, len(x), batch):
        for key, (mean, var) in net.batch_statistics(x[i:i + batch].cpu()).items():
            sums.setdefault(key, []).append((mean, var))
    state = dict(state)
    var_of = {op.mean_key: op.var_key for op in model.plan.ops if op.running_stats}
    for key, parts in sums.items():
        state[key] = torch.stack([m for m, _ in parts]).mean(0).to(state[key].dtype)
        state[var_of[key]] = torch.stack([v for _, v in parts]).mean(0).to(state[var_of[key]].dtype)
    return state


def interpolate(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """(1 - alpha) a + alpha b for float tensors; integer buffers are A's."""
    return {k: (1 - alpha) * v + alpha * b[k] if v.is_floating_point() else v.clone() for k, v in a.items()}


def loss_barrier(evaluate: Evaluator, a: dict, b: dict, points: int, reset_bn: bool) -> float:
    ts = np.linspace(0.0, 1.0, points)
    losses = [evaluate(interpolate(a, b, float(t)), reset_bn and 0 < t < 1)[1] for t in ts]
    return float(max(loss - ((1 - t) * losses[0] + t * losses[-1]) for t, loss in zip(ts, losses)))


# --------------------------------------------------------------------------- alignment inputs
@torch.no_grad()
def layer_activations(model: CatalogModel, state: dict[str, torch.Tensor], x: torch.Tensor) -> dict[int, np.ndarray]:
    """Per neuron layer, the (neurons, samples x positions) responses to ``x``: the value of the
    operation that last writes the layer (its conv / linear / norm, or the residual sum), before
    the layer's activation, read from the network's layer taps (any converted model)."""
    taps = model.network(state).to(x.device).taps(x, after_activation=False)
    acts: dict[int, np.ndarray] = {}
    for layer, t in taps.items():
        if layer == 0:
            continue
        t = t.detach().float()
        acts[layer] = t.transpose(0, 1).reshape(t.shape[1], -1).cpu().numpy() if t.dim() > 2 else t.T.cpu().numpy()
    return acts


def newest_run(con) -> str | None:
    row = con.execute(LATEST_RUN).fetchone()
    return row[0] if row else None


@torch.no_grad()
def node_embeddings(catalog: Catalog, run_id: str, model: CatalogModel, device: str = "cpu") -> np.ndarray:
    """A trained run's node embeddings of ``model`` (N, H * members), rows in graph node order."""
    from jobs.training.data import normalised_graph
    from jobs.training.artifacts import load_metanetwork

    members, manifest = load_metanetwork(catalog, run_id, device)
    etypes = members[0].cfg.etypes
    frame = manifest.frame
    if model.graph.kernel_shape[0] > frame[0] or model.graph.kernel_shape[1] > frame[1]:
        raise JobError(f"run {run_id} was trained on kernels up to {frame}, model {model.model_id} has "
                       f"{model.graph.kernel_shape}")
    try:
        g = normalised_graph(model.graph, manifest.stats, frame, etypes,
                             raw=bool(members[0].cfg.probes), model_id=model.model_id).to(device)
    except ValueError as exc:
        raise JobError(f"run {run_id} cannot embed model {model.model_id}: {exc}") from None
    out = np.zeros((model.graph.num_nodes, 0), dtype=np.float32)
    for net in members:
        h = net.node_embeddings(g)
        part = np.zeros((model.graph.num_nodes, net.cfg.hidden), dtype=np.float32)
        for t, emb in h.items():
            if emb.shape[0]:
                part[g.nodes[t].data["nid"].cpu().numpy()] = emb.cpu().numpy()
        out = np.concatenate([out, part], 1)
    return out


def find_permutation(method: str, catalog: Catalog, run_id: str | None, a: CatalogModel, b: CatalogModel,
                     x_probe: torch.Tensor, cfg: MergeConfig) -> np.ndarray:
    """B's node permutation into A's basis by ``method``."""
    if method == "weights":
        return weight_matching(a.graph, b.graph, seed=cfg.seed)
    if method == "activations":
        return activation_matching(a.graph, layer_activations(a, a.state_dict(), x_probe),
                                   layer_activations(b, b.state_dict(), x_probe))
    if method == "embeddings":
        if run_id is None:
            raise JobError("embedding matching needs a trained NG-GNN run (`jobs train-heterognn`, or --run); "
                           "or choose --method activations / weights")
        return embedding_matching(a.graph, node_embeddings(catalog, run_id, a, cfg.device),
                                  node_embeddings(catalog, run_id, b, cfg.device))
    raise JobError(f"unknown merge method {method!r}; choose one of {', '.join(METHODS)}")


# --------------------------------------------------------------------------- the job
def merge_models(catalog: Catalog | str, model_a: str, model_b: str, cfg: MergeConfig | None = None,
                 out: str | Path | None = None, ingest: bool = False, store=None) -> MergeReport:
    """Align, merge and evaluate; write the merged checkpoint to ``out`` (and ingest it)."""
    cfg = cfg or MergeConfig()
    if cfg.method not in METHODS:
        raise JobError(f"unknown merge method {cfg.method!r}; choose one of {', '.join(METHODS)}")
    if not 0.0 <= cfg.alpha <= 1.0:
        raise JobError(f"--alpha must lie in [0, 1], got {cfg.alpha}")
    catalog = (catalog if isinstance(catalog, Catalog) else Catalog(catalog)).require()
    con = duck.connect(catalog)
    a, b = load_model(con, model_a), load_model(con, model_b)
    run_id = cfg.run_id or newest_run(con)
    con.close()
    if a.architecture_id != b.architecture_id:
        raise JobError(f"models {model_a} and {model_b} have different architectures "
                       f"({a.architecture_id} vs {b.architecture_id}); only one architecture's models can be merged")
    check_same_architecture(a.graph, b.graph)
    evaluate = Evaluator(a, cfg.device)
    x_probe = evaluate.x_train[:cfg.probe_samples]
    sa, sb = a.state_dict(), b.state_dict()
    rows = [MergeRow("parent A", *evaluate(sa)), MergeRow("parent B", *evaluate(sb))]
    naive = interpolate(sa, sb, cfg.alpha)
    rows.append(MergeRow("naive average", *evaluate(naive, cfg.reset_bn),
                         loss_barrier(evaluate, sa, sb, cfg.points, cfg.reset_bn)))
    notes, merged = [], None
    for method in METHODS:
        try:
            perm = find_permutation(method, catalog, run_id, a, b, x_probe, cfg)
        except JobError as exc:
            if method == cfg.method:
                raise
            notes.append(f"{method} matching skipped: {exc}")     # a baseline that cannot run here
            continue
        sb_aligned = a.state_dict(b.graph.permuted(perm))
        state = evaluate.settle(interpolate(sa, sb_aligned, cfg.alpha), cfg.reset_bn)
        moved = float((perm != np.arange(len(perm))).mean())
        rows.append(MergeRow(f"aligned ({method})", *evaluate(state),
                             loss_barrier(evaluate, sa, sb_aligned, cfg.points, cfg.reset_bn),
                             f"{moved:.0%} of nodes moved" + (f", run {run_id}" if method == "embeddings" else "")))
        if method == cfg.method:
            merged = state
    report = MergeReport(model_a, model_b, cfg.method, cfg.alpha, rows, merged, a.spec,
                         run_id=run_id if cfg.method == "embeddings" else None, notes=notes)
    if out is not None:
        report.out = write_merged(report, a, Path(out))
        if ingest:
            from pipeline.ingest import ingest_zoo

            rep = ingest_zoo(report.out.parent, catalog, zoo_name="merged", files=[report.out], store=store,
                             progress=False)
            if rep.errors:
                raise JobError(f"the merged checkpoint was written but not ingested: {rep.errors[0].message}")
            con = duck.connect(catalog, ["models"])
            row = con.execute("SELECT model_id FROM models WHERE checkpoint = ? ORDER BY ingested_at DESC",
                              [report.out.name]).fetchone()
            con.close()
            report.merged_id = row[0] if row else None
    return report


def write_merged(report: MergeReport, a: CatalogModel, out: Path) -> Path:
    """``out`` as ``.safetensors`` with its JSON sidecar (spec, provenance, measured metrics); a
    model without a spec (a torch.export archive) as ``.pt2``, its kept program with the merged
    weights, beside the same sidecar without the spec."""
    from safetensors.torch import save_file

    from pipeline.neural_graph.runnable import save_program_archive

    suffix = ".safetensors" if report.spec is not None else ".pt2"
    if out.suffix != suffix:
        out = out.with_suffix(suffix)
    out.parent.mkdir(parents=True, exist_ok=True)
    written = report.row(f"aligned ({report.method})")
    inherited = {k: v for k, v in a.metadata.items()
                 if k not in ("index", "zoo_seed", "init_seed", "recipe", "test_accuracy", "train_accuracy",
                              "test_loss") and not isinstance(v, (dict, list))}
    side: dict[str, Any] = {
        **({"architecture": report.spec} if report.spec is not None else {}),
        "metadata": {**inherited, "merged_from": f"{report.model_a},{report.model_b}", "merge_method": report.method,
                     "merge_alpha": report.alpha, **({"merge_run": report.run_id} if report.run_id else {})},
        "metrics": {"test_accuracy": written.test_accuracy, "test_loss": written.test_loss}}
    tmp = out.with_name(f".{out.name}.tmp")
    if report.spec is not None:
        save_file({k: v.contiguous() for k, v in report.state.items()}, str(tmp))
    else:
        save_program_archive(tmp, a.program[0], report.state, a.program[1])
    os.replace(tmp, out)
    sidecar = out.with_suffix(".json")
    tmp = sidecar.with_name(f".{sidecar.name}.tmp")
    tmp.write_text(json.dumps(side, indent=1))
    os.replace(tmp, sidecar)
    return out
