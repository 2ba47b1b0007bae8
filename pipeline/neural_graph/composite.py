"""Activations written out as several elementwise ATen operations, read as one activation.

Hugging Face's ``NewGELUActivation`` (GPT-2's ``gelu_new``) computes the tanh approximation of
GELU as ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))``: seven ATen nodes inside
one module. Every node of such a module is taken together as the activation named here.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.neural_graph.ops.base import module_groups, type_name

COMPOSITE_ACTIVATIONS = {
    "NewGELUActivation": "gelu_tanh",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
}


@dataclass
class CompositeActivation:
    path: str
    name: str
    nodes: list
    names: set


def composite_activations(graph, clean) -> dict[str, CompositeActivation]:
    """Nodes inside a module of a COMPOSITE_ACTIVATIONS class, by node name."""
    out: dict[str, CompositeActivation] = {}
    match = lambda typ: COMPOSITE_ACTIVATIONS.get(type_name(typ))  # noqa: E731
    for path, (name, nodes) in module_groups(graph, clean, match).items():
        blk = CompositeActivation(path, name, nodes, {n.name for n in nodes})
        out.update((n.name, blk) for n in nodes)
    return out


class CompositeOps:
    """Tracer handler for composite activations (mixed into plan._Tracer)."""

    def composite_activation(self, node, blk: CompositeActivation) -> None:
        inputs = {a.name: a for n in blk.nodes for a in n.all_input_nodes if a.name not in blk.names}
        neurons = [a for k, a in inputs.items() if isinstance(self.vals.get(k), type(self).Val)]
        outputs = [n for n in blk.nodes if any(u.name not in blk.names for u in n.users)]
        if len(neurons) != 1 or len(outputs) != 1 or len(inputs) != 1:
            raise self.unsupported(node, f"{blk.name} on other than one neuron tensor")
        self.apply_activation(node, neurons[0], blk.name, outputs[0], inside=blk.names)
