"""NG-T: the neural-graph transformer (Kofinas et al., ICLR 2024, section 3.3).

Relational attention over the neural graph: every neuron attends to the neurons it is connected
to (forward and reverse edges of every relation, and itself), edge features modulate the attention
scores and, FiLM-style, the values (``V_uv = gamma(e_uv) * V_u + beta(e_uv)``), and edge features are
updated every layer from their endpoints. ``attention_groups`` says what one softmax runs over: all
of a neuron's edges and itself (``all``), its in-edges and itself apart from its reverse edges
(``direction``), or each edge type apart (``relation``); the groups' attended values are read side
by side (bench_accuracy: none beat ``all`` as an ensemble, README). With ``attention_std`` a neuron
also reads the attention-weighted standard deviation of its values beside their weighted mean (a
softmax average alone cannot tell a neuron whose inputs agree from one whose inputs are spread, which
PNA's std aggregator gives NG-GNN; README, "NG-T's levers"). With ``relation_values`` every edge type
has its own value map, as NG-GNN's messages have (otherwise one map is shared and the relation
enters only through the FiLM of the edge features). Node encodings (hidden positions
shared per layer, own positions for inputs and outputs, activation embeddings), the invariant
readout, the head and the optional quasi-equivariant scaling are NG-GNN's (``NGT`` only replaces
the propagation), so both metanetworks read the same batched DGL heterographs and train, save and
predict the same way.

Every operation is per node, per edge or a sum over a node's edges, so hidden-neuron permutations
permute node embeddings and leave the readout unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import dgl
import torch
from torch import nn

from jobs.config import ATTENTION_GROUPS
from jobs.metanets.ngnn import NGGNN, NGGNNConfig, _key, mlp
from jobs.metanets.relational_kernels import rel_linear
from pipeline.neural_graph.vocabulary import NODE_TYPES


@dataclass
class FlatEdges:
    """All edges of a batched heterograph with node ids into the concatenation of the node types
    (input, hidden, output), as one homogeneous DGL graph for the per-destination softmax."""

    graph: dgl.DGLGraph
    offsets: dict[str, int]
    counts: dict[str, int]
    parts: list[tuple[tuple, int, int]]          # (etype, first edge, end) in the flat edge order
    relation: torch.Tensor                       # per flat edge: its etype's index in etypes, len(etypes) for self-loops
    blocks: list[int]                            # the same per block of ``parts``, then the self-loops' block
    block_rows: list[int]                        # edges of each of those blocks (for rel_linear)


def flat_edges(g: dgl.DGLHeteroGraph, etypes, structure) -> FlatEdges:
    counts = {t: g.num_nodes(t) for t in NODE_TYPES}
    offsets, total = {}, 0
    for t in NODE_TYPES:
        offsets[t], total = total, total + counts[t]
    src, dst, parts, relation, blocks, start = [], [], [], [], [], 0
    for i, et in enumerate(etypes):
        ix = structure.get(tuple(et))
        if ix is None:
            continue
        s, _, d = et
        src.append(ix.src + offsets[s])
        dst.append(ix.dst + offsets[d])
        relation.append(torch.full((len(ix.src),), i, device=g.device))
        parts.append((tuple(et), start, start + len(ix.src)))
        blocks.append(i)
        start += len(ix.src)
    loops = torch.arange(total, device=g.device)
    src.append(loops)
    dst.append(loops)
    relation.append(torch.full((total,), len(etypes), device=g.device))
    hg = dgl.graph((torch.cat(src), torch.cat(dst)), num_nodes=total, device=g.device)
    return FlatEdges(hg, offsets, counts, parts, torch.cat(relation).long(), blocks + [len(etypes)],
                     [b - a for _, a, b in parts] + [total])


def group_softmax(logits: torch.Tensor, group: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Softmax of ``logits`` (E, heads) over the edges of each group (``group``: (E,) in 0..n_groups-1)."""
    idx = group.unsqueeze(-1).expand_as(logits)
    top = torch.full((n_groups, logits.shape[1]), -torch.inf, dtype=logits.dtype, device=logits.device)
    top = top.scatter_reduce(0, idx, logits, "amax", include_self=True)
    ex = (logits - top.index_select(0, group)).exp()
    total = torch.zeros_like(top).index_add_(0, group, ex)
    return ex / total.index_select(0, group)


class RelationalAttentionLayer(nn.Module):
    """One NG-T layer: multi-head relational attention, a feed-forward block, an edge update."""

    def __init__(self, etypes, hidden: int, edge_hidden: int, heads: int = 4, dropout: float = 0.0,
                 attention_groups: str = "all", attention_std: bool = False, relation_values: bool = False,
                 attention_dropout: float = 0.0):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not a multiple of {heads} heads")
        self.heads, self.dk = heads, hidden // heads
        self.relation_values = relation_values
        self.qkv = nn.Linear(hidden, (2 if relation_values else 3) * hidden)
        if relation_values:     # one value map per edge type (the last: self-loops), as NG-GNN's messages
            bound = 1 / math.sqrt(hidden)
            self.value_weight = nn.Parameter(torch.empty(len(etypes) + 1, hidden, hidden).uniform_(-bound, bound))
            self.value_bias = nn.Parameter(torch.empty(len(etypes) + 1, hidden).uniform_(-bound, bound))
        self.score = nn.Linear(edge_hidden, heads)            # edge term of the attention score
        self.film = nn.Linear(edge_hidden, 2 * hidden)        # gamma, beta of the values
        self.self_edge = nn.Parameter(torch.zeros(edge_hidden))
        if attention_groups not in ATTENTION_GROUPS:
            raise ValueError(f"attention_groups {attention_groups!r}: one of {', '.join(ATTENTION_GROUPS)}")
        self.groups = attention_groups
        self.n_groups = {"all": 1, "direction": 2, "relation": len(etypes) + 1}[attention_groups]
        # per relation index (the last: self-loops): 1 for reverse types, the direction group of an edge
        self.register_buffer("reverse", torch.tensor([int(r.startswith("rev_")) for _, r, _ in etypes] + [0]),
                             persistent=False)
        self.attention_std = attention_std
        self.out = nn.Linear((1 + attention_std) * self.n_groups * hidden, hidden)
        self.ffn = mlp(hidden, 2 * hidden, hidden)
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.drop = nn.Dropout(dropout)
        self.attention_drop = nn.Dropout(attention_dropout)
        self.edge_update = nn.ModuleDict({_key(e): mlp(edge_hidden + 2 * hidden, edge_hidden, edge_hidden)
                                          for e in etypes})

    def forward(self, flat: FlatEdges, x: torch.Tensor, e: dict) -> tuple[torch.Tensor, dict]:
        n, H = x.shape
        ef = torch.cat([e[et] for et, _, _ in flat.parts] + [self.self_edge.expand(n, -1)], 0)   # (E + N, De)
        src, dst = flat.graph.edges()
        if self.relation_values:
            q, k = self.qkv(x).view(n, 2, self.heads, self.dk).unbind(1)
            v_src = rel_linear(x.index_select(0, src), self.value_weight, self.value_bias, flat.blocks,
                               flat.block_rows)
            v_src = v_src.view(-1, self.heads, self.dk)
        else:
            q, k, v = self.qkv(x).view(n, 3, self.heads, self.dk).unbind(1)
            v_src = v.index_select(0, src)
        logits = (q.index_select(0, dst) * k.index_select(0, src)).sum(-1) / math.sqrt(self.dk) + self.score(ef)
        gamma, beta = self.film(ef).view(-1, 2, self.heads, self.dk).unbind(1)
        vals = gamma * v_src + beta
        if self.groups == "all":
            group = dst
        elif self.groups == "direction":    # in-edges and self | reverse edges
            group = dst * 2 + self.reverse[flat.relation]
        else:                               # each edge type, and self
            group = dst * self.n_groups + flat.relation
        attn = self.attention_drop(group_softmax(logits, group, n * self.n_groups))
        agg = torch.zeros(n * self.n_groups, self.heads, self.dk, dtype=x.dtype, device=x.device)
        agg.index_add_(0, group, attn.unsqueeze(-1) * vals)
        if self.attention_std:          # the attention-weighted spread of the values, beside their mean
            second = torch.zeros_like(agg).index_add_(0, group, attn.unsqueeze(-1) * vals * vals)
            agg = torch.cat([agg, torch.sqrt(torch.relu(second - agg * agg) + 1e-6)], -1)
        agg = agg.reshape(n, -1)
        x = self.norm1(x + self.drop(self.out(agg)))
        x = self.norm2(x + self.drop(self.ffn(x)))
        new_e = {}
        for et, a, b in flat.parts:
            s, d = src[a:b], dst[a:b]
            new_e[et] = e[et] + self.edge_update[_key(et)](torch.cat([e[et], x.index_select(0, s),
                                                                      x.index_select(0, d)], -1))
        return x, {**e, **new_e}


class NGT(NGGNN):
    """NG-GNN's encoders, readout and head around ``layers`` relational-attention layers."""

    def __init__(self, cfg: NGGNNConfig):
        super().__init__(cfg)
        self.layers = nn.ModuleList(RelationalAttentionLayer(cfg.etypes, cfg.hidden, cfg.edge_hidden,
                                                             heads=cfg.heads, dropout=cfg.dropout,
                                                             attention_groups=cfg.attention_groups,
                                                             attention_std=cfg.attention_std,
                                                             relation_values=cfg.relation_values,
                                                             attention_dropout=cfg.attention_dropout)
                                    for _ in range(cfg.layers))

    def propagate(self, g, h: dict, e: dict, structure: dict) -> tuple[dict, dict]:
        flat = flat_edges(g, self.cfg.etypes, structure)
        x = torch.cat([h[t] for t in NODE_TYPES], 0)
        for layer in self.layers:
            x, e = layer(flat, x, e)
        return {t: x[flat.offsets[t]:flat.offsets[t] + flat.counts[t]] for t in NODE_TYPES}, e
