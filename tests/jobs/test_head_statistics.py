"""--head-statistics: StatNN's features beside the graph embedding in the metanetwork's head. The
map is fitted on the training models only, invariant where the run's graphs are, saved in the
manifest, and `jobs predict` reads the same inputs the run trained on."""
import json

import numpy as np
import pytest
import torch

from graphstore import duck
from graphstore.catalog import Catalog
from jobs.config import TrainConfig
from jobs.metanets import build_metanetwork
from jobs.metanets.ngnn import NGGNNConfig
from jobs.training.artifacts import load_metanetwork
from jobs.training.data import layer_stats, normalised_graph, select_models
from jobs.training.head_statistics import KNOTS, SCORES, HeadStatistics
from jobs.training.manifest import RunManifest
from jobs.training.train import train_heterognn
from tests.jobs.predict_again import predict_again_gap
from pipeline.graph_codec import read_graphs, read_plans
from jobs.predictors import answer_name
from pipeline.neural_graph.symmetry import random_rescaling


def test_the_map_is_fitted_on_training_models_and_reads_normal_scores(catalog_dir):
    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", "zoo = 'cnn'", catalog=catalog_dir)
    head, rows = HeadStatistics.fit(con, sel)
    raw = head.features(con, sel.model_ids)
    assert rows.shape == (len(sel.model_ids), head.width) and rows.dtype == np.float32
    assert head.settings["shape"] is True          # a mixed zoo: shape descriptors too, as StatNN reads them
    train = sel.mask("train")
    for j, c in enumerate(head.columns):           # every kept column varies on the training models
        values = raw[train, c][np.isfinite(raw[train, c])]
        assert values.max() > values.min()
        assert SCORES[0] - 1e-6 <= rows[:, j].min() and rows[:, j].max() <= SCORES[-1] + 1e-6
    # the training models' scores spread over the normal scores: median near 0 for a continuous column
    j = int(np.argmax([len(np.unique(raw[train, c])) for c in head.columns]))
    assert abs(float(np.median(rows[train, j]))) < 0.2
    # a model missing a slot reads 0 there and 1 in its indicator
    if head.missing:
        c = head.missing[0]
        gone = ~np.isfinite(raw[:, c])
        assert gone.any() and (rows[gone, head.columns.index(c)] == 0).all()
        assert (rows[gone, len(head.columns)] == 1).all() and (rows[~gone, len(head.columns)] == 0).all()
    # models outside the training split do not move the map
    other = select_models(con, "test_accuracy", "zoo = 'cnn'", catalog=catalog_dir)
    other.splits = np.where(other.splits == "test", "val", other.splits)
    assert HeadStatistics.fit(con, other)[0].knots == head.knots
    con.close()


def test_balanced_statistics_do_not_change_when_a_model_is_rescaled(catalog_dir):
    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", "zoo = 'cnn'", catalog=catalog_dir)
    head, rows = HeadStatistics.fit(con, sel, {"balanced": True})
    ids = sel.model_ids[:4]
    arch, plans = read_plans(con, ids)
    rescaled = [random_rescaling(g, np.random.default_rng(k), 10.0, steps=plans[arch[m]].steps)
                for k, (m, g) in enumerate(zip(ids, read_graphs(con, ids, plans=plans)))]
    again = head.of_graphs(con, ids, rescaled)
    assert np.abs(again - rows[:4]).max() < 1e-3
    plain, _ = HeadStatistics.fit(con, sel)        # the checkpoints' own weights: rescaling shows
    assert np.abs(plain.of_graphs(con, ids, rescaled) - plain.of_models(con, ids)).max() > 0.1
    con.close()


def test_the_map_survives_the_manifest_and_refuses_another_shape(catalog_dir):
    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", "zoo = 'cnn'", catalog=catalog_dir)
    head, rows = HeadStatistics.fit(con, sel, {"balanced": True})
    back = HeadStatistics.from_dict(head.to_dict())
    assert np.array_equal(back.of_models(con, sel.model_ids), rows)
    bad = head.to_dict()
    bad["knots"] = [k[:KNOTS - 1] for k in bad["knots"]]
    with pytest.raises(ValueError, match="another shape"):
        HeadStatistics.from_dict(bad)
    con.close()


def test_the_head_reads_the_statistics_and_refuses_to_run_without_them(catalog_dir):
    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", "zoo = 'cnn'", catalog=catalog_dir)
    stats = layer_stats(con, sel.ids("train"))
    graph, = read_graphs(con, [sel.model_ids[0]])
    con.close()
    g = normalised_graph(graph, stats, sel.frame, sel.etypes)
    torch.manual_seed(0)
    model = build_metanetwork(NGGNNConfig(etypes=sel.etypes, edge_in=sel.frame[0] * sel.frame[1], out_dim=1,
                                          hidden=16, edge_hidden=8, layers=1, statistics_dim=5)).eval()
    with torch.no_grad():
        a, za = model(g, torch.zeros(1, 5))
        b, zb = model(g, torch.ones(1, 5))
    assert torch.equal(za, zb) and not torch.allclose(a, b)     # the embedding is the graph's; the answer reads both
    with pytest.raises(ValueError, match="reads 5 statistics"):
        model(g)


def test_a_run_with_head_statistics_trains_saves_and_predicts_the_same(catalog_copy):
    cfg = TrainConfig(where="zoo = 'cnn'", ensemble=1, epochs=2, batch_size=8, hidden=16, edge_hidden=8, layers=1,
                      patience=2, head_statistics=True, baselines=False, rescale_test=(4.0,))
    report = train_heterognn(catalog_copy, cfg, progress=False)
    models, manifest = load_metanetwork(Catalog(catalog_copy), report.run_id)
    assert manifest.head is not None and models[0].cfg.statistics_dim == manifest.head.width > 0
    assert RunManifest.from_json(manifest.to_json()).head.knots == manifest.head.knots
    assert "ngnn@x4" in report.metrics          # rescaled copies get their own statistics
    assert predict_again_gap(catalog_copy, report.run_id, "zoo = 'cnn'") < 1e-5


def test_the_head_and_the_blend_read_each_models_statistics_once(catalog_copy, monkeypatch):
    """The head and the blend's StatNN read the same features of the same balanced graphs: one read
    serves both, and one pass over each preparation of the graphs (plain, balanced) reads the
    statistics and the spectral descriptors of every predictor that wants them (balancing every graph
    a second time would cost a pass over the zoo)."""
    import jobs.training.preparation as preparation
    from jobs.predictors.tabular import StatNN

    reads, passes, read, read_prepared = [], [], StatNN.features, preparation.read_prepared

    def counted(self, con, model_ids, blocks=None):
        reads.append(json.dumps(self.settings, sort_keys=True))
        return read(self, con, model_ids, blocks)

    def counted_pass(con, ids, prepare=None, chunk=256):
        passes.append((tuple(ids), prepare is None))
        return read_prepared(con, ids, prepare, chunk)

    monkeypatch.setattr(StatNN, "features", counted)
    monkeypatch.setattr(preparation, "read_prepared", counted_pass)
    report = train_heterognn(catalog_copy, TrainConfig(where="zoo = 'cnn'", ensemble=1, epochs=1, batch_size=8,
                                                       hidden=16, edge_hidden=8, layers=1, patience=1),
                             progress=False)
    assert answer_name("ngnn") in report.metrics        # the head, the baselines and the blend all ran
    # the plain statistics for the baselines, the balanced ones for the head and the blend, each with and
    # without the spectral descriptors (statnn_spectral, a partner): four reads, none repeated
    assert len(reads) == len(set(reads)) == 4 and sum('"balanced": true' in r for r in reads) == 2
    assert sum('"spectral": true' in r for r in reads) == 2
    # ... from one pass over the selection's balanced graphs (the head, the balanced partners and their
    # spectra) and one over its plain graphs for the features; the other plain pass is the trust gate's
    # (the selection fits one chunk; a pass over the training models alone is the trust signal's)
    whole = max(len(ids) for ids, _ in passes)
    plain = [p for ids, p in passes if len(ids) == whole]
    assert plain.count(False) == 1 and plain.count(True) == 2, passes


def test_a_run_with_spectral_descriptors_reads_them_saves_and_predicts_the_same(catalog_copy):
    """--head-spectral widens the head by the descriptors the training models have, keeps them in the
    saved map's settings, and `jobs predict` reads them again to the same predictions (rescaled
    copies included: their descriptors are read from the copies' own graphs)."""
    cfg = dict(where="zoo = 'cnn'", ensemble=1, epochs=1, batch_size=8, hidden=16, edge_hidden=8, layers=1,
               patience=1, baselines=False, stack=False)
    plain = train_heterognn(catalog_copy, TrainConfig(**cfg), progress=False)
    spectral = train_heterognn(catalog_copy, TrainConfig(**cfg, head_spectral=True, rescale_test=(4.0,)),
                               progress=False)
    _, without = load_metanetwork(Catalog(catalog_copy), plain.run_id)
    models, manifest = load_metanetwork(Catalog(catalog_copy), spectral.run_id)
    assert manifest.head.settings.get("spectral") is True and not without.head.settings.get("spectral")
    assert manifest.head.width > without.head.width and models[0].cfg.statistics_dim == manifest.head.width
    assert "ngnn@x4" in spectral.metrics
    assert predict_again_gap(catalog_copy, spectral.run_id, "zoo = 'cnn'") < 1e-5
