"""``jobs train-editor``: train metanetworks that edit INRs, compare them, write the edited zoo.

A run selects the SIRENs of one architecture (the ``inr`` zoo, models not themselves edited), splits
them by the hash of their model_id (train / val / test), and trains, on the same split:

- the metanetwork (NG-GNN or NG-T) with equivariant edge/node heads and K = ``oce`` weight sets whose
  functions are averaged (Output Capacity Expansion; K = 1 is the plain metanetwork);
- baselines: the identity (the unedited INR), the same metanetwork with K = 1, and NFN's NP layers.

Every editor is residual (edited = original + predicted change) and trained on the function-space
MSE between the edited INR on its pixel grid (8x8, or the side its zoo was made at) and the transformed digit; the checkpoint with the
best validation MSE is kept. The test MSE of every method (mean and spread over test INRs) is
printed and stored in ``runs``; the main editor's weights go to ``CATALOG/artifacts/RUN/``; its edits
of every selected INR are written as a zoo (one network K times wider for K > 1, exact) and
ingested with their lineage (``edited_from``, ``edit``, ``edit_run``) as model columns.
"""
from __future__ import annotations

import copy
import json
import math
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from graphstore import duck
from graphstore.catalog import Catalog, now_utc
from jobs.config import EditConfig
from jobs.editing.data import EditData, load_edit_data
from jobs.editing.heads import GraphEditor, NFNEditor, nfn_available
from jobs.editing.siren import MLPLayout, Params, mlp_forward, pixel_grid, widen, widened_spec
from jobs.editing.targets import EDITS
from jobs.config import LEGACY
from jobs.metanets.ngnn import NGGNNConfig
from jobs.training.loop import Schedule, fit
from jobs.training.run_weights import read_weights, require_run, weights_files
from jobs.training.runs import run_row
from pipeline.neural_graph.build import state_dict_from_graph
from pipeline.neural_graph.graph import NeuralGraph
from zoocore.errors import JobError

def edited_members(editor, data: EditData, idx: np.ndarray, device) -> Params:
    """The K edited weight sets of models ``idx``: per layer (B, K, out, in) and (B, K, out)."""
    deltas = editor.deltas(data, idx, device)
    return [(w[idx].to(device).unsqueeze(1) + dw, b[idx].to(device).unsqueeze(1) + db)
            for (w, b), (dw, db) in zip(data.params, deltas)]


def average_function(members: Params, coords: torch.Tensor, activations: Sequence[str]) -> torch.Tensor:
    """(B, P) the mean over the K members of each network's output on ``coords`` (one output)."""
    B, K = members[0][0].shape[:2]
    flat = [(w.reshape(B * K, *w.shape[2:]), b.reshape(B * K, -1)) for w, b in members]
    return mlp_forward(flat, coords, activations)[..., 0].reshape(B, K, -1).mean(1)


def per_model_mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((pred - target) ** 2).mean(-1)


@torch.no_grad()
def score(editor, data: EditData, idx: np.ndarray, device, batch: int = 256) -> np.ndarray:
    """Per-model MSE of the edited (or, for ``editor`` None, the original) INRs against the targets."""
    coords = pixel_grid(data.side).to(device)
    out = []
    for start in range(0, len(idx), batch):
        part = idx[start:start + batch]
        if editor is None:
            pred = mlp_forward([(w[part].to(device), b[part].to(device)) for w, b in data.params], coords,
                               data.layout.activations)[..., 0]
        else:
            editor.eval()
            pred = average_function(edited_members(editor, data, part, device), coords, data.layout.activations)
        out.append(per_model_mse(pred, data.targets[part].to(device)).cpu().numpy())
    return np.concatenate(out) if out else np.zeros(0)


class EditObjective:
    """The edit as an objective of the shared loop (jobs.training.loop): the function-space MSE
    of the edited INRs (K members averaged) against the transformed images; a round is
    ``eval_every`` steps over a running permutation of the training INRs; the score is minus the
    validation MSE."""

    def __init__(self, data: EditData, cfg: EditConfig, device):
        self.data, self.cfg, self.device = data, cfg, device
        self.train_idx, self.val_idx = data.index("train"), data.index("val")
        self.rng = np.random.default_rng(cfg.seed)
        self.coords = pixel_grid(data.side).to(device)
        self.order, self.pos, self.done = self.rng.permutation(self.train_idx), 0, 0

    def rounds(self) -> int:
        return math.ceil(self.cfg.steps / self.cfg.eval_every)

    def batches(self, round_: int):
        for _ in range(min(self.cfg.eval_every, self.cfg.steps - self.done)):
            if self.pos >= len(self.order):
                self.order, self.pos = self.rng.permutation(self.train_idx), 0
            idx = self.order[self.pos:self.pos + self.cfg.batch_size]
            self.pos += self.cfg.batch_size
            self.done += 1
            yield idx

    def loss(self, editor, idx):
        pred = average_function(edited_members(editor, self.data, idx, self.device), self.coords,
                                self.data.layout.activations)
        return per_model_mse(pred, self.data.targets[idx].to(self.device)).mean(), len(idx)

    def score(self, editor) -> float:
        return -float(score(editor, self.data, self.val_idx, self.device).mean())


def fit_editor(editor, data: EditData, cfg: EditConfig, device, desc: str, progress: bool = True):
    """Train ``editor`` on the shared loop; keep the state of best validation MSE."""
    editor.to(device)
    objective = EditObjective(data, cfg, device)
    fitted = fit(editor, objective, Schedule(objective.rounds(), cfg.lr, cfg.weight_decay, clip=1.0, per_step=True,
                                             total_steps=cfg.steps), desc, progress)
    history = [{"step": min((h["round"] + 1) * cfg.eval_every, cfg.steps), "train_mse": h["last_loss"],
                "val_mse": -h["val_score"]} for h in fitted.history]
    return fitted.model.eval(), history


def graph_editor(data: EditData, cfg: EditConfig, members: int) -> GraphEditor:
    torch.manual_seed(cfg.seed)
    # the editor reads node and edge embeddings, not the readout, and was tuned without Fourier features
    mcfg = NGGNNConfig(etypes=data.etypes, edge_in=1, out_dim=1, hidden=cfg.hidden, edge_hidden=cfg.edge_hidden,
                       layers=cfg.layers, kind=cfg.model, **LEGACY)
    return GraphEditor(mcfg, members)


@dataclass
class MethodResult:
    name: str
    mse: np.ndarray | None               # per test INR; None when the method could not run
    seconds: float = 0.0
    note: str = ""

    def summary(self) -> dict[str, Any]:
        if self.mse is None:
            return {"note": self.note}
        return {"mse_mean": float(self.mse.mean()), "mse_std": float(self.mse.std()),
                "mse_median": float(np.median(self.mse)), "n": int(len(self.mse)), "seconds": round(self.seconds, 1),
                **({"note": self.note} if self.note else {})}


@dataclass
class EditReport:
    run_id: str
    edit: str
    main: str
    counts: dict[str, int]
    results: dict[str, MethodResult]
    out_dir: Path | None = None
    written: int = 0
    ingested: int = 0
    artifact: Any = None
    store_warning: str | None = None
    editors: dict[str, Any] = field(default_factory=dict, repr=False)   # the trained editors, by method
    data: EditData | None = field(default=None, repr=False)

    def summary(self) -> str:
        c = self.counts
        lines = [f"run {self.run_id}: edit {self.edit!r} of {c['train']} train / {c['val']} val / {c['test']} test INRs",
                 f"  {'method':14s} {'test MSE':>10s} {'std':>9s} {'median':>9s} {'vs identity':>12s} {'seconds':>8s}"]
        base = self.results.get("identity")
        ref = float(base.mse.mean()) if base is not None and base.mse is not None else None
        for name, r in self.results.items():
            if r.mse is None:
                lines.append(f"  {name:14s} {'skipped':>10s}   {r.note}")
                continue
            m = float(r.mse.mean())
            rel = f"{100 * (m - ref) / ref:+.1f}%" if ref else "n/a"
            lines.append(f"  {name:14s} {m:10.5f} {float(r.mse.std()):9.5f} {float(np.median(r.mse)):9.5f} "
                         f"{rel:>12s} {r.seconds:8.0f}" + (f"   {r.note}" if r.note else ""))
        k1, oce = self.results.get(self.main.split("-oce")[0]), self.results.get(self.main)
        if "-oce" in self.main and k1 is not None and k1.mse is not None and oce is not None and oce.mse is not None:
            diff = oce.mse - k1.mse
            se = float(diff.std(ddof=1) / math.sqrt(len(diff))) if len(diff) > 1 else float("nan")
            lines.append(f"  OCE vs K=1: {100 * (oce.mse.mean() - k1.mse.mean()) / k1.mse.mean():+.1f}% test MSE "
                         f"(paired difference {diff.mean():+.5f} +- {1.96 * se:.5f}, 95% CI; negative = OCE better)")
        if self.out_dir is not None:
            lines.append(f"  wrote {self.written} edited INRs ({self.main}) to {self.out_dir}, ingested {self.ingested}")
        if self.store_warning:
            lines.append(f"  graph store not updated: {self.store_warning} (run `graphstore sync` later)")
        return "\n".join(lines)


def train_editor(catalog: Catalog | str, cfg: EditConfig, store=None, progress: bool = True) -> EditReport:
    """Train and compare the editors on one split, save the main one, write and ingest its edits."""
    if cfg.edit not in EDITS:
        raise JobError(f"unknown edit {cfg.edit!r}; choose one of {', '.join(EDITS)}")
    if cfg.oce < 1:
        raise JobError("--oce takes the number K >= 1 of averaged weight sets")
    if cfg.write not in ("all", "test", "none"):
        raise JobError("--write takes all, test or none")
    catalog = (catalog if isinstance(catalog, Catalog) else Catalog(catalog)).require()
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    data = load_edit_data(catalog, cfg)
    counts = {s: int((data.splits == s).sum()) for s in ("train", "val", "test")}
    test_idx = data.index("test")
    main = cfg.model if cfg.oce == 1 else f"{cfg.model}-oce{cfg.oce}"
    results: dict[str, MethodResult] = {"identity": MethodResult("identity", score(None, data, test_idx, device))}
    histories: dict[str, list] = {}
    editors: dict[str, Any] = {}
    if cfg.baselines:
        reason = nfn_available()
        if reason:
            results["nfn"] = MethodResult("nfn", None, note=f"skipped: {reason}")
        else:
            torch.manual_seed(cfg.seed)
            started = time.perf_counter()
            nfn, histories["nfn"] = fit_editor(NFNEditor(data.layout.sizes, 1, cfg.nfn_channels), data, cfg, device,
                                               "train NFN (NP)", progress)
            results["nfn"] = MethodResult("nfn", score(nfn, data, test_idx, device), time.perf_counter() - started)
            editors["nfn"] = nfn
        if cfg.oce > 1:
            started = time.perf_counter()
            k1, histories[cfg.model] = fit_editor(graph_editor(data, cfg, 1), data, cfg, device,
                                                  f"train {cfg.model} K=1", progress)
            results[cfg.model] = MethodResult(cfg.model, score(k1, data, test_idx, device), time.perf_counter() - started)
            editors[cfg.model] = k1
    started = time.perf_counter()
    editor, histories[main] = fit_editor(graph_editor(data, cfg, cfg.oce), data, cfg, device,
                                         f"train {cfg.model} K={cfg.oce}", progress)
    results[main] = MethodResult(main, score(editor, data, test_idx, device), time.perf_counter() - started)
    editors[main] = editor
    run_id = f"edit-{now_utc():%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"
    report = EditReport(run_id, cfg.edit, main, counts, results, editors=editors, data=data)
    report.artifact = save_editor(catalog, run_id, editor, data, cfg)
    metrics = {name: r.summary() for name, r in results.items()}
    write_edit_run(catalog, run_id, cfg, metrics, report.artifact, histories)
    if cfg.write != "none":
        idx = np.arange(len(data.model_ids)) if cfg.write == "all" else test_idx
        out = Path(cfg.out_dir) if cfg.out_dir else Path(f"edited-{cfg.edit}-{run_id}")
        spec = _spec_of(catalog, data.model_ids[0])
        report.out_dir = out
        report.written = write_edited_zoo(out, editor, data, idx, spec, run_id, cfg, main, device)
        from pipeline.ingest import ingest_zoo

        rep = ingest_zoo(out, catalog, zoo_name=f"edited-{cfg.edit}", store=store, progress=progress)
        if rep.errors:
            raise JobError(f"the edited INRs were written to {out} but {len(rep.errors)} failed to ingest: "
                           f"{rep.errors[0].message}")
        report.ingested = rep.added
        if rep.graph_behind:
            report.store_warning = "the graph store is behind the catalog"
    return report


def small_inr_catalog(workdir, n: int = 40, seed: int = 0, workers: int = 2) -> Path:
    """A small inr zoo made on the spot and ingested with the embedded graph store (the notebook's
    data); reused when ``workdir`` already holds it."""
    from jobs.demo import made_catalog

    return made_catalog(workdir, "inr", n, "inr-catalog.txt", seed=seed, workers=workers)[0]


def _spec_of(catalog: Catalog, model_id: str) -> dict:
    con = duck.connect(catalog, ["models", "architectures"])
    try:
        row = con.execute("SELECT a.spec_json FROM models m JOIN architectures a USING (architecture_id) "
                          "WHERE m.model_id = ?", [model_id]).fetchone()
    finally:
        con.close()
    if row is None or not row[0]:
        raise JobError(f"model {model_id} has no JSON spec in the catalog; edited INRs need one to be written")
    return json.loads(row[0])


def edited_graph(graph: NeuralGraph, layout: MLPLayout, member: Params) -> NeuralGraph:
    """``graph`` with the weights and biases of one edited network (per layer (out, in), (out,))."""
    out = copy.copy(graph)
    out.weight, out.bias = graph.weight.copy(), graph.bias.copy()
    offsets = graph.layer_offsets()
    for li, (w, b) in enumerate(member):
        e = graph.edge_op == li
        so, do = offsets[li], offsets[li + 1]
        out.weight[e, 0] = w.detach().cpu().numpy()[graph.dst[e] - do, graph.src[e] - so]
        out.bias[do:do + layout.sizes[li + 1]] = b.detach().cpu().numpy()
    return out.validate()


def edited_state_dict(graph: NeuralGraph, layout: MLPLayout, members: Params) -> dict[str, torch.Tensor]:
    """The checkpoint of one edited INR: each of the K members' graphs turned back into weights with
    the exact inverse, then widened into one network (for K = 1 the member itself).

    Args:
        members: per layer (K, out, in) and (K, out).
    """
    K = members[0][0].shape[0]
    states = [state_dict_from_graph(edited_graph(graph, layout, [(w[k], b[k]) for w, b in members]))
              for k in range(K)]
    if K == 1:
        return states[0]
    wide = widen(layout.stack(states))
    return {key: t.contiguous() for (w, b), wk, bk in zip(wide, layout.weight_keys, layout.bias_keys)
            for key, t in ((wk, w), (bk, b))}


def write_edited_zoo(out: Path, editor, data: EditData, idx: np.ndarray, spec: dict, run_id: str,
                     cfg: EditConfig, method: str, device, batch: int = 64) -> int:
    """One checkpoint and JSON sidecar per edited INR and a ``metrics.csv``: the zoo format of
    ``pipeline zoo make``. Metadata: the original's (label, image_index...) and the lineage."""
    from safetensors.torch import save_file

    from pipeline.zoo.make import _write_atomic, write_metrics_csv

    out.mkdir(parents=True, exist_ok=True)
    wide_spec = spec if cfg.oce == 1 else widened_spec(spec, cfg.oce)
    coords = pixel_grid(data.side)
    rows = []
    for start in range(0, len(idx), batch):
        part = idx[start:start + batch]
        with torch.no_grad():
            editor.eval()
            members = [(w.cpu(), b.cpu()) for w, b in edited_members(editor, data, part, device)]
        for j, i in enumerate(part):
            state = edited_state_dict(data.graphs[i], data.layout, [(w[j], b[j]) for w, b in members])
            params = [(state[wk].unsqueeze(0), state[bk].unsqueeze(0))
                      for wk, bk in zip(data.layout.weight_keys, data.layout.bias_keys)]
            mse = float(per_model_mse(mlp_forward(params, coords, data.layout.activations)[..., 0],
                                      data.targets[i:i + 1]).item())
            name = f"{cfg.edit}-{data.model_ids[i][:16]}.safetensors"
            meta = {**data.inherited.get(data.model_ids[i], {}), "image_index": int(data.image_index[i]),
                    "edited_from": data.model_ids[i], "edit": cfg.edit, "edit_run": run_id, "edit_method": method,
                    "oce": cfg.oce, "edit_split": str(data.splits[i])}
            metrics = {"mse": mse, "psnr": float(10 * math.log10(1.0 / max(mse, 1e-12)))}
            _write_atomic(out / name, lambda p, s=state: save_file(s, str(p)))
            side = {"architecture": wide_spec, "metadata": meta, "metrics": metrics}
            _write_atomic((out / name).with_suffix(".json"), lambda p, s=side: p.write_text(json.dumps(s, indent=1)))
            rows.append({"checkpoint": name, **metrics, **meta})
    rows.sort(key=lambda r: r["checkpoint"])
    write_metrics_csv(out / "metrics.csv", rows)
    return len(rows)


def save_editor(catalog: Catalog, run_id: str, editor: GraphEditor, data: EditData, cfg: EditConfig):
    """``CATALOG/artifacts/RUN/``: ``editor.safetensors`` (state dict) and ``metanet.json`` (kind,
    config, normalisation), committed as one folder."""
    meta = {"kind": "editor", "model": editor.cfg.to_dict(), "members": editor.members, "stats": data.stats.to_dict(),
            "edit": cfg.edit, "layout": asdict(data.layout), "train": asdict(cfg)}
    catalog.commit_artifacts(run_id, {**weights_files("editor", editor.state_dict()),
                                      "metanet.json": json.dumps(meta, indent=1, default=str).encode()})
    return catalog.location("artifacts", run_id)


def load_editor(catalog: Catalog | str, run_id: str, device: str = "cpu") -> tuple[GraphEditor, dict]:
    """The trained editor of a run (weights read as tensors only: jobs.training.run_weights) and its metadata."""
    catalog = catalog if isinstance(catalog, Catalog) else Catalog(catalog)
    require_run(catalog, run_id)
    raw = catalog.read_artifact(run_id, "metanet.json")
    if raw is None:
        raise JobError(f"no trained editor for run {run_id!r} in {catalog.artifacts_dir}")
    meta = json.loads(raw)
    if meta.get("kind") != "editor":
        raise JobError(f"run {run_id!r} saved a {meta.get('kind', 'predictor')!r} metanetwork, not an editor")
    editor = GraphEditor(NGGNNConfig.from_dict(meta["model"]), meta["members"])
    editor.load_state_dict(read_weights(catalog, run_id, "editor"))
    return editor.to(device).eval(), meta


def write_edit_run(catalog: Catalog, run_id: str, cfg: EditConfig, metrics: dict, artifact, histories: dict) -> None:
    """The run's row in ``runs`` (task ``edit``, target the edit, metrics per method): the same
    run store as a predictor's (jobs.training.runs), without per-model predictions."""
    catalog.commit_results(run_id, {"runs": run_row(run_id, "edit", cfg.edit, {**asdict(cfg), "history": histories},
                                                    metrics, artifact, None)})


__all__ = ["EditConfig", "EditData", "EditReport", "average_function", "edited_members", "edited_state_dict",
           "fit_editor", "load_editor", "score", "train_editor", "write_edited_zoo"]
