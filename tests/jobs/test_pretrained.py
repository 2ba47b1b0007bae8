"""--init-from: a run fine-tunes another run's metanetwork (pretraining on a large generated zoo,
then the user's zoo). Every tensor carries over, the source may sit in another catalog, and
models the source cannot read are refused in one line."""
import shutil

import pytest
import torch

from graphstore.catalog import Catalog
from jobs.config import TrainConfig
from jobs.training.artifacts import load_metanetwork
from jobs.training.train import train_heterognn
from zoocore.errors import JobError
from zoocore.names import InvalidName

SMALL = dict(ensemble=1, epochs=1, batch_size=8, hidden=16, edge_hidden=8, layers=1, patience=1, baselines=False)


def test_a_fine_tuned_run_starts_from_the_source_and_keeps_its_shape(catalog_copy, tmp_path):
    source = train_heterognn(catalog_copy, TrainConfig(where="zoo = 'cnn'", **SMALL), progress=False)
    # the source in another catalog: copied away, as a pretraining catalog would be
    other = tmp_path / "pretraining"
    shutil.copytree(catalog_copy, other)
    (src_model,), src_manifest = load_metanetwork(Catalog(other), source.run_id)
    # lr 0: fine-tuning moves nothing, so the members are the source's tensors, whatever the options say
    cfg = TrainConfig(where="zoo = 'cnn'", init_from=source.run_id, init_catalog=str(other),
                      **{**SMALL, "hidden": 32, "ensemble": 2, "lr": 0.0, "seed": 5})
    tuned = train_heterognn(catalog_copy, cfg, progress=False)
    members, manifest = load_metanetwork(Catalog(catalog_copy), tuned.run_id)
    assert len(members) == 2 and manifest.train["hidden"] == 16 and manifest.train["init_from"] == source.run_id
    # the head reads statistics by default; the fine-tuned run reads them with the source's map, not a new one
    assert src_manifest.head is not None and src_manifest.head.width == src_model.cfg.statistics_dim > 0
    assert manifest.head.to_dict() == src_manifest.head.to_dict()
    for member in members:
        state = member.state_dict()
        assert state.keys() == src_model.state_dict().keys()
        assert all(torch.equal(state[k], v) for k, v in src_model.state_dict().items())
    # with a learning rate it moves away from the source
    moved = train_heterognn(catalog_copy, TrainConfig(where="zoo = 'cnn'", init_from=source.run_id,
                                                      **{**SMALL, "lr": 1e-2}), progress=False)
    (m,), _ = load_metanetwork(Catalog(catalog_copy), moved.run_id)
    assert any(not torch.equal(m.state_dict()[k], v) for k, v in src_model.state_dict().items()
               if v.is_floating_point())


def test_models_the_source_cannot_read_are_refused_in_one_line(catalog_copy):
    mlp = train_heterognn(catalog_copy, TrainConfig(where="zoo = 'mlp'", **SMALL), progress=False)
    with pytest.raises(JobError, match="edge types its metanetwork never saw") as exc:
        train_heterognn(catalog_copy, TrainConfig(where="zoo = 'cnn'", init_from=mlp.run_id, **SMALL),
                        progress=False)
    assert "\n" not in str(exc.value)
    with pytest.raises(JobError, match="no run 'run-nope'"):
        train_heterognn(catalog_copy, TrainConfig(where="zoo = 'cnn'", init_from="run-nope", **SMALL),
                        progress=False)
    with pytest.raises(InvalidName, match="run id"):            # a name, never followed as a path
        train_heterognn(catalog_copy, TrainConfig(where="zoo = 'cnn'", init_from="../x", **SMALL), progress=False)
    with pytest.raises(JobError, match="--model statnn is not one"):   # a tabular answer has nothing to start from
        train_heterognn(catalog_copy, TrainConfig(where="zoo = 'cnn'", init_from=mlp.run_id, model="statnn"),
                        progress=False)
    with pytest.raises(JobError, match="no catalog"):
        train_heterognn(catalog_copy, TrainConfig(where="zoo = 'cnn'", init_from=mlp.run_id,
                                                  init_catalog="/nonexistent/cat", **SMALL), progress=False)
