"""Every command explains itself, and the three entry points list their commands."""
import shutil
import subprocess
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from graphstore.cli import main as graphstore_cli
from jobs.cli import main as jobs_cli
from pipeline.cli import main as pipeline_cli

ROOT = Path(__file__).resolve().parents[1]


def _commands(group, prefix=()):
    for name, cmd in group.commands.items():
        yield prefix + (name,), cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, prefix + (name,))


@pytest.mark.parametrize("cli,expected", [
    (pipeline_cli, {"zoo", "ingest", "convert", "sql"}), (graphstore_cli, {"sync", "cypher", "queries"}),
    (jobs_cli, {"train-heterognn", "predict", "demo", "retrieve", "classify"})])
def test_every_command_has_help(cli, expected):
    assert expected <= set(cli.commands)
    top = CliRunner().invoke(cli, ["--help"])
    assert top.exit_code == 0 and all(name in top.output for name in expected)
    for path, cmd in _commands(cli):
        assert cmd.help and len(cmd.help.strip()) > 20, f"{' '.join(path)} has no help text"
        res = CliRunner().invoke(cli, [*path, "--help"])
        assert res.exit_code == 0 and "Usage" in res.output


def _compose():
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


@pytest.mark.skipif(_compose() is None, reason="no docker compose client (plugin or docker-compose) here")
def test_docker_compose_file_is_valid():
    res = subprocess.run([*_compose(), "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("module", ["jobs.cli", "pipeline.cli", "graphstore.cli"])
def test_reading_the_command_line_costs_neither_torch_nor_dgl(module):
    """Options are generated from configuration dataclasses and choices read from registries: none
    of that may import torch or DGL, or `--help` takes seconds."""
    import subprocess
    import sys

    code = f"import sys, {module}; print(sorted({{'torch', 'dgl'}} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
