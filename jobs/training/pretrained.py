"""Fine-tuning (``--init-from RUN_ID``): a run that starts from another run's trained metanetwork
instead of a random one (issue #31's "pretraining on large generated zoos, fine-tuning on the
user's zoo").

The project can make as many models as it likes; a user's zoo is often a few hundred. A
metanetwork trained on a large generated zoo (``jobs train-heterognn`` on it) is continued on the
user's zoo: every ensemble member starts from the source run's member k mod n, with the source's
hyperparameters, edge types and kernel frame (so every tensor carries over); the selected models
must fit them, as for ``jobs predict``. The per-layer normalisation and the target scale are the
new zoo's; a source whose head reads statistics (``--head-statistics``) gives the run its
statistics map too. The source run may live in another catalog (``--init-catalog``); its weights
are read as tensors only, like any run folder.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from graphstore.catalog import Catalog
from jobs.metanets.ngnn import NGGNNConfig
from jobs.training.head_statistics import HeadStatistics
from zoocore.errors import JobError


@dataclass
class Pretrained:
    run_id: str
    config: NGGNNConfig                 # the source's metanetwork (edge types, frame, hyperparameters)
    frame: tuple[int, int]
    states: list[dict[str, torch.Tensor]]     # one state dict per source member
    head: HeadStatistics | None = None  # the source's statistics map (--head-statistics): the new zoo's models
    #                                     are read and scored with it, so the head's inputs mean what they meant

    def state_for(self, member: int) -> dict[str, torch.Tensor]:
        return self.states[member % len(self.states)]

    def fit(self, sel, out_dim: int) -> NGGNNConfig:
        """The configuration the fine-tuned members are built with, after checking that ``sel``'s
        models fit the source (edge types it knows, kernels within its frame, the same output);
        ``sel`` is given the source's edge types and frame."""
        unknown = sorted(set(sel.etypes) - set(self.config.etypes))
        if unknown:
            raise JobError(f"--init-from {self.run_id}: these models have edge types its metanetwork never saw: "
                           f"{unknown}")
        if sel.frame[0] > self.frame[0] or sel.frame[1] > self.frame[1]:
            raise JobError(f"--init-from {self.run_id}: these models have kernels up to {tuple(sel.frame)}, its "
                           f"metanetwork reads {self.frame}")
        if self.config.out_dim != out_dim:
            raise JobError(f"--init-from {self.run_id}: its metanetwork has {self.config.out_dim} outputs, "
                           f"this task needs {out_dim}")
        sel.frame, sel.etypes = self.frame, list(self.config.etypes)
        return replace(self.config)


def load_pretrained(catalog: Catalog, run_id: str, source: str | None = None) -> Pretrained:
    """The metanetwork of run ``run_id`` of catalog ``source`` (default: ``catalog``)."""
    from jobs.training.artifacts import load_metanetwork

    where = catalog if source is None else Catalog(source)
    if not where.exists():
        raise JobError(f"--init-catalog: no catalog at {source}")
    models, manifest = load_metanetwork(where, run_id)
    return Pretrained(run_id, manifest.model, tuple(manifest.frame),
                      [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models], manifest.head)
