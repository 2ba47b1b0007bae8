"""Metanetworks that output weight changes: equivariant heads on NG-GNN / NG-T, and NFN's NP layers.

Both editors map a batch of B networks to K sets of weight and bias changes, per linear layer
``(B, K, out, in)`` and ``(B, K, out)``, in raw units (the heads work in per-layer normalised units
and are scaled back by the training split's per-layer standard deviations). The edited networks
are ``original + change`` (residual), so a zero change is the identity edit.

- ``GraphEditor``: the metanetwork's final edge features and endpoint node embeddings give each
  edge K weight changes (``edge_head(e_uv, h_u, h_v)``), each non-input node K bias changes
  (``node_head(h_v)``); the changes are scattered back to the weight tensors by the edge's layer
  and the neurons' positions, the order ``state_dict_from_graph`` uses. Every step is per edge or
  per node, so permuting hidden neurons permutes the changes in the same way.
- ``NFNEditor``: NFN's NP layers (Zhou et al., 2023; PyPI ``nfn``, the optional extra ``peers``),
  with learned input/output embeddings, on the normalised weight tensors directly.

The heads' last layers start small and random rather than zero: with K > 1 members, identical
members would receive identical gradients and never part (the widened network's K copies of each
neuron would stay copies).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from jobs.editing.data import EditData
from jobs.metanets import build_metanetwork
from jobs.metanets.ngnn import NGGNNConfig, mlp
from zoocore.errors import JobError

HEAD_INIT = 0.1        # scale of the heads' last layer at initialisation (default init times this)


def _small_last_layer(seq: nn.Sequential, scale: float = HEAD_INIT) -> None:
    last = seq[-1]
    with torch.no_grad():
        last.weight.mul_(scale)
        last.bias.zero_()


def _scales(data: "EditData", device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return ([torch.tensor(s, dtype=torch.float32, device=device) for s in data.weight_scale],
            [torch.tensor(s, dtype=torch.float32, device=device) for s in data.bias_scale])


class GraphEditor(nn.Module):
    """NG-GNN or NG-T (``cfg.kind``) with per-edge and per-node heads predicting K weight sets.

    Shapes:
        ``deltas(data, idx)``: per linear layer (B, K, out, in) and (B, K, out), B = len(idx).
    """

    def __init__(self, cfg: NGGNNConfig, members: int = 1):
        super().__init__()
        self.cfg, self.members = cfg, members
        self.backbone = build_metanetwork(cfg)
        self.backbone.head = nn.Identity()           # the invariant head is not used: outputs are per edge/node
        H, E = cfg.hidden, cfg.edge_hidden
        self.edge_head = mlp(E + 2 * H, H, members)
        self.node_head = mlp(H, H, members)
        _small_last_layer(self.edge_head)
        _small_last_layer(self.node_head)

    def forward(self, g) -> tuple[dict, dict]:
        """Per forward edge type (E_t, K) weight changes and per node type (N_t, K) bias changes."""
        h, e = self.backbone.embeddings(g)
        edge_out = {}
        for et in self.backbone.forward_etypes:
            if et not in e or g.num_edges(et) == 0:
                continue
            s, _, d = et
            src, dst = g.edges(etype=et)
            edge_out[et] = self.edge_head(torch.cat([e[et], h[s].index_select(0, src), h[d].index_select(0, dst)], -1))
        node_out = {t: self.node_head(h[t]) for t in ("hidden", "output") if g.num_nodes(t)}
        return edge_out, node_out

    def deltas(self, data: "EditData", idx: np.ndarray, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        import dgl

        g = dgl.batch([data.dgl_graphs[i] for i in idx]).to(device)
        edge_out, node_out = self(g)
        return scatter_changes(g, edge_out, node_out, data.layout.sizes, self.members, *_scales(data, device))


def scatter_changes(g, edge_out: dict, node_out: dict, sizes, members: int, weight_scale, bias_scale):
    """Per-edge and per-node outputs of a batched neural graph as dense per-layer tensors.

    An edge from neuron layer l-1 to layer l is entry (position of its destination, position of its
    source) of linear layer l-1; a node of layer l is entry (its position) of bias l-1.

    Shapes:
        edge_out: per edge type (E_t, K); node_out: per node type (N_t, K); returns per linear
        layer (B, K, out, in) and (B, K, out), multiplied by that layer's scales.
    """
    B = g.batch_size
    dev = next(iter(edge_out.values())).device
    graph_of = {t: torch.repeat_interleave(torch.arange(B, device=dev), g.batch_num_nodes(t))
                for t in ("input", "hidden", "output")}
    L = len(sizes) - 1
    dW = [torch.zeros(B, sizes[i + 1], sizes[i], members, device=dev) for i in range(L)]
    db = [torch.zeros(B, sizes[i + 1], members, device=dev) for i in range(L)]
    for (s, rel, d), vals in edge_out.items():
        src, dst = g.edges(etype=(s, rel, d))
        layer = g.nodes[d].data["layer"][dst] - 1
        row, col = g.nodes[d].data["position"][dst], g.nodes[s].data["position"][src]
        gid = graph_of[d][dst]
        for li in torch.unique(layer).tolist():
            m = layer == li
            dW[li] = dW[li] + torch.zeros_like(dW[li]).index_put((gid[m], row[m], col[m]), vals[m])
    for t, vals in node_out.items():
        layer = g.nodes[t].data["layer"] - 1
        pos = g.nodes[t].data["position"]
        for li in torch.unique(layer).tolist():
            m = layer == li
            db[li] = db[li] + torch.zeros_like(db[li]).index_put((graph_of[t][m], pos[m]), vals[m])
    return [(w.permute(0, 3, 1, 2) * ws, b.permute(0, 2, 1) * bs)
            for w, b, ws, bs in zip(dW, db, weight_scale, bias_scale)]


def nfn_available() -> str | None:
    """None when NFN's layers can be used here, else why not (shown instead of the baseline)."""
    try:
        import importlib

        importlib.import_module("nfn.layers")
    except Exception as exc:          # ImportError, or a version clash inside the package
        return (f"the nfn package is not usable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                "install the optional extra: pip install 'zoograph[peers]'")
    return None


class NFNEditor(nn.Module):
    """NFN NP layers (``nfn.layers.NPLinear`` with learned input/output embeddings, ReLU between)
    from the normalised weights to K weight sets.

    Shapes:
        ``deltas(data, idx)``: per linear layer (B, K, out, in) and (B, K, out).
    """

    def __init__(self, sizes, members: int = 1, channels: int = 32, layers: int = 3):
        super().__init__()
        reason = nfn_available()
        if reason:
            raise JobError(reason)
        from nfn.common import WeightSpaceFeatures, network_spec_from_wsfeat
        from nfn.layers import NPLinear, TupleOp

        self.members = members
        probe = WeightSpaceFeatures([torch.zeros(1, 1, sizes[i + 1], sizes[i]) for i in range(len(sizes) - 1)],
                                    [torch.zeros(1, 1, sizes[i + 1]) for i in range(len(sizes) - 1)])
        spec = network_spec_from_wsfeat(probe)
        widths = [1] + [channels] * (layers - 1) + [members]
        mods: list[nn.Module] = []
        for i in range(layers):
            mods.append(NPLinear(spec, widths[i], widths[i + 1], io_embed=True))
            if i < layers - 1:
                mods.append(TupleOp(nn.ReLU()))
        self.net = nn.Sequential(*mods)
        last = mods[-1]
        with torch.no_grad():                   # start near the identity edit, members apart
            for name, p in last.named_parameters():
                if not name.endswith("embed"):
                    p.mul_(HEAD_INIT)

    def deltas(self, data: "EditData", idx: np.ndarray, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        from nfn.common import WeightSpaceFeatures

        ws, bs = _scales(data, device)
        wm = [torch.tensor(m, dtype=torch.float32, device=device) for m in data.weight_mean]
        bm = [torch.tensor(m, dtype=torch.float32, device=device) for m in data.bias_mean]
        params = [(w[idx].to(device), b[idx].to(device)) for w, b in data.params]
        x = WeightSpaceFeatures([((w - m) / s).unsqueeze(1) for (w, _), m, s in zip(params, wm, ws)],
                                [((b - m) / s).unsqueeze(1) for (_, b), m, s in zip(params, bm, bs)])
        out = self.net(x)
        return [(w * s, b * t) for w, b, s, t in zip(out.weights, out.biases, ws, bs)]
