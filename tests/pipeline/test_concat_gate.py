"""Concatenation, channel shuffles and gates: converted without new weights, inverted bit for bit,
and the function kept under the graph's permutation and scaling symmetries."""
import numpy as np
import pytest
import torch
from torch import nn

from pipeline.neural_graph.build import state_dict_from_graph
from pipeline.neural_graph.convert import convert_module
from pipeline.neural_graph.coverage import check_exact_inverse
from pipeline.neural_graph.heterograph import neural_graph_to_dgl
from pipeline.neural_graph.symmetry import random_hidden_permutation, random_rescaling
from pipeline.neural_graph.vocabulary import RELATIONS
from zoocore.errors import UnsupportedModuleError


def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random parameters and batch-norm statistics (positive variances), eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen).abs() + 0.5 if "running_var" in name
                        else torch.randn(t.shape, generator=gen) * 0.5)
    return model.eval()


class Fire(nn.Module):
    """SqueezeNet's fire module: squeeze, two expands, concatenated; then a head on the union."""

    def __init__(self):
        super().__init__()
        self.squeeze = nn.Conv2d(3, 4, 1)
        self.e1 = nn.Conv2d(4, 5, 1)
        self.e3 = nn.Conv2d(4, 6, 3, padding=1)
        self.head = nn.Conv2d(11, 7, 1)

    def forward(self, x):
        s = torch.relu(self.squeeze(x))
        h = torch.cat([torch.relu(self.e1(s)), torch.relu(self.e3(s))], 1)
        return torch.flatten(nn.functional.adaptive_avg_pool2d(self.head(torch.max_pool2d(h, 2)), 1), 1)


class Dense(nn.Module):
    """DenseNet: batch norm and convolutions reading the running concatenation."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(2, 4, 3, padding=1)
        self.n1, self.c1 = nn.BatchNorm2d(4), nn.Conv2d(4, 3, 3, padding=1)
        self.n2, self.c2 = nn.BatchNorm2d(7), nn.Conv2d(7, 3, 1)
        self.n3 = nn.BatchNorm2d(10)
        self.fc = nn.Linear(10, 5)

    def forward(self, x):
        x = self.stem(x)
        x = torch.cat([x, self.c1(torch.relu(self.n1(x)))], 1)
        x = torch.cat([x, self.c2(torch.relu(self.n2(x)))], 1)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(torch.relu(self.n3(x)), 1), 1))


def channel_shuffle(x, groups):
    n, c, h, w = x.shape
    return x.view(n, groups, c // groups, h, w).transpose(1, 2).contiguous().view(n, c, h, w)


class Shuffle(nn.Module):
    """ShuffleNetV2's unit: split the channels, transform one half, concatenate, shuffle."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.branch = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.ReLU(),
                                    nn.Conv2d(4, 4, 3, padding=1, groups=4), nn.BatchNorm2d(4))
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        x = self.stem(x)
        a, b = x.chunk(2, dim=1)
        x = channel_shuffle(torch.cat([a, self.branch(b)], 1), 2)
        x = self.dw(x)
        return self.fc(x.mean([2, 3]))


class SqueezeExcite(nn.Module):
    """MobileNetV3 / EfficientNet: a gate g(x) in (0, 1) per channel scales the channels of x."""

    def __init__(self, act=nn.Hardsigmoid):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.fc1, self.fc2 = nn.Conv2d(6, 3, 1), nn.Conv2d(3, 6, 1)
        self.act = act()
        self.proj = nn.Conv2d(6, 6, 1)
        self.scale = nn.Parameter(torch.randn(6, 1, 1))       # layer scale: one factor per channel
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        x = nn.functional.hardswish(self.bn(self.conv(x)))
        g = self.act(self.fc2(torch.relu(self.fc1(nn.functional.adaptive_avg_pool2d(x, 1)))))
        y = self.proj(g * x)
        return self.fc((self.scale * y).mean([2, 3]) + x.mean([2, 3]))


MODELS = {"fire": Fire, "dense": Dense, "shuffle": Shuffle, "se_hardsigmoid": SqueezeExcite,
          "se_sigmoid": lambda: SqueezeExcite(nn.Sigmoid)}


def _convert(name, seed=0):
    model = randomize(MODELS[name](), seed)
    x = torch.randn(3, model.stem.in_channels if hasattr(model, "stem") else 3, 8, 8)
    return model, x, convert_module(model, x)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_converts_and_inverts_bit_exactly(name):
    model, x, conv = _convert(name)
    check_exact_inverse(conv.graph, model.state_dict(), name)
    clone = MODELS[name]()
    clone.load_state_dict(state_dict_from_graph(conv.graph))
    assert torch.equal(clone.eval()(x), model(x))


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_symmetries_keep_the_function(name, seed):
    """A random hidden permutation and a random rescaling of the graph, inverted into a network,
    compute the same function: the ties through concatenations and gates are the right ones."""
    model, x, conv = _convert(name, seed)
    rng = np.random.default_rng(seed)
    g = conv.graph.permuted(random_hidden_permutation(conv.graph, rng))
    g = random_rescaling(g, rng, max_scale=3.0, steps=conv.plan.steps)
    clone = MODELS[name]()
    clone.load_state_dict(state_dict_from_graph(g))
    torch.testing.assert_close(clone.eval()(x), model(x), rtol=1e-4, atol=1e-4)
    assert not all(torch.equal(a, b) for a, b in zip(clone.state_dict().values(), model.state_dict().values()))


def test_concatenation_adds_no_neurons_or_weights():
    """The neurons of a concatenation are its operands' neurons: the head conv's 11 inputs come
    from the two expand layers, and no layer or edge is made for the cat itself."""
    model, _, conv = _convert("fire")
    sizes = [layer.size for layer in conv.plan.layers]
    assert sizes == [3, 4, 5, 6, 7]
    head = conv.plan.ops[-1]
    assert head["src_segments"] == [[2, 0, 5, 1], [3, 0, 6, 1]]
    params = sum(p.numel() for p in model.parameters() if p.dim() > 1)
    assert int(conv.graph.weight.astype(bool).sum()) <= params
    assert conv.graph.num_edges == sum(p.numel() // (p.shape[2] * p.shape[3]) for p in model.parameters()
                                       if p.dim() == 4)


def test_channel_shuffle_interleaves_the_two_halves():
    _, _, conv = _convert("shuffle")
    dw = next(op for op in conv.plan.ops if op["kind"] == "conv" and op["groups"] == 8)
    # shuffled order: stem 0, branch 0, stem 1, branch 1, ...: single-neuron runs alternating layers
    assert [s[0] for s in dw["src_segments"]] == [1, 5] * 4 and [s[1] for s in dw["src_segments"]] == [
        0, 0, 1, 1, 2, 2, 3, 3]


def test_gate_is_a_relation_of_its_own():
    _, _, conv = _convert("se_hardsigmoid")
    g = conv.graph
    gate = RELATIONS.index("gate")
    assert int((g.relation == gate).sum()) == 6
    assert "hardsigmoid" in g.layer_activation and "hardswish" in g.layer_activation
    gate_op = next(op for op in conv.plan.ops if op["kind"] == "gate")
    assert conv.plan.layers[gate_op["src_layer"]].activation == "hardsigmoid"
    assert conv.plan.layers[gate_op["dst_layer"]].kind == "gate"
    et = neural_graph_to_dgl(g).canonical_etypes
    assert ("hidden", "gate", "hidden") in et and ("hidden", "rev_gate", "hidden") in et


class RepeatCat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.cat([h, h], 1))


def test_repeated_neurons_are_refused():
    with pytest.raises(UnsupportedModuleError, match="repeats neurons"):
        convert_module(RepeatCat(), torch.randn(2, 3, 4, 4))


class GatedConcatNet(nn.Module):
    """A small CNN with a concatenation and a squeeze-excitation gate, for the ingest-to-training test."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(1, 3, 3, padding=1), nn.Conv2d(1, 2, 1)
        self.fc1, self.fc2 = nn.Conv2d(5, 2, 1), nn.Conv2d(2, 5, 1)
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        h = torch.cat([torch.relu(self.a(x)), torch.relu(self.b(x))], 1)
        g = torch.sigmoid(self.fc2(torch.relu(self.fc1(h.mean([2, 3], keepdim=True)))))
        return self.fc((g * h).mean([2, 3]))


@pytest.mark.slow
def test_gated_concat_zoo_flows_through_ingest_store_and_training(tmp_path):
    """Exported archives with cat and a gate: ingested (catalog tables, graph store), read back
    as graphs that invert exactly, and a metanetwork trains on them."""
    import json

    from graphstore import duck
    from pipeline.graph_codec import read_graphs
    from jobs.config import TrainConfig
    from jobs.training.train import train_heterognn
    from pipeline.ingest import ingest_zoo

    zoo = tmp_path / "zoo"
    zoo.mkdir()
    states = {}
    for i in range(16):
        model = randomize(GatedConcatNet(), i)
        torch.export.save(torch.export.export(model, (torch.randn(2, 1, 6, 6),)), str(zoo / f"m{i:02d}.pt2"))
        (zoo / f"m{i:02d}.json").write_text(json.dumps({"metrics": {"test_accuracy": float(i % 5) / 5}}))
        states[f"m{i:02d}.pt2"] = model.state_dict()
    report = ingest_zoo(zoo, tmp_path / "cat", progress=False)
    assert report.ok and report.added == 16
    con = duck.connect(tmp_path / "cat")
    assert con.execute("SELECT count(*) FROM edges WHERE CAST(relation AS VARCHAR) = 'gate'").fetchone()[0] == 16 * 5
    summary = con.execute("SELECT summary FROM architectures").fetchone()[0]
    assert "gate(" in summary and "conv(5->2" in summary
    ids = dict(con.execute("SELECT source_path, model_id FROM models").fetchall())
    graphs = read_graphs(con, [ids["m03.pt2"]])
    graph = graphs[ids["m03.pt2"]] if isinstance(graphs, dict) else graphs[0]
    check_exact_inverse(graph, states["m03.pt2"], "m03")
    run = train_heterognn(tmp_path / "cat", TrainConfig(ensemble=1, epochs=2, batch_size=8, hidden=8, edge_hidden=4, layers=1,
                                                         baselines=False, loader_workers=0), progress=False)
    assert -1 <= run.metrics["ngnn"]["kendall_tau"] <= 1


def test_streamed_parquet_is_the_graph(tmp_path):
    """Written op by op in small row groups, the edges and nodes read back are graph_from_plan's."""
    import pyarrow.parquet as pq

    from pipeline.graph_codec import dictionary_codes
    from pipeline.neural_graph.build import graph_from_plan
    from pipeline.neural_graph.stream import write_graph_parquet

    model, _, conv = _convert("dense")
    out = write_graph_parquet(conv.plan, model.state_dict(), "m0", tmp_path, rows_per_group=5)
    g = graph_from_plan(conv.plan, model.state_dict())
    assert (out.num_nodes, out.num_edges) == (g.num_nodes, g.num_edges)
    assert out.row_groups == pq.ParquetFile(out.edges_path).num_row_groups > len(conv.plan.ops)
    e = pq.read_table(out.edges_path)
    np.testing.assert_array_equal(e.column("src").to_numpy(), g.src)
    np.testing.assert_array_equal(e.column("dst").to_numpy(), g.dst)
    np.testing.assert_array_equal(dictionary_codes(e.column("relation"), RELATIONS), g.relation)
    weight = np.stack(e.column("weight").to_numpy(zero_copy_only=False))
    np.testing.assert_array_equal(weight, g.weight)
    nodes = pq.read_table(out.nodes_path)
    np.testing.assert_array_equal(nodes.column("bias").to_numpy(), g.bias)
