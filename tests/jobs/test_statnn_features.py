"""StatNN's per-layer statistics read parameters only: edges of weight 1 are structure, not weights."""
import numpy as np
import torch

from jobs.predictors.baselines import statnn_features_of_graphs
from pipeline.neural_graph.convert import convert_module
from pipeline.neural_graph.vocabulary import RELATIONS, UNIT_RELATIONS
from tests.pipeline.test_windowed_attention import tiny_swin_v2


def test_weight_statistics_ignore_every_unit_edge():
    """Swin V2 has residual, attn_bias and attn_scale edges (weight 1, no parameter): the statistics
    are the same whatever those edges hold, and they still see every parameter."""
    torch.manual_seed(0)
    graph = convert_module(tiny_swin_v2().eval(), torch.randn(1, 3, 8, 8)).graph
    unit = np.isin(graph.relation, [RELATIONS.index(r) for r in UNIT_RELATIONS])
    present = {RELATIONS[r] for r in np.unique(graph.relation[unit])}
    assert {"residual", "attn_bias", "attn_scale"} <= present
    assert np.all(graph.weight[unit][graph.weight[unit] != 0] == 1)
    before = statnn_features_of_graphs([graph])
    graph.weight[unit] = np.where(graph.weight[unit] != 0, 7.0, 0.0)
    np.testing.assert_array_equal(statnn_features_of_graphs([graph]), before)
    graph.weight[~unit] *= 2          # a parameter change moves them
    assert not np.allclose(np.nan_to_num(statnn_features_of_graphs([graph])), np.nan_to_num(before))


def test_sql_and_in_memory_statistics_agree_and_statnn_stays_in_range(catalog_dir, cnn_zoo, mlp_zoo):
    """The statistics DuckDB computes from the catalog equal those of the same models' graphs
    (index slots, position slots, norm layers), and both StatNN learners predict inside the
    training targets' range (an unclipped MLP once scored R^2 -48 on a zoo it had not seen)."""
    from graphstore import duck
    from jobs.predictors.baselines import statnn_features
    from jobs.predictors.tabular import fit_all
    from jobs.training.data import select_models
    from pipeline.neural_graph.convert import convert_checkpoint

    con = duck.connect(catalog_dir)
    try:
        rows = con.execute("SELECT model_id, zoo, source_path FROM models ORDER BY model_id LIMIT 6").fetchall()
        sql = statnn_features(con, [r[0] for r in rows])
        zoos = {"cnn": cnn_zoo, "mlp": mlp_zoo}
        graphs = [convert_checkpoint(zoos[zoo] / path).graph for _, zoo, path in rows]
        np.testing.assert_allclose(statnn_features_of_graphs(graphs), sql, rtol=1e-5, atol=1e-7)
        assert np.isfinite(sql).sum(1).min() > 2 * 3 * 7          # first, last and more are filled for every model
        sel = select_models(con, "test_accuracy", "zoo = 'cnn'", catalog=catalog_dir)
        low, high = sel.targets[sel.mask("train")].min(), sel.targets[sel.mask("train")].max()
        for name, (_, result) in fit_all(con, sel, ["statnn", "statnn_mlp"]).items():
            assert np.all(np.isfinite(result.predictions)), name
            assert result.predictions.min() >= low - 1e-9 and result.predictions.max() <= high + 1e-9, name
    finally:
        con.close()
