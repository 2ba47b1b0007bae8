"""Merging by neuron alignment on real zoo models: a permuted copy merges back exactly, and
aligned merging beats naive averaging on replicas trained from different seeds."""
import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from graphstore import duck
from jobs.analysis.catalog_models import load_model
from jobs.cli import main as jobs_cli
from jobs.analysis.merge import MergeConfig, merge_models
from jobs.config import TrainConfig
from jobs.training.train import train_heterognn
from pipeline.checkpoints import load_state_dict
from pipeline.ingest import ingest_zoo
from pipeline.neural_graph.symmetry import random_hidden_permutation
from pipeline.zoo.make import make_zoo
from zoocore.errors import JobError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """16 CNNs in pairs of replicas (same recipe, different initialisation), ingested, plus a
    neuron-permuted copy of a batch-norm residual model, and a small NG-GNN run."""
    root = tmp_path_factory.mktemp("merge")
    zoo, catalog = root / "zoo", root / "catalog"
    make_zoo("cnn", zoo, n=16, seed=3, workers=2, progress=False, replicas=2)
    assert ingest_zoo(zoo, catalog, progress=False).ok
    con = duck.connect(catalog)
    rows = con.execute("SELECT model_id, recipe, test_accuracy, batchnorm, residual FROM models "
                       "ORDER BY checkpoint").fetchall()
    # the permuted copy: a real checkpoint with other bytes (and so another model_id)
    source = next(r for r in rows if r[3] and r[4])
    model = load_model(con, source[0])
    con.close()
    perm = random_hidden_permutation(model.graph, np.random.default_rng(0))
    copies = root / "copies"
    copies.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict(model.graph.permuted(perm)).items()},
              str(copies / "copy.safetensors"))
    side = json.loads((zoo / model.checkpoint).with_suffix(".json").read_text())
    (copies / "copy.json").write_text(json.dumps(side))
    assert ingest_zoo(copies, catalog, progress=False).added == 1
    con = duck.connect(catalog)
    copy_id = con.execute("SELECT model_id FROM models WHERE checkpoint = 'copy.safetensors'").fetchone()[0]
    con.close()
    run = train_heterognn(catalog, TrainConfig(ensemble=1, epochs=2, batch_size=8, hidden=16, edge_hidden=8, layers=2,
                                               baselines=False), progress=False)
    return {"catalog": catalog, "rows": rows, "source": source[0], "copy": copy_id, "perm": perm,
            "run": run.run_id, "zoo": zoo}


@pytest.mark.parametrize("method", ["embeddings", "activations", "weights"])
def test_permuted_copy_merges_back_exactly(pairs, method):
    report = merge_models(pairs["catalog"], pairs["source"], pairs["copy"],
                          MergeConfig(method=method, run_id=pairs["run"], reset_bn=False))
    con = duck.connect(pairs["catalog"])
    original = load_model(con, pairs["source"]).state_dict()
    con.close()
    assert (pairs["perm"] != np.arange(len(pairs["perm"]))).any()
    assert set(report.state) == set(original)
    for key, value in original.items():
        assert torch.equal(report.state[key], value), key
    aligned, parent = report.row(f"aligned ({method})"), report.row("parent A")
    assert aligned.test_accuracy == parent.test_accuracy and aligned.barrier == pytest.approx(0.0, abs=1e-6)
    assert report.row("naive average").test_loss > parent.test_loss     # the unaligned copy does not average back


def test_aligned_merging_beats_naive_averaging_on_different_seeds(pairs):
    by_recipe = {}
    for model_id, recipe, acc, _bn, _res in pairs["rows"]:
        by_recipe.setdefault(recipe, []).append((model_id, acc))
    good = [p for p in by_recipe.values() if len(p) == 2 and min(a for _, a in p) >= 0.5]
    assert len(good) >= 2, by_recipe          # the zoo has well-trained replica pairs to merge
    for (a, _), (b, _) in good:
        report = merge_models(pairs["catalog"], a, b, MergeConfig(method="weights", run_id=pairs["run"]))
        naive = report.row("naive average")
        for method in ("weights", "activations"):
            aligned = report.row(f"aligned ({method})")
            assert aligned.test_accuracy > naive.test_accuracy, report.summary()
            assert aligned.barrier < naive.barrier, report.summary()


def test_merge_cli_writes_and_ingests(pairs, tmp_path):
    catalog = tmp_path / "catalog"
    shutil.copytree(pairs["catalog"], catalog)
    a, b = [r[0] for r in pairs["rows"] if r[1] == 2]
    out = tmp_path / "merged" / "m.safetensors"
    res = CliRunner().invoke(jobs_cli, ["merge", a, b, "--method", "activations", "--out", str(out), "--ingest",
                                        "--catalog", str(catalog)])
    assert res.exit_code == 0, res.output
    assert "naive average" in res.output and "aligned (weights)" in res.output and "ingested as model" in res.output
    side = json.loads(out.with_suffix(".json").read_text())
    assert side["metadata"]["merged_from"] == f"{a},{b}" and side["metadata"]["merge_method"] == "activations"
    con = duck.connect(catalog)
    zoo, acc = con.execute("SELECT zoo, test_accuracy FROM models WHERE checkpoint = 'm.safetensors'").fetchone()
    merged = load_model(con, con.execute("SELECT model_id FROM models WHERE checkpoint = 'm.safetensors'").fetchone()[0])
    con.close()
    assert zoo == "merged" and acc == side["metrics"]["test_accuracy"]
    written = load_state_dict(out)
    assert all(torch.equal(merged.state_dict()[k], v) for k, v in written.items())


def test_merge_refuses_models_of_two_architectures(pairs):
    a, b = pairs["rows"][0][0], pairs["rows"][2][0]
    with pytest.raises(JobError, match="different architectures"):
        merge_models(pairs["catalog"], a, b, MergeConfig(method="weights"))
    res = CliRunner().invoke(jobs_cli, ["merge", a, "nope", "--catalog", str(pairs["catalog"])])
    assert res.exit_code == 1 and "no model 'nope'" in res.output


def test_a_baseline_that_cannot_run_is_noted_and_the_chosen_method_fails_clearly(pairs):
    a, b = [r[0] for r in pairs["rows"] if r[1] == 2]
    report = merge_models(pairs["catalog"], a, b, MergeConfig(method="weights", run_id="no-such-run"))
    assert any("embeddings matching skipped" in n and "no-such-run" in n for n in report.notes)
    assert {r.name for r in report.rows} >= {"aligned (weights)", "aligned (activations)"}
    with pytest.raises(JobError, match="no run 'no-such-run' in the catalog"):
        merge_models(pairs["catalog"], a, b, MergeConfig(method="embeddings", run_id="no-such-run"))


def test_batch_norm_statistics_through_the_graph_match_the_modules(pairs):
    """Exported graphs have no batch-norm modules to run in training mode: the statistics are
    recomputed norm by norm through the layer taps, and agree with the modules' own reset."""
    from jobs.analysis.merge import Evaluator, batch_norm_statistics

    con = duck.connect(pairs["catalog"])
    model = load_model(con, pairs["source"])                     # batch norm and a residual block
    con.close()
    assert model.spec is not None and any(op.running_stats for op in model.plan.ops)
    evaluate = Evaluator(model)
    state = {k: v * 1.1 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    by_modules = evaluate.settle(state, True)
    by_graph = batch_norm_statistics(model, state, evaluate.x_train)
    keys = [k for k in state if "running_" in k]
    assert keys and all(not torch.allclose(by_graph[k], state[k]) for k in keys)      # they did move
    for k in state:
        assert torch.allclose(by_graph[k], by_modules[k], rtol=1e-5, atol=1e-6), k


def test_torch_export_archives_merge_and_write_an_archive(pairs, tmp_path):
    """A zoo of .pt2 archives (no JSON spec): a permuted copy written as an archive merges back
    exactly, batch norm is re-estimated through the graph, and the merge is written as a .pt2 that
    the safe reader ingests."""
    from pipeline.neural_graph.runnable import save_program_archive

    zoo, catalog = tmp_path / "zoo", tmp_path / "catalog"
    make_zoo("cnn", zoo, n=16, seed=3, fmt="pt2", workers=2, progress=False, replicas=2)
    assert ingest_zoo(zoo, catalog, progress=False).ok
    con = duck.connect(catalog)
    rows = con.execute("SELECT model_id, checkpoint, batchnorm FROM models ORDER BY checkpoint").fetchall()
    source = next(r for r in rows if r[2])
    model = load_model(con, source[0])
    con.close()
    assert model.spec is None and model.program[0] is not None
    perm = random_hidden_permutation(model.graph, np.random.default_rng(1))
    copies = tmp_path / "copies"
    copies.mkdir()
    save_program_archive(copies / "copy.pt2", model.program[0], model.state_dict(model.graph.permuted(perm)),
                         model.program[1])
    (copies / "copy.json").write_text((zoo / model.checkpoint).with_suffix(".json").read_text())
    assert ingest_zoo(copies, catalog, progress=False).added == 1
    con = duck.connect(catalog)
    copy_id = con.execute("SELECT model_id FROM models WHERE checkpoint = 'copy.pt2'").fetchone()[0]
    con.close()
    for method in ("activations", "weights"):
        report = merge_models(catalog, source[0], copy_id, MergeConfig(method=method, reset_bn=False))
        for key, value in model.state_dict().items():
            assert torch.equal(report.state[key], value), key
        assert report.row(f"aligned ({method})").test_accuracy == report.row("parent A").test_accuracy
    out = tmp_path / "merged" / "m.safetensors"
    res = CliRunner().invoke(jobs_cli, ["merge", source[0], copy_id, "--method", "weights", "--out", str(out),
                                        "--ingest", "--catalog", str(catalog)])
    assert res.exit_code == 0, res.output
    written = out.with_suffix(".pt2")
    assert written.exists() and not out.exists() and "architecture" not in json.loads(
        written.with_suffix(".json").read_text())
    con = duck.connect(catalog)
    merged_id, acc = con.execute("SELECT model_id, test_accuracy FROM models WHERE checkpoint = 'm.pt2'").fetchone()
    merged = load_model(con, merged_id)
    con.close()
    report = merge_models(catalog, source[0], copy_id, MergeConfig(method="weights"))
    assert acc == pytest.approx(report.row("aligned (weights)").test_accuracy)
    for key, value in report.state.items():               # batch norm re-estimated, then written and read back
        assert torch.allclose(merged.state_dict()[key], value, atol=1e-6), key
