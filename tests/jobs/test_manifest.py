"""The run manifest and the parts of a run's configuration."""
import json
from dataclasses import asdict, fields

import numpy as np
import pytest

from jobs.training.data import LayerStats
from jobs.training.manifest import RunManifest
from jobs.metanets.ngnn import NGGNNConfig
from jobs.training.tasks import TargetScale
from jobs.config import DataConfig, ModelConfig, OptimConfig, TrainConfig
from jobs.training.train import metanet_config
from zoocore.errors import JobError

ETYPES = [("input", "conv", "hidden"), ("hidden", "linear", "output")]


def _manifest() -> RunManifest:
    stats = LayerStats(np.zeros(2), np.ones(2), np.zeros((2, 3)), np.ones((2, 3)))
    return RunManifest(model=NGGNNConfig(etypes=ETYPES, edge_in=9, out_dim=3, kind="ngt"), stats=stats,
                       task="classification", target="activation", frame=(3, 3), classes=["gelu", "relu", "tanh"],
                       members=2, train=asdict(TrainConfig(target="activation", epochs=3)))


def test_manifest_round_trips_typed():
    m = _manifest()
    back = RunManifest.from_json(m.to_json())
    assert back.model == m.model and back.frame == (3, 3) and back.classes == m.classes and back.members == 2
    assert back.stats.to_dict() == m.stats.to_dict() and back.task_kind.name == "classification"
    assert back.train["epochs"] == 3 and json.loads(m.to_json())["format"] == "zoograph.run/1"


def test_a_monotone_calibration_travels_with_the_run():
    m = _manifest()
    m.scale = TargetScale(0.4, 0.2, (0.1, 0.3, 0.8), (0.15, 0.2, 0.7))
    back = RunManifest.from_json(m.to_json())
    assert back.scale == m.scale


def test_manifests_saved_before_the_format_was_named_still_load():
    d = json.loads(_manifest().to_json())
    for key in ("format", "members", "target_knots"):
        del d[key]
    del d["model"]["kind"]
    d.update(task="regression", target_mean=0.5, target_std=0.25, classes=None)
    old = RunManifest.from_json(json.dumps(d))
    assert old.members == 1 and old.model.kind == "ngnn" and old.scale == TargetScale(0.5, 0.25)
    assert old.classes == []


@pytest.mark.parametrize("raw", ["{not json", "{}", json.dumps({"format": "zoograph.run/9"})])
def test_an_unreadable_manifest_is_refused_clearly(raw):
    with pytest.raises(JobError, match="run-x"):
        RunManifest.from_json(raw, "the manifest of run 'run-x'")


def test_train_config_is_its_three_parts():
    names = [[f.name for f in fields(part)] for part in (DataConfig, OptimConfig, ModelConfig)]
    flat = [n for part in names for n in part]
    assert len(flat) == len(set(flat)) and set(flat) == {f.name for f in fields(TrainConfig)}
    cfg = TrainConfig(where="zoo = 'cnn'", lr=0.01, hidden=128, model="ngt")
    assert cfg.part(DataConfig).where == "zoo = 'cnn'" and cfg.part(OptimConfig).lr == 0.01
    mcfg = metanet_config(cfg.part(ModelConfig), ETYPES, (3, 3), 1)
    assert (mcfg.hidden, mcfg.kind, mcfg.edge_in, mcfg.readout_outputs) == (128, "ngt", 9, cfg.readout_outputs)


def test_a_model_saved_before_fourier_features_and_output_readout_loads_without_them():
    """``jobs.config.LEGACY``: a key a saved model lacks takes the value runs computed before the
    field existed, not today's default (Fourier features and the output-neuron readout are on by
    default now; a run saved without them has no weights for them)."""
    d = json.loads(_manifest().to_json())
    for key in ("fourier", "readout_outputs", "attention_std", "relation_values", "heads"):
        d["model"].pop(key, None)
    old = RunManifest.from_json(json.dumps(d)).model
    assert (old.fourier, old.readout_outputs, old.attention_std, old.relation_values, old.heads) == (0, 0, False,
                                                                                                    False, 4)
    from jobs.config import MetanetConfig

    assert (MetanetConfig().fourier, MetanetConfig().readout_outputs) == (32, 10)
