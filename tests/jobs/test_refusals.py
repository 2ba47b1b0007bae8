"""Requests that cannot mean anything are refused: a one-class target, a catalog that is not there."""
import pytest
from click.testing import CliRunner

from graphstore.cli import main as graphstore_cli
from jobs.cli import main as jobs_cli
from jobs.config import TrainConfig
from jobs.training.train import train_heterognn
from pipeline.cli import main as pipeline_cli
from zoocore.errors import JobError


def test_one_class_target_is_refused_not_scored_perfectly(catalog_dir):
    with pytest.raises(JobError, match="single class 'iris'.*nothing to classify"):
        train_heterognn(catalog_dir, TrainConfig(target="dataset", where="dataset = 'iris'", ensemble=1, epochs=1),
                        progress=False)
    with pytest.raises(JobError, match="single class"):
        train_heterognn(catalog_dir, TrainConfig(target="zoo", where="zoo = 'cnn'", task="classification",
                                                 epochs=1), progress=False)


@pytest.mark.parametrize("cli, args", [
    (graphstore_cli, ["cypher", "MATCH (m:Model) RETURN count(m)"]),
    (graphstore_cli, ["sync"]),
    (jobs_cli, ["train-heterognn", "--epochs", "1"]),
    (jobs_cli, ["predict", "--run", "run-x"]),
    (jobs_cli, ["retrieve", "m0", "--write-back"]),
    (jobs_cli, ["merge", "a", "b"]),
    (pipeline_cli, ["sql", "SELECT 1"]),
], ids=["cypher", "sync", "train", "predict", "retrieve", "merge", "sql"])
def test_a_mistyped_catalog_is_refused_and_not_created(tmp_path, cli, args):
    typo = tmp_path / "catalgo"
    res = CliRunner().invoke(cli, [*args, "--catalog", str(typo)], env={"NEO4J_URI": ""})
    assert res.exit_code == 1, res.output
    assert f"no catalog at {typo}" in res.output and "Traceback" not in res.output
    assert not typo.exists()


def test_ingest_still_creates_its_catalog(tmp_path, mlp_zoo):
    import shutil

    zoo = tmp_path / "zoo"
    zoo.mkdir()
    for p in sorted(mlp_zoo.glob("*.safetensors"))[:2]:
        shutil.copy(p, zoo / p.name)
        shutil.copy(p.with_suffix(".json"), zoo / p.with_suffix(".json").name)
    res = CliRunner().invoke(pipeline_cli, ["ingest", str(zoo), "--catalog", str(tmp_path / "new"), "--no-graph"])
    assert res.exit_code == 0 and "2 new models" in res.output, res.output
    # the graph store was not built (--no-graph): cypher says how to build it rather than creating an empty one
    nograph = CliRunner().invoke(graphstore_cli, ["cypher", "RETURN 1 AS one", "--catalog", str(tmp_path / "new")],
                                 env={"NEO4J_URI": ""})
    assert nograph.exit_code != 0 and "graphstore sync" in nograph.output, nograph.output
    synced = CliRunner().invoke(graphstore_cli, ["sync", "--catalog", str(tmp_path / "new")], env={"NEO4J_URI": ""})
    assert synced.exit_code == 0, synced.output
    ok = CliRunner().invoke(graphstore_cli, ["cypher", "RETURN 1 AS one", "--catalog", str(tmp_path / "new")],
                            env={"NEO4J_URI": ""})
    assert ok.exit_code == 0, ok.output
