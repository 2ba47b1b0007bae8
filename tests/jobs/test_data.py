"""Selection, splits, per-layer statistics and the streamed arrays, against the catalog itself."""
import numpy as np
import pytest

from graphstore import duck
from jobs.training.data import GraphStream, hash_split, layer_stats, select_models
from jobs.training.distributed import DistContext, shard
from pipeline.graph_codec import read_graphs
from pipeline.neural_graph.vocabulary import RELATIONS


def test_per_layer_statistics_match_numpy_over_the_training_models(catalog_dir):
    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", "zoo = 'cnn'", catalog=catalog_dir)
    train = sel.ids("train")
    stats = layer_stats(con, train)
    arrays = read_graphs(con, train)
    # weights of op 1 that are batch norm, and of op 1 that are conv: separate layers
    for rel in ("norm", "conv"):
        r = RELATIONS.index(rel)
        vals = np.concatenate([a.weight[(a.edge_op == 1) & (a.relation == r)].ravel() for a in arrays])
        vals = vals[vals != 0]
        if len(vals):
            assert stats.weight_mean[1, r] == pytest.approx(vals.mean(), rel=1e-4)
            assert stats.weight_std[1, r] == pytest.approx(vals.std(), rel=1e-3)
    biases = np.concatenate([a.bias[(a.node_layer == 2)] for a in arrays])
    assert stats.bias_mean[2] == pytest.approx(biases.mean(), rel=1e-4, abs=1e-7)
    assert stats.bias_mean.ndim == 1 and stats.weight_mean.shape[1] == len(RELATIONS)   # never per neuron


def test_split_is_stable_and_roughly_70_15_15():
    ids = [f"m{i}" for i in range(3000)]
    splits = [hash_split(m) for m in ids]
    assert splits == [hash_split(m) for m in ids]
    frac = {s: splits.count(s) / len(ids) for s in ("train", "val", "test")}
    assert abs(frac["train"] - 0.7) < 0.03 and abs(frac["test"] - 0.15) < 0.03


def test_stream_gives_the_same_graphs_with_and_without_cache(catalog_dir):
    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", "zoo = 'cnn'", catalog=catalog_dir)
    stats = layer_stats(con, sel.ids("train"))
    idx = list(range(len(sel.model_ids)))
    cached = GraphStream(con, sel, stats, chunk=8, workers=2)
    plain = GraphStream(con, sel, stats, chunk=20, workers=3, cache_bytes=0)     # 2 batches of 8 per query
    seen = []
    for (i1, g1), (i2, g2) in zip(cached.batches(idx, 8), plain.batches(idx, 8)):
        assert list(i1) == list(i2)
        for a, b in zip(g1, g2):
            for et in a.canonical_etypes:
                assert np.array_equal(a.edges[et].data["w"].numpy(), b.edges[et].data["w"].numpy())
        seen += list(i1)
    assert seen == idx
    again = [i for batch, _ in cached.batches(shard(idx, DistContext(), seed=1), 8) for i in batch]
    assert sorted(again) == idx and again != idx


def test_stream_reads_several_batches_per_query(catalog_dir, monkeypatch):
    """``chunk`` models per DuckDB query (a query's cost grows with the catalog): 5 batches of 6
    models with chunk 18 take 2 queries (3 batches, then 2), and come out in order, the last one short."""
    import jobs.training.data as data

    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", "zoo = 'cnn'", catalog=catalog_dir)
    stats = layer_stats(con, sel.ids("train"))
    queries = []
    real = data.read_graphs
    monkeypatch.setattr(data, "read_graphs", lambda con, ids, **kw: queries.append(len(ids)) or real(con, ids, **kw))
    idx = list(range(27))
    out = list(GraphStream(con, sel, stats, chunk=18, workers=2, cache_bytes=0).batches(idx, 6))
    assert [list(i) for i, _ in out] == [idx[k:k + 6] for k in range(0, 27, 6)]
    assert [len(g) for _, g in out] == [6, 6, 6, 6, 3] and sorted(queries) == [9, 18]


def test_fewer_training_models_are_nested_and_leave_validation_and_test_alone(catalog_dir):
    """``--train-size N`` (a learning curve): the smaller training sets are subsets of the larger,
    and the models validated and tested on are the same at every size."""
    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", catalog=catalog_dir)
    con.close()
    n = int(sel.mask("train").sum())
    small, large = sel.with_training_models(3), sel.with_training_models(n - 2)
    assert int(small.mask("train").sum()) == 3 and int(large.mask("train").sum()) == n - 2
    assert set(small.ids("train")) < set(large.ids("train")) < set(sel.ids("train"))
    for part in ("val", "test"):
        assert small.ids(part) == large.ids(part) == sel.ids(part)
    by_id = dict(zip(sel.model_ids, sel.targets))
    assert all(by_id[m] == t for m, t in zip(small.model_ids, small.targets))
    assert sel.with_training_models(n + 5) is sel


def test_a_diverged_checkpoint_is_refused_by_name_not_trained_on(catalog_dir):
    """One NaN weight would make every prediction of a run NaN: the graph is refused, naming the
    model and how to leave it out."""
    import dataclasses

    from jobs.training.data import normalised_graph
    from zoocore.errors import JobError

    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", "zoo = 'cnn'", catalog=catalog_dir)
    stats = layer_stats(con, sel.ids("train"))
    graph, = read_graphs(con, sel.model_ids[:1])
    con.close()
    assert normalised_graph(graph, stats, sel.frame, sel.etypes, model_id=sel.model_ids[0]) is not None
    weight = graph.weight.copy()
    weight[3, 0] = np.nan
    with pytest.raises(JobError, match=f"model {sel.model_ids[0]} has NaN or infinite weights") as exc:
        normalised_graph(dataclasses.replace(graph, weight=weight), stats, sel.frame, sel.etypes,
                         model_id=sel.model_ids[0])
    assert f"--where \"model_id <> '{sel.model_ids[0]}'\"" in str(exc.value)
