"""Reading checkpoints safely: torch.export archives, state dicts (.pt, .safetensors) + JSON spec.

No byte of a checkpoint reaches ``torch.load``, ``torch.jit.load``, ``torch.export.load`` or
``pickle``: ``.safetensors`` files are read by safetensors, ``.pt``/``.pth`` zip archives and the
insides of ``.pt2`` archives by ``pipeline.torch_archive`` (its own restricted unpickler; TorchScript
archives and legacy pickle files are refused by name before anything is loaded). A checkpoint file
over 64 MiB that is mostly holes (a sparse file) is refused before it is read, since its holes would
be read back as zeros (``torch_archive.refuse_sparse``).
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import torch

from pipeline import torch_archive
from zoocore.errors import CheckpointError, first_line

CHECKPOINT_SUFFIXES = (".pt2", ".pt", ".pth", ".safetensors")
MAX_SIDECAR_BYTES = 16 * 2**20      # a sidecar or spec is a few kB of JSON; at most this much is read


def load_exported(path: str | Path):
    """Load a ``torch.export`` archive (``.pt2``) without running anything from it."""
    return torch_archive.load_exported(path)


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Load a state dict from ``.safetensors`` or a ``.pt``/``.pth`` zip archive (tensors only)."""
    path = Path(path)
    if path.suffix != ".safetensors":
        return torch_archive.load_tensor_dict(path, str(path))
    torch_archive.refuse_sparse(path, str(path))     # load_file allocates the file's length
    try:
        from safetensors.torch import load_file

        return load_file(str(path))         # a flat dict of tensors by the format itself
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot read state dict: {first_line(exc)}") from exc


def tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """The shapes of a state dict's tensors without reading their data: the ``.safetensors``
    header, or the ``data.pkl`` of a ``.pt`` zip archive."""
    path = Path(path)
    if path.suffix != ".safetensors":
        state = torch_archive.load_tensor_dict(path, str(path), shapes_only=True)
        return {k: tuple(v.shape) for k, v in state.items()}
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as fh:
            return {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot read state dict: {first_line(exc)}") from exc


def sidecar_path(checkpoint: str | Path) -> Path:
    """``model.safetensors`` -> ``model.json``."""
    checkpoint = Path(checkpoint)
    return checkpoint.with_suffix(".json")


def read_sidecar(checkpoint: str | Path) -> dict[str, Any]:
    """The JSON sidecar of a checkpoint ({} when there is none)."""
    side = sidecar_path(checkpoint)
    if not side.exists():
        return {}
    return read_json_object(side, "JSON sidecar")


def read_json_object(path: str | Path, what: str = "JSON file") -> dict[str, Any]:
    """A JSON object from a file a user gave (a sidecar, a spec): size- and depth-checked, one-line
    errors."""
    path = Path(path)
    if not stat.S_ISREG(os.stat(path).st_mode):      # a FIFO or a device would block or never end
        raise CheckpointError(f"{path}: a {what} must be a regular file")
    with open(path, "rb") as fh:
        raw = fh.read(MAX_SIDECAR_BYTES + 1)         # never more than the limit, whatever stat said
    if len(raw) > MAX_SIDECAR_BYTES:
        raise CheckpointError(f"{path}: a {what} of {path.stat().st_size} bytes, over the limit of "
                              f"{MAX_SIDECAR_BYTES}")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:    # ValueError: bad JSON, or an integer of 4,300+ digits
        raise CheckpointError(f"{path}: invalid {what}: {first_line(exc)}") from exc
    except RecursionError:
        raise CheckpointError(f"{path}: {what} nested too deeply to read") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: a {what} must be a JSON object")
    return data

