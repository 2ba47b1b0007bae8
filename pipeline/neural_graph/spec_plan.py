"""Plans read straight from a JSON architecture spec, without ``torch.export``.

A spec is a sequence of known layer types, so the plan that ``torch.export`` + the ATen tracer
(``pipeline.neural_graph.plan``) would produce can be written down layer by layer: shapes come
from running a zero tensor through the built modules, and the rules for where an activation or a
residual sum may go are the tracer's own. This costs about a millisecond per architecture
instead of a few hundred (one export per architecture dominated the ingest of diverse zoos).

The tracer stays the reference: ``plan_from_spec`` returns ``None`` for anything it does not
cover exactly (embeddings, layer norm, 1-d pooling, linear layers on maps or tokens, string
padding, and every case the tracer would reject), and the caller
then exports. A property test checks that both give identical plans (paths and signature
included) on random specs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeline.neural_graph.ops import SPEC_HANDLERS, SPEC_MIXINS, Op, make_op
from pipeline.neural_graph.plan import NeuronLayer, Plan, architecture_signature
from pipeline.neural_graph.vocabulary import VOCABULARY
from pipeline.spec import Residual, SpecNet, example_input

# Activation module -> the name the tracer records (nn.Identity adds no operation at all).
_ACTIVATION_NAMES = {a.module: a.name for a in VOCABULARY if a.in_specs and a.name != "identity"}


class _NotCovered(Exception):
    """This spec needs the tracer (either it is outside the covered subset or it is unsupported)."""


@dataclass
class _Val:
    layer: int
    channels_last: bool
    spatial: tuple[int, ...]
    folded: tuple[int, ...] | None = None
    fresh: bool = True          # produced by an operation read by exactly one consumer so far


class _SpecPlanner(*SPEC_MIXINS):
    NotCovered = _NotCovered
    Val = _Val

    def __init__(self, net: SpecNet, example: torch.Tensor):
        self.net = net
        self.layers: list[NeuronLayer] = []
        self.ops: list[Op] = []
        self.steps: list[dict[str, Any]] = []
        self.state = net.state_dict()
        self.example = example

    def new_layer(self, size: int, kind: str) -> int:
        self.layers.append(NeuronLayer(size=int(size), kind=kind))
        return len(self.layers) - 1

    def add_op(self, path: str, **op) -> None:
        op["path"] = path
        rec = make_op(**op)
        self.ops.append(rec)
        self.steps.append({"step": rec.kind, "op": len(self.ops) - 1, "dst_layer": rec.dst_layer})

    def key(self, path: str, name: str) -> str | None:
        k = f"{path}.{name}"
        return k if k in self.state else None

    # ------------------------------------------------------------------ walking the modules
    def run(self) -> Plan:
        x = self.example
        if x.dtype != torch.float32:
            raise _NotCovered("token inputs")
        shape = tuple(x.shape)
        if len(shape) == 2:
            v = _Val(self.new_layer(shape[1], "input"), True, ())
        elif len(shape) in (3, 4):
            if len(shape) == 3 and not isinstance(self._first_op(self.net.layers), nn.Conv1d):
                raise _NotCovered("(N, T, F) inputs")
            v = _Val(self.new_layer(shape[1], "input"), False, tuple(shape[2:]))
        else:
            raise _NotCovered("input rank")
        v, x = self.sequence(self.net.layers, "layers", v, x)
        if v.layer == 0 or v.folded is not None:
            raise _NotCovered("output is not a neuron layer")
        ops = self.ops
        plan = Plan(layers=self.layers, ops=ops, steps=self.steps, output_layer=v.layer,
                    kernel_shape=(max(op["kernel"][0] for op in ops), max(op["kernel"][1] for op in ops)),
                    state_keys=[k for k, _ in self.net.named_parameters()] + [k for k, _ in self.net.named_buffers()],
                    buffer_keys=[op["nbt_key"] for op in ops if op.get("nbt_key")],
                    input_shape=list(shape[1:]), input_dtype="float32")
        plan.signature = architecture_signature(plan)
        return plan

    @staticmethod
    def _first_op(seq: nn.Sequential):
        for m in seq:
            if isinstance(m, Residual):
                return _SpecPlanner._first_op(m.body)
            if not isinstance(m, (nn.Identity, nn.Dropout)):
                return m
        return None

    def sequence(self, seq: nn.Sequential, prefix: str, v: _Val, x: torch.Tensor) -> tuple[_Val, torch.Tensor]:
        for i, mod in enumerate(seq):
            path = f"{prefix}.{i}"
            with torch.no_grad():
                y = mod(x)
            v = self.module(mod, path, v, x, y)
            x = y
        return v, x

    def module(self, mod: nn.Module, path: str, v: _Val, x: torch.Tensor, y: torch.Tensor) -> _Val:
        if isinstance(mod, (nn.Identity, nn.Dropout)):
            return v
        if type(mod) in _ACTIVATION_NAMES:
            return self.activation(mod, v)
        if isinstance(mod, (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d)):
            return self.pool(mod, v, y)
        if isinstance(mod, nn.Flatten):
            return self.flatten(v, y)
        for types, handler in SPEC_HANDLERS:
            if isinstance(mod, types):
                return getattr(self, handler)(mod, path, v, x, y)
        raise _NotCovered(type(mod).__name__)

    # ------------------------------------------------------------------ one rule per module kind
    def activation(self, mod, v: _Val) -> _Val:
        name = _ACTIVATION_NAMES[type(mod)]
        if name == "leaky_relu" and mod.negative_slope != 0.01:
            raise _NotCovered("leaky_relu slope")
        if name == "elu" and mod.alpha != 1.0:
            raise _NotCovered("elu alpha")
        if name == "gelu" and mod.approximate != "none":
            raise _NotCovered("tanh gelu")
        layer = self.layers[v.layer]
        if v.layer == 0 or layer.activation != "identity" or not v.fresh or v.folded is not None:
            raise _NotCovered("activation the graph cannot hold")
        layer.activation = name
        self.steps.append({"step": "activation", "fn": name, "layer": v.layer})
        return v

    def pool(self, mod, v: _Val, y: torch.Tensor) -> _Val:
        if v.channels_last or v.folded is not None or y.dim() != 4:
            raise _NotCovered("pooling input")
        out = tuple(int(s) for s in y.shape[2:])
        if isinstance(mod, nn.MaxPool2d):
            if mod.dilation not in (1, (1, 1)) or mod.ceil_mode or mod.padding not in (0, (0, 0)):
                raise _NotCovered("max pool variant")
            name = "max_pool"
        elif isinstance(mod, nn.AvgPool2d):
            if mod.ceil_mode or mod.padding not in (0, (0, 0)) or mod.divisor_override is not None:
                raise _NotCovered("avg pool variant")
            name = "avg_pool"
        else:     # ATen lowers a 1x1 adaptive average pool to a mean over the map
            name = "mean_pool" if out == (1, 1) else "adaptive_avg_pool"
        self.steps.append({"step": name, "layer": v.layer, "out": list(out)})
        return _Val(v.layer, False, out)

    def flatten(self, v: _Val, y: torch.Tensor) -> _Val:
        if v.channels_last or v.folded is not None or y.dim() != 2:
            raise _NotCovered("flatten input")
        per = math.prod(v.spatial)
        self.steps.append({"step": "reshape", "layer": v.layer, "out": [int(y.shape[1])]})
        return _Val(v.layer, True, (), folded=None if per == 1 else tuple(v.spatial))

def plan_from_spec(net: SpecNet, spec: dict) -> Plan | None:
    """The plan of a spec-built network, or None where only the tracer can tell."""
    try:
        return _SpecPlanner(net.eval(), example_input(spec)).run()
    except _NotCovered:
        return None
