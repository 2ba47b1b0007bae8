"""A spec that declares more than its checkpoint holds is refused before anything is built."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from graphstore import duck
from pipeline.checkpoints import tensor_shapes
from pipeline.ingest import ingest_zoo
from pipeline.neural_graph.convert import convert_checkpoint
from pipeline.spec import build_module
from zoocore.errors import SpecError

# Convert a checkpoint with a given spec in a fresh process; print the peak RSS growth (MB) and the error.
MEASURE = r"""
import json, resource, sys, time
from pipeline.neural_graph.convert import convert_checkpoint
from zoocore.errors import SpecError
spec = json.loads(open(sys.argv[2]).read())
convert_checkpoint(sys.argv[3])                        # warm up: imports, first allocations
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
started = time.perf_counter()
try:
    convert_checkpoint(sys.argv[1], spec)
    message = "accepted"
except SpecError as exc:
    message = str(exc)
print(json.dumps({"grew_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024,
                  "seconds": time.perf_counter() - started, "message": message}))
"""


def _hostile(spec: dict, size: int = 100_000_000) -> dict:
    spec = json.loads(json.dumps(spec))
    next(layer for layer in spec["layers"] if layer["type"] == "linear")["out_features"] = size
    return spec


def test_hostile_sidecar_is_refused_fast_with_bounded_memory(tmp_path, mlp_zoo):
    good, other = sorted(mlp_zoo.glob("*.safetensors"))[:2]
    spec = json.loads(good.with_suffix(".json").read_text())["architecture"]
    hostile = tmp_path / "hostile.json"
    hostile.write_text(json.dumps(_hostile(spec)))
    assert hostile.stat().st_size < 1000
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", MEASURE, str(good), str(hostile), str(other)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["grew_mb"] < 200 and result["seconds"] < 5, result
    first = spec["layers"][0]["out_features"]
    assert result["message"] == (f"{good}: the spec's layers[0] (linear) declares layers.0.weight of shape "
                                 f"[100000000, 4], the checkpoint holds [{first}, 4]")


def test_ingest_records_the_hostile_spec_and_ingests_the_rest(tmp_path, mlp_zoo):
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    for p in sorted(mlp_zoo.glob("*.safetensors"))[:3]:
        shutil.copy(p, zoo / p.name)
        shutil.copy(p.with_suffix(".json"), zoo / p.with_suffix(".json").name)
    victim = zoo / sorted(p.name for p in zoo.glob("*.json"))[0]
    side = json.loads(victim.read_text())
    side["architecture"] = _hostile(side["architecture"])
    victim.write_text(json.dumps(side))
    report = ingest_zoo(zoo, tmp_path / "cat", progress=False)
    assert report.added == 2 and len(report.errors) == 1
    con = duck.connect(tmp_path / "cat")
    (kind, message), = con.execute("SELECT error_type, message FROM ingest_errors").fetchall()
    assert kind == "SpecError" and "[100000000, 4]" in message and victim.with_suffix(".safetensors").name in message


def _small_conv(tmp_path, suffix: str):
    spec = {"format": "zoograph.spec/1", "input_shape": [1, 8, 8],
            "layers": [{"type": "conv2d", "out_channels": 2, "kernel_size": 3}, {"type": "adaptive_avgpool",
                                                                                  "output_size": 1},
                       {"type": "flatten"}, {"type": "linear", "out_features": 3}]}
    state = {k: v.contiguous() for k, v in build_module(spec).state_dict().items()}
    path = tmp_path / f"conv{suffix}"
    if suffix == ".safetensors":
        save_file(state, str(path))
    else:
        torch.save(state, path)
    return spec, path


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_shapes_are_read_without_loading_and_checked(tmp_path, suffix):
    spec, path = _small_conv(tmp_path, suffix)
    assert tensor_shapes(path) == {"layers.0.weight": (2, 1, 3, 3), "layers.0.bias": (2,),
                                   "layers.3.weight": (3, 2), "layers.3.bias": (3,)}
    assert convert_checkpoint(path, spec).graph.num_nodes > 0
    wide = json.loads(json.dumps(spec))
    wide["layers"][0]["out_channels"] = 50_000
    with pytest.raises(SpecError, match=r"layers\[0\] \(conv2d\) declares layers.0.weight of shape "
                                        r"\[50000, 1, 3, 3\], the checkpoint holds \[2, 1, 3, 3\]"):
        convert_checkpoint(path, wide)
    huge_input = dict(spec, input_shape=[1, 6000, 6000])      # same weights, a 72M-element activation
    with pytest.raises(SpecError, match=r"layers\[0\] \(conv2d\) has an activation of shape \[2, 5998, 5998\]"):
        convert_checkpoint(path, huge_input)
    missing = json.loads(json.dumps(spec))
    missing["layers"].append({"type": "linear", "out_features": 2})
    with pytest.raises(SpecError, match=r"layers\[4\] \(linear\) declares layers.4.weight of shape \[2, 3\], "
                                        "which the checkpoint does not have"):
        convert_checkpoint(path, missing)
