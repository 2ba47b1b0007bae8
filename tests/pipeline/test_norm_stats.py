"""Batch norm as its evaluation-time affine map: the rewritten edge and bias compute what the
batch norm computes, and nothing else in the graph changes."""
import numpy as np
import torch
from torch import nn

from pipeline.neural_graph.convert import convert_module
from pipeline.neural_graph.norm_stats import effective_batch_norms


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
    bn = model[1]
    with torch.no_grad():
        bn.weight.uniform_(0.5, 2.0)
        bn.bias.uniform_(-1, 1)
        bn.running_mean.uniform_(-2, 2)
        bn.running_var.uniform_(0.1, 3.0)
    return model.eval()


def test_batch_norm_edges_and_biases_compute_the_evaluation_affine_map():
    model = _model()
    graph = convert_module(model, torch.zeros(1, 1, 6, 6)).graph
    out = effective_batch_norms(graph)
    i = next(k for k, op in enumerate(graph.ops) if op["kind"] == "batch_norm")
    e = np.flatnonzero(graph.edge_op == i)
    dst = graph.dst[e]
    a, c = out.weight[e].sum(1), out.bias[dst]
    x = torch.randn(5, 4, 2, 2)
    expect = model[1](x)
    got = torch.from_numpy(a)[None, :, None, None] * x + torch.from_numpy(c)[None, :, None, None]
    assert torch.allclose(got, expect, atol=1e-5)
    assert not np.allclose(a, graph.weight[e].sum(1))              # the statistics did change the edge
    other = np.setdiff1d(np.arange(len(graph.src)), e)
    assert np.array_equal(out.weight[other], graph.weight[other])
    keep = np.setdiff1d(np.arange(graph.num_nodes), dst)
    assert np.array_equal(out.bias[keep], graph.bias[keep])


def test_a_graph_without_batch_norm_is_unchanged():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
    graph = convert_module(model, torch.zeros(1, 3)).graph
    out = effective_batch_norms(graph)
    assert np.array_equal(out.weight, graph.weight) and np.array_equal(out.bias, graph.bias)
