"""The main job end to end on the embedded defaults: make a CNN zoo, ingest it, train NG-GNN (the
run answers with it blended with StatNN), and compare predicted with true test accuracy (the
README's first command)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from graphstore import duck
from graphstore.catalog import Catalog
from graphstore.metadata import open_store
from jobs.config import TrainConfig
from jobs.training.runs import RunReport
from jobs.training.train import train_heterognn
from pipeline.ingest import IngestReport, ingest_zoo
from pipeline.zoo.make import ZooReport, make_zoo
from zoocore.errors import ZooGraphError

# the run's answer (runs.method: NG-GNN blended with StatNN, jobs.predictors.stacking) on the test models
PREDICTED_VS_TRUE = (
    "SELECT m.checkpoint, round(m.test_accuracy, 3) AS true_accuracy, round(p.predicted, 3) AS predicted "
    "FROM predictions p JOIN runs r USING (run_id, method) JOIN models m USING (model_id) "
    "WHERE p.run_id = ? AND p.split = 'test' ORDER BY m.test_accuracy DESC")


@dataclass
class DemoReport:
    zoo: ZooReport
    ingest: IngestReport
    run: RunReport
    rows: list[tuple]


def run_demo(workdir: str | Path = "demo", n: int = 160, epochs: int = 10, seed: int = 0, workers: int = 2,
             device: str = "cpu", progress: bool = True) -> DemoReport:
    workdir = Path(workdir)
    zoo = make_zoo("cnn", workdir / "zoo-cnn", n=n, seed=seed, workers=workers, progress=progress)
    catalog = Catalog(workdir / "catalog")
    with open_store(catalog.root, use_env=False) as store:
        ingest = ingest_zoo(workdir / "zoo-cnn", catalog, workers=workers, store=store, progress=progress)
        if not ingest.ok:
            raise ZooGraphError(ingest.summary())
        run = train_heterognn(catalog, TrainConfig(epochs=epochs, seed=seed, device=device), store=store,
                              progress=progress)
    con = duck.connect(catalog)
    rows = con.execute(PREDICTED_VS_TRUE, [run.run_id]).fetchall()
    con.close()
    return DemoReport(zoo, ingest, run, rows)


def small_catalog(workdir: str | Path, kind: str = "cnn", n: int = 48, target: str = "test_accuracy",
                  epochs: int = 10, seed: int = 0, baselines: bool = True) -> tuple[Path, str]:
    """A small zoo made on the spot, ingested (with the embedded graph store) and trained on:
    (catalog folder, run id). Reused when ``workdir`` already holds one for ``kind``/``target``.
    ``baselines``: StatNN and the other tabular predictors beside the metanetwork (a notebook that
    only reads the embeddings skips their validation grids)."""
    def train(catalog, store) -> str:
        # one small member, not the recipe's ensemble of 3: a notebook's 48-model zoo, trained in seconds
        return train_heterognn(catalog, TrainConfig(target=target, epochs=epochs, batch_size=8, hidden=32,
                                                    edge_hidden=16, layers=2, patience=epochs, seed=seed,
                                                    ensemble=1, baselines=baselines),
                               store=store, progress=False).run_id

    return made_catalog(workdir, kind, n, f"run-{kind}-{target}.txt", seed=seed, then=train)


def made_catalog(workdir: str | Path, kind: str, n: int, marker: str, seed: int = 0, workers: int = 2,
                 then: Callable[[Catalog, Any], str] | None = None) -> tuple[Path, str]:
    """A zoo of ``kind`` made in ``workdir/zoo-KIND``, ingested with the embedded graph store into
    ``workdir/catalog-KIND`` and, with ``then(catalog, store)``, worked on (a run, an analysis):
    (catalog folder, what ``then`` returned, else the number of models added). The notebooks' data;
    reused when the ``marker`` file of an earlier finished call is there."""
    workdir = Path(workdir)
    catalog = Catalog(workdir / f"catalog-{kind}")
    done = workdir / marker
    if done.exists() and catalog.exists():
        return catalog.root, done.read_text().strip()
    make_zoo(kind, workdir / f"zoo-{kind}", n=n, seed=seed, workers=workers, progress=False)
    with open_store(catalog.root, use_env=False) as store:
        report = ingest_zoo(workdir / f"zoo-{kind}", catalog, store=store, zoo_name=kind, progress=False)
        result = then(catalog, store) if then is not None else str(report.added)
    done.write_text(result)
    return catalog.root, result
