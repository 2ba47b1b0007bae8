"""bench_blend_statistics gives a saved run the answer today's default gives it: re-scored from a
default run's own rows, it reproduces that run's answer exactly (the same plain blend and gate)."""
import sys
from pathlib import Path

import numpy as np
import pytest

from graphstore import duck
from jobs.config import TrainConfig
from jobs.training.compare import kendall_tau
from jobs.training.train import train_heterognn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_blend_statistics  # noqa: E402


@pytest.mark.slow
def test_rescoring_a_default_run_reproduces_its_answer(catalog_copy):
    cfg = TrainConfig(where="zoo = 'cnn'", ensemble=1, epochs=2, batch_size=8, hidden=16, edge_hidden=8, layers=2)
    report = train_heterognn(catalog_copy, cfg, progress=False)
    con = duck.connect(catalog_copy)
    # a default run is not one the benchmark re-scores (its answer is already the gated one) ...
    assert bench_blend_statistics.saved_runs(con) == []
    (run_id, config, method), = con.execute("SELECT run_id, config_json, method FROM runs").fetchall()
    import json

    # ... but its rows re-blended as if it were give back its own answer: the plain blend where
    # the gate trusts a model, and the saved answer (here the same gated one) where it does not
    scores = bench_blend_statistics.rescore(con, run_id, json.loads(config), method)
    assert scores["gated"] == pytest.approx(report.metrics[method]["kendall_tau"], abs=1e-9)
    assert scores["statnn"] == pytest.approx(report.metrics["statnn"]["kendall_tau"], abs=1e-9)
    assert 0 <= scores["untrusted"] < 0.5
    y, p = zip(*con.execute("SELECT m.test_accuracy, p.predicted FROM predictions p JOIN models m USING (model_id) "
                            "WHERE p.run_id = ? AND p.method = ? AND p.split = 'test'", [run_id, method]).fetchall())
    assert scores[method] == pytest.approx(kendall_tau(np.array(y), np.array(p)))
    con.close()
    assert bench_blend_statistics.main([str(catalog_copy)]) == 0
