"""Upsampling (``nn.Upsample``, ``nn.UpsamplingNearest2d``, ``nn.UpsamplingBilinear2d``): each
channel's map is resized on its own, so the neurons stay the channels and no edge is made; the
plan records an ``upsample`` step with the new spatial extent, which later flattens and linear
layers read. Nearest and (bi)linear interpolation are linear in each channel, so they commute
with permuting, rescaling and sign-flipping channels: the step ties nothing.

``torch.export`` writes an upsampling out as index arithmetic (``arange``, ``_unsafe_index``,
``clamp``, ...), not as one ATen op, so the tracer reads every node inside the module as one call
(``traced_modules``)."""
from __future__ import annotations

from pipeline.neural_graph.ops.base import register

MODULES = ("Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d")


class UpsampleTracing:
    """Tracer handler for an upsampling module's nodes, read at its last node (mixed into plan._Tracer)."""

    def upsample(self, node, nodes: list) -> None:
        inside = {n.name for n in nodes}
        inputs = {a.name: a for n in nodes for a in n.all_input_nodes if a.name not in inside}
        neurons = [a for k, a in inputs.items() if isinstance(self.vals.get(k), self.Val)]
        if len(neurons) != 1:
            raise self.unsupported(node, "upsampling of other than one neuron tensor")
        v = self.val(node, neurons[0])
        out = tuple(int(d) for d in node.meta["val"].shape)
        if v.channels_last or v.folded is not None or v.tokens or not v.spatial or len(out) != 2 + len(v.spatial):
            raise self.unsupported(node, "upsampling other than of feature maps")
        for layer in self.layers_of(v):
            self.steps.append({"step": "upsample", "layer": layer, "out": list(out[2:])})
        self.vals[node.name] = self.Val(v.layer, False, out[2:], nmap=v.nmap)


register(tracer=UpsampleTracing, traced_modules={name: "upsample" for name in MODULES})
