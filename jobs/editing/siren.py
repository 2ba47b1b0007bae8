"""MLPs as tensors: the batched functional forward of many SIRENs of one architecture, and the
exact widening that writes the average of K networks as one network (Output Capacity Expansion).

All INRs of a zoo share one architecture, so a batch of B networks is, per linear layer, a weight
tensor (B, out, in) and a bias tensor (B, out); evaluating them on P points is one ``torch.baddbmm``
per layer. Gradients flow to the weights, so a metanetwork that predicts weights can be trained on
the MSE of the functions it outputs.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from pipeline.neural_graph.graph import NeuralGraph
from pipeline.neural_graph.vocabulary import VOCABULARY
from zoocore.errors import JobError

Params = list[tuple[torch.Tensor, torch.Tensor]]     # per linear layer: weight (B, out, in), bias (B, out)

ACTIVATIONS = {a.name: a.fn for a in VOCABULARY}    # the functional forward applies any of them


def pixel_grid(size: int = 8) -> torch.Tensor:
    """(size*size, 2) pixel coordinates in [-1, 1]^2, row-major: point k is (row k // size, column
    k % size), the grid the ``inr`` zoo fits its digits on."""
    g = torch.linspace(-1, 1, size)
    return torch.stack(torch.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2)


@dataclass(frozen=True)
class MLPLayout:
    """Where the weights of a plain MLP live in its state dict and neural graph.

    ``sizes`` are the neuron-layer sizes (input, hidden..., output); linear layer ``l`` maps neuron
    layer ``l`` to ``l + 1`` and is followed by ``activations[l]``.
    """

    weight_keys: tuple[str, ...]
    bias_keys: tuple[str, ...]
    sizes: tuple[int, ...]
    activations: tuple[str, ...]

    @property
    def num_layers(self) -> int:
        return len(self.weight_keys)

    @classmethod
    def of_graph(cls, graph: NeuralGraph) -> "MLPLayout":
        """The layout of ``graph``; JobError unless it is a chain of biased linear layers with
        activations the functional forward knows (an INR / MLP)."""
        ops = graph.ops
        bad = [op["kind"] for op in ops if op["kind"] != "linear" or not op.get("bias_key") or "rows" in op]
        chain = all(op["src_layer"] == i and op["dst_layer"] == i + 1 for i, op in enumerate(ops))
        if bad or not chain or not ops:
            raise JobError("editing needs plain MLPs (a chain of linear layers with biases, like the inr zoo's "
                           f"SIRENs); this architecture has operations {[op['kind'] for op in ops]}")
        acts = tuple(graph.layer_activation[1:])
        unknown = sorted(set(acts) - set(ACTIVATIONS))
        if unknown:
            raise JobError(f"the functional forward knows the activations {sorted(ACTIVATIONS)}, not {unknown}")
        return cls(tuple(op["weight_key"] for op in ops), tuple(op["bias_key"] for op in ops),
                   tuple(int(s) for s in graph.layer_sizes()), acts)

    def stack(self, states: Sequence[dict[str, torch.Tensor]], device=None) -> Params:
        """The state dicts of B networks as per-layer (B, out, in) / (B, out) tensors."""
        return [(torch.stack([s[w] for s in states]).float().to(device), torch.stack([s[b] for s in states]).float().to(device))
                for w, b in zip(self.weight_keys, self.bias_keys)]

    def state_dict(self, params: Params, i: int) -> dict[str, torch.Tensor]:
        """Network ``i`` of a batch as a state dict (detached, contiguous, on the CPU)."""
        out = {}
        for (w, b), wk, bk in zip(params, self.weight_keys, self.bias_keys):
            out[wk] = w[i].detach().cpu().contiguous()
            out[bk] = b[i].detach().cpu().contiguous()
        return out


def mlp_forward(params: Params, coords: torch.Tensor, activations: Sequence[str]) -> torch.Tensor:
    """Evaluate B MLPs of one architecture at P points.

    Args:
        params: per linear layer, weight (B, out, in) and bias (B, out).
        coords: (P, in) points shared by all networks, or (B, P, in).
        activations: the activation after each linear layer (``identity`` after the last).
    Shapes:
        returns (B, P, out).
    Example:
        >>> w = [(torch.ones(1, 1, 2), torch.zeros(1, 1))]
        >>> mlp_forward(w, torch.tensor([[1.0, 2.0]]), ["identity"]).item()
        3.0
    """
    B = params[0][0].shape[0]
    h = coords.expand(B, *coords.shape) if coords.dim() == 2 else coords
    for (w, b), act in zip(params, activations):
        h = ACTIVATIONS[act](torch.baddbmm(b.unsqueeze(1), h, w.transpose(1, 2)))
    return h


def widen(members: Params) -> Params:
    """One network computing the average of K networks of one architecture, exactly.

    For a chain of linear layers with element-wise activations, the average
    ``(1/K) sum_k f_k(x)`` is one network whose hidden layers are the K networks' hidden layers side
    by side: the first weight matrices stacked (all members read the same input), the middle ones
    block-diagonal (member k's neurons only feed member k's), the last ones concatenated and scaled
    by 1/K, and the last biases averaged. Hidden widths grow K-fold; inputs and outputs are unchanged.

    Args:
        members: per linear layer, weight (K, out, in) and bias (K, out) of the K networks.
    Shapes:
        returns per layer weight (out', in') and bias (out',), out' = K * out for hidden layers.
    """
    K = members[0][0].shape[0]
    if len(members) == 1:
        w, b = members[0]
        return [(w.mean(0), b.mean(0))]
    out: Params = []
    last = len(members) - 1
    for i, (w, b) in enumerate(members):
        if i == 0:
            out.append((w.reshape(K * w.shape[1], w.shape[2]), b.reshape(-1)))
        elif i < last:
            out.append((torch.block_diag(*w.unbind(0)), b.reshape(-1)))
        else:
            out.append((w.permute(1, 0, 2).reshape(w.shape[1], K * w.shape[2]) / K, b.mean(0)))
    return out


def widened_spec(spec: dict, k: int) -> dict:
    """The JSON spec of ``widen``'s network: every linear layer but the last ``k`` times wider."""
    layers = spec.get("layers", [])
    kinds = {layer.get("type") for layer in layers}
    if not kinds <= {"linear", "activation"}:
        raise JobError(f"only specs of linear and activation layers can be widened, not {sorted(kinds)}")
    out = copy.deepcopy(spec)
    linear = [layer for layer in out["layers"] if layer["type"] == "linear"]
    for layer in linear[:-1]:
        layer["out_features"] = int(layer["out_features"]) * k
    return out


def permute_params(params: Params, perms: Sequence[np.ndarray]) -> Params:
    """The same networks with the neurons of hidden layer ``l`` reordered: new neuron ``perms[l][j]``
    is old neuron ``j`` (the convention of ``NeuralGraph.permuted`` within a layer)."""
    inv = [torch.as_tensor(np.argsort(p)) for p in perms]
    out = []
    for i, (w, b) in enumerate(params):
        if i < len(inv):                       # rows: this layer's outputs are hidden layer i
            w, b = w[:, inv[i]], b[:, inv[i]]
        if i > 0:                              # columns: its inputs are hidden layer i - 1
            w = w[:, :, inv[i - 1]]
        out.append((w, b))
    return out
