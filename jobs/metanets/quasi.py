"""The quasi-equivariant scaling of "Quasi-Equivariant Metanetworks" (ICLR 2026) for NG-GNN.

An equivariant backbone beta(theta) is wrapped in a learned group element alpha(theta): F = alpha * beta.
Here alpha is one positive factor per hidden neuron, kept inside the scaling group and close to the
identity as ``1 + eps * sin(mlp(stats))``, where ``stats`` are permutation-equivariant statistics of the
neuron (sum and square sum of its incoming normalised weights, its bias) beside its layer's mean and
spread of them. The factor acts on the backbone's equivariant features as the scaling group acts on a
network: a hidden node's embedding times alpha_v, an edge u -> v's features times alpha_v / alpha_u
(reverse edges the inverse); input and output neurons keep 1. Everything is computed per neuron from
per-neuron and per-layer quantities, so hidden-neuron permutations still permute the result.
"""
from __future__ import annotations

import torch
from torch import nn

STATS = 4          # per neuron: mean incoming weight sum, mean incoming square sum, bias, |bias|


class QuasiScaling(nn.Module):
    def __init__(self, eps: float = 0.1, hidden: int = 32, max_layers: int = 64):
        super().__init__()
        self.eps, self.max_layers = float(eps), max_layers
        self.net = nn.Sequential(nn.Linear(3 * STATS, hidden), nn.SiLU(), nn.Linear(hidden, 1))

    def factors(self, g, structure) -> torch.Tensor:
        """alpha (N_hidden,) for the hidden nodes of the batched graph ``g``."""
        n = g.num_nodes("hidden")
        data = g.nodes["hidden"].data
        bias = data["bias"].float()
        acc = torch.zeros(n, 3, device=bias.device)
        for et, ix in structure.items():
            if et[2] != "hidden" or et[1].startswith("rev_"):
                continue
            w = g.edges[et].data["w"].float().index_select(0, ix.order)     # in the structure's edge order
            s = w.sum(-1)
            vals = torch.stack([torch.ones_like(s), s, (w * w).sum(-1)], -1)
            acc.index_add_(0, ix.dst, vals)
        count = acc[:, :1].clamp(min=1)
        node = torch.cat([acc[:, 1:] / count, bias[:, None], bias.abs()[:, None]], -1)      # (N, STATS)
        graph_of = torch.repeat_interleave(torch.arange(g.batch_size, device=bias.device),
                                           g.batch_num_nodes("hidden"))
        key = graph_of * self.max_layers + data["layer"].clamp(max=self.max_layers - 1)
        _, group = torch.unique(key, return_inverse=True)
        size = torch.zeros(int(group.max()) + 1 if n else 0, 1, device=bias.device).index_add_(
            0, group, torch.ones(n, 1, device=bias.device))
        mean = torch.zeros(size.shape[0], STATS, device=bias.device).index_add_(0, group, node) / size
        sq = torch.zeros(size.shape[0], STATS, device=bias.device).index_add_(0, group, node * node) / size
        std = torch.sqrt(torch.relu(sq - mean * mean) + 1e-8)
        feats = torch.cat([node, mean[group], std[group]], -1)
        return 1.0 + self.eps * torch.sin(self.net(feats).squeeze(-1))

    def forward(self, g, h: dict, e: dict, structure: dict) -> tuple[dict, dict]:
        if g.num_nodes("hidden") == 0:
            return h, e
        alpha = self.factors(g, structure)
        ones = {t: torch.ones(g.num_nodes(t), device=alpha.device) for t in h}
        per_type = {**ones, "hidden": alpha}
        h = {**h, "hidden": h["hidden"] * alpha[:, None].to(h["hidden"].dtype)}
        out = {}
        for et, x in e.items():
            ix = structure.get(et)
            if ix is None:
                out[et] = x
                continue
            s, rel, d = et
            ratio = per_type[d][ix.dst] / per_type[s][ix.src]      # forward edge u -> v: alpha_v / alpha_u
            if rel.startswith("rev_"):
                ratio = 1.0 / ratio                                 # the same weight seen from v
            out[et] = x * ratio[:, None].to(x.dtype)
        return h, out
