"""A trained run's manifest (``CATALOG/artifacts/RUN_ID/metanet.json``), typed.

It names the metanetwork and its configuration, how many ensemble members were saved, the
per-layer statistics and kernel frame its inputs were normalised with, the task and target
(with the regression scale or the class names), and the training configuration. ``jobs predict``
and merging rebuild everything from it. The JSON keys are those runs have always been saved
with, so older runs load (a manifest without ``format`` is format 1; without ``members``, one
member; a model without ``kind``, NG-GNN).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from jobs.training.data import LayerStats
from jobs.training.head_statistics import HeadStatistics
from jobs.metanets.ngnn import NGGNNConfig
from jobs.training.tasks import TargetScale, Task, task_named
from jobs.training.trust import TrustProfile
from zoocore.errors import JobError

FORMAT = "zoograph.run/1"


@dataclass
class RunManifest:
    model: NGGNNConfig
    stats: LayerStats
    task: str                              # a jobs.training.tasks name: regression | classification
    target: str
    frame: tuple[int, int]                 # the kernel frame (Kh, Kw) edge features were padded to
    scale: TargetScale = field(default_factory=TargetScale)
    classes: list[str] = field(default_factory=list)
    members: int = 1
    train: dict[str, Any] = field(default_factory=dict)   # the TrainConfig the run was made with
    trust: TrustProfile | None = None      # the training models' weight-scale envelope (runs saved before: none)
    head: HeadStatistics | None = None     # the head's statistics map (--head-statistics), else none

    @property
    def task_kind(self) -> Task:
        return task_named(self.task)

    def to_json(self) -> bytes:
        d = {"format": FORMAT, "model": self.model.to_dict(), "members": self.members, "stats": self.stats.to_dict(),
             "target_mean": self.scale.mean, "target_std": self.scale.std,
             "target_knots": [list(self.scale.knots_x), list(self.scale.knots_y)], "task": self.task,
             "target": self.target,
             "classes": list(self.classes), "frame": list(self.frame), "train": self.train,
             **({"trust": self.trust.to_dict()} if self.trust is not None else {}),
             **({"head_statistics": self.head.to_dict()} if self.head is not None else {})}
        return json.dumps(d, indent=1, default=str).encode()

    @classmethod
    def from_json(cls, raw: bytes | str, where: str = "metanet.json") -> "RunManifest":
        try:
            d = json.loads(raw)
            fmt = d.get("format", FORMAT)
            if fmt != FORMAT:
                raise JobError(f"{where} is {fmt!r}; this version reads {FORMAT!r}")
            return cls(model=NGGNNConfig.from_dict(d["model"]), stats=LayerStats.from_dict(d["stats"]),
                       task=d["task"], target=d["target"], frame=tuple(d["frame"]),
                       scale=TargetScale(float(d.get("target_mean", 0.0)), float(d.get("target_std", 1.0)),
                                         *(tuple(float(v) for v in k) for k in d.get("target_knots") or ((), ()))),
                       classes=list(d.get("classes") or []), members=int(d.get("members", 1)),
                       train=dict(d.get("train") or {}),
                       trust=TrustProfile.from_dict(d["trust"]) if d.get("trust") else None,
                       head=HeadStatistics.from_dict(d["head_statistics"]) if d.get("head_statistics") else None)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise JobError(f"{where} is not a readable run manifest ({type(exc).__name__}: {exc})") from None
