"""Published zoo formats, each from a fixture written from the published description alone
(tests/fixtures/, by helpers that never read the importer): detected, ingested, queried in SQL
and Cypher, rebuilt from the catalog computing what the original network computed, trained on."""
import json
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from graphstore import duck
from graphstore.cli import main as graphstore_cli
from jobs.analysis.catalog_models import load_model
from pipeline.cli import main as pipeline_cli
from tests.fixtures.small_cnn_zoo import reference_logits, write_small_cnn_zoo


def _ingest(zoo, cat, *args):
    return CliRunner().invoke(pipeline_cli, ["ingest", str(zoo), "--catalog", str(cat), *args])


def _cypher(cat, query):
    res = CliRunner().invoke(graphstore_cli, ["cypher", query, "--format", "json", "--catalog", str(cat)])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def _rebuilt(con, model_id):
    """The network rebuilt from the catalog alone: its spec and the graph's exact inverse."""
    return load_model(con, model_id).module()


# --------------------------------------------------------------------------- Small CNN Zoo
@pytest.fixture(scope="module")
def small_zoo(tmp_path_factory):
    out = tmp_path_factory.mktemp("scz") / "mnist"
    info = write_small_cnn_zoo(out, dataset="mnist", n_runs=6, crashed_runs=1, seed=3)
    return out, info


def test_small_cnn_zoo_final_checkpoints_compute_what_tensorflow_computed(small_zoo, tmp_path):
    zoo, info = small_zoo
    res = _ingest(zoo, tmp_path / "cat")
    assert res.exit_code == 0, res.output
    assert "(small-cnn-zoo)" in res.output and f"{len(info['final_rows'])} new models" in res.output
    assert "1 training runs have no final checkpoint" in res.output
    con = duck.connect(tmp_path / "cat")
    rows = con.execute("SELECT model_id, source_path, step, modeldir, config_activation, config_learning_rate, "
                       "test_accuracy FROM models ORDER BY source_path").fetchall()
    assert sorted(int(r[1].split("#")[1]) for r in rows) == sorted(info["final_rows"])
    assert {r[2] for r in rows} == {86} and info["crashed_modeldirs"][0] not in {r[3] for r in rows}
    assert {r[4] for r in rows} == {"relu", "tanh"} and all(isinstance(r[5], float) for r in rows)
    weights = np.load(zoo / "weights.npy")
    x = np.random.default_rng(0).uniform(-1, 1, (5, info["side"], info["side"], 1)).astype(np.float32)
    for mid, source, _, _, act, _, _ in rows:
        want = reference_logits(weights[int(source.split("#")[1])], zoo / "layout.csv", act, x)
        with torch.no_grad():
            got = _rebuilt(con, mid)(torch.from_numpy(x).permute(0, 3, 1, 2)).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # the attributes are graph properties too
    found = _cypher(tmp_path / "cat", "MATCH (m:Model) WHERE m.config_activation = 'tanh' RETURN count(m) AS n")
    assert found[0]["n"] == sum(r[4] == "tanh" for r in rows) > 0


def test_small_cnn_zoo_every_checkpoint_and_same_padding(tmp_path):
    zoo = tmp_path / "cifar10"
    info = write_small_cnn_zoo(zoo, dataset="cifar10", n_runs=3, crashed_runs=0, seed=5, order="lexicographic")
    w = np.lib.format.open_memmap(zoo / "weights.npy", mode="r+")
    step0 = [i for i, s in enumerate(info["steps"]) if s == 0]
    w[step0[1]] = w[step0[0]]          # two runs from one initialisation: still two models
    w.flush()
    del w
    res = _ingest(zoo, tmp_path / "cat", "--steps", "all", "--padding", "same")
    assert res.exit_code == 0, res.output
    con = duck.connect(tmp_path / "cat")
    n, runs, steps = con.execute("SELECT count(*), count(DISTINCT modeldir), count(DISTINCT step) FROM models").fetchone()
    assert (n, runs, steps) == (info["rows"], 3, 9)
    weights = np.load(zoo / "weights.npy")
    x = np.random.default_rng(1).uniform(-1, 1, (3, 32, 32, 1)).astype(np.float32)
    mid, source, act = con.execute("SELECT model_id, source_path, config_activation FROM models "
                                   "WHERE step = 86 LIMIT 1").fetchone()
    want = reference_logits(weights[int(source.split("#")[1])], zoo / "layout.csv", act, x, padding="SAME")
    with torch.no_grad():
        got = _rebuilt(con, mid)(torch.from_numpy(x).permute(0, 3, 1, 2)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_small_cnn_zoo_refusals_are_one_line_and_write_nothing(tmp_path):
    zoo = tmp_path / "zoo"
    write_small_cnn_zoo(zoo, n_runs=2, crashed_runs=0)
    np.save(zoo / "weights.npy", np.zeros((5, 4970), np.float32))           # rows disagree with metrics
    res = _ingest(zoo, tmp_path / "cat")
    assert res.exit_code == 1 and "weights.npy has 5" in res.output and "Traceback" not in res.output
    np.save(zoo / "weights.npy", np.array([{"a": 1}] * 18, dtype=object), allow_pickle=True)   # a pickle inside
    res = _ingest(zoo, tmp_path / "cat")
    assert res.exit_code == 1 and "expected a 2-d float matrix in C order, found object" in res.output
    res = _ingest(zoo, tmp_path / "cat", "--format", "checkpoints")
    assert res.exit_code == 1 and "no checkpoints" in res.output
    write_small_cnn_zoo(zoo, n_runs=2, crashed_runs=0)
    res = _ingest(zoo, tmp_path / "cat", "--steps", "all", "--format", "small-cnn-zoo", "--input-side", "0")
    assert res.exit_code == 2                                                # click's own range check
    assert not (tmp_path / "cat").exists() or not list((tmp_path / "cat").rglob("*.parquet"))


def test_a_format_option_the_zoo_does_not_take_is_refused_by_name(tmp_path, small_zoo):
    from tests.fixtures.hf_zoo import write_hf_zoo

    write_hf_zoo(tmp_path / "hf", n_per_arch=1, archs=("vit",), sharded=0)
    res = _ingest(tmp_path / "hf", tmp_path / "cat", "--steps", "all")
    assert res.exit_code == 1 and "--steps does not apply to a zoo of format 'hf-folders'" in res.output


@pytest.mark.slow          # trains a metanetwork / builds transformers
def test_small_cnn_zoo_trains_end_to_end(tmp_path):
    from jobs.cli import main as jobs_cli

    zoo = tmp_path / "zoo"
    write_small_cnn_zoo(zoo, n_runs=40, crashed_runs=0, seed=7)
    assert _ingest(zoo, tmp_path / "cat", "--no-graph").exit_code == 0
    res = CliRunner().invoke(jobs_cli, ["train-heterognn", "--catalog", str(tmp_path / "cat"), "--ensemble", "1",
                                        "--epochs", "1", "--hidden", "8", "--edge-hidden", "4", "--layers", "1",
                                        "--batch-size", "8", "--no-baselines"])
    assert res.exit_code == 0, res.output
    con = duck.connect(tmp_path / "cat")
    assert con.execute("SELECT count(*) FROM predictions").fetchone()[0] == 40


# --------------------------------------------------------------------------- Hugging Face folders
@pytest.fixture(scope="module")
def hf_zoo(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.fixtures.hf_zoo import write_hf_zoo

    out = tmp_path_factory.mktemp("hf") / "zoo"
    return out, write_hf_zoo(out, n_per_arch=2, sharded=3, seed=1)


@pytest.mark.slow          # trains a metanetwork / builds transformers
def test_hugging_face_folders_ingest_and_rebuild_what_transformers_loads(hf_zoo, tmp_path):
    from pipeline.formats.hf_folders import ModelOutput, load_model as hf_network
    from pipeline.checkpoints import read_json_object
    from tests.fixtures.hf_zoo import example_inputs, load_reference

    zoo, info = hf_zoo
    res = _ingest(zoo, tmp_path / "cat")
    assert res.exit_code == 0, res.output
    assert "(hf-folders)" in res.output and f"{len(info)} new models" in res.output
    con = duck.connect(tmp_path / "cat")
    rows = con.execute("SELECT model_id, source_path, test_accuracy FROM models").fetchall()
    assert {r[1]: round(r[2], 4) for r in rows} == {k: round(v["test_accuracy"], 4) for k, v in info.items()}
    for mid, folder, _ in rows:
        ref = load_reference(zoo / folder)
        # rebuilt from the catalog: the class's fresh network given the graph's exact inverse
        net = hf_network(zoo / folder, read_json_object(zoo / folder / "config.json"))
        torch.nn.init.zeros_(next(net.parameters()))
        ModelOutput(net).load_state_dict(load_model(con, mid).state_dict())
        x = next(iter(example_inputs(info[folder]["arch"]).values()))
        with torch.no_grad():
            want, got = ref(x, return_dict=False)[0], net(x, return_dict=False)[0]
            outputs = [t for t in ref(x, return_dict=False) if isinstance(t, torch.Tensor)]
            # and without the class: the program kept at ingest, run on the exact inverse (3 inputs,
            # where it was traced on 2)
            x3 = torch.cat([x, x[:1]])
            kept = load_model(con, mid).network()(x3)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert any(t.shape == kept[:2].shape and torch.allclose(kept[:2], t, rtol=1e-5, atol=1e-5) for t in outputs)
        torch.testing.assert_close(kept[2], kept[0])
    found = _cypher(tmp_path / "cat", "MATCH (m:Model) RETURN count(m) AS n")
    assert found[0]["n"] == len(info)


# --------------------------------------------------------------------------- Model Zoos (Schürholt et al.)
def test_model_zoos_trials_ingest_and_compute_what_the_published_class_computed(tmp_path):
    from tests.fixtures.model_zoos import INPUT_SHAPE, reference_forward, write_model_zoo

    for kind, dropout in (("CNN", (0.0, 0.5)), ("CNN3", (0.0,))):
        info = write_model_zoo(tmp_path / kind, kind=kind, n_models=4, dropout=dropout,
                               activations=("tanh", "relu", "gelu", "sigmoid"), seed=2)
        res = _ingest(tmp_path / kind, tmp_path / "cat")
        assert res.exit_code == 0, res.output
        assert "(model-zoos)" in res.output and "4 new models" in res.output
        con = duck.connect(tmp_path / "cat")
        rows = con.execute("SELECT model_id, trial, model__nlin, model__dropout, epoch, test_acc FROM models "
                           "WHERE model__type = ?", [kind]).fetchall()
        assert {r[1] for r in rows} == set(info) and {r[4] for r in rows} == {2}
        x = torch.randn(3, *INPUT_SHAPE[kind], generator=torch.Generator().manual_seed(0))
        for mid, trial, nlin, p, _, acc in rows:
            assert acc == pytest.approx(info[trial]["test_acc"])
            want = reference_forward(info[trial]["module"], kind, nlin, p, x)
            with torch.no_grad():
                got = _rebuilt(con, mid)(x)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        con.close()
    found = _cypher(tmp_path / "cat", "MATCH (m:Model) WHERE m.model__type = 'CNN3' RETURN count(m) AS n")
    assert found[0]["n"] == 4


def test_model_zoos_every_epoch_and_a_hostile_checkpoint(tmp_path):
    from tests.fixtures.model_zoos import write_model_zoo

    info = write_model_zoo(tmp_path / "z", kind="CNN", n_models=3, epochs=(0, 1, 2), seed=4)
    trial = next(iter(info))
    bad = next((tmp_path / "z").rglob(f"{trial}/checkpoint_000001/checkpoints"))
    import pickle

    class Boom:
        def __reduce__(self):
            return (print, ("pwned",))

    bad.write_bytes(pickle.dumps(Boom()))          # a legacy pickle posing as a checkpoint
    res = _ingest(tmp_path / "z", tmp_path / "cat", "--steps", "all")
    assert res.exit_code == 1 and "pwned" not in res.output and "Traceback" not in res.output
    assert "8 new models" in res.output and "1 failed" in res.output
    con = duck.connect(tmp_path / "cat")
    assert con.execute("SELECT count(*) FROM models WHERE epoch = 0 AND train_acc IS NULL").fetchone()[0] == 3
    assert con.execute("SELECT count(*) FROM ingest_errors").fetchone()[0] == 1


@pytest.mark.slow          # trains a metanetwork / builds transformers
def test_model_zoos_train_end_to_end(tmp_path):
    from jobs.cli import main as jobs_cli
    from tests.fixtures.model_zoos import write_model_zoo

    write_model_zoo(tmp_path / "z", kind="CNN", n_models=30, epochs=(0, 1), seed=6)
    assert _ingest(tmp_path / "z", tmp_path / "cat", "--no-graph").exit_code == 0
    res = CliRunner().invoke(jobs_cli, ["train-heterognn", "--catalog", str(tmp_path / "cat"), "--target", "test_acc",
                                        "--ensemble", "1", "--epochs", "1", "--hidden", "8", "--edge-hidden", "4",
                                        "--layers", "1", "--batch-size", "8", "--no-baselines"])
    assert res.exit_code == 0, res.output
    assert duck.connect(tmp_path / "cat").execute("SELECT count(*) FROM predictions").fetchone()[0] == 30


def test_hugging_face_folders_refuse_what_they_cannot_read_safely(tmp_path):
    pytest.importorskip("transformers")
    from tests.fixtures.hf_zoo import write_hf_zoo

    info = write_hf_zoo(tmp_path / "zoo", n_per_arch=1, archs=("gpt2", "bert", "vit"), sharded=1, seed=2)
    sharded = next(k for k, v in info.items() if v["sharded"])
    index = tmp_path / "zoo" / sharded / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    key = next(iter(data["weight_map"]))
    data["weight_map"][key] = "../../outside.safetensors"          # a shard outside the member folder
    index.write_text(json.dumps(data))
    other = next(k for k, v in info.items() if not v["sharded"])
    cfg_path = tmp_path / "zoo" / other / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["AutoModel"]                           # not a model class
    cfg["auto_map"] = {"AutoModel": "evil.Model"}                  # remote code is never used
    cfg_path.write_text(json.dumps(cfg))
    res = _ingest(tmp_path / "zoo", tmp_path / "cat")
    assert res.exit_code == 1 and "Traceback" not in res.output and "1 new models" in res.output
    assert "shard '../../outside.safetensors' is not a file name in the folder" in res.output
    assert "config.json key 'auto_map' can name code" in res.output


@pytest.mark.slow          # trains a metanetwork / builds transformers
def test_hugging_face_folders_train_end_to_end(tmp_path):
    pytest.importorskip("transformers")
    from jobs.cli import main as jobs_cli
    from tests.fixtures.hf_zoo import write_hf_zoo

    info = write_hf_zoo(tmp_path / "zoo", n_per_arch=3, sharded=2, seed=3)
    lines = (tmp_path / "zoo" / "metrics.csv").read_text().splitlines()
    splits = ["train", "train", "val", "test"] * 3                    # a user's own split column
    (tmp_path / "zoo" / "metrics.csv").write_text("\n".join([lines[0] + ",split"] + [
        f"{line},{s}" for line, s in zip(lines[1:], splits)]) + "\n")
    assert _ingest(tmp_path / "zoo", tmp_path / "cat", "--no-graph").exit_code == 0
    res = CliRunner().invoke(jobs_cli, ["train-heterognn", "--catalog", str(tmp_path / "cat"), "--split-column", "split",
                                        "--ensemble", "1", "--epochs", "1", "--hidden", "8", "--edge-hidden", "4",
                                        "--layers", "1", "--batch-size", "4", "--no-baselines"])
    assert res.exit_code == 0, res.output
    assert duck.connect(tmp_path / "cat").execute("SELECT count(*) FROM predictions").fetchone()[0] == len(info)


@pytest.mark.slow          # starts conversion processes
def test_small_cnn_zoo_conversion_processes_give_the_same_models(small_zoo, tmp_path):
    """The format is sent to spawned workers by name and options; each opens the matrix itself."""
    zoo, _ = small_zoo
    ids = []
    for workers in ("1", "2"):
        cat = tmp_path / f"cat{workers}"
        res = _ingest(zoo, cat, "--workers", workers, "--no-graph")
        assert res.exit_code == 0, res.output
        ids.append(duck.connect(cat).execute("SELECT model_id, source_path FROM models ORDER BY 1").fetchall())
    assert ids[0] == ids[1] and len(ids[0]) == 5


def test_a_rewritten_zoo_is_read_afresh_in_the_same_process(tmp_path):
    """Nothing of a zoo's files outlives its ingest in the calling process: rewritten in place
    with other weights, the zoo ingests as the new models."""
    from pipeline.ingest import ingest_zoo

    zoo = tmp_path / "zoo"
    write_small_cnn_zoo(zoo, n_runs=3, crashed_runs=0, seed=1)
    first = ingest_zoo(zoo, tmp_path / "a", progress=False).model_ids
    write_small_cnn_zoo(tmp_path / "new", n_runs=4, crashed_runs=0, seed=2)
    for f in (tmp_path / "new").iterdir():          # replaced as a downloader does: new files renamed in
        os.replace(f, zoo / f.name)
    second = ingest_zoo(zoo, tmp_path / "b", progress=False)
    assert second.ok and len(second.model_ids) == 4 and not set(first) & set(second.model_ids)
    con = duck.connect(tmp_path / "b")
    weights = np.load(zoo / "weights.npy")
    mid, source, act = con.execute("SELECT model_id, source_path, config_activation FROM models LIMIT 1").fetchone()
    x = np.random.default_rng(0).uniform(-1, 1, (2, 28, 28, 1)).astype(np.float32)
    want = reference_logits(weights[int(source.split("#")[1])], zoo / "layout.csv", act, x)
    with torch.no_grad():
        got = _rebuilt(con, mid)(torch.from_numpy(x).permute(0, 3, 1, 2)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
