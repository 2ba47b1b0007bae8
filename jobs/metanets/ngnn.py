"""NG-GNN (Kofinas et al., ICLR 2024) generalised to relations, on DGL heterographs.

Per canonical edge type, messages are FiLM-modulated, ``m = gamma(e) * W h_src + beta(e)``, and
aggregated PNA-style (mean, max, std, each with identity / amplification / attenuation degree
scalers); relation outputs are summed per destination node type. Every layer also updates the
edge features, ``e' = e + phi(e, h_src, h_dst)``. Node features start from the normalised bias,
an activation embedding, a positional embedding (shared by the hidden neurons of one layer, one
per position for input and output neurons) and, optionally, probe activations (jobs.metanets.probes). The readout
(mean and max per node type) is invariant to hidden-neuron permutations; node embeddings are
equivariant.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Sequence

import dgl
import torch
from torch import nn

from jobs.config import LEGACY, MetanetConfig
from jobs.metanets.probes import ProbeFeatures
from jobs.metanets.quasi import QuasiScaling
from jobs.metanets.relational_kernels import FiLM, rel_linear, segment_stats
from pipeline.neural_graph.heterograph import CanonicalEtype
from pipeline.neural_graph.vocabulary import ACTIVATIONS, NODE_TYPES, SEEDED_ACTIVATIONS


@dataclass
class NGGNNConfig(MetanetConfig):
    """A metanetwork's hyperparameters (jobs.config.MetanetConfig) and what its inputs fix."""
    etypes: list[CanonicalEtype]
    edge_in: int                 # edge feature width (kernel frame Kh*Kw)
    out_dim: int                 # 1 for regression, number of classes for classification
    max_layers: int = 64         # positional embeddings of hidden layers
    max_positions: int = 128     # positional embeddings of input / output neurons
    kind: str = "ngnn"           # which metanetwork (jobs.predictors): ngnn | ngt
    statistics_dim: int = 0      # width of the head's statistics input (jobs.training.head_statistics); 0: none

    def to_dict(self) -> dict:
        d = asdict(self)
        d["etypes"] = [list(e) for e in self.etypes]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "NGGNNConfig":
        """A saved configuration; a field it lacks takes the value that runs saved before the field
        existed computed (``jobs.config.LEGACY``), then the default."""
        d = {**LEGACY, **d}
        d["etypes"] = [tuple(e) for e in d["etypes"]]
        known = {f.name for f in fields(cls)}
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
    """One NG-GNN layer over every canonical edge type of the graph.

    The per-relation maps are held stacked, one (R, in, out) parameter per family, and every
    relation's edges are processed at once (see ``StackedEdges``), so a layer issues a few large
    operations instead of a dozen small ones per relation. Per relation r and edge u -> v:
    ``m = gamma_r(e) * (W_r h_u + b_r) + beta_r(e)``; PNA aggregation (mean, max, std) over v's
    in-edges of r; the post map of the aggregates with identity / amplification / attenuation degree
    scalers; relation outputs summed per node; ``e' = e + MLP_r(e, h_u, h_v)``."""

    AGGREGATORS = 3   # mean, max, std
    SCALERS = 3       # identity, amplification, attenuation

    def __init__(self, etypes: Sequence[CanonicalEtype], hidden: int, edge_hidden: int):
        super().__init__()
        self.etypes = [tuple(e) for e in etypes]
        R, H, De = len(self.etypes), hidden, edge_hidden
        F = self.AGGREGATORS * H

        def stacked(*shape, fan_in):                # nn.Linear's default initialisation
            return nn.Parameter(torch.empty(R, *shape).uniform_(-1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in)))

        self.msg_weight, self.msg_bias = stacked(H, H, fan_in=H), stacked(H, fan_in=H)
        self.film_weight, self.film_bias = stacked(De, 2 * H, fan_in=De), stacked(2 * H, fan_in=De)
        # post map of cat(f, f * amp, f * att) (9H -> H) held as f @ post_weight (3H -> [id | amp | att])
        self.post_weight = stacked(F, self.SCALERS * H, fan_in=self.SCALERS * F)
        self.post_bias = stacked(H, fan_in=self.SCALERS * F)
        # edge update MLP(cat(e, h_src, h_dst)): first map's rows [e | src | dst], SiLU, second map
        self.edge_weight1 = stacked(De + 2 * H, De, fan_in=De + 2 * H)
        self.edge_bias1 = stacked(De, fan_in=De + 2 * H)
        self.edge_weight2, self.edge_bias2 = stacked(De, De, fan_in=De), stacked(De, fan_in=De)
        self.node_update = nn.ModuleDict({t: mlp(2 * hidden, hidden, hidden) for t in NODE_TYPES})
        self.norm = nn.ModuleDict({t: nn.LayerNorm(hidden) for t in NODE_TYPES})
        # mean log-degree per edge type (PNA's delta), fixed from the first training batch
        self.register_buffer("delta", torch.zeros(R))
        self.register_buffer("delta_set", torch.zeros((), dtype=torch.bool))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        _stack_per_relation_weights(state_dict, prefix, self.etypes)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, flat: "StackedEdges", x: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` (N, H): every node (``flat``'s node order); ``e`` (E, De): every edge (``flat``'s edge
        order). Returns both updated."""
        H = x.shape[-1]
        if e is None:                                # no edges: only the node update, with nothing aggregated
            return self._update_nodes(flat, x, torch.zeros_like(x)), e
        De = e.shape[-1]
        rel, rows = flat.rel, flat.edges_per_rel
        # node terms are computed once per (relation, source) and per (relation, destination), then
        # gathered onto the edges
        xs = x.index_select(0, flat.sources)
        msg = rel_linear(xs, self.msg_weight, self.msg_bias, rel, flat.sources_per_rel).index_select(0, flat.src)
        # gamma and beta from the two halves of the film map (contiguous results; no chunk / cat)
        fw, fb = self.film_weight, self.film_bias
        gamma = rel_linear(e, fw[..., :H], fb[..., :H], rel, rows)
        beta = rel_linear(e, fw[..., H:], fb[..., H:], rel, rows)
        m = FiLM.apply(gamma, msg, beta)                                                   # FiLM messages
        # PNA over each (relation, destination) segment: edges are ordered by relation, then destination
        n = len(flat.nodes)
        total, squares, mx = segment_stats(m, flat.seg, n)
        mean, sq = total / flat.deg, squares / flat.deg
        std = torch.sqrt(torch.relu(sq - mean ** 2) + 1e-6)
        if self.training and not bool(self.delta_set):
            self.delta[flat.rel_index] = flat.logd_mean.detach()
            self.delta_set.fill_(True)
        delta = self.delta.clamp(min=1e-3).index_select(0, flat.seg_rel).unsqueeze(-1)     # (U, 1)
        scale = torch.cat([torch.ones_like(delta), flat.logd / delta, delta / flat.logd], -1)   # (U, 3)
        bias = nn.functional.pad(self.post_bias, (0, (self.SCALERS - 1) * H))              # scaled by 1
        y = rel_linear(torch.cat([mean, mx, std], -1), self.post_weight, bias, rel, flat.segments_per_rel)
        out = (y.view(n, self.SCALERS, H) * scale.unsqueeze(-1)).sum(1)
        agg = torch.zeros_like(x).index_add_(0, flat.nodes, out)
        # edge update: the first map's node blocks are applied per node, then gathered
        w1 = self.edge_weight1
        pre = (rel_linear(e, w1[:, :De], self.edge_bias1, rel, rows)
               + rel_linear(xs, w1[:, De:De + H], None, rel, flat.sources_per_rel).index_select(0, flat.src)
               + rel_linear(x.index_select(0, flat.nodes), w1[:, De + H:], None, rel,
                             flat.segments_per_rel).index_select(0, flat.seg))
        e = e + rel_linear(nn.functional.silu(pre), self.edge_weight2, self.edge_bias2, rel, rows)
        return self._update_nodes(flat, x, agg), e

    def _update_nodes(self, flat: "StackedEdges", x: torch.Tensor, agg: torch.Tensor) -> torch.Tensor:
        xa = torch.cat([x, agg], -1)
        parts = []
        for t in NODE_TYPES:
            a, b = flat.node_offsets[t], flat.node_offsets[t] + flat.node_counts[t]
            parts.append(self.norm[t](x[a:b] + self.node_update[t](xa[a:b])))
        return torch.cat(parts, 0)


def _stack_per_relation_weights(state: dict, prefix: str, etypes: Sequence[CanonicalEtype]) -> None:
    """Rewrite, in place, a layer state saved with one nn.Linear per relation and family
    (``msg.<src>__<rel>__<dst>.weight`` ...) into the stacked (R, in, out) parameters."""
    keys = [_key(et) for et in etypes]
    if f"{prefix}msg.{keys[0]}.weight" not in state:
        return

    def stack(old: str, new_weight: str, new_bias: str, weight=lambda w: w.T) -> None:
        names = [old.format(k) for k in keys]
        state[prefix + new_weight] = torch.stack([weight(state.pop(f"{prefix}{n}.weight")) for n in names])
        state[prefix + new_bias] = torch.stack([state.pop(f"{prefix}{n}.bias") for n in names])

    stack("msg.{}", "msg_weight", "msg_bias")
    stack("film.{}", "film_weight", "film_bias")
    stack("edge_update.{}.0", "edge_weight1", "edge_bias1")
    stack("edge_update.{}.2", "edge_weight2", "edge_bias2")
    # post (H, 9H) = [W_id | W_amp | W_att] -> (3H, 3H) = [W_id; W_amp; W_att]^T
    stack("post.{}", "post_weight", "post_bias",
          lambda w: torch.cat(w.chunk(RelationalPNALayer.SCALERS, dim=1), 0).T)


@dataclass
class StackedEdges:
    """Every relation's edges of a batched graph as one edge list, for RelationalPNALayer: edges
    grouped by relation (in the layer's relation order), each group in EdgeIndex order (by
    destination), and nodes numbered across node types (NODE_TYPES order). A segment is one
    (relation, destination) pair with at least one edge."""

    rel: list[int]                 # relation index (into the etype list) of each present relation
    rel_index: torch.Tensor        # the same as a tensor
    edges_per_rel: list[int]       # edges of each present relation
    segments_per_rel: list[int]    # segments of each present relation
    sources: torch.Tensor          # (S,) flat node of each (relation, source node with an out-edge) pair
    sources_per_rel: list[int]     # such pairs of each present relation
    src: torch.Tensor              # (E,) the (relation, source) pair of each edge (index into ``sources``)
    seg: torch.Tensor              # (E,) segment of each edge
    nodes: torch.Tensor            # (U,) flat destination node of each segment
    seg_rel: torch.Tensor          # (U,) relation of each segment
    deg: torch.Tensor              # (U, 1) in-degree
    logd: torch.Tensor             # (U, 1) log(deg + 1)
    logd_mean: torch.Tensor        # (len(rel),) PNA's delta of each present relation
    node_offsets: dict[str, int]
    node_counts: dict[str, int]


def stacked_edges(g: dgl.DGLHeteroGraph, etypes: Sequence[CanonicalEtype], structure: dict) -> StackedEdges:
    counts = {t: g.num_nodes(t) for t in NODE_TYPES}
    offsets, total = {}, 0
    for t in NODE_TYPES:
        offsets[t], total = total, total + counts[t]
    rel, ne, nu, ns, sources, src, seg, nodes, seg_rel, deg, logd, logd_mean = ([] for _ in range(12))
    u0 = s0 = 0
    for r, et in enumerate(etypes):
        ix = structure.get(tuple(et))
        if ix is None:
            continue
        s, _, d = et
        rel.append(r)
        ne.append(len(ix.src))
        nu.append(len(ix.nodes))
        u, inverse = torch.unique(ix.src, return_inverse=True)
        sources.append(u + offsets[s])
        ns.append(len(u))
        src.append(inverse + s0)
        s0 += len(u)
        seg.append(torch.repeat_interleave(torch.arange(u0, u0 + len(ix.nodes), device=g.device), ix.seglen))
        u0 += len(ix.nodes)
        nodes.append(ix.nodes + offsets[d])
        seg_rel.append(torch.full((len(ix.nodes),), r, dtype=torch.long, device=g.device))
        deg.append(ix.deg)
        logd.append(ix.logd)
        logd_mean.append(ix.logd_mean)
    def cat(parts, *shape, dtype=torch.long):
        return torch.cat(parts) if parts else torch.zeros(*shape, dtype=dtype, device=g.device)
    f = torch.float32
    return StackedEdges(rel, torch.tensor(rel, dtype=torch.long, device=g.device), ne, nu, cat(sources, 0), ns, cat(src, 0),
                     cat(seg, 0), cat(nodes, 0), cat(seg_rel, 0), cat(deg, 0, 1, dtype=f), cat(logd, 0, 1, dtype=f),
                     torch.stack(logd_mean) if logd_mean else torch.zeros(0, device=g.device), offsets, counts)


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
        self.bias_in = nn.Linear(1 + cfg.probes + 2 * cfg.fixed_probes, H)
        self.probes = ProbeFeatures(cfg.probes) if cfg.probes else None
        # nn.Embedding's N(0, 1) rows for the seeded kinds, zeros for kinds added later (vocabulary .seeded)
        first = torch.randn(SEEDED_ACTIVATIONS, H)
        self.act_emb = nn.Embedding(len(ACTIVATIONS), H, _weight=torch.cat(
            [first, torch.zeros(len(ACTIVATIONS) - SEEDED_ACTIVATIONS, H)]))
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
        self.head = nn.Sequential(nn.Linear(self.readout_dim + cfg.statistics_dim, H), nn.SiLU(),
                                  nn.Dropout(cfg.dropout),
                                  nn.Linear(H, cfg.out_dim))
        self.quasi = QuasiScaling(cfg.quasi_eps, max_layers=cfg.max_layers) if cfg.quasi else None

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # runs saved before an activation kind was added hold fewer rows: the new kinds (appended
        # last, pipeline.neural_graph.vocabulary) read a zero embedding, as an unseen kind should
        key = prefix + "act_emb.weight"
        saved = state_dict.get(key)
        if saved is not None and saved.shape[0] < self.act_emb.num_embeddings:
            pad = saved.new_zeros(self.act_emb.num_embeddings - saved.shape[0], saved.shape[1])
            state_dict[key] = torch.cat([saved, pad])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

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
            if self.cfg.fixed_probes:
                x = torch.cat([x, data["probe"]], -1)
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
        flat = stacked_edges(g, self.cfg.etypes, structure)
        present = [et for et in self.cfg.etypes if et in structure]
        x = torch.cat([h[t] for t in NODE_TYPES], 0)
        ef = torch.cat([e[et] for et in present], 0) if present else None
        for layer in self.layers:
            x, ef = layer(flat, x, ef)
        h = {t: x[flat.node_offsets[t]:flat.node_offsets[t] + flat.node_counts[t]] for t in NODE_TYPES}
        return h, ({**e, **dict(zip(present, ef.split(flat.edges_per_rel)))} if present else e)

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

    def forward(self, g, statistics: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Head output and the invariant graph embedding; ``statistics`` (B, statistics_dim): each
        model's statistics inputs (jobs.training.head_statistics), for a metanetwork built to read them."""
        z = self.embed(g)
        if self.cfg.statistics_dim:
            if statistics is None or statistics.shape != (len(z), self.cfg.statistics_dim):
                raise ValueError(f"this metanetwork's head reads {self.cfg.statistics_dim} statistics per model")
            return self.head(torch.cat([z, statistics.to(z.dtype)], -1)), z
        return self.head(z), z
