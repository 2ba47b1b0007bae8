"""NG-T: permutation symmetry, an end-to-end run, and --model surviving `jobs predict`."""
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from graphstore import duck
from graphstore.catalog import Catalog
from jobs.training.data import layer_stats, normalised_graph, select_models
from jobs.metanets import build_metanetwork
from jobs.metanets.ngnn import NGGNNConfig
from jobs.metanets.ngt import NGT
from jobs.config import TrainConfig
from jobs.training.artifacts import load_metanetwork
from jobs.training.predict import predict
from jobs.training.train import train_heterognn
from pipeline.graph_codec import read_graphs
from pipeline.neural_graph.symmetry import random_hidden_permutation
from tests.conftest import ingest_with_split_column

FAST = dict(ensemble=1, epochs=2, batch_size=8, hidden=16, edge_hidden=8, layers=2, patience=2)


@pytest.mark.parametrize("zoo,seed,split,spread,values", [
    ("cnn", 0, "all", False, False), ("cnn", 1, "direction", True, False), ("cnn", 2, "relation", False, True),
    ("mlp", 2, "relation", True, False), ("cnn", 3, "all", True, True), ("mlp", 1, "all", True, True)])
def test_predictions_are_invariant_and_node_embeddings_equivariant(catalog_dir, zoo, seed, split, spread, values):
    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", f"zoo = '{zoo}'", catalog=catalog_dir)
    stats = layer_stats(con, sel.ids("train"))
    torch.manual_seed(seed)
    model = build_metanetwork(NGGNNConfig(etypes=sel.etypes, edge_in=sel.frame[0] * sel.frame[1], out_dim=3,
                                          hidden=16, edge_hidden=8, layers=2, kind="ngt",
                                          attention_groups=split, attention_std=spread,
                                          relation_values=values)).eval()
    assert isinstance(model, NGT) and model.layers[0].groups == split
    assert hasattr(model.layers[0], "value_weight") == values
    graph, = read_graphs(con, [sel.model_ids[seed]])
    perm = random_hidden_permutation(graph, np.random.default_rng(seed))
    assert (perm != np.arange(len(perm))).any()
    g0 = normalised_graph(graph, stats, sel.frame, sel.etypes)
    g1 = normalised_graph(graph.permuted(perm), stats, sel.frame, sel.etypes)
    with torch.no_grad():
        (out0, z0), (out1, z1) = model(g0), model(g1)
        h0, h1 = model.node_embeddings(g0)["hidden"], model.node_embeddings(g1)["hidden"]
    rel = lambda a, b: float((a - b).abs().max() / (b.abs().max() + 1e-12))  # noqa: E731
    assert rel(out1, out0) < 1e-5 and rel(z1, z0) < 1e-5
    n_in = int((graph.node_type == 0).sum())
    hidden = np.nonzero(graph.node_type == 1)[0]
    assert rel(h1[torch.as_tensor(perm[hidden] - n_in)], h0[torch.as_tensor(hidden - n_in)]) < 1e-5
    assert rel(h1, h0) > 1e-3


def test_ngt_gradients_reach_every_layer(catalog_dir):
    import dgl

    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", "zoo = 'cnn'", catalog=catalog_dir)
    stats = layer_stats(con, sel.ids("train"))
    model = NGT(NGGNNConfig(etypes=sel.etypes, edge_in=sel.frame[0] * sel.frame[1], out_dim=1, hidden=16,
                            edge_hidden=8, layers=2, kind="ngt"))
    g = dgl.batch([normalised_graph(x, stats, sel.frame, sel.etypes) for x in read_graphs(con, sel.model_ids[:4])])
    model(g)[0].sum().backward()
    for i, layer in enumerate(model.layers):
        assert layer.qkv.weight.grad is not None and layer.qkv.weight.grad.abs().sum() > 0, i
        assert layer.score.weight.grad.abs().sum() > 0 and layer.film.weight.grad.abs().sum() > 0


def test_an_ngt_run_is_saved_as_ngt_and_predicts_as_one(catalog_copy):
    from jobs.cli import main

    res = CliRunner().invoke(main, ["train-heterognn", "--catalog", str(catalog_copy), "--model", "ngt",
                                    "--where", "zoo = 'cnn'", "--ensemble", "1", "--epochs", "2", "--hidden", "16", "--layers", "2",
                                    "--batch-size", "8", "--no-baselines"])
    assert res.exit_code == 0, res.output
    assert "ngt" in res.output
    con = duck.connect(catalog_copy)
    run_id, = con.execute("SELECT run_id FROM runs").fetchone()
    models, meta = load_metanetwork(Catalog(catalog_copy), run_id)
    assert isinstance(models[0], NGT) and meta.model.kind == "ngt"
    mine = dict(con.execute("SELECT model_id, predicted FROM predictions WHERE run_id = ? AND method = 'ngt'",
                            [run_id]).fetchall())
    out = predict(catalog_copy, run_id, where="zoo = 'cnn'")
    assert out.n == len(mine) > 0
    con = duck.connect(catalog_copy)
    again = dict(con.execute("SELECT model_id, predicted FROM predictions WHERE starts_with(run_id, ?) "
                             "AND method = 'ngt'", [run_id + "-predict-"]).fetchall())
    assert max(abs(again[m] - v) for m, v in mine.items()) < 1e-5


def test_both_metanetworks_take_the_users_split_column(tmp_path, cnn_zoo):
    folds = ["train", "train", "train", "val", "test"]
    rows = ingest_with_split_column(cnn_zoo, tmp_path, folds)
    for kind in ("ngnn", "ngt"):
        report = train_heterognn(tmp_path / "cat", TrainConfig(model=kind, baselines=False, split_column="fold",
                                                               **FAST), progress=False)
        assert report.n_models["test"] == sum(1 for i in range(len(rows)) if folds[i % 5] == "test")
        assert set(report.metrics) == {kind}
        con = duck.connect(tmp_path / "cat")
        got = dict(con.execute("SELECT m.checkpoint, p.split FROM predictions p JOIN models m USING (model_id) "
                               "WHERE p.run_id = ?", [report.run_id]).fetchall())
        assert got == {r["checkpoint"]: r["fold"] for r in rows}


def test_group_softmax_is_dgls_edge_softmax_per_group():
    import dgl

    from jobs.metanets.ngt import group_softmax

    gen = torch.Generator().manual_seed(0)
    src, dst = torch.randint(0, 6, (40,), generator=gen), torch.randint(0, 6, (40,), generator=gen)
    logits = torch.randn(40, 3, generator=gen) * 5
    got = group_softmax(logits, dst, 6)
    torch.testing.assert_close(got, dgl.ops.edge_softmax(dgl.graph((src, dst), num_nodes=6), logits))
    # finer groups (destination x a label): each group sums to one on its own
    label = torch.randint(0, 2, (40,), generator=gen)
    per = group_softmax(logits, dst * 2 + label, 12)
    sums = torch.zeros(12, 3).index_add_(0, dst * 2 + label, per)
    present = torch.zeros(12, dtype=torch.bool)
    present[dst * 2 + label] = True
    torch.testing.assert_close(sums[present], torch.ones(int(present.sum()), 3))
    assert (sums[~present] == 0).all()


def test_an_ngt_saved_before_the_spread_read_and_relation_values_loads_as_it_was():
    """Runs saved before ``attention_std`` and ``relation_values`` existed have no such keys: they load
    without them (output maps one block wide, one shared value map), while new runs get both from the
    recipe."""
    from jobs.config import ModelConfig
    from jobs.training.train import metanet_config

    etypes = [("input", "w", "hidden"), ("hidden", "rev_w", "input")]
    new = metanet_config(ModelConfig(model="ngt", hidden=16, edge_hidden=8, layers=1), etypes, (1, 1), 1)
    assert new.attention_std and new.relation_values
    old = new.to_dict()
    old.pop("attention_std")
    old.pop("relation_values")
    old_cfg = NGGNNConfig.from_dict(old)
    assert not old_cfg.attention_std and not old_cfg.relation_values
    before, after = NGT(old_cfg), NGT(new)
    assert before.layers[0].out.in_features == 16 and after.layers[0].out.in_features == 32
    assert before.layers[0].qkv.out_features == 48 and not hasattr(before.layers[0], "value_weight")
    assert after.layers[0].qkv.out_features == 32 and after.layers[0].value_weight.shape == (3, 16, 16)
    before.load_state_dict(NGT(NGGNNConfig.from_dict(old_cfg.to_dict())).state_dict())
    after.load_state_dict(NGT(NGGNNConfig.from_dict(new.to_dict())).state_dict())


def test_attention_dropout_acts_while_training_only(catalog_dir):
    """--attention-dropout reaches NG-T's attention from its one field: training outputs vary with
    it, evaluation outputs do not."""
    from jobs.config import ModelConfig
    from jobs.training.train import metanet_config

    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", "zoo = 'cnn'", catalog=catalog_dir)
    g = normalised_graph(read_graphs(con, [sel.model_ids[0]])[0], layer_stats(con, sel.ids("train")), sel.frame,
                         sel.etypes)
    cfg = metanet_config(ModelConfig(model="ngt", hidden=16, edge_hidden=8, layers=1, attention_dropout=0.5),
                         sel.etypes, sel.frame, 1)
    torch.manual_seed(0)
    model = NGT(cfg)
    assert all(layer.attention_drop.p == 0.5 for layer in model.layers)
    with torch.no_grad():
        train = [model.train()(g)[0] for _ in range(2)]
        evals = [model.eval()(g)[0] for _ in range(2)]
    assert not torch.equal(train[0], train[1]) and torch.equal(evals[0], evals[1])
