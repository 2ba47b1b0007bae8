"""Layout operations that only move axes: the neurons stay the channels.

``permute`` between channels-first feature maps ``(N, C, *S)`` and channels-last ones
``(N, *S, C)`` (ConvNeXt's and Swin's LayerNorm over channels, ViT's patch tokens) moves the
neuron axis without touching a value: the traced value keeps its neurons and spatial extent and
only flips where its neuron axis is. Permutations that reorder the spatial axes among themselves
(MaxViT's window and grid partitions, ``view`` into windows then ``permute``) move tokens only:
the neurons stay the channels, and the step (with its ``dims`` and ``positions``) is recorded in
the plan, so the architecture signature tells two layouts apart. Zero padding of positions,
slices of positions and ``roll`` (Swin's patch merging and shifted windows) are recorded steps too. An ``as_strided`` that keeps the shape
and reads the tensor in its contiguous order (how a pooled ``(N, C, 1, 1)`` map is re-laid out)
is the identity, and so is a slice that keeps a whole axis (``x[:, 0]`` exports as one); a slice
of the neuron axis keeps those neurons.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten

PERMUTE_OPS = (aten.permute.default,)
RESTRIDE_OPS = (aten.as_strided.default,)
SLICE_OPS = (aten.slice.Tensor,)
PAD_OPS = (aten.constant_pad_nd.default,)
ROLL_OPS = (aten.roll.default,)


def _contiguous_strides(shape) -> list[int]:
    out, step = [], 1
    for s in reversed(shape):
        out.append(step)
        step *= s
    return out[::-1]


class LayoutOps:
    """Tracer handler for ``aten.permute`` (mixed into plan._Tracer)."""

    def permute(self, node) -> None:
        x, dims = node.args[:2]
        self.move_axes(node, self.val(node, x), list(dims))

    def move_axes(self, node, v, dims: list[int]) -> None:
        """A permute (or a transpose, as one) of value ``v``'s axes."""
        ndim = len(dims)
        dims = [d % ndim for d in dims]
        if v.folded is not None or v.tokens or self.axes(v) != 1 or dims[0] != 0:
            raise self.unsupported(node, "permute that moves the batch or regrouped channels", f"dims={dims}")
        neuron = ndim - 1 if v.channels_last else 1
        out_neuron = dims.index(neuron)
        spatial_order = [d for d in dims[1:] if d != neuron]
        if out_neuron not in (1, ndim - 1):
            raise self.unsupported(node, "permute that puts the neurons between positions", f"dims={dims}")
        channels_last = out_neuron == ndim - 1 and ndim > 2
        step = {"step": "permute", "layer": self.layers_of(v)[0], "dims": dims}
        spatial = v.spatial
        if spatial_order != sorted(spatial_order):      # window / grid partitions, axis swaps: tokens move
            step["positions"] = True
            shape = tuple(int(s) for s in node.meta["val"].shape)
            spatial = shape[1:-1] if channels_last or (ndim == 2) else shape[2:]
        self.steps.append(step)
        self.vals[node.name] = type(v)(v.layer, channels_last, spatial, None, nmap=v.nmap)

    def restride(self, node) -> None:
        x, size, stride = node.args[:3]
        offset = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset", 0)
        v = self.val(node, x)
        shape = list(x.meta["val"].shape)
        want = _contiguous_strides(shape)
        same = all(a == b or n == 1 for a, b, n in zip(stride, want, shape))
        if list(size) != shape or not same or offset not in (0, None) or not x.meta["val"].is_contiguous():
            raise self.unsupported(node, "as_strided that moves values", f"size={list(size)} stride={list(stride)}")
        self.vals[node.name] = v

    def slice(self, node) -> None:
        x = node.args[0]
        dim, start, end, step = (list(node.args[1:]) + [0, None, None, 1][len(node.args) - 1:])[:4]
        v = self.val(node, x)
        shape = list(x.meta["val"].shape)
        dim = dim % len(shape)
        start, end, step = start or 0, shape[dim] if end is None else min(end, shape[dim]), step or 1
        if (start, end, step) == (0, shape[dim], 1):
            self.vals[node.name] = v
            return
        neuron = len(shape) - 1 if v.channels_last else 1
        if dim == neuron and self.axes(v) == 1 and v.folded is None and not v.tokens:
            self.vals[node.name] = self.from_map(self.neuron_map(v)[start:end:step], v)
            return
        if dim != neuron and dim != 0 and self.axes(v) == 1 and v.folded is None and not v.tokens:
            self.keep_neurons(node, v, "slice_positions", dim=dim, start=start, end=end, every=step)
            return
        raise self.unsupported(node, "slice of the batch", f"dim={dim} {start}:{end}:{step}")

    def pad(self, node) -> None:
        """Zero padding of positions (``F.pad`` before a window partition or a patch merge)."""
        x, pads = node.args[:2]
        value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0.0)
        v = self.val(node, x)
        ndim = len(x.meta["val"].shape)
        neuron = ndim - 1 if v.channels_last else 1
        touched = [ndim - 1 - i // 2 for i, p in enumerate(pads) if p]
        if value != 0 or neuron in touched or 0 in touched or v.folded is not None or v.tokens or self.axes(v) != 1:
            raise self.unsupported(node, "padding other than zeros around positions", f"pad={list(pads)}")
        if not touched:
            self.vals[node.name] = v
            return
        self.keep_neurons(node, v, "pad_positions", pad=list(pads))

    def roll(self, node) -> None:
        """A cyclic shift of positions (Swin's shifted windows outside an attention block)."""
        x, shifts = node.args[:2]
        dims = list(node.args[2]) if len(node.args) > 2 else []
        v = self.val(node, x)
        ndim = len(x.meta["val"].shape)
        neuron = ndim - 1 if v.channels_last else 1
        if not dims or any(d % ndim in (0, neuron) for d in dims) or v.folded is not None or self.axes(v) != 1:
            raise self.unsupported(node, "roll other than a shift of positions", f"shifts={list(shifts)} dims={dims}")
        self.keep_neurons(node, v, "roll", shifts=list(shifts), dims=[d % ndim for d in dims])

    def keep_neurons(self, node, v, step: str, **info) -> None:
        """A layout step that moves or drops positions only: same neurons, new positions (recorded)."""
        shape = tuple(int(s) for s in node.meta["val"].shape)
        spatial = shape[1:-1] if v.channels_last else shape[2:]
        for layer in self.layers_of(v):
            self.steps.append({"step": step, "layer": layer, **info})
        self.vals[node.name] = type(v)(v.layer, v.channels_last, spatial, None, nmap=v.nmap)
