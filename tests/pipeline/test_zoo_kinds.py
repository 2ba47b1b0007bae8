"""Zoo kinds as users make them: the fixed-architecture CNN zoo shares one shape."""
from graphstore import duck
from pipeline.ingest import ingest_zoo
from pipeline.zoo.make import make_zoo


def test_the_fixed_cnn_zoo_is_one_shape_with_varied_training(tmp_path):
    make_zoo("cnn-fixed", tmp_path / "zoo", n=6, seed=1, workers=1, progress=False)
    report = ingest_zoo(tmp_path / "zoo", tmp_path / "cat", progress=False)
    assert report.ok and report.added == 6
    con = duck.connect(tmp_path / "cat")
    # one shape (parameters, neurons, edges); the activation (relu or tanh) alone tells architectures apart
    assert con.execute("SELECT count(DISTINCT (num_params, num_nodes, num_edges)) FROM models").fetchone()[0] == 1
    assert con.execute("SELECT count(DISTINCT architecture_id) = count(DISTINCT activation) FROM models"
                       ).fetchone()[0]
    varied = con.execute("SELECT count(DISTINCT lr), count(DISTINCT init_std), count(DISTINCT train_fraction), "
                         "min(test_accuracy), max(test_accuracy) FROM models").fetchone()
    assert varied[:3] == (6, 6, 6) and 0 <= varied[3] < varied[4] <= 1


def test_the_cli_lists_exactly_the_kinds_and_formats_that_exist():
    """`pipeline zoo make` reads its choices from pipeline.zoo (no torch import); every name there is
    a recipe and every recipe is listed, so a new kind is one recipe plus one line."""
    from click.testing import CliRunner

    from pipeline.cli import main
    from pipeline.zoo import CHECKPOINT_FORMATS, KINDS
    from pipeline.zoo.kinds import RECIPES
    from pipeline.zoo.make import FORMATS

    assert list(KINDS) == list(RECIPES)
    assert list(FORMATS) == list(CHECKPOINT_FORMATS)
    res = CliRunner().invoke(main, ["zoo", "make", "--help"])
    assert res.exit_code == 0
    for kind in KINDS:
        assert f"{kind}:" in " ".join(res.output.split())
    res = CliRunner().invoke(main, ["zoo", "make", "nope", "out"])
    assert res.exit_code == 2 and "'nope' is not one of 'cnn', 'cnn-fixed', 'mlp', 'inr', 'mlp-equivariant'" in res.output
