"""NG-GNN (Kofinas et al., ICLR 2024) generalised to relations, on DGL heterographs.

Per canonical edge type, messages are FiLM-modulated, ``m = gamma(e) * W h_src + beta(e)``, and
aggregated PNA-style (mean, max, std, each with identity / amplification / attenuation degree
scalers); relation outputs are summed per destination node type. Every layer also updates the
edge features, ``e' = e + phi(e, h_src, h_dst)``. Node features start from the normalised bias,
an activation embedding, a positional embedding (shared by the hidden neurons of one layer, one
per position for input and output neurons) and, optionally, probe activations (jobs.probes). The readout
(mean and max per node type) is invariant to hidden-neuron permutations; node embeddings are
equivariant.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import dgl
import torch
from torch import nn

from jobs.probes import ProbeFeatures
from jobs.quasi import QuasiScaling
from pipeline.neural_graph.heterograph import CanonicalEtype
from pipeline.neural_graph.vocabulary import ACTIVATIONS, NODE_TYPES


@dataclass
class NGGNNConfig:
    etypes: list[CanonicalEtype]
    edge_in: int                 # edge feature width (kernel frame Kh*Kw)
    out_dim: int                 # 1 for regression, number of classes for classification
    hidden: int = 64
    edge_hidden: int = 32
    layers: int = 3
    max_layers: int = 64         # positional embeddings of hidden layers
    max_positions: int = 128     # positional embeddings of input / output neurons
    probes: int = 0              # probe-activation features per node
    dropout: float = 0.0
    quasi: bool = False          # learned quasi-equivariant scaling of the output features (jobs.quasi)
    quasi_eps: float = 0.1
    kind: str = "ngnn"           # which metanetwork (jobs.metanets): ngnn | ngt
    heads: int = 4               # attention heads (ngt)
    readout_outputs: int = 0     # K > 0: the readout also holds the embeddings of output neurons 0..K-1, in order
    fourier: int = 0             # F > 0: random Fourier features (F frequencies) of edge weights and biases

    def to_dict(self) -> dict:
        d = asdict(self)
        d["etypes"] = [list(e) for e in self.etypes]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "NGGNNConfig":
        d = dict(d)
        d["etypes"] = [tuple(e) for e in d["etypes"]]
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


def _key(et: CanonicalEtype) -> str:
    return "__".join(et)


def mlp(i: int, h: int, o: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(i, h), nn.SiLU(), nn.Linear(h, o))


class FourierFeatures(nn.Module):
    """Random Fourier features of a value vector, ``[sin(2 pi B x), cos(2 pi B x)]`` with fixed
    B ~ N(0, sigma^2) of shape (F, d), mapped linearly to ``out`` (Tancik et al., 2020; the
    reference NG-GNN encodes weights and biases this way). They let the first layer resolve small
    differences between values that one linear map of the value blurs. B is drawn from a fixed seed
    and saved with the model."""

    def __init__(self, d: int, frequencies: int, out: int, sigma: float = 1.0, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.register_buffer("B", torch.randn(frequencies, d, generator=gen) * sigma)
        self.proj = nn.Linear(2 * frequencies, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = 2 * math.pi * x @ self.B.T
        return self.proj(torch.cat([torch.sin(z), torch.cos(z)], -1))


class RelationalPNALayer(nn.Module):
    """One NG-GNN layer over every canonical edge type of the graph."""

    AGGREGATORS = 3   # mean, max, std
    SCALERS = 3       # identity, amplification, attenuation

    def __init__(self, etypes: Sequence[CanonicalEtype], hidden: int, edge_hidden: int):
        super().__init__()
        self.etypes = [tuple(e) for e in etypes]
        self.msg = nn.ModuleDict({_key(e): nn.Linear(hidden, hidden) for e in self.etypes})
        self.film = nn.ModuleDict({_key(e): nn.Linear(edge_hidden, 2 * hidden) for e in self.etypes})
        self.post = nn.ModuleDict({_key(e): nn.Linear(self.AGGREGATORS * self.SCALERS * hidden, hidden)
                                   for e in self.etypes})
        self.edge_update = nn.ModuleDict({_key(e): mlp(edge_hidden + 2 * hidden, edge_hidden, edge_hidden)
                                          for e in self.etypes})
        self.node_update = nn.ModuleDict({t: mlp(2 * hidden, hidden, hidden) for t in NODE_TYPES})
        self.norm = nn.ModuleDict({t: nn.LayerNorm(hidden) for t in NODE_TYPES})
        # mean log-degree per edge type (PNA's delta), fixed from the first training batch
        self.register_buffer("delta", torch.zeros(len(self.etypes)))
        self.register_buffer("delta_set", torch.zeros((), dtype=torch.bool))

    def forward(self, g: dgl.DGLHeteroGraph, h: dict[str, torch.Tensor], e: dict[CanonicalEtype, torch.Tensor],
                structure: dict[CanonicalEtype, "EdgeIndex"]):
        """``e`` holds each relation's edges in ``structure``'s order (by destination; see EdgeIndex)."""
        agg = {t: torch.zeros_like(h[t]) for t in h}
        new_e = {}
        calibrate = self.training and not bool(self.delta_set)
        H = h[next(iter(h))].shape[-1]
        for k, et in enumerate(self.etypes):
            if et not in e or et not in structure:
                continue
            s, _, d = et
            ix = structure[et]
            key = _key(et)
            gamma, beta = self.film[key](e[et]).chunk(2, dim=-1)
            m = gamma * self.msg[key](h[s]).index_select(0, ix.src) + beta                       # (E, H) FiLM messages
            # aggregate onto the U destination nodes that have an in-edge of this relation only (the
            # others receive nothing from it), so the per-node work scales with U, not with N
            # (edges are ordered by destination, so every reduction is a segment reduction)
            mean = dgl.ops.segment_reduce(ix.seglen, m, "sum") / ix.deg
            sq = dgl.ops.segment_reduce(ix.seglen, m * m, "sum") / ix.deg
            mx = dgl.ops.segment_reduce(ix.seglen, m, "max")
            std = torch.sqrt(torch.relu(sq - mean ** 2) + 1e-6)
            if calibrate:
                self.delta[k] = ix.logd_mean.detach()
            delta = self.delta[k].clamp(min=1e-3)
            # post(cat[f, f * amp, f * att]) computed as f @ [W_id; W_amp; W_att]^T, then scaled per
            # node: the same linear map without building the 9H-wide input
            post = self.post[key]
            y = torch.cat([mean, mx, std], dim=-1) @ torch.cat(post.weight.chunk(self.SCALERS, dim=1), 0).T
            y_id, y_amp, y_att = y.chunk(self.SCALERS, dim=-1)
            out = y_id + y_amp * (ix.logd / delta) + y_att * (delta / ix.logd) + post.bias
            agg[d] = agg[d].index_add(0, ix.nodes, out)
            # edge update from both endpoints: the first linear map of cat(e, h_src, h_dst) is split
            # into its three column blocks, so the node terms are computed per node, then gathered
            first, rest = self.edge_update[key][0], self.edge_update[key][1:]
            eh = e[et].shape[-1]
            w_e, w_s, w_d = first.weight[:, :eh], first.weight[:, eh:eh + H], first.weight[:, eh + H:]
            pre = (e[et] @ w_e.T + first.bias + (h[s] @ w_s.T).index_select(0, ix.src)
                   + (h[d] @ w_d.T).index_select(0, ix.dst))
            new_e[et] = e[et] + rest(pre)
        if calibrate:
            self.delta_set.fill_(True)
        out = {t: self.norm[t](h[t] + self.node_update[t](torch.cat([h[t], agg[t]], -1))) for t in h}
        return out, {**e, **new_e}


@dataclass
class EdgeIndex:
    """One canonical edge type of a (batched) graph, computed once per forward pass and shared by
    every layer. Inside the metanetwork a relation's edges are kept ordered by destination (``order``
    maps each position to the graph's edge id; ``restore`` maps back), so that the edges into one
    node are one contiguous segment; ``nodes`` are the destinations that have an in-edge, with their
    in-degrees (``seglen``) and PNA's degree terms."""

    src: torch.Tensor          # (E,) source node index in its node type, in destination order
    dst: torch.Tensor          # (E,) destination node index, ascending
    order: torch.Tensor        # (E,) graph edge id at each position
    restore: torch.Tensor      # (E,) position of each graph edge id (the inverse of ``order``)
    nodes: torch.Tensor        # (U,) destination nodes with at least one in-edge, ascending
    seglen: torch.Tensor       # (U,) in-degree of ``nodes`` (all >= 1)
    deg: torch.Tensor          # (U, 1) in-degree, float
    logd: torch.Tensor         # (U, 1) log(deg + 1)
    logd_mean: torch.Tensor    # () mean of log(max(deg, 1) + 1) over all N_dst nodes (PNA's delta)
    num_dst: int


def edge_index(g: dgl.DGLHeteroGraph, etypes: Sequence[CanonicalEtype]) -> dict[CanonicalEtype, EdgeIndex]:
    """EdgeIndex of every edge type of ``etypes`` that ``g`` has edges of."""
    out = {}
    present = set(g.canonical_etypes)
    for et in etypes:
        et = tuple(et)
        if et not in present or g.num_edges(et) == 0:
            continue
        src, dst = g.edges(etype=et)
        order = torch.argsort(dst, stable=True)
        restore = torch.empty_like(order)
        restore[order] = torch.arange(len(order), device=order.device)
        src, dst = src.index_select(0, order), dst.index_select(0, order)
        nodes, seglen = torch.unique_consecutive(dst, return_counts=True)
        deg = seglen.to(torch.float32).unsqueeze(-1)
        num_dst = g.num_nodes(et[2])
        logd_mean = (torch.log(deg + 1).sum() + (num_dst - len(nodes)) * math.log(2.0)) / num_dst
        out[et] = EdgeIndex(src, dst, order, restore, nodes, seglen, deg, torch.log(deg + 1), logd_mean, num_dst)
    return out


class NGGNN(nn.Module):
    """The metanetwork: node/edge encoders, ``layers`` RelationalPNALayers, invariant readout, head.

    The interface every metanetwork (jobs.metanets) keeps: ``encode`` (node and edge encodings),
    ``propagate`` (its layers; the one method NG-T replaces), ``embeddings`` (equivariant node and
    edge embeddings), ``embed`` (the invariant graph embedding) and ``forward`` (head output and
    graph embedding).

    Shapes:
        input: a batched heterograph (pipeline.neural_graph.heterograph) with ndata bias/layer/position/
        activation and edata w (E_t, edge_in); output: (B, out_dim), embeddings (B, 6*hidden).
    """

    def __init__(self, cfg: NGGNNConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden
        self.bias_in = nn.Linear(1 + cfg.probes, H)
        self.probes = ProbeFeatures(cfg.probes) if cfg.probes else None
        self.act_emb = nn.Embedding(len(ACTIVATIONS), H)
        self.type_emb = nn.Embedding(len(NODE_TYPES), H)
        self.layer_emb = nn.Embedding(cfg.max_layers, H)            # hidden neurons: one per layer
        self.pos_emb = nn.ModuleDict({"input": nn.Embedding(cfg.max_positions, H),
                                      "output": nn.Embedding(cfg.max_positions, H)})
        self.edge_in = nn.Linear(cfg.edge_in, cfg.edge_hidden)
        self.edge_fourier = FourierFeatures(cfg.edge_in, cfg.fourier, cfg.edge_hidden, seed=1) if cfg.fourier else None
        self.bias_fourier = FourierFeatures(1, cfg.fourier, H, seed=2) if cfg.fourier else None
        self.rel_emb = nn.ParameterDict({_key(e): nn.Parameter(torch.zeros(cfg.edge_hidden)) for e in cfg.etypes})
        self.layers = nn.ModuleList(RelationalPNALayer(cfg.etypes, H, cfg.edge_hidden) for _ in range(cfg.layers))
        self.forward_etypes = [e for e in cfg.etypes if not e[1].startswith("rev_")]
        self.readout_dim = (2 * H * len(NODE_TYPES) + cfg.edge_hidden * len(self.forward_etypes)
                            + H * cfg.readout_outputs)
        self.head = nn.Sequential(nn.Linear(self.readout_dim, H), nn.SiLU(), nn.Dropout(cfg.dropout),
                                  nn.Linear(H, cfg.out_dim))
        self.quasi = QuasiScaling(cfg.quasi_eps, max_layers=cfg.max_layers) if cfg.quasi else None

    def parameter_overhead(self) -> tuple[int, float]:
        """Parameters of the quasi-equivariant scaling, and their share of the backbone's."""
        extra = sum(p.numel() for p in self.quasi.parameters()) if self.quasi is not None else 0
        total = sum(p.numel() for p in self.parameters())
        return extra, extra / max(total - extra, 1)

    def encode_nodes(self, g, probe_features: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        h = {}
        for i, t in enumerate(NODE_TYPES):
            if g.num_nodes(t) == 0:
                h[t] = torch.zeros(0, self.cfg.hidden, device=g.device)
                continue
            data = g.nodes[t].data
            x = data["bias"].unsqueeze(-1)
            if self.cfg.probes:
                x = torch.cat([x, probe_features[t]], -1)
            z = self.bias_in(x) + self.act_emb(data["activation"]) + self.type_emb.weight[i]
            if self.bias_fourier is not None:
                z = z + self.bias_fourier(data["bias"].unsqueeze(-1))
            if t == "hidden":
                z = z + self.layer_emb(data["layer"].clamp(max=self.cfg.max_layers - 1))
            else:
                z = z + self.pos_emb[t](data["position"].clamp(max=self.cfg.max_positions - 1))
            h[t] = z
        return h

    def encode(self, g) -> tuple[dict[str, torch.Tensor], dict[CanonicalEtype, torch.Tensor]]:
        """Node encodings (bias, activation, node type, shared layer / unique position embeddings) and
        edge encodings (weights plus a relation embedding), shared by every metanetwork."""
        h = self.encode_nodes(g, self.probes(g) if self.probes is not None else None)
        e = {}
        for et in self.cfg.etypes:
            if et in g.canonical_etypes:
                w = g.edges[et].data["w"]
                e[et] = self.edge_in(w) + self.rel_emb[_key(et)]
                if self.edge_fourier is not None:
                    e[et] = e[et] + self.edge_fourier(w)
        return h, e

    def propagate(self, g, h: dict, e: dict, structure: dict) -> tuple[dict, dict]:
        """The metanetwork's own part: ``layers`` of message passing that update nodes and edges
        (here relational PNA with FiLM-modulated messages; NG-T overrides it with attention)."""
        for layer in self.layers:
            h, e = layer(g, h, e, structure)
        return h, e

    def embeddings(self, g) -> tuple[dict[str, torch.Tensor], dict[CanonicalEtype, torch.Tensor]]:
        """Equivariant node and edge embeddings after encoding, propagation and (optionally) the
        quasi-equivariant scaling: what graph readouts and per-node / per-edge heads read."""
        h, e = self.encode(g)
        structure = edge_index(g, self.cfg.etypes)
        e = {et: x.index_select(0, structure[et].order) if et in structure else x for et, x in e.items()}
        h, e = self.propagate(g, h, e, structure)
        if self.quasi is not None:
            h, e = self.quasi(g, h, e, structure)
        return h, {et: x.index_select(0, structure[et].restore) if et in structure else x for et, x in e.items()}

    def node_embeddings(self, g) -> dict[str, torch.Tensor]:
        """Equivariant node embeddings after all layers."""
        return self.embeddings(g)[0]

    def embed(self, g) -> torch.Tensor:
        """Invariant graph embeddings (B, readout_dim): mean and max of node embeddings per node
        type, and the mean of the final edge features per forward relation."""
        h, e = self.embeddings(g)
        parts = []
        with g.local_scope():
            for t in NODE_TYPES:
                g.nodes[t].data["h_out"] = h[t]
                parts.append(dgl.readout_nodes(g, "h_out", ntype=t, op="mean"))
                parts.append(dgl.readout_nodes(g, "h_out", ntype=t, op="max"))
            for et in self.forward_etypes:      # mean over a graph's edges of each relation (0 if none)
                g.edges[et].data["e_out"] = e[et]
                total = dgl.readout_edges(g, "e_out", etype=et, op="sum")
                count = g.batch_num_edges(et).clamp(min=1).unsqueeze(-1).to(total.dtype)
                parts.append(total / count)
        if self.cfg.readout_outputs:
            parts.append(self.output_readout(g, h["output"]))
        return torch.cat(parts, -1)

    def output_readout(self, g, h_out: torch.Tensor) -> torch.Tensor:
        """(B, K*hidden): the embeddings of output neurons 0..K-1 of every graph, by position (zeros
        where a network has fewer). Output neurons are never permuted, so this stays invariant; it
        gives the head what the network finally computes, which a mean over nodes dilutes."""
        K, H = self.cfg.readout_outputs, self.cfg.hidden
        counts = g.batch_num_nodes("output")
        graph_of = torch.repeat_interleave(torch.arange(len(counts), device=h_out.device), counts)
        pos = g.nodes["output"].data["position"].long()
        keep = pos < K
        dense = h_out.new_zeros(len(counts), K, H)
        dense[graph_of[keep], pos[keep]] = h_out[keep]
        return dense.reshape(len(counts), K * H)

    def forward(self, g) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.embed(g)
        return self.head(z), z
