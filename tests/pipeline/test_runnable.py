"""Every converted model runs from the catalog alone: a .pt2 archive's program is kept at ingest
(checked again when read back), the network computes what the archive computed at any batch size,
its layer taps are the layers' values, and a tampered program is refused by name."""
import json

import pytest
import torch
from torch import nn

from graphstore import duck
from jobs.analysis.catalog_models import load_model
from pipeline.checkpoints import load_exported
from pipeline.ingest import ingest_zoo
from pipeline.neural_graph.runnable import Network, program_from_catalog
from zoocore.errors import CheckpointError


class Block(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv, self.norm = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.norm(self.conv(x)))


def residual_cnn() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), Block(6), nn.MaxPool2d(2),
                        nn.Conv2d(6, 4, 3), nn.Tanh(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)).eval()
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2.0)
    return net


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    root = tmp_path_factory.mktemp("runnable")
    (root / "zoo").mkdir()
    net = residual_cnn()
    torch.export.save(torch.export.export(net, (torch.zeros(2, 1, 8, 8),)), str(root / "zoo" / "net.pt2"))
    assert ingest_zoo(root / "zoo", root / "catalog", progress=False).added == 1
    con = duck.connect(root / "catalog")
    model = load_model(con, con.execute("SELECT model_id FROM models").fetchone()[0])
    con.close()
    return {"root": root, "net": net, "model": model}


def test_the_catalog_runs_what_the_archive_ran_at_any_batch(archive):
    model, net = archive["model"], archive["net"]
    assert model.spec is None and model.program[0] is not None
    original = load_exported(archive["root"] / "zoo" / "net.pt2").module()
    x = torch.randn(7, 1, 8, 8)
    network = model.network()
    with torch.no_grad():
        assert torch.equal(network(x[:2]), original(x[:2]))          # the batch it was exported with
        torch.testing.assert_close(network(x), net(x), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(network(x[:1]), net(x[:1]), rtol=1e-5, atol=1e-6)
    assert model.module() is not None and isinstance(model.module(), Network)


def test_layer_taps_are_the_layers_values(archive):
    model, net = archive["model"], archive["net"]
    x = torch.randn(5, 1, 8, 8)
    taps = model.network().taps(x)
    pre = model.network().taps(x, after_activation=False)
    assert sorted(taps) == list(range(len(model.plan.layers)))
    with torch.no_grad():
        conv = net[0](x)
        torch.testing.assert_close(pre[1], conv)                           # the conv's own output
        torch.testing.assert_close(taps[2], net[2](net[1](conv)))          # batch norm, then its relu
        block = net[3](net[2](net[1](conv)))
        torch.testing.assert_close(taps[max(taps) - 2], block)             # the residual sum, after relu
        torch.testing.assert_close(taps[max(taps)], net(x))                # the output layer
    assert [tuple(t.shape[1:]) for t in taps.values()][:2] == [(1, 8, 8), (6, 8, 8)]


def test_a_graph_fixed_to_its_batch_runs_chunk_by_chunk():
    class Fixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            return self.lin(x) + torch.arange(6.0).view(2, 3)             # a table as wide as the batch

    net = Fixed().eval()
    exported = torch.export.export(net, (torch.zeros(2, 4),))
    network = Network(exported, net.state_dict())
    x = torch.randn(4, 4)
    with torch.no_grad():
        want = torch.cat([net(x[:2]), net(x[2:])])
        torch.testing.assert_close(network(x), want)
        torch.testing.assert_close(network(x[:3]), want[:3])


def test_a_tampered_program_is_refused_by_name(archive):
    model = archive["model"]
    program = json.loads(model.program[0])
    node = program["graph_module"]["graph"]["nodes"][0]
    node["target"] = "builtins.eval"
    with pytest.raises(CheckpointError, match="refused the graph call target 'builtins.eval'"):
        program_from_catalog(json.dumps(program), model.program[1], model.state_dict(), "catalog")
    node["target"] = "torch.ops.aten.save.default"
    with pytest.raises(CheckpointError, match="only ATen operators are read"):
        program_from_catalog(json.dumps(program), model.program[1], model.state_dict(), "catalog")


def test_group_norm_and_flatten_graphs_exported_for_one_sample_run_whole_batches():
    """The blind zoos' archives are exported with a batch of 1: their group norms name the batch
    and their reshapes hold it; both are rewritten, and checked against the one-sample graph."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.SiLU(), nn.MaxPool2d(2),
                        nn.Flatten(), nn.Linear(128, 3)).eval()
    exported = torch.export.export(net, (torch.zeros(1, 1, 8, 8),))
    network = Network(exported, net.state_dict())
    x = torch.randn(9, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(network(x), net(x), rtol=1e-5, atol=1e-6)
    assert exported._zoograph_batch_free is not None          # one call for the batch, not nine
    assert {k: tuple(v.shape) for k, v in network.taps(x).items()}[2] == (9, 8, 8, 8)
