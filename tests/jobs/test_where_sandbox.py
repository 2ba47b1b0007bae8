"""`--where` is the user's SQL: it runs under the sandbox of `pipeline sql` (library and CLI)."""
import re

import pytest
from click.testing import CliRunner

from graphstore import duck
from jobs.cli import main as jobs_cli
from jobs.training.data import select_models
from zoocore.errors import JobError

EVIL = "1=1 AND (SELECT count(*) FROM read_csv('/etc/passwd'))>0"
TINY = ["--ensemble", "1", "--epochs", "1", "--hidden", "8", "--layers", "1", "--batch-size", "16", "--no-baselines",
        "--loader-workers", "1"]


def test_select_models_runs_where_sandboxed(catalog_dir):
    con = duck.connect(catalog_dir)
    try:
        with pytest.raises(JobError, match=r"--where .* is refused: .*/etc/passwd"):
            select_models(con, "test_accuracy", EVIL, catalog=catalog_dir)
        with pytest.raises(JobError, match="DROP statements are refused"):     # a second statement smuggled in
            select_models(con, "test_accuracy", "1=1) ORDER BY 1; DROP VIEW models; SELECT (1", catalog=catalog_dir)
        with pytest.raises(JobError, match="runs sandboxed"):
            select_models(con, "test_accuracy", "zoo = 'mlp'")          # no catalog: no sandbox, no run
        sel = select_models(con, "test_accuracy", "zoo = 'mlp' AND dataset = 'iris'", catalog=catalog_dir)
        expected = {r[0] for r in con.execute("SELECT model_id FROM models WHERE zoo = 'mlp' AND dataset = 'iris' "
                                              "AND test_accuracy IS NOT NULL").fetchall()}
        assert set(sel.model_ids) == expected and len(expected) > 2
        everything = select_models(con, "test_accuracy")                  # no condition: the job's own query
        assert len(everything.model_ids) == con.execute("SELECT count(*) FROM models").fetchone()[0]
    finally:
        con.close()


def test_cli_refuses_where_outside_the_catalog_and_accepts_a_normal_one(catalog_copy):
    run = CliRunner().invoke
    cat = ["--catalog", str(catalog_copy)]
    refused = run(jobs_cli, ["train-heterognn", "--where", EVIL, *TINY, *cat], env={"NEO4J_URI": ""})
    assert refused.exit_code == 1 and "is refused" in refused.output, refused.output
    assert "root:" not in refused.output and "Traceback" not in refused.output
    ok = run(jobs_cli, ["train-heterognn", "--where", "zoo = 'mlp'", *TINY, *cat], env={"NEO4J_URI": ""})
    assert ok.exit_code == 0, ok.output
    run_id = re.search(r"run (\S+):", ok.output).group(1)
    refused = run(jobs_cli, ["predict", "--run", run_id, "--where", EVIL, *cat], env={"NEO4J_URI": ""})
    assert refused.exit_code == 1 and "is refused" in refused.output, refused.output
    ok = run(jobs_cli, ["predict", "--run", run_id, "--where", "dataset = 'iris'", *cat], env={"NEO4J_URI": ""})
    assert ok.exit_code == 0 and "predicted 'test_accuracy'" in ok.output, ok.output
