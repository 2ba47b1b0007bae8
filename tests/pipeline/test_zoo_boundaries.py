"""What a zoo may name stays inside the zoo (issue #53): Hugging Face configs are data (no key names
code, a path, a Hub id or another model, at any depth; the network they describe is sized against
the stored weights before anything is allocated), members that are links out of the zoo are
refused by the name given, and metrics columns never take the names the catalog's views use."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from graphstore.column_types import column_name
from pipeline.cli import main as pipeline_cli
from zoocore.errors import CheckpointError
from zoocore.names import inside_folder

ROOT = Path(__file__).resolve().parents[2]


def _ingest(zoo, cat, *args):
    return CliRunner().invoke(pipeline_cli, ["ingest", str(zoo), "--catalog", str(cat), "--no-graph", *args])


def _sql(cat, query):
    res = CliRunner().invoke(pipeline_cli, ["sql", query, "--catalog", str(cat), "--format", "json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


# ----------------------------------------------------------------------------- Hugging Face configs
def _bert_folder(folder: Path, **changes) -> Path:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=16, max_position_embeddings=16)
    torch.manual_seed(0)
    transformers.BertModel(cfg).save_pretrained(folder, safe_serialization=True)
    data = json.loads((folder / "config.json").read_text())
    data.update(changes)
    (folder / "config.json").write_text(json.dumps(data))
    return folder


def _code_folder(folder: Path, canary: Path) -> Path:
    """A folder a config could point at: its config names a Python file (auto_map) that writes
    ``canary`` when transformers imports it."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "evil", "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel",
                                           "AutoBackbone": "evil.EvilModel"}}))
    (folder / "evil.py").write_text(f"open({str(canary)!r}, 'w').close()\n"
                                    "from transformers import PretrainedConfig\n"
                                    "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n")
    return folder


@pytest.mark.slow          # builds transformers models, a process each
def test_the_code_folder_payload_is_live(tmp_path):
    """Loaded the way a config's ``backbone`` would have it loaded, the folder's code runs: the
    refusals below are refusals of a working payload."""
    pytest.importorskip("transformers")
    canary = tmp_path / "ran"
    code = _code_folder(tmp_path / "code", canary)
    subprocess.run([sys.executable, "-c", "import transformers, sys; transformers.AutoConfig.from_pretrained("
                    "sys.argv[1], trust_remote_code=True)", str(code)], capture_output=True, timeout=120,
                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert canary.exists()


@pytest.mark.slow          # builds transformers models
@pytest.mark.parametrize("changes, words", [
    ({"auto_map": {"AutoModel": "evil.Model"}}, "key 'auto_map' can name code"),
    ({"trust_remote_code": True}, "key 'trust_remote_code'"),
    ({"backbone": "CODE", "backbone_kwargs": {"trust_remote_code": True}}, "key 'backbone'"),
    ({"backbone": "org/repo"}, "key 'backbone'"),
    ({"name_or_path": "CODE"}, "key 'name_or_path'"),
    ({"decoder": {"model_type": "bert", "auto_map": {"AutoModel": "evil.Model"}}}, "key 'decoder'"),
    ({"text_config": {"model_type": "bert"}}, "key 'text_config'"),
    ({"id2label": {"0": "a"}, "task_specific_params": {"x": {"model_path": "CODE"}}},
     "key 'task_specific_params.x.model_path'"),
    ({"problem_type": "../../elsewhere"}, "reads as a path or a Hub repository"),
    ({"architectures": ["UperNetForSemanticSegmentation"]}, "do not name one single model"),
    ({"vocab_size": 40_000_000}, "refused before allocating"),
])
def test_a_config_that_names_code_a_path_or_another_model_is_refused_by_name(tmp_path, changes, words):
    """In this process (the round-two sweep runs the same configs through `pipeline ingest` as real
    processes, standard input closed): refused by name, and the code never ran."""
    from pipeline.checkpoints import read_json_object
    from pipeline.formats.hf_folders import load_model

    canary = tmp_path / "ran"
    code = _code_folder(tmp_path / "code", canary)
    changes = json.loads(json.dumps(changes).replace("CODE", str(code)))
    folder = _bert_folder(tmp_path / "zoo" / "m0", **changes)
    with pytest.raises(CheckpointError, match=re.escape(words)):
        load_model(folder, read_json_object(folder / "config.json"))
    assert not canary.exists()


@pytest.mark.slow          # builds transformers models, a process each
def test_private_keys_are_dropped_and_a_plain_config_still_reads(tmp_path):
    """``save_pretrained`` writes ``_name_or_path``: it is ignored (never followed), and the model
    converts; a list of numbers under a word that can name things (Swin-v2's
    ``pretrained_window_sizes``) is plain data."""
    from pipeline.formats.hf_folders import checked_config

    code = tmp_path / "code"
    folder = _bert_folder(tmp_path / "zoo" / "m0", _name_or_path=str(code), _commit_hash="x")
    res = _ingest(tmp_path / "zoo", tmp_path / "cat")
    assert res.exit_code == 0, res.output
    assert checked_config({"model_type": "swinv2", "pretrained_window_sizes": [0, 0]}, "w") == {
        "model_type": "swinv2", "pretrained_window_sizes": [0, 0]}
    with pytest.raises(CheckpointError, match="nested deeper"):
        nested: dict = {"model_type": "bert"}
        inner = nested
        for _ in range(20):
            inner["x"] = {}
            inner = inner["x"]
        checked_config(nested, str(folder))


# ----------------------------------------------------------------------------- links out of the zoo
def _mlp_checkpoint(path: Path, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    save_file({"layers." + k: v.contiguous() for k, v in net.state_dict().items()}, str(path))
    path.with_suffix(".json").write_text(json.dumps({"architecture": {
        "format": "zoograph.spec/1", "input_shape": [4],
        "layers": [{"type": "linear", "out_features": 3}, {"type": "activation", "fn": "relu"},
                   {"type": "linear", "out_features": 2}]}}))
    return path


def test_a_member_that_links_out_of_the_zoo_is_refused_by_the_name_given(tmp_path, monkeypatch):
    outside = _mlp_checkpoint(tmp_path / "elsewhere" / "x.safetensors", seed=1)
    zoo = tmp_path / "z" / "x"
    _mlp_checkpoint(zoo / "good.safetensors")
    (zoo / "m.safetensors").symlink_to(outside)
    (zoo / "m.json").symlink_to(outside.with_suffix(".json"))
    monkeypatch.chdir(tmp_path)                          # the zoo given as a relative path
    res = _ingest("z/x", "cat")
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert "z/x/m.safetensors: resolves outside the zoo folder z/x" in res.output
    assert "z/x/z/x" not in res.output
    assert _sql("cat", "SELECT source_path FROM models") == [{"source_path": "good.safetensors"}]


def test_a_sidecar_or_metrics_file_that_links_out_is_refused(tmp_path):
    zoo = tmp_path / "zoo"
    outside = _mlp_checkpoint(tmp_path / "elsewhere" / "x.safetensors")
    _mlp_checkpoint(zoo / "a.safetensors")
    (zoo / "a.json").unlink()
    (zoo / "a.json").symlink_to(outside.with_suffix(".json"))
    res = _ingest(zoo, tmp_path / "cat")
    assert res.exit_code == 1 and "a.json: resolves outside the zoo folder" in res.output
    (zoo / "a.json").unlink()
    shutil.copy(outside.with_suffix(".json"), zoo / "a.json")
    (tmp_path / "secret.csv").write_text("model,secret\na.safetensors,42\n")
    (zoo / "metrics.csv").symlink_to(tmp_path / "secret.csv")
    res = _ingest(zoo, tmp_path / "cat2")
    assert res.exit_code == 1 and "metrics.csv: resolves outside the zoo folder" in res.output
    assert not (tmp_path / "cat2" / "parts").exists() or "42" not in json.dumps(
        _sql(tmp_path / "cat2", "SELECT * FROM models"), default=str)


def test_inside_folder_allows_links_within_the_zoo(tmp_path):
    (tmp_path / "zoo" / "a").mkdir(parents=True)
    (tmp_path / "zoo" / "a" / "f").write_text("x")
    (tmp_path / "zoo" / "link").symlink_to(tmp_path / "zoo" / "a" / "f")
    assert inside_folder(tmp_path / "zoo", tmp_path / "zoo" / "link") == tmp_path / "zoo" / "link"
    (tmp_path / "zoo" / "b").write_text("y")
    (tmp_path / "zoo" / "a" / "up").symlink_to(Path("..") / "b")          # a relative link one level up
    with pytest.raises(CheckpointError, match="resolves outside"):
        inside_folder(tmp_path / "zoo" / "a", tmp_path / "zoo" / "a" / "up")
    with pytest.raises(CheckpointError, match="resolves outside"):
        inside_folder(tmp_path / "zoo" / "a", tmp_path / "zoo" / "a" / ".." / "b")


# ----------------------------------------------------------------------------- reserved columns
def test_columns_named_like_the_catalogs_own_are_renamed_and_the_catalog_stays_readable(tmp_path):
    assert column_name("_file") == ("meta__file", "metadata field '_file' is stored as column 'meta__file' "
                                    "(names starting with _ are the catalog's own, so meta_ was put in front)")
    assert column_name("_rn")[0] == "meta__rn"
    zoo = tmp_path / "zoo"
    _mlp_checkpoint(zoo / "a.safetensors")
    _mlp_checkpoint(zoo / "b.safetensors", seed=1)
    (zoo / "metrics.csv").write_text("model,_file,_rn,test_accuracy\na.safetensors,x,1,0.5\nb.safetensors,y,2,0.7\n")
    res = _ingest(zoo, tmp_path / "cat")
    assert res.exit_code == 0, res.output
    assert "stored as column 'meta__file'" in res.output
    rows = _sql(tmp_path / "cat", "SELECT meta__file, meta__rn FROM models ORDER BY source_path")
    assert rows == [{"meta__file": "x", "meta__rn": 1}, {"meta__file": "y", "meta__rn": 2}]
    _mlp_checkpoint(tmp_path / "zoo2" / "c.safetensors", seed=2)
    assert _ingest(tmp_path / "zoo2", tmp_path / "cat").exit_code == 0        # later ingests still work
    assert _sql(tmp_path / "cat", "SELECT count(*) AS n FROM models") == [{"n": 3}]


# ----------------------------------------------------------------------------- time budget
def test_a_member_conversion_that_runs_past_its_budget_is_stopped(tmp_path):
    import time

    from pipeline.ingest import member_budget, time_budget

    assert member_budget(0) == 120.0 and member_budget(100 << 20) == 320.0
    start = time.monotonic()
    with pytest.raises(CheckpointError, match="m.pt2: converting it took more than its budget of 0 s"):
        with time_budget(0.3, "m.pt2"):
            while True:             # Python that never returns (sympy evaluating 9**9**9 is such code)
                pass
    assert time.monotonic() - start < 5
    with time_budget(5, "fine"):    # a block that ends in time is untouched, and the alarm is off after
        pass
    time.sleep(0.4)


def test_the_budget_counts_the_bytes_a_member_really_stores(tmp_path):
    from pipeline.formats.base import Member
    from pipeline.formats.checkpoint_folder import CheckpointFolder

    with open(tmp_path / "sparse.pt2", "wb") as fh:
        fh.truncate(1 << 30)                        # declares a gigabyte, stores nothing
    (tmp_path / "dense.pt2").write_bytes(b"x" * 100_000)
    fmt = CheckpointFolder(tmp_path)
    assert fmt.stored_bytes(Member("sparse.pt2", "sparse.pt2")) < 1 << 20
    assert fmt.stored_bytes(Member("dense.pt2", "dense.pt2")) == 100_000


@pytest.mark.parametrize("fmt, name", [("small-cnn-zoo", "layout.csv"), ("small-cnn-zoo", "weights.npy"),
                                       ("small-cnn-zoo", "metrics.csv.gz"), ("model-zoos", "result.json"),
                                       ("model-zoos", "params.json")])
def test_the_published_formats_refuse_files_that_link_out(tmp_path, fmt, name):
    from tests.fixtures.model_zoos import write_model_zoo
    from tests.fixtures.small_cnn_zoo import write_small_cnn_zoo

    zoo = tmp_path / "zoo"
    if fmt == "small-cnn-zoo":
        write_small_cnn_zoo(zoo, n_runs=2)
        target = zoo / name
    else:
        write_model_zoo(zoo, n_models=1, epochs=(0,))
        target = next(zoo.rglob(name))
    outside = tmp_path / "elsewhere" / name
    outside.parent.mkdir()
    shutil.move(target, outside)
    target.symlink_to(outside)
    res = _ingest(zoo, tmp_path / "cat")
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert f"{name}: resolves outside the zoo folder" in res.output, res.output


def test_entries_no_format_reads_are_failures_not_silence(tmp_path, monkeypatch):
    """A folder that links out of the zoo and a link to nothing are not members any format lists:
    each is recorded as a failure naming the path as given; a FIFO refuses the zoo before any
    reader could block on it."""
    zoo = tmp_path / "z" / "x"
    _mlp_checkpoint(zoo / "good.safetensors")
    _mlp_checkpoint(tmp_path / "elsewhere" / "y.safetensors")
    (zoo / "sub").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (zoo / "gone.safetensors").symlink_to(tmp_path / "no-such-file")
    monkeypatch.chdir(tmp_path)
    res = _ingest("z/x", "cat")
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert "z/x/sub: resolves outside the zoo folder z/x" in res.output
    assert "z/x/gone.safetensors: a link to nothing" in res.output
    assert _sql("cat", "SELECT source_path FROM models") == [{"source_path": "good.safetensors"}]
    assert {r["source_path"] for r in _sql("cat", "SELECT source_path FROM ingest_errors")} == {
        "sub", "gone.safetensors"}
    os.mkfifo(zoo / "metrics.csv")
    res = _ingest("z/x", "cat")
    assert res.exit_code == 1 and "z/x/metrics.csv: not a regular file (a FIFO" in res.output, res.output
