"""``pipeline zoo make``: train a zoo and write it in the zoo format (see README, "Zoo format").

A zoo folder holds one checkpoint per model, a JSON sidecar per checkpoint (``architecture``:
the spec, ``metadata``: hyper-parameters) and ``metrics.csv`` (first column the checkpoint file
name, then one column per metric and metadata field, ``hparams`` as JSON).
"""
from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from tqdm import tqdm

from pipeline.spec import example_input
from pipeline.workers import process_pool
from pipeline.zoo import CHECKPOINT_FORMATS
from pipeline.zoo.kinds import RECIPES, make_model
from zoocore.errors import ZooGraphError

FORMATS = {fmt: f".{fmt}" for fmt in CHECKPOINT_FORMATS}
METRIC_COLUMNS = ("test_accuracy", "train_accuracy", "test_loss", "mse", "psnr")


@dataclass
class ZooReport:
    out_dir: Path
    made: int
    skipped: int

    def __str__(self) -> str:
        return f"{self.made} models trained, {self.skipped} already present, in {self.out_dir}"


def model_seed(zoo_seed: int, index: int) -> int:
    return zoo_seed * 1_000_003 + index


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def save_checkpoint(model: torch.nn.Module, spec: dict, path: Path, fmt: str) -> None:
    """Write one checkpoint in ``fmt`` (safetensors, pt, pt2) atomically."""
    if fmt == "safetensors":
        from safetensors.torch import save_file

        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        _write_atomic(path, lambda p: save_file(state, str(p)))
    elif fmt == "pt":
        _write_atomic(path, lambda p: torch.save(model.state_dict(), str(p)))
    elif fmt == "pt2":
        exported = torch.export.export(model.eval(), (example_input(spec),))
        _write_atomic(path, lambda p: torch.export.save(exported, str(p)))
    else:
        raise ZooGraphError(f"unknown checkpoint format {fmt!r}; choose one of {sorted(FORMATS)}")


def _one(args: tuple[str, int, int, str, str, int, dict[str, Any]]) -> dict[str, Any]:
    kind, index, seed, fmt, out_dir, replicas, settings = args
    torch.set_num_threads(1)
    name = f"{kind}-{index:05d}{FORMATS[fmt]}"
    init_seed = model_seed(seed, index)
    model, recipe, metrics = make_model(kind, model_seed(seed, index // replicas), init_seed, settings)
    metadata = dict(recipe.metadata)
    if replicas > 1:        # replicas of one recipe differ only in initialisation and batch order
        metadata.update(recipe=index // replicas, init_seed=init_seed)
    out = Path(out_dir)
    save_checkpoint(model, recipe.spec, out / name, fmt)
    side = {"architecture": recipe.spec, "metadata": {**metadata, "zoo_seed": seed, "index": index},
            "metrics": metrics, **({"recipe_settings": settings} if settings else {})}
    _write_atomic((out / name).with_suffix(".json"), lambda p: p.write_text(json.dumps(side, indent=1)))
    return {"checkpoint": name, **metrics, **metadata}


def _rows(kind: str, n: int, seed: int, fmt: str, out_dir: Path, workers: int,
          replicas: int, settings: dict[str, Any]) -> Iterator[dict[str, Any]]:
    todo, done = [], []
    for i in range(n):
        name = f"{kind}-{i:05d}{FORMATS[fmt]}"
        side = (out_dir / name).with_suffix(".json")
        if (out_dir / name).exists() and side.exists():
            meta = json.loads(side.read_text())
            if meta.get("recipe_settings", {}) != settings:     # one zoo, one recipe: never mix on resume
                raise ZooGraphError(
                    f"{out_dir} already holds {name} made with recipe settings {meta.get('recipe_settings', {})}, "
                    f"not {settings}; make this zoo in another folder")
            done.append({"checkpoint": name, **meta.get("metrics", {}), **{k: v for k, v in meta["metadata"].items()
                                                                            if k not in ("zoo_seed", "index")}})
        else:
            todo.append((kind, i, seed, fmt, str(out_dir), replicas, settings))
    yield from ({"_skipped": True, **d} for d in done)
    if workers <= 1:
        yield from map(_one, todo)
    else:
        with process_pool(workers) as pool:
            yield from pool.map(_one, todo, chunksize=4)


def make_zoo(kind: str, out_dir: str | Path, n: int, seed: int = 0, fmt: str = "safetensors",
             workers: int = 1, progress: bool = True, replicas: int = 1,
             settings: dict[str, Any] | None = None) -> ZooReport:
    """Train ``n`` models of zoo ``kind`` into ``out_dir``; models already there are kept (resume).
    With ``replicas`` K, models come in groups of K that share architecture, hyper-parameters and
    data and differ only in initialisation and batch order (pairs for merging). ``settings``
    (``pipeline.zoo.kinds.recipe_settings``) change the kind's training recipe; a folder holds one
    recipe, so resuming with other settings is refused."""
    if kind not in RECIPES:
        raise ZooGraphError(f"unknown zoo kind {kind!r}; choose one of {sorted(RECIPES)}")
    if fmt not in FORMATS:
        raise ZooGraphError(f"unknown checkpoint format {fmt!r}; choose one of {sorted(FORMATS)}")
    if n < 1:
        raise ZooGraphError("--n must be at least 1")
    if replicas < 1:
        raise ZooGraphError("--replicas must be at least 1")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, skipped = [], 0
    bar = tqdm(total=n, desc=f"zoo {kind}", unit="model", disable=not progress)
    for row in _rows(kind, n, seed, fmt, out_dir, workers, replicas, dict(settings or {})):
        skipped += bool(row.pop("_skipped", False))
        rows.append(row)
        bar.update(1)
    bar.close()
    rows.sort(key=lambda r: r["checkpoint"])
    write_metrics_csv(out_dir / "metrics.csv", rows)
    return ZooReport(out_dir, n - skipped, skipped)


def write_metrics_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """metrics.csv: checkpoint, metric columns, metadata columns, hparams (JSON of all metadata)."""
    meta_cols = sorted({k for r in rows for k in r} - {"checkpoint", *METRIC_COLUMNS})
    metric_cols = [c for c in METRIC_COLUMNS if any(c in r for r in rows)]

    def write(p: Path) -> None:
        with open(p, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["checkpoint", *metric_cols, *meta_cols, "hparams"])
            for r in rows:
                hp = {k: r.get(k) for k in meta_cols}
                w.writerow([r["checkpoint"], *[_cell(r.get(c)) for c in metric_cols],
                            *[_cell(r.get(c)) for c in meta_cols], json.dumps(hp, sort_keys=True)])

    _write_atomic(path, write)


def _cell(v: Any) -> Any:
    return "" if v is None else v
