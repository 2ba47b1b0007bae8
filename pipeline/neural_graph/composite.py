"""Activations written out as several elementwise ATen operations, read as one activation.

Hugging Face's ``NewGELUActivation`` (GPT-2's ``gelu_new``) computes the tanh approximation of
GELU as ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))``: seven ATen nodes inside
one module. Every node of such a module is taken together as the activation named here.
"""
from __future__ import annotations

from dataclasses import dataclass

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
    by_path: dict[str, CompositeActivation] = {}
    out: dict[str, CompositeActivation] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        for raw, typ in (node.meta.get("nn_module_stack") or {}).values():
            name = COMPOSITE_ACTIVATIONS.get(getattr(typ, "__name__", ""))
            if name is not None:
                path = clean(raw)
                blk = by_path.setdefault(path, CompositeActivation(path, name, [], set()))
                blk.nodes.append(node)
                blk.names.add(node.name)
                out[node.name] = blk
                break
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
