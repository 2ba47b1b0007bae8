"""The output-neuron readout: invariant under hidden-neuron permutations, and it reads the outputs."""
import numpy as np
import pytest
import torch

from graphstore import duck
from jobs.training.data import layer_stats, normalised_graph, select_models
from jobs.metanets import build_metanetwork
from jobs.metanets.ngnn import NGGNNConfig
from pipeline.graph_codec import read_graphs
from pipeline.neural_graph.symmetry import random_hidden_permutation


@pytest.mark.parametrize("kind", ["ngnn", "ngt"])
def test_output_readout_is_invariant_and_sees_each_output(catalog_dir, kind):
    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", "zoo = 'cnn'", catalog=catalog_dir)
    stats = layer_stats(con, sel.ids("train"))
    torch.manual_seed(0)
    cfg = NGGNNConfig(etypes=sel.etypes, edge_in=sel.frame[0] * sel.frame[1], out_dim=1, hidden=16, edge_hidden=8,
                      layers=2, kind=kind, readout_outputs=12)
    model = build_metanetwork(cfg).eval()
    graphs = read_graphs(con, sel.model_ids[:2])
    perm = random_hidden_permutation(graphs[0], np.random.default_rng(0))
    import dgl

    batch = dgl.batch([normalised_graph(g, stats, sel.frame, sel.etypes) for g in graphs])
    moved = dgl.batch([normalised_graph(graphs[0].permuted(perm), stats, sel.frame, sel.etypes),
                       normalised_graph(graphs[1], stats, sel.frame, sel.etypes)])
    with torch.no_grad():
        (out0, z0), (out1, z1) = model(batch), model(moved)
    assert z0.shape == (2, model.readout_dim) and model.readout_dim > 12 * 16
    assert float((z1 - z0).abs().max() / z0.abs().max()) < 1e-5
    # the untrained head's scalar is small against its summands (0.036 on one machine's zoo), so the
    # float32 summation order a permutation changes shows at ~1e-5 of it; a readout that saw the
    # permutation would be off by orders of magnitude more
    assert float((out1 - out0).abs().max() / out0.abs().max()) < 1e-4
    # the 10 outputs of a digit classifier fill slots 0..9 of each graph; slots 10 and 11 stay empty
    slots = z0[:, -12 * 16:].reshape(2, 12, 16)
    assert (slots[:, :10].abs().sum(-1) > 0).all() and (slots[:, 10:] == 0).all()
    # and the slots follow the output positions: the embedding of output 3 is in slot 3
    h_out = model.node_embeddings(batch)["output"]
    first = batch.nodes["output"].data["position"][:10]
    np.testing.assert_allclose(slots[0, first.long()].numpy(), h_out[:10].detach().numpy(), rtol=1e-6)
