"""A run's weights: written as safetensors, read back exactly; runs saved before that (``.pt``)
still load, through the restricted reader, never torch.load."""
import io

import pytest
import torch

from graphstore.catalog import Catalog
from jobs.training.run_weights import read_weights, weights_files
from zoocore.errors import JobError


def test_weights_round_trip_as_safetensors(tmp_path):
    state = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4)).state_dict()
    files = weights_files("metanet-0", state)
    assert list(files) == ["metanet-0.safetensors"] and files["metanet-0.safetensors"][:8] != b"PK\x03\x04"
    cat = Catalog(tmp_path / "cat")
    cat.commit_artifacts("run-a", files)
    got = read_weights(cat, "run-a", "metanet-0")
    assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state)


def test_a_run_saved_before_safetensors_still_loads(tmp_path):
    state = torch.nn.Linear(3, 2).state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    cat = Catalog(tmp_path / "cat")
    cat.commit_artifacts("run-old", {"metanet-0.pt": buf.getvalue()})
    got = read_weights(cat, "run-old", "metanet-0")
    assert all(torch.equal(got[k], state[k]) for k in state)
    with pytest.raises(JobError, match="no weights"):
        read_weights(cat, "run-old", "metanet-1")
