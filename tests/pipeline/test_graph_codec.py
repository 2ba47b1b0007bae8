"""The one codec between neural graphs and the nodes/edges relations: written, committed, read back."""
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from graphstore import duck
from graphstore.schema import EDGES, NODES
from pipeline.graph_codec import graph_tables, read_graphs
from pipeline.neural_graph.build import state_dict_from_graph
from pipeline.neural_graph.convert import convert_checkpoint


def _edge_order(g):
    return np.lexsort((g.src, g.dst, g.edge_op))


@pytest.mark.parametrize("zoo", ["cnn", "mlp"])
def test_a_graph_read_from_the_catalog_is_the_converted_graph(catalog_dir, cnn_zoo, mlp_zoo, zoo):
    source = {"cnn": cnn_zoo, "mlp": mlp_zoo}[zoo]
    con = duck.connect(catalog_dir)
    rows = con.execute("SELECT model_id, checkpoint FROM models WHERE zoo = ? ORDER BY model_id LIMIT 3",
                       [zoo]).fetchall()
    assert rows
    graphs = read_graphs(con, [m for m, _ in rows])
    for (mid, checkpoint), got in zip(rows, graphs):
        want = convert_checkpoint(source / checkpoint).graph
        a, b = _edge_order(got), _edge_order(want)
        for name in ("src", "dst", "relation", "edge_op", "weight"):
            np.testing.assert_array_equal(getattr(got, name)[a], getattr(want, name)[b], err_msg=name)
        for name in ("node_type", "node_layer", "node_position", "bias", "extra"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
        assert got.layer_activation == want.layer_activation and got.ops == want.ops
        assert got.kernel_shape == want.kernel_shape and got.buffers == want.buffers
        # and the exact inverse of what was read is the checkpoint, bit for bit
        state, original = state_dict_from_graph(got), load_file(str(source / checkpoint))
        assert state.keys() == original.keys()
        assert all(torch.equal(state[k], original[k]) for k in original)


def test_written_tables_have_the_catalog_schema_and_read_back_in_the_given_order(catalog_dir):
    con = duck.connect(catalog_dir)
    ids = [m for m, in con.execute("SELECT model_id FROM models ORDER BY model_id DESC LIMIT 4").fetchall()]
    graphs = read_graphs(con, ids)
    tables = graph_tables(ids, graphs)
    assert tables["nodes"].schema.equals(NODES) and tables["edges"].schema.equals(EDGES)
    assert tables["nodes"].num_rows == sum(g.num_nodes for g in graphs)
    assert tables["edges"].num_rows == sum(g.num_edges for g in graphs)
    # the tables of a graph read back give the same tables
    again = graph_tables(ids[::-1], read_graphs(con, ids[::-1]))
    for name in ("nodes", "edges"):
        key = [("model_id", "ascending")] + ([("node", "ascending")] if name == "nodes" else
                                            [("layer", "ascending"), ("dst", "ascending"), ("src", "ascending")])
        assert tables[name].sort_by(key).equals(again[name].sort_by(key))


def test_reading_a_model_the_catalog_does_not_hold_names_it(catalog_dir):
    from zoocore.errors import CatalogError

    with pytest.raises(CatalogError, match="no-such-model"):
        read_graphs(duck.connect(catalog_dir), ["no-such-model"])
