"""Data-parallel NG-GNN training: two CPU processes under torchrun (gloo) against one."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from graphstore import duck
from jobs.training.distributed import DistContext, local_batch_size, shard

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
ARGS = ["train-heterognn", "--where", "zoo = 'mlp'", "--ensemble", "1", "--epochs", "4", "--batch-size", "8",
        "--hidden", "16", "--layers", "2", "--no-baselines", "--loader-workers", "1"]


def test_rank_batches_together_are_the_single_process_batches():
    idx = np.arange(37)
    one = shard(idx, DistContext(), seed=5)
    ranks = [shard(idx, DistContext(rank=r, world=2), seed=5) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 19                     # padded to equal shares
    b = local_batch_size(8, DistContext(world=2))
    for k in range(len(one) // 8):
        together = sorted(np.concatenate([r[k * b:(k + 1) * b] for r in ranks]).tolist())
        assert together == sorted(one[k * 8:(k + 1) * 8].tolist())
    assert set(np.concatenate(ranks).tolist()) == set(idx.tolist())


def _train(catalog, *extra, procs=1):
    env = {**os.environ, "CI": os.environ.get("CI", ""), "OMP_NUM_THREADS": "1"}
    launcher = ([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(procs), "-m", "jobs.cli"]
                if procs > 1 else [str(BIN / "jobs")])
    res = subprocess.run(launcher + ARGS + ["--catalog", str(catalog), *extra], capture_output=True, text=True,
                         env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    run_lines = [line for line in res.stdout.splitlines() if line.startswith("run run-")]
    assert len(run_lines) == 1, res.stdout                     # one report: rank 0's
    return run_lines[0].split()[1].rstrip(":")


def _predictions(catalog, run_id):
    con = duck.connect(catalog)
    rows = con.execute("SELECT model_id, predicted FROM predictions WHERE run_id = ? ORDER BY model_id",
                       [run_id]).fetchall()
    configs = con.execute("SELECT config_json FROM runs WHERE run_id = ?", [run_id]).fetchall()
    con.close()
    assert len(configs) == 1
    return np.array([r[1] for r in rows]), json.loads(configs[0][0])["world_size"]


def test_two_process_ddp_matches_one_process_within_noise(catalog_copy):
    single, w1 = _predictions(catalog_copy, _train(catalog_copy, "--seed", "0"))
    ddp, w2 = _predictions(catalog_copy, _train(catalog_copy, "--seed", "0", procs=2))
    other_seed, _ = _predictions(catalog_copy, _train(catalog_copy, "--seed", "1"))
    assert (w1, w2) == (1, 2) and len(ddp) == len(single) == 48
    gap = np.abs(ddp - single).mean()
    noise = np.abs(other_seed - single).mean()
    assert gap < 0.5 * noise, (gap, noise)
