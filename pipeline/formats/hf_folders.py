"""Hugging Face model folders: a zoo folder whose members are ``save_pretrained`` folders.

Each member holds ``config.json`` and ``model.safetensors`` (or a sharded
``model.safetensors.index.json`` with its shards); the zoo's ``metrics.csv`` is keyed by the
member folder's path relative to the zoo (first column). The network is rebuilt offline from its
config by the ``transformers`` class the config names in ``architectures`` (GPT-2, BERT, ViT, ...),
its tensors are read by safetensors (no pickle), weights the class ties (GPT-2's output head) are
re-tied, and its output (logits, or the last hidden state) is traced once per distinct config. Needs
the ``hf`` extra (``pip install -e '.[hf]'``).

A config is data (``checked_config``): a key that can name code, a path, a Hub repository or another
model (``auto_map``, ``trust_remote_code``, ``backbone``, ``encoder``/``decoder``, ``text_config``,
``name_or_path``, ...) is refused by name at any depth, keys starting with ``_`` (``_name_or_path``,
written by ``save_pretrained``) are dropped, transformers runs offline and never asks a question,
and the network the config describes is sized on the ``meta`` device against the bytes the folder
stores before any memory is allocated (``check_budget``).
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import sys
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
from zoocore.errors import CheckpointError, UnsupportedModuleError, ZooGraphError, first_line

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_SHARD_NAME = re.compile(r"^[A-Za-z0-9_.-]+\.safetensors$")

# Keys that make transformers load code or another model (a path, a Hub id, remote code), refused at
# any depth whatever their value.
REFUSED_KEYS = frozenset({
    "auto_map", "trust_remote_code", "custom_pipelines", "backbone", "backbone_config", "backbone_kwargs",
    "use_pretrained_backbone", "use_timm_backbone", "encoder", "decoder", "name_or_path",
    "pretrained_model_name_or_path", "model_name_or_path", "quantization_config", "attn_implementation",
    "adapter_config", "peft_config",
})
# Words that mark a key naming another model, code or a place; refused when the value is text or an
# object (a number or a list of numbers, such as Swin-v2's pretrained_window_sizes, is plain data).
_NAMING_WORDS = re.compile(r"remote|name_or_path|auto_map|backbone|pretrained|_config$|_configs$|hub|repo|"
                           r"_path$|_file$|_dir$|url|module|code", re.I)
_LABEL_KEYS = frozenset({"id2label", "label2id"})          # free text users choose; values never load
# Text that reads as a path or a Hub id ("org/repo", "../x", "C:\\x") is refused outside label maps.
_PATH_LIKE = re.compile(r"[/\\]|^\.|^~")
# The network the config describes may hold at most this many times the bytes the folder stores, plus
# a little for buffers (position ids): a config cannot make ingest allocate memory the zoo does not hold.
STATE_RATIO, STATE_SLACK = 2, 4 << 20
MAX_IMAGE_SIDE, MAX_CHANNELS = 1024, 16         # the traced example image: at most 1024 x 1024 x 16
MAX_TOKENS = 4096                                # tokens (patches) one attention layer attends over
MAX_CONFIG_DEPTH = 8
# Building even an empty (meta) network takes time per layer: counts of layers, blocks or heads above
# this are refused before anything is built (the largest published models have under 200 layers).
MAX_COUNT = 1024
_COUNT_KEY = re.compile(r"(^|_)(n_?)?(layers?|blocks?|heads?|depths?|stages?|experts?)$", re.I)
MAX_INTEGER = 2 ** 40           # no size in a config is larger; a 5000-digit integer is refused as such


def checked_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    """``config`` without its private keys, refused (CheckpointError) when any key at any depth can
    name code, a path, a Hub repository or another model (see the module docstring)."""

    def walk(value: Any, path: str, depth: int, labels: bool) -> None:
        if depth > MAX_CONFIG_DEPTH:
            raise CheckpointError(f"{where}: config.json is nested deeper than {MAX_CONFIG_DEPTH} levels at {path}")
        if isinstance(value, dict):
            if depth and "model_type" in value and not labels:
                raise CheckpointError(f"{where}: config.json key {path!r} is the config of another model; "
                                      "composite models are not read (a sub-model can name code or a Hub id)")
            for key, item in value.items():
                key_path = f"{path}.{key}" if path else str(key)
                if not labels:
                    refuse_key(str(key), item, key_path)
                walk(item, key_path, depth + 1, labels or key in _LABEL_KEYS)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, f"{path}[{i}]", depth + 1, labels)
        elif isinstance(value, int) and not isinstance(value, bool) and not labels:
            name = path.rsplit(".", 1)[-1].split("[")[0]
            if abs(value) > MAX_INTEGER or (_COUNT_KEY.search(name) and value > MAX_COUNT):
                raise CheckpointError(f"{where}: config.json key {path!r} is {str(value)[:20]}"
                                      f"{'...' if len(str(value)) > 20 else ''}, over the limit of "
                                      f"{MAX_COUNT if _COUNT_KEY.search(name) else MAX_INTEGER}")
        elif isinstance(value, str) and not labels and path != "architectures[0]" and _PATH_LIKE.search(value):
            raise CheckpointError(f"{where}: config.json key {path!r} holds {value[:60]!r}, which reads as a path or "
                                  "a Hub repository; a config may not name files or other models")

    def refuse_key(key: str, item: Any, key_path: str) -> None:
        if key.startswith("_"):
            return
        if key in REFUSED_KEYS or (isinstance(item, (str, dict)) and _NAMING_WORDS.search(key)):
            raise CheckpointError(f"{where}: config.json key {key_path!r} can name code, a path or another model; "
                                  "such configs are refused (a config is data)")

    if not isinstance(config, dict):
        raise CheckpointError(f"{where}: config.json must be a JSON object")
    clean = {k: v for k, v in config.items() if not str(k).startswith("_")}
    walk(clean, "", 0, False)
    return {k: v for k, v in clean.items() if k != "transformers_version"}


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


_OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def _transformers():
    """transformers, imported offline where this is its first import (the Hub libraries read these
    variables once, at import); the variables are put back after, so no child process inherits them.
    A config can name no Hub id anyway (``checked_config``): this is the second lock."""
    saved = {k: os.environ.get(k) for k in _OFFLINE}
    os.environ.update({k: "1" for k in _OFFLINE})
    try:
        import transformers
    except ImportError:
        raise CheckpointError("Hugging Face model folders need the transformers package: "
                              "pip install -e '.[hf]'") from None
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return transformers


def model_class(config: dict[str, Any], where: str):
    """The transformers model class a config names (``architectures[0]``), checked to be one of a
    single model whose config class is the one ``model_type`` names."""
    transformers = _transformers()
    names = config.get("architectures") or []
    name = names[0] if isinstance(names, list) and names and isinstance(names[0], str) else None
    cls = getattr(transformers, name, None) if name and name.isidentifier() else None
    if cls is None or not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise CheckpointError(f"{where}: config.json names no transformers model class in 'architectures' "
                              f"({names!r:.80})")
    config_class = getattr(cls, "config_class", None)
    if config_class is None or getattr(config_class, "is_composition", False) \
            or getattr(config_class, "model_type", None) != config.get("model_type"):
        raise CheckpointError(f"{where}: config.json's architectures {name!r} and model_type "
                              f"{str(config.get('model_type'))[:40]!r} do not name one single model")
    return cls


def stored_bytes(folder: Path) -> int:
    """The bytes of the folder's safetensors files (the budget every allocation is held to)."""
    if (folder / SINGLE).is_file():
        return (folder / SINGLE).stat().st_size
    return sum(f.stat().st_size for f in shard_files(folder))


def check_budget(cls, cfg, folder: Path) -> None:
    """Refuse (CheckpointError) a config whose network or example input would take memory the
    folder's weights do not account for: the network is built on the ``meta`` device (no memory)
    and its bytes compared with the stored bytes; the example input and attention are bounded."""
    stored = stored_bytes(folder)
    try:
        with torch.device("meta"):
            shell = cls(cfg)
    except Exception as exc:
        raise CheckpointError(f"{folder}: config.json does not build a {cls.__name__}: {first_line(exc)}") from None
    seen, need = set(), 0
    for t in list(shell.parameters()) + list(shell.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            need += t.numel() * t.element_size()
    if need > STATE_RATIO * stored + STATE_SLACK:
        raise CheckpointError(f"{folder}: config.json describes a {cls.__name__} of {need} bytes, but the folder "
                              f"stores {stored} bytes of weights; refused before allocating")
    if shell.main_input_name == "pixel_values":
        side, channels = int(getattr(cfg, "image_size", 32)), int(getattr(cfg, "num_channels", 3))
        if not (0 < side <= MAX_IMAGE_SIDE and 0 < channels <= MAX_CHANNELS):
            raise CheckpointError(f"{folder}: config.json asks for {channels} x {side} x {side} images; at most "
                                  f"{MAX_CHANNELS} x {MAX_IMAGE_SIDE} x {MAX_IMAGE_SIDE} are traced")
        patch = getattr(cfg, "patch_size", None)
        patch = patch[0] if isinstance(patch, (list, tuple)) and patch else patch
        if isinstance(patch, int) and patch > 0 and (side // patch) ** 2 > MAX_TOKENS:
            raise CheckpointError(f"{folder}: config.json makes {(side // patch) ** 2} patches; attention over more "
                                  f"than {MAX_TOKENS} is refused")


def shard_files(folder: Path) -> list[Path]:
    """The shard files a sharded folder's index names: file names beside the index only."""
    index = checkpoints.read_json_object(folder / INDEX, "safetensors index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{folder / INDEX}: no 'weight_map'")
    names = sorted(set(weight_map.values()))
    bad = [n for n in names if not isinstance(n, str) or not _SHARD_NAME.match(n)]
    if bad:       # a shard is a file beside the index, never a path elsewhere
        raise CheckpointError(f"{folder / INDEX}: shard {bad[0]!r} is not a file name in the folder")
    return [folder / n for n in names]


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors, from ``model.safetensors`` or every shard its index names."""
    from safetensors.torch import load_file

    files = [folder / SINGLE] if (folder / SINGLE).is_file() else shard_files(folder)
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
    config = checked_config(config, str(folder))
    cls = model_class(config, str(folder))
    with no_questions():
        try:
            cfg = transformers.AutoConfig.for_model(**config)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise CheckpointError(f"{folder}: config.json is not a valid {config.get('model_type')!r} config: "
                                  f"{first_line(exc)}") from None
        if hasattr(cfg, "use_cache"):
            cfg.use_cache = False
        check_budget(cls, cfg, folder)
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


@contextlib.contextmanager
def no_questions():
    """Standard input reads as empty while a model is built: nothing in transformers may ask the
    user a question (``trust_remote_code`` prompts) and wait for an answer."""
    saved = sys.stdin
    sys.stdin = io.StringIO("")
    try:
        yield
    finally:
        sys.stdin = saved


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
        folder = self.inside(self.zoo_dir / member.key)
        for name in ("config.json", SINGLE, INDEX):
            self.inside(folder / name)
        if not (folder / SINGLE).is_file():
            for shard in shard_files(folder):
                self.inside(shard)
        config = checkpoints.read_json_object(folder / "config.json", "config.json")
        model = load_model(folder, config)
        key = hashlib.sha256(json.dumps({k: v for k, v in config.items() if not k.startswith("_")
                                         and k != "transformers_version"}, sort_keys=True).encode()).hexdigest()
        _, plan, program = cache.traced(key, lambda: traced_plan(model))
        state = ModelOutput(model).state_dict()
        return Converted(plan, graph_from_plan(plan, state), state, program=lambda: program)
