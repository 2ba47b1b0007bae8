"""Zoo formats ``pipeline ingest`` reads, one module each, and how a zoo folder's format is told.

Detection looks at file names only, most specific format first; ``--format NAME`` overrides it.
Adding a format: a ``ZooFormat`` subclass (pipeline.formats.base) in its own module, listed here.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from pipeline.formats.base import Member, ZooFormat
from zoocore.errors import ZooGraphError

# name -> ("module:Class", what the folder holds), in detection order (most specific first; the
# checkpoint folder last). The summaries are here, not on the classes, so that `pipeline ingest
# --help` lists the formats without importing torch.
FORMATS = {
    "small-cnn-zoo": ("pipeline.formats.small_cnn_zoo:SmallCNNZoo",
                      "the Small CNN Zoo (Unterthiner et al. 2020): weights.npy, layout.csv, metrics.csv.gz; "
                      "config.* fields become columns config_activation, ...; read a row at a time"),
    "hf-folders": ("pipeline.formats.hf_folders:HFFolders",
                   "Hugging Face model folders (config.json + model.safetensors, sharded or not) with a "
                   "metrics.csv keyed by folder name; needs the hf extra"),
    "model-zoos": ("pipeline.formats.model_zoos:ModelZoos",
                   "Model Zoos (Schürholt et al. 2022): ray-tune trial folders with params.json, result.json "
                   "and checkpoint_*/checkpoints (CNN and CNN3); params become columns model__nlin, ..."),
    "checkpoints": ("pipeline.formats.checkpoint_folder:CheckpointFolder",
                    "this project's format: .pt2 (torch.export) archives, or .pt/.safetensors state dicts with "
                    "a JSON sidecar holding the architecture spec, plus metrics.csv and sidecars"),
}

__all__ = ["FORMATS", "Member", "ZooFormat", "format_class", "detect", "open_zoo"]


def format_class(name: str) -> type[ZooFormat]:
    if name not in FORMATS:
        raise ZooGraphError(f"unknown zoo format {name!r}; known: {', '.join(FORMATS)}")
    module, cls = FORMATS[name][0].split(":")
    return getattr(importlib.import_module(module), cls)


def detect(zoo_dir: str | Path) -> str:
    """The name of the format of ``zoo_dir``; ZooGraphError when it is none of them."""
    zoo_dir = Path(zoo_dir)
    if not zoo_dir.is_dir():
        raise ZooGraphError(f"zoo folder {zoo_dir} does not exist")
    for name in FORMATS:
        if format_class(name).detect(zoo_dir):
            return name
    raise ZooGraphError(f"{zoo_dir} holds no zoo this program can read: no checkpoints (.pt2, .pt, .pth, "
                        ".safetensors), no Small CNN Zoo files (weights.npy, layout.csv, metrics.csv.gz), no "
                        "Hugging Face model folders (config.json + model.safetensors) and no Model Zoos trial "
                        "folders (params.json + checkpoint_*/checkpoints); nothing was ingested")


def open_zoo(zoo_dir: str | Path, fmt: str | None = None, **options: Any) -> ZooFormat:
    """The zoo at ``zoo_dir`` read as ``fmt`` (default: detected); options a format does not take
    are refused by name. Options left None are not passed."""
    name = fmt or detect(zoo_dir)
    return format_class(name)(zoo_dir, **{k: v for k, v in options.items() if v is not None})
