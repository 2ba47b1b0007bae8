"""The weights a trained run saves (``CATALOG/artifacts/RUN_ID/<stem>.safetensors``), and reading them back.

A run's weights are written as safetensors (tensors and a JSON header, nothing executable). Runs
saved before that hold ``<stem>.pt`` files; those are read by the project's restricted reader
(``pipeline.torch_archive``), never by ``torch.load``: a run folder can come from someone else.
"""
from __future__ import annotations

import torch

from graphstore.catalog import Catalog
from pipeline.torch_archive import load_tensor_dict
from zoocore.errors import CheckpointError, JobError


def weights_files(stem: str, state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """``{"<stem>.safetensors": bytes}`` of a module's state dict (on the CPU, contiguous)."""
    from safetensors.torch import save

    return {f"{stem}.safetensors": save({k: v.detach().cpu().contiguous() for k, v in state.items()})}


def read_weights(catalog: Catalog, run_id: str, stem: str) -> dict[str, torch.Tensor]:
    """The state dict saved as ``stem`` in a run's artifacts (safetensors, or a legacy ``.pt``)."""
    raw = catalog.read_artifact(run_id, f"{stem}.safetensors")
    where = f"run {run_id}: {stem}"
    try:
        if raw is not None:
            from safetensors.torch import load

            return load(raw)
        raw = catalog.read_artifact(run_id, f"{stem}.pt")
        if raw is None:
            raise JobError(f"run {run_id!r} has no weights {stem!r} in {catalog.artifacts_dir}")
        return load_tensor_dict(raw, where + ".pt")
    except CheckpointError as exc:
        raise JobError(f"cannot read the weights of {exc}") from exc
    except (ValueError, RuntimeError, OSError) as exc:        # safetensors' own errors
        raise JobError(f"cannot read the weights of {where}.safetensors: {str(exc).splitlines()[0][:200]}") from exc


def require_run(catalog: Catalog, run_id: str) -> str:
    """``run_id`` when it is a plain name and a run the catalog's ``runs`` relation lists: a run id
    is looked up, never followed as a path."""
    from graphstore import duck
    from zoocore.names import check_name

    check_name(run_id, "run id")
    con = duck.connect(catalog, ["runs"])
    try:
        found = con.execute("SELECT count(*) FROM runs WHERE run_id = ?", [run_id]).fetchone()[0]
    finally:
        con.close()
    if not found:
        raise JobError(f"no run {run_id!r} in the catalog's runs (list them with: pipeline sql "
                       "\"SELECT run_id, task, target FROM runs\")")
    return run_id


PREDICTOR_FORMAT = "zoograph.predictor/1"


def predictor_files(stem: str, predictor) -> dict[str, bytes]:
    """``{"<stem>.json", "<stem>.safetensors"}`` of a fitted tabular or weight-space predictor (jobs.predictors):
    its JSON state and its arrays (a tabular one's training rows, a weight-space one's network); ``read_predictor`` refits it from them."""
    import json

    from safetensors.numpy import save

    state, arrays = predictor.save()
    return {f"{stem}.json": json.dumps({"format": PREDICTOR_FORMAT, **state}, indent=1).encode(),
            f"{stem}.safetensors": save(arrays)}


def read_predictor(catalog: Catalog, run_id: str, stem: str):
    """The tabular or weight-space predictor saved as ``stem`` in a run's artifacts, rebuilt; None when the run
    saved none under that name."""
    import json

    from jobs.predictors import entry, predictor_class

    raw = catalog.read_artifact(run_id, f"{stem}.json")
    if raw is None:
        return None
    where = f"run {run_id}: {stem}"
    try:
        state = json.loads(raw)
        if not isinstance(state, dict) or state.get("format") != PREDICTOR_FORMAT:
            raise ValueError(f"not a {PREDICTOR_FORMAT} file")
        if entry(state["name"]).family == "metanetwork":
            raise ValueError(f"{state['name']!r} is a metanetwork, not a predictor fitted on a split")
        data = catalog.read_artifact(run_id, f"{stem}.safetensors")
        if data is None:
            raise ValueError(f"{stem}.safetensors is missing")
        from safetensors.numpy import load

        return predictor_class(state["name"]).load(state, load(data))
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise JobError(f"cannot read the predictor of {where}: {str(exc).splitlines()[0][:200]}") from exc
