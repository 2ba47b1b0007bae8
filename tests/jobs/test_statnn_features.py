"""StatNN's per-layer statistics read parameters only: edges of weight 1 are structure, not weights."""
import numpy as np
import torch

from jobs.baselines import statnn_features_of_graphs
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
