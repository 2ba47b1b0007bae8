"""The stacked NG-GNN layer (one (R, in, out) parameter per weight family, every relation's edges
at once) computes the same function as the per-relation formulation it replaced, and runs saved
with per-relation parameter names load into it."""
import dgl
import pytest
import torch
from torch import nn

from graphstore import duck
from jobs.training.data import layer_stats, normalised_graph, select_models
from jobs.metanets.ngnn import NGGNN, NGGNNConfig, _key, mlp
from jobs.metanets.relational_kernels import segment_max
from pipeline.graph_codec import read_graphs
from pipeline.neural_graph.vocabulary import NODE_TYPES


class PerRelationPNALayer(nn.Module):
    """The layer as it was before the parameters were stacked: one nn.Linear per relation and
    family, one relation at a time (kept here as the reference)."""

    def __init__(self, etypes, hidden, edge_hidden):
        super().__init__()
        self.etypes = [tuple(e) for e in etypes]
        self.msg = nn.ModuleDict({_key(e): nn.Linear(hidden, hidden) for e in self.etypes})
        self.film = nn.ModuleDict({_key(e): nn.Linear(edge_hidden, 2 * hidden) for e in self.etypes})
        self.post = nn.ModuleDict({_key(e): nn.Linear(9 * hidden, hidden) for e in self.etypes})
        self.edge_update = nn.ModuleDict({_key(e): mlp(edge_hidden + 2 * hidden, edge_hidden, edge_hidden)
                                          for e in self.etypes})
        self.node_update = nn.ModuleDict({t: mlp(2 * hidden, hidden, hidden) for t in NODE_TYPES})
        self.norm = nn.ModuleDict({t: nn.LayerNorm(hidden) for t in NODE_TYPES})
        self.register_buffer("delta", torch.zeros(len(self.etypes)))
        self.register_buffer("delta_set", torch.zeros((), dtype=torch.bool))

    def forward(self, h, e, structure):
        agg = {t: torch.zeros_like(h[t]) for t in h}
        new_e = {}
        calibrate = self.training and not bool(self.delta_set)
        for k, et in enumerate(self.etypes):
            if et not in e or et not in structure:
                continue
            s, _, d = et
            ix, key = structure[et], _key(et)
            gamma, beta = self.film[key](e[et]).chunk(2, dim=-1)
            m = gamma * self.msg[key](h[s])[ix.src] + beta
            pos = torch.repeat_interleave(torch.arange(len(ix.nodes)), ix.seglen)
            mean = torch.zeros(len(ix.nodes), m.shape[1]).index_add(0, pos, m) / ix.deg
            sq = torch.zeros(len(ix.nodes), m.shape[1]).index_add(0, pos, m * m) / ix.deg
            mx = torch.zeros(len(ix.nodes), m.shape[1]).scatter_reduce(0, pos[:, None].expand_as(m), m, "amax",
                                                                       include_self=False)
            std = torch.sqrt(torch.relu(sq - mean ** 2) + 1e-6)
            if calibrate:
                self.delta[k] = ix.logd_mean.detach()
            delta = self.delta[k].clamp(min=1e-3)
            f = torch.cat([mean, mx, std], -1)
            out = self.post[key](torch.cat([f, f * (ix.logd / delta), f * (delta / ix.logd)], -1))
            agg[d] = agg[d].index_add(0, ix.nodes, out)
            new_e[et] = e[et] + self.edge_update[key](torch.cat([e[et], h[s][ix.src], h[d][ix.dst]], -1))
        if calibrate:
            self.delta_set.fill_(True)
        out = {t: self.norm[t](h[t] + self.node_update[t](torch.cat([h[t], agg[t]], -1))) for t in h}
        return out, {**e, **new_e}


class PerRelationNGGNN(NGGNN):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.layers = nn.ModuleList(PerRelationPNALayer(cfg.etypes, cfg.hidden, cfg.edge_hidden)
                                    for _ in range(cfg.layers))

    def propagate(self, g, h, e, structure):
        for layer in self.layers:
            h, e = layer(h, e, structure)
        return h, e


def _batch(catalog_dir, zoo, n=5):
    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", f"zoo = '{zoo}'", catalog=catalog_dir)
    stats = layer_stats(con, sel.ids("train"))
    g = dgl.batch([normalised_graph(x, stats, sel.frame, sel.etypes) for x in read_graphs(con, sel.model_ids[:n])])
    return g, sel


@pytest.mark.parametrize("zoo", ["cnn", "mlp"])
def test_stacked_layers_compute_what_per_relation_layers_computed(catalog_dir, zoo):
    g, sel = _batch(catalog_dir, zoo)
    cfg = NGGNNConfig(etypes=sel.etypes, edge_in=sel.frame[0] * sel.frame[1], out_dim=2, hidden=16,
                      edge_hidden=8, layers=2)
    torch.manual_seed(0)
    ref = PerRelationNGGNN(cfg)
    new = NGGNN(cfg)
    saved = ref.state_dict()
    assert "layers.0.msg." + _key(sel.etypes[0]) + ".weight" in saved        # the old layout
    new.load_state_dict(saved)                                                # strict: every key placed
    assert "layers.0.msg_weight" in new.state_dict()
    rel = lambda a, b: float((a - b).abs().max() / (b.abs().max() + 1e-12))  # noqa: E731
    for train in (True, False):          # training mode calibrates PNA's delta on the first batch
        ref.train(train), new.train(train)
        (y0, z0), (y1, z1) = ref(g), new(g)
        assert rel(y1, y0) < 1e-5 and rel(z1, z0) < 1e-5
    assert torch.equal(ref.layers[1].delta, new.layers[1].delta) and bool(new.layers[1].delta_set)
    # gradients agree too (through the segment max, the stacked maps and the gathers)
    ref.zero_grad(), new.zero_grad()
    ref(g)[0].pow(2).sum().backward()
    new(g)[0].pow(2).sum().backward()
    for name in ("bias_in.weight", "edge_in.weight", "layers.0.node_update.hidden.0.weight"):
        a, b = dict(ref.named_parameters())[name].grad, dict(new.named_parameters())[name].grad
        assert rel(b, a) < 1e-4, name
    k = _key(sel.etypes[0])
    assert rel(new.layers[0].msg_weight.grad[0], ref.layers[0].msg[k].weight.grad.T) < 1e-4
    assert rel(new.layers[0].film_weight.grad[0], ref.layers[0].film[k].weight.grad.T) < 1e-4


def test_a_stacked_state_round_trips(catalog_dir):
    g, sel = _batch(catalog_dir, "cnn", 2)
    cfg = NGGNNConfig(etypes=sel.etypes, edge_in=sel.frame[0] * sel.frame[1], out_dim=1, hidden=16,
                      edge_hidden=8, layers=2)
    a, b = NGGNN(cfg).eval(), NGGNN(cfg).eval()
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        assert torch.equal(a(g)[0], b(g)[0])
    assert len(list(a.parameters())) < 150     # stacked: far fewer tensors for the optimiser to step


def test_segment_max_gradient_goes_to_the_maximum_and_is_shared_on_ties():
    x = torch.tensor([[1.0, 5.0], [3.0, 5.0], [2.0, 0.0], [7.0, -1.0]], requires_grad=True)
    seg = torch.tensor([0, 0, 0, 1])
    out = segment_max(x, seg, 2)
    assert torch.equal(out, torch.tensor([[3.0, 5.0], [7.0, -1.0]]))
    out.backward(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert torch.equal(x.grad, torch.tensor([[0.0, 1.0], [1.0, 1.0], [0.0, 0.0], [3.0, 4.0]]))
