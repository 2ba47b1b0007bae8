"""Reading checkpoints safely: torch.export archives, state dicts (.pt, .safetensors) + JSON spec.

Nothing here unpickles arbitrary objects: ``.pt`` files load with ``weights_only=True`` and the
weights inside a ``.pt2`` archive go through the same restricted unpickler.
"""
from __future__ import annotations

import contextlib
import functools
import json
import zipfile
from pathlib import Path
from typing import Any

import torch

from zoocore.errors import CheckpointError

CHECKPOINT_SUFFIXES = (".pt2", ".pt", ".pth", ".safetensors")


@contextlib.contextmanager
def _weights_only_torch_load():
    """torch 2.2's torch.export.load calls a plain torch.load on the archive's weights; make it
    the restricted unpickler so a payload cannot run."""
    original = torch.load
    torch.load = functools.partial(original, weights_only=True)
    try:
        yield
    finally:
        torch.load = original


def load_exported(path: str | Path):
    """Load a ``torch.export`` archive (``.pt2``) without running pickled code."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path}: not a torch.export archive (not a zip file)")
    try:
        with _weights_only_torch_load():
            return torch.export.load(str(path))
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot load torch.export archive: {_first_line(exc)}") from exc


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Load a state dict from ``.safetensors`` or a ``.pt``/``.pth`` file (weights only)."""
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot read state dict: {_first_line(exc)}") from exc
    return _tensor_dict(path, state)


def tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """The shapes of a state dict's tensors without reading their data: the ``.safetensors``
    header, or a ``.pt`` zip archive mapped into memory (an old-style ``.pt`` is loaded: its size
    is the file's own)."""
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as fh:
                return {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
        try:
            state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot read state dict: {_first_line(exc)}") from exc
    return {k: tuple(v.shape) for k, v in _tensor_dict(path, state).items()}


def _tensor_dict(path: Path, state) -> dict[str, torch.Tensor]:
    """A loaded checkpoint as a state dict of tensors (unwrapping ``{"state_dict": ...}``), or refused."""
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: not a state dict of tensors")
    return state


def sidecar_path(checkpoint: str | Path) -> Path:
    """``model.safetensors`` -> ``model.json``."""
    checkpoint = Path(checkpoint)
    return checkpoint.with_suffix(".json")


def read_sidecar(checkpoint: str | Path) -> dict[str, Any]:
    """The JSON sidecar of a checkpoint ({} when there is none)."""
    side = sidecar_path(checkpoint)
    if not side.exists():
        return {}
    try:
        data = json.loads(side.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{side}: invalid JSON sidecar: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{side}: a sidecar must be a JSON object")
    return data


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]
