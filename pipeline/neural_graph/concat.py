"""Concatenation, splits and channel shuffles: a neuron axis made of other layers' neurons.

``torch.cat`` along the neuron axis makes no new neurons and no weights: the neurons of the result
are its operands' neurons, in order. ``split``/``chunk`` take a slice of them, and a channel
shuffle (``view`` into groups, ``transpose``, ``view`` back) reorders them. So a traced value
carries a *neuron map*: an integer array ``(..., 2)`` of (neuron layer, position) pairs, one per
index of its neuron axes (two axes while a shuffle is in flight).

An operation that reads such a value records where its inputs come from as ``src_segments``:
runs ``[layer, start, count, step]`` whose neurons, in order, are the operation's input
channels; ``src_layer`` is then the first run's layer. Without ``src_segments`` an operation
reads the whole of ``src_layer``, in order.

Operands that hold the same neurons at different positions (Swin's patch merging puts four
position slices of one map side by side) cannot share their neurons: their concatenation is a new
neuron layer, joined to its sources by one ``residual`` edge per neuron. The same tensor
concatenated with itself is refused.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

aten = torch.ops.aten

SPLIT_OPS = (aten.split.Tensor, aten.split_with_sizes.default)


def layer_map(layer: int, size: int) -> np.ndarray:
    """The neuron map of a whole neuron layer: (size, 2)."""
    return np.stack([np.full(size, layer, np.int64), np.arange(size, dtype=np.int64)], axis=1)


def whole_layer(nmap: np.ndarray, sizes: Sequence[int]) -> int | None:
    """The layer a 1-axis map is exactly (every neuron, in order), else None."""
    if nmap.ndim != 2 or nmap.shape[0] == 0:
        return None
    layer = int(nmap[0, 0])
    if (nmap[:, 0] == layer).all() and nmap.shape[0] == sizes[layer] and (nmap[:, 1] == np.arange(len(nmap))).all():
        return layer
    return None


def encode_segments(nmap: np.ndarray) -> list[list[int]]:
    """Run-length code of a (C, 2) neuron map: ``[layer, start, count, step]`` runs, greedy."""
    out: list[list[int]] = []
    for layer, pos in nmap.tolist():
        if out:
            run = out[-1]
            if run[0] == layer and (run[2] == 1 and pos != run[1] or run[1] + run[2] * run[3] == pos):
                if run[2] == 1:
                    run[3] = pos - run[1]
                run[2] += 1
                continue
        out.append([layer, pos, 1, 1])
    return out


def source_of(nmap: np.ndarray, sizes: Sequence[int]) -> dict[str, Any]:
    """The ``src_layer`` (and, unless the map is one whole layer, ``src_segments``) of an op."""
    layer = whole_layer(nmap, sizes)
    if layer is not None:
        return {"src_layer": layer}
    return {"src_layer": int(nmap[0, 0]), "src_segments": encode_segments(nmap)}


def source_nodes(op: dict, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Global node indices of an operation's input channels, in channel order."""
    segs = op.get("src_segments")
    if segs is None:
        layer = op["src_layer"]
        return offsets[layer] + np.arange(int(sizes[layer]), dtype=np.int64)
    return np.concatenate([offsets[layer] + start + step * np.arange(count, dtype=np.int64)
                           for layer, start, count, step in segs])


def source_layers(op: dict) -> list[int]:
    """Every neuron layer an operation reads (one unless it reads a concatenation)."""
    segs = op.get("src_segments")
    if segs is None:
        return [op["src_layer"]]
    return sorted({s[0] for s in segs})


def in_size(op: dict, sizes: Sequence[int]) -> int:
    """Number of input channels of an operation."""
    segs = op.get("src_segments")
    return int(sizes[op["src_layer"]]) if segs is None else sum(s[2] for s in segs)


class ConcatOps:
    """Tracer handlers for cat, split and channel-shuffle layouts (mixed into plan._Tracer)."""

    def neuron_axis(self, v, ndim: int, dim: int) -> bool:
        dim = dim % ndim
        return dim == ndim - 1 if v.channels_last else dim == 1

    def cat(self, node) -> None:
        tensors, dim = node.args[0], (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0))
        parts = [self.vals.get(t.name) if isinstance(t, torch.fx.Node) else None for t in tensors]
        if any(isinstance(p, tuple) and p[0] == "param_expand" for p in parts):
            return self.token_cat(node, parts, dim)                 # class tokens: tokens.py
        vals = [self.val(node, t) for t in tensors]
        ndim = len(node.meta["val"].shape)
        first = vals[0]
        if any(v.folded is not None or v.tokens or v.channels_last != first.channels_last
               or v.spatial != first.spatial or self.axes(v) != 1 for v in vals):
            raise self.unsupported(node, "concatenation of tensors that are not neuron layers of one layout")
        if not self.neuron_axis(first, ndim, dim):
            raise self.unsupported(node, "concatenation along an axis other than the neurons", f"dim={dim}")
        nmap = np.concatenate([self.neuron_map(v) for v in vals])
        if len({(a, b) for a, b in nmap.tolist()}) != len(nmap):
            if len({t.name for t in tensors}) != len(tensors):
                raise self.unsupported(node, "concatenation that repeats neurons")
            # the same neurons at other positions (Swin's patch merging: four position slices side by
            # side): a new layer of their values, one residual edge from each source neuron
            dst = self.new_layer(len(nmap), "concat")
            self.add_op(node, kind="residual", relation="residual", **source_of(nmap, [x.size for x in self.layers]),
                        dst_layer=dst, kernel=[1, 1])
            self.vals[node.name] = type(first)(dst, first.channels_last, first.spatial)
            return
        self.vals[node.name] = self.from_map(nmap, first)

    def split(self, node) -> None:
        x, sizes = node.args[:2]
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        v = self.val(node, x)
        ndim = len(node.args[0].meta["val"].shape)
        if v.folded is not None or self.axes(v) != 1 or not self.neuron_axis(v, ndim, dim):
            raise self.unsupported(node, "split along an axis other than the neurons", f"dim={dim}")
        nmap = self.neuron_map(v)
        if isinstance(sizes, int):
            sizes = [min(sizes, len(nmap) - i) for i in range(0, len(nmap), sizes)]
        bounds = np.cumsum([0] + list(sizes))
        self.vals[node.name] = tuple(self.from_map(nmap[a:b], v) for a, b in zip(bounds[:-1], bounds[1:]))

    def group_view(self, node, v, out: tuple[int, ...]) -> bool:
        """``view`` of a feature map's channels into (groups, channels/groups) and back; True if handled."""
        if v.channels_last or v.folded is not None:
            return False
        axes = self.axes(v)
        per = tuple(v.spatial)
        nmap = self.neuron_map(v)
        if axes == 1 and len(out) == 3 + len(per) and tuple(out[3:]) == per and out[1] * out[2] == len(nmap) \
                and out[1] > 1 and out[2] > 1:
            new = nmap.reshape(out[1], out[2], 2)
        elif axes == 2 and len(out) == 2 + len(per) and tuple(out[2:]) == per and out[1] == nmap.shape[0] * nmap.shape[1]:
            new = nmap.reshape(out[1], 2)
        else:
            return False
        self.steps.append({"step": "reshape", "layer": int(nmap.reshape(-1, 2)[0, 0]), "out": list(out[1:])})
        self.vals[node.name] = self.from_map(new, v)
        return True

    def transpose(self, node) -> None:
        x, d0, d1 = node.args[:3]
        v = self.val(node, x)
        ndim = len(node.args[0].meta["val"].shape)
        if self.axes(v) == 2 and not v.channels_last and {d0 % ndim, d1 % ndim} == {1, 2}:
            self.vals[node.name] = self.from_map(self.neuron_map(v).transpose(1, 0, 2), v)
            return
        dims = list(range(ndim))
        dims[d0 % ndim], dims[d1 % ndim] = dims[d1 % ndim], dims[d0 % ndim]
        self.move_axes(node, v, dims)                       # layout.py: a permute of two axes
