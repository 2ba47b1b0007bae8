"""Hugging Face model folders: a zoo folder whose members are ``save_pretrained`` folders.

Each member holds ``config.json`` and ``model.safetensors`` (or a sharded
``model.safetensors.index.json`` with its shards); the zoo's ``metrics.csv`` is keyed by the
member folder's path relative to the zoo (first column). The network is rebuilt offline from its
config by the ``transformers`` class the config names in ``architectures`` (GPT-2, BERT, ViT, ...;
never remote code), its tensors are read by safetensors (no pickle), weights the class ties (GPT-2's
output head) are re-tied, and its output (logits, or the last hidden state) is traced once per
distinct config. Needs the ``hf`` extra (``pip install -e '.[hf]'``).
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import torch

from pipeline import checkpoints
from pipeline.formats.base import Member, ZooFormat
from pipeline.neural_graph.build import graph_from_plan
from pipeline.neural_graph.convert import Converted, PlanCache
from pipeline.neural_graph.plan import exported_plan
from pipeline.neural_graph.runnable import keep_program
from pipeline.zoo_metadata import ZooMetadata, read_metrics_csv, table_rows
from zoocore.errors import CheckpointError, UnsupportedModuleError, ZooGraphError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_SHARD_NAME = re.compile(r"^[A-Za-z0-9_.-]+\.safetensors$")


def is_member(folder: Path) -> bool:
    return (folder / "config.json").is_file() and ((folder / SINGLE).is_file() or (folder / INDEX).is_file())


class ModelOutput(torch.nn.Module):
    """One of the model's outputs as a plain tensor: the first (logits, or the last hidden state),
    or a later one that reads every parameter (BERT's pooled output reads the pooler too)."""

    def __init__(self, model, index: int = 0):
        super().__init__()
        self.model = model
        self.index = index

    def forward(self, x):
        return self.model(x, return_dict=False)[self.index]


def traced_plan(model):
    """The plan of the first output of ``model`` that reads every parameter."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()         # its advice about attention masks is not the user's concern here
    try:
        return _traced_plan(model)
    finally:
        hf_logging.set_verbosity(level)


def _traced_plan(model):
    x = example_input(model)
    with torch.no_grad():
        outputs = model(x, return_dict=False)
    first_error = None
    for i, out in enumerate(outputs):
        if not isinstance(out, torch.Tensor):
            continue
        try:
            plan, exported = exported_plan(ModelOutput(model, i), x)
            return i, plan, keep_program(exported, plan.state_keys)
        except UnsupportedModuleError as exc:
            first_error = first_error or exc
    raise first_error or CheckpointError("the model has no tensor output")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise CheckpointError("Hugging Face model folders need the transformers package: "
                              "pip install -e '.[hf]'") from None
    return transformers


def model_class(config: dict[str, Any], where: str):
    """The transformers model class a config names (``architectures[0]``), checked to be one."""
    transformers = _transformers()
    names = config.get("architectures") or []
    name = names[0] if isinstance(names, list) and names and isinstance(names[0], str) else None
    cls = getattr(transformers, name, None) if name and name.isidentifier() else None
    if cls is None or not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise CheckpointError(f"{where}: config.json names no transformers model class in 'architectures' "
                              f"({names!r:.80})")
    return cls


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors, from ``model.safetensors`` or every shard its index names."""
    from safetensors.torch import load_file

    if (folder / SINGLE).is_file():
        files = [folder / SINGLE]
    else:
        index = checkpoints.read_json_object(folder / INDEX, "safetensors index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{folder / INDEX}: no 'weight_map'")
        names = sorted(set(weight_map.values()))
        bad = [n for n in names if not isinstance(n, str) or not _SHARD_NAME.match(n)]
        if bad:       # a shard is a file beside the index, never a path elsewhere
            raise CheckpointError(f"{folder / INDEX}: shard {bad[0]!r} is not a file name in the folder")
        files = [folder / n for n in names]
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as exc:
            raise CheckpointError(f"{f}: cannot read safetensors: {str(exc).splitlines()[0]}") from exc
    return state


def example_input(model) -> torch.Tensor:
    cfg = model.config
    if model.main_input_name == "pixel_values":
        side = int(getattr(cfg, "image_size", 32))
        return torch.zeros(1, int(getattr(cfg, "num_channels", 3)), side, side)
    if model.main_input_name == "input_ids":
        n = min(8, int(getattr(cfg, "max_position_embeddings", getattr(cfg, "n_positions", 8)) or 8))
        return torch.arange(n).remainder(int(cfg.vocab_size)).unsqueeze(0)
    raise CheckpointError(f"models whose input is {model.main_input_name!r} are not covered")


def load_model(folder: Path, config: dict[str, Any]):
    """The folder's network with its own weights, tied weights re-tied; refuses missing weights."""
    transformers = _transformers()
    cls = model_class(config, str(folder))
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "auto_map"})
    if hasattr(cfg, "use_cache"):
        cfg.use_cache = False
    torch.manual_seed(0)
    model = cls(cfg).eval()
    state = read_tensors(folder)
    missing, unexpected = model.load_state_dict(state, strict=False)
    ignored = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    unexpected = [k for k in unexpected if not any(p.search(k) for p in ignored)]
    if unexpected:
        raise CheckpointError(f"{folder}: tensors the {cls.__name__} has no place for, e.g. {unexpected[:3]}")
    model.tie_weights()
    loaded = {t.data_ptr() for k, t in model.state_dict().items() if k in state}
    lost = [k for k in missing if model.state_dict()[k].data_ptr() not in loaded
            and not k.endswith(("position_ids", "masked_bias")) and not k.endswith(".attn.bias")]
    if lost:
        raise CheckpointError(f"{folder}: the {cls.__name__} needs weights the folder lacks, e.g. {lost[:3]}")
    return model


class HFFolders(ZooFormat):
    name = "hf-folders"

    @classmethod
    def detect(cls, zoo_dir: Path) -> bool:
        return any(is_member(p.parent) for p in Path(zoo_dir).rglob("config.json"))

    def members(self) -> list[Member]:
        root = self.zoo_dir
        found = sorted({p.parent for p in root.rglob("config.json") if is_member(p.parent)})
        if not found:
            raise ZooGraphError(f"no Hugging Face model folders in {root} (each needs config.json and "
                                f"{SINGLE} or {INDEX}); nothing was ingested")
        return [Member(p.relative_to(root).as_posix(), p.name) for p in found]

    def metadata(self, members, all_members, established, on_bad_value) -> ZooMetadata:
        warnings: list[str] = []
        rows = read_metrics_csv(self.zoo_dir, warnings)
        meta = table_rows({m.key: dict(rows[m.key].values) if m.key in rows else {} for m in all_members},
                          str(self.zoo_dir / "metrics.csv"), {m.key for m in members}, established, on_bad_value)
        unlisted = [m.key for m in members if m.key not in rows]
        if rows and unlisted:
            warnings.append(f"metrics.csv does not list {len(unlisted)} member folder(s), e.g. {unlisted[0]!r}")
        meta.warnings[:0] = warnings
        return meta

    def convert(self, member: Member, metadata: dict[str, Any], cache: PlanCache) -> Converted:
        folder = self.zoo_dir / member.key
        config = checkpoints.read_json_object(folder / "config.json", "config.json")
        model = load_model(folder, config)
        key = hashlib.sha256(json.dumps({k: v for k, v in config.items() if not k.startswith("_")
                                         and k != "transformers_version"}, sort_keys=True).encode()).hexdigest()
        _, plan, program = cache.traced(key, lambda: traced_plan(model))
        state = ModelOutput(model).state_dict()
        return Converted(plan, graph_from_plan(plan, state), state, program=lambda: program)
