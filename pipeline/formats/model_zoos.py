"""Model Zoos (Schürholt et al., NeurIPS 2022 Datasets and Benchmarks): ray-tune experiment folders.

Each model is a trial folder holding ``params.json`` (``model::type``, ``model::nlin``,
``model::channels_in``, ``optim::lr``, ``seed``, ...), ``result.json`` (one JSON object per line
and epoch: ``test_acc``, ``train_acc``, ``test_loss``, ``train_loss``, ``training_iteration``) and
``checkpoint_000000/checkpoints`` ... (``torch.save`` of the state dict, keys
``module_list.<i>.weight|bias``; read by the project's restricted unpickler, never by pickle).

The networks are the published small CNNs: ``CNN`` (28x28 input; conv 5x5 -> max-pool 2 -> act,
conv 5x5 -> max-pool 2 -> act, conv 2x2 -> act, flatten, linear -> act, linear) and ``CNN3``
(32x32; three conv 3x3 -> max-pool 2 -> act blocks, flatten, linear -> act, linear). Dropout moves
the ``module_list`` indices, so the layers are found from the checkpoint's keys in index order,
not from fixed indices. By default each model's last checkpoint is ingested; ``steps="all"``
ingests every one (an ``epoch`` column tells them apart). ``params.json`` fields become columns
(``model::nlin`` -> ``model__nlin``), with the epoch's metrics from ``result.json``; the
first epoch's training metrics, which the published trainable logs as -999, are recorded as null.

Not covered: ``Resnet18`` zoos (their layout was not confirmed here), and CNN Wild Park, whose
checkpoints pickle an OmegaConf configuration object that the restricted unpickler refuses.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from pipeline import torch_archive
from pipeline.checkpoints import read_json_object
from pipeline.formats.base import STEPS, Member, ZooFormat
from pipeline.neural_graph.convert import Converted, PlanCache, convert_state_dict
from pipeline.zoo_metadata import ZooMetadata, table_rows
from zoocore.errors import CheckpointError, ZooGraphError

ARCHITECTURES = {"CNN": {"side": 28, "pooled_convs": 2}, "CNN3": {"side": 32, "pooled_convs": 3}}
ACTIVATIONS = {"relu": "relu", "tanh": "tanh", "sigmoid": "sigmoid", "gelu": "gelu", "silu": "silu",
               "leakyrelu": "leaky_relu", "leaky_relu": "leaky_relu", "elu": "elu", "identity": "identity"}
SENTINEL = -999
MAX_RESULT_BYTES = 64 * 2**20       # result.json: one line per epoch of ~1-5 kB (ray-tune logs its config too);
#                                     64 MiB is 10,000 epochs of 6 kB
MAX_RESULT_LINE_BYTES = 2**20       # one epoch's line; a line is read only up to this, then refused
_CHECKPOINT = re.compile(r"^checkpoint_(\d+)$")
_KEY = re.compile(r"^module_list\.(\d+)\.(weight|bias)$")


def checkpoints_of(folder: Path) -> list[tuple[int, Path]]:
    """(epoch, checkpoint file) of a trial folder, by epoch."""
    out = []
    for d in folder.iterdir():
        m = _CHECKPOINT.match(d.name)
        if m and (d / "checkpoints").is_file():
            out.append((int(m.group(1)), d / "checkpoints"))
    return sorted(out)


def results_by_epoch(folder: Path) -> dict[int, dict[str, Any]]:
    """``result.json`` lines by ``training_iteration`` (scalars only; an unreadable line is skipped).
    A file over ``MAX_RESULT_BYTES`` or a line over ``MAX_RESULT_LINE_BYTES`` is refused
    (ZooGraphError) before it is read; at most ``MAX_RESULT_BYTES`` are read."""
    path = folder / "result.json"
    if not path.is_file():
        return {}
    out = {}
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > MAX_RESULT_BYTES:
            raise ZooGraphError(f"{path}: {size} bytes, over the limit of {MAX_RESULT_BYTES} for a result.json "
                                "(one line per epoch); nothing was ingested")
        lines = iter(lambda: fh.readline(MAX_RESULT_LINE_BYTES + 1), b"")
        for number, raw in enumerate(lines, start=1):
            if len(raw) > MAX_RESULT_LINE_BYTES or fh.tell() > MAX_RESULT_BYTES:
                raise ZooGraphError(f"{path}: line {number} is over {MAX_RESULT_LINE_BYTES} bytes (or the file grew "
                                    f"past {MAX_RESULT_BYTES}); one epoch's results are a few kB; nothing was ingested")
            try:
                rec = json.loads(raw.decode("utf-8", errors="replace"))
            except (json.JSONDecodeError, RecursionError):
                continue
            if isinstance(rec, dict) and isinstance(rec.get("training_iteration"), int):
                out[rec["training_iteration"]] = {k: v for k, v in rec.items()
                                                  if isinstance(v, (int, float, str, bool)) or v is None}
    return out


def spec_for(kind: str, channels: int, layers: list[tuple[int, tuple[int, ...], bool]], activation: str
             ) -> tuple[dict, list[int]]:
    """The spec of a published CNN whose parameterised layers (module index, weight shape, bias)
    the checkpoint holds, and the spec index of each."""
    arch = ARCHITECTURES[kind]
    convs = [l for l in layers if len(l[1]) == 4]
    fcs = [l for l in layers if len(l[1]) == 2]
    if not convs or not fcs or [len(l[1]) for l in layers] != [4] * len(convs) + [2] * len(fcs):
        raise CheckpointError(f"a {kind} checkpoint holds convolutions then linear layers; found weights of shapes "
                              f"{[list(l[1]) for l in layers]}")
    act = [] if activation == "identity" else [{"type": "activation", "fn": activation}]
    out: list[dict[str, Any]] = []
    index = []
    for i, (_, shape, bias) in enumerate(convs):
        index.append(len(out))
        out.append({"type": "conv2d", "out_channels": shape[0], "kernel_size": [shape[2], shape[3]], "bias": bias})
        if i < arch["pooled_convs"]:
            out.append({"type": "maxpool", "kernel_size": 2})
        out += act
    out.append({"type": "flatten"})
    for i, (_, shape, bias) in enumerate(fcs):
        index.append(len(out))
        out.append({"type": "linear", "out_features": shape[0], "bias": bias})
        if i < len(fcs) - 1:
            out += act
    return ({"format": "zoograph.spec/1", "input_shape": [channels, arch["side"], arch["side"]], "layers": out},
            index)


class ModelZoos(ZooFormat):
    name = "model-zoos"
    options = ("steps",)

    def __init__(self, zoo_dir, steps: str = "final"):
        super().__init__(zoo_dir, steps=steps)
        self.steps = self.choice("steps", steps, STEPS)

    @classmethod
    def detect(cls, zoo_dir: Path) -> bool:
        return any(checkpoints_of(p.parent) for p in Path(zoo_dir).rglob("params.json"))

    def _trials(self) -> list[Path]:
        return sorted({p.parent for p in self.zoo_dir.rglob("params.json") if checkpoints_of(p.parent)})

    def members(self) -> list[Member]:
        trials = self._trials()
        if not trials:
            raise ZooGraphError(f"no Model Zoos trial folders in {self.zoo_dir} (each holds params.json and "
                                "checkpoint_*/checkpoints); nothing was ingested")
        out = []
        for trial in trials:
            found = checkpoints_of(trial)
            for epoch, path in (found if self.steps == "all" else found[-1:]):
                out.append(Member(path.relative_to(self.zoo_dir).as_posix(), f"epoch {epoch}"))
        return out

    def metadata(self, members, all_members, established, on_bad_value) -> ZooMetadata:
        records: dict[str, dict[str, Any]] = {}
        trials: dict[Path, tuple[dict[str, Any], dict[int, dict[str, Any]]]] = {}   # params, results: read once
        sentinels = 0
        for m in all_members:
            ckpt = self.zoo_dir / m.key
            trial, epoch = ckpt.parent.parent, int(_CHECKPOINT.match(ckpt.parent.name).group(1))
            if trial not in trials:
                self.inside(trial / "params.json")       # a link out of the zoo refuses the zoo, by name
                self.inside(trial / "result.json")
                try:
                    params = read_json_object(trial / "params.json", "params.json")
                except Exception:       # reported with the member's conversion
                    params = {}
                trials[trial] = (params, results_by_epoch(trial))
            params, results = trials[trial]
            res = {k: v for k, v in results.get(epoch, {}).items()
                   if k in ("test_acc", "train_acc", "test_loss", "train_loss", "val_acc", "val_loss")}
            sentinels += sum(v == SENTINEL for v in res.values())
            res = {k: (None if v == SENTINEL else v) for k, v in res.items()}
            records[m.key] = {**{k: v for k, v in params.items() if not isinstance(v, (dict, list))},
                              **res, "epoch": epoch, "trial": trial.name}
        meta = table_rows(records, str(self.zoo_dir), {m.key for m in members}, established, on_bad_value)
        if sentinels:
            meta.warnings.append(f"{sentinels} metric value(s) of -999 (the trainable's 'not measured') recorded as "
                                 "null")
        return meta

    def convert(self, member: Member, metadata: dict[str, Any], cache: PlanCache) -> Converted:
        path = self.inside(self.zoo_dir / member.key)
        kind = metadata.get("model::type")
        if kind not in ARCHITECTURES:
            raise CheckpointError(f"model::type {kind!r} is not covered (covered: {', '.join(ARCHITECTURES)})")
        nlin = str(metadata.get("model::nlin", "")).lower()
        if nlin not in ACTIVATIONS:
            raise CheckpointError(f"model::nlin {nlin!r} is not covered ({', '.join(sorted(ACTIVATIONS))})")
        state = torch_archive.load_tensor_dict(path, member.key)
        layers: dict[int, dict[str, Any]] = {}
        for key, t in state.items():
            m = _KEY.match(key)
            if not m:
                raise CheckpointError(f"unexpected state entry {key!r} (a {kind} holds module_list.<i>.weight/bias)")
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = t
        found = [(i, tuple(v["weight"].shape), "bias" in v) for i, v in sorted(layers.items()) if "weight" in v]
        channels = int(metadata.get("model::channels_in") or (found[0][1][1] if found else 1))
        spec, index = spec_for(kind, channels, found, ACTIVATIONS[nlin])
        renamed = {}
        for (i, _, _), j in zip(found, index):
            for part, t in layers[i].items():
                renamed[f"layers.{j}.{part}"] = t
        return convert_state_dict(renamed, spec, cache, member.key)
