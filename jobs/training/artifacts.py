"""A metanetwork run's folder (``CATALOG/artifacts/RUN_ID/``): the members' weights, the manifest,
the blend with StatNN; written as one commit, read back without running code.
"""
from __future__ import annotations

from dataclasses import asdict


from graphstore.catalog import Catalog
from jobs.config import TrainConfig
from jobs.metanets import build_metanetwork
from jobs.metanets.ngnn import NGGNN
from jobs.predictors.stacking import Stack
from jobs.training.data import LayerStats, Selection
from jobs.training.manifest import RunManifest
from jobs.training.run_weights import read_weights, require_run, weights_files
from jobs.training.tasks import TargetScale
from jobs.training.trust import TrustProfile
from zoocore.errors import JobError


def save_metanetwork(catalog: Catalog, run_id: str, models: list[NGGNN], sel: Selection, stats: LayerStats,
                     scale: TargetScale, cfg: TrainConfig, stack: Stack | None = None,
                     trust: TrustProfile | None = None, head=None):
    """``CATALOG/artifacts/RUN/``: one ``metanet-<k>.safetensors`` state dict per member,
    ``metanet.json`` and the blend with a baseline (jobs.predictors.stacking) if the run made one, committed as
    one folder (a crash leaves all of them or none)."""
    manifest = RunManifest(model=models[0].cfg, stats=stats, task=sel.task, target=sel.target, frame=tuple(sel.frame),
                           scale=scale, classes=list(sel.classes), members=len(models), train=asdict(cfg), trust=trust,
                           head=head)
    files = {}
    for k, model in enumerate(models):
        files.update(weights_files(f"metanet-{k}", model.state_dict()))
    files["metanet.json"] = manifest.to_json()
    if stack is not None:
        files.update(stack.files())
    catalog.commit_artifacts(run_id, files)
    return catalog.location("artifacts", run_id)


def load_metanetwork(catalog: Catalog, run_id: str, device: str = "cpu") -> tuple[list[NGGNN], RunManifest]:
    """The trained members of a run (weights read as tensors only: jobs.training.run_weights) and its manifest."""
    require_run(catalog, run_id)
    raw = catalog.read_artifact(run_id, "metanet.json")
    if raw is None:
        raise JobError(f"no trained metanetwork for run {run_id!r} in {catalog.artifacts_dir}")
    manifest = RunManifest.from_json(raw, f"the manifest of run {run_id!r}")
    models = []
    for k in range(manifest.members):
        model = build_metanetwork(manifest.model)
        model.load_state_dict(read_weights(catalog, run_id, f"metanet-{k}"))
        models.append(model.to(device).eval())
    return models, manifest
