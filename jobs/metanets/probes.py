"""Probe features: the activations of a learned set of inputs, per neuron, computed on the graph.

The network is run on the neural graph itself, neuron layer by neuron layer, from the raw
weights (``w_raw``) and biases (``bias_raw``): value(d) = act_d(sum_e w_e * value(src_e) + b_d).
Because it is message passing, the features are differentiable in the probe inputs (which are
learned) and permute with the neurons. Exact for graphs of scalar edges whose operations are
linear layers and residual sums (MLPs, SIRENs); other graphs are refused when the data is built.
"""
from __future__ import annotations

import dgl
import torch
from torch import nn

from pipeline.neural_graph.vocabulary import NODE_TYPES, VOCABULARY

_FORWARD = {"linear", "residual"}


def _activate(x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    for code, act in enumerate(VOCABULARY):
        mask = codes == code
        if act.name != "identity" and mask.any():
            out[mask] = act.fn(x[mask])
    return out


class ProbeFeatures(nn.Module):
    """``n`` learned probe inputs; features (N_t, n) per node type, squashed by sign*log1p|x|."""

    def __init__(self, n: int, max_inputs: int = 128, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.inputs = nn.Parameter(torch.randn(max_inputs, n, generator=gen))

    def forward(self, g: dgl.DGLHeteroGraph) -> dict[str, torch.Tensor]:
        n = self.inputs.shape[1]
        val = {t: torch.zeros(g.num_nodes(t), n, device=g.device) for t in NODE_TYPES}
        pos = g.nodes["input"].data["position"].clamp(max=self.inputs.shape[0] - 1)
        val["input"] = self.inputs[pos]
        layers = {t: g.nodes[t].data["layer"] for t in NODE_TYPES}
        top = max(int(layers[t].max()) for t in NODE_TYPES if g.num_nodes(t))
        fwd = [et for et in g.canonical_etypes if et[1] in _FORWARD and g.num_edges(et)]
        for layer in range(1, top + 1):
            acc = {t: torch.zeros_like(val[t]) for t in NODE_TYPES}
            for et in fwd:
                s, _, d = et
                src, dst = g.edges(etype=et)
                sel = layers[d][dst] == layer
                if not sel.any():
                    continue
                msg = g.edges[et].data["w_raw"][sel].unsqueeze(-1) * val[s][src[sel]]
                acc[d] = acc[d].index_add(0, dst[sel], msg)
            for t in ("hidden", "output"):
                mask = layers[t] == layer
                if mask.any():
                    pre = acc[t][mask] + g.nodes[t].data["bias_raw"][mask].unsqueeze(-1)
                    val[t] = val[t].clone()
                    val[t][mask] = _activate(pre, g.nodes[t].data["activation"][mask])
        return {t: torch.sign(v) * torch.log1p(v.abs()) for t, v in val.items()}


def check_probe_graph(etypes) -> None:
    """Refuse edge types a scalar forward pass cannot run (conv kernels, norms, attention, gates)."""
    from zoocore.errors import JobError

    bad = sorted({et[1] for et in etypes if not et[1].startswith("rev_")} - _FORWARD)
    if bad:
        raise JobError(f"probe features run the network on its graph and cover linear and residual edges; "
                       f"these models also have {bad} (use --probes 0)")


__all__ = ["ProbeFeatures", "check_probe_graph"]
