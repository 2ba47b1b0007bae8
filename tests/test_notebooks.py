"""The analytics notebooks execute top to bottom on a small zoo made on the spot, with figures."""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("notebooks")


def test_the_notebooks_are_there():
    """An empty parameter list would skip the test below silently: fail instead."""
    assert len(NOTEBOOKS) >= 4, NOTEBOOKS


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_draws(path, workdir, monkeypatch):
    monkeypatch.setenv("ZOOGRAPH_NOTEBOOK_WORKDIR", str(workdir))
    monkeypatch.setenv("ZOOGRAPH_NOTEBOOK_FIGURES", str(workdir / "figures"))
    nb = nbformat.read(path, as_version=4)
    # a cell that makes and trains a small zoo takes a few minutes alone; on a machine shared with
    # other jobs it took over 900 s once, so the bound is generous: it catches hangs, not slowness
    NotebookClient(nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    assert (workdir / "figures" / f"{path.stem}.png").stat().st_size > 5000
