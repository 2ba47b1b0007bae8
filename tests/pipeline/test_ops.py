"""The operation registry: every kind has a record, stored dicts read back into the same record,
and a plan that names an unknown kind or field is refused with the valid names."""
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeline.neural_graph.ops import KIND_MODULES, REGISTRY, Op, op_from_dict
from pipeline.neural_graph.plan import Plan, plan_from_module
from zoocore.errors import SpecError


# kinds that stored plans name: they stay registered under these names (a plan's JSON is the catalog's)
STORED_KINDS = {"linear", "conv", "batch_norm", "layer_norm", "residual", "embedding", "class_token", "position",
                "gate", "scale", "group_norm", "relative_position", "logit_scale", "attention_bias", "attention_scale"}


def test_every_kind_is_registered_once():
    assert set(REGISTRY) >= STORED_KINDS
    assert all(issubclass(cls, Op) and cls.kind == kind and isinstance(kind, str) for kind, cls in REGISTRY.items())
    # every module of the ops package is found and imported, nothing lists them by hand
    names = sorted(m.__name__.rsplit(".", 1)[1] for m in KIND_MODULES)
    assert names == sorted(p.stem for p in (Path(KIND_MODULES[0].__file__).parent).glob("*.py")
                           if p.stem not in ("__init__", "base"))


def test_records_read_and_write_the_stored_dicts():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, groups=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2))
    plan = plan_from_module(model.eval(), torch.randn(2, 3, 6, 6))
    assert [type(op).__name__ for op in plan.ops] == ["Conv", "BatchNorm", "Linear"]
    again = Plan.from_json(plan.to_json())
    assert again.ops == plan.ops
    for op in plan.ops:
        d = op.to_dict()
        assert op_from_dict(d) == op and dict(op.items()) == d
        assert op["kind"] == d["kind"] and op.get("src_segments") is None and "src_segments" not in d
    linear = plan.ops[-1]
    assert linear["relation"] == "conv" and linear.kernel == [4, 4]      # a linear layer on a flattened map


def test_unknown_kinds_and_fields_are_refused_with_the_known_ones():
    with pytest.raises(SpecError, match="unknown operation kind 'bilinear'.*'batch_norm'"):
        op_from_dict({"kind": "bilinear", "relation": "linear", "src_layer": 0, "dst_layer": 1, "kernel": [1, 1]})
    with pytest.raises(SpecError, match=r"residual operation with unknown fields \['weight_key'\]"):
        op_from_dict({"kind": "residual", "relation": "residual", "src_layer": 0, "dst_layer": 1, "kernel": [1, 1],
                      "weight_key": "w"})
