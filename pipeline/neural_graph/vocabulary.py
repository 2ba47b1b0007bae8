"""The neural-graph vocabulary: node types, relations and activations, in one place.

Codes are stored (Parquet dictionaries, DGL node and edge types, node-type embeddings): append new
names, never reorder. Each activation is one record: its name, the torch module a spec or a model
uses for it, the ATen ops the tracer reads as it, its function, and the hidden-neuron symmetries it
keeps beyond permutation. Every table of activations elsewhere is read from these records: the
tracer's ATen map (plan.py), the spec builder's modules (spec.py) and planner's names
(spec_plan.py), probe forward passes (jobs.metanets.probes), the scaling symmetries (symmetry.py) and the
editor's functional forward (jobs.editing.siren).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

NODE_TYPES = ("input", "hidden", "output")
RELATIONS = ("linear", "conv", "norm", "residual", "embedding", "attn_q", "attn_k", "attn_v", "attn_o", "gate",
             "attn_bias", "attn_scale")
# Relations with one edge per destination neuron (channel c to channel c; attn_bias / attn_scale: a
# head's score bias / score scale neuron to each query neuron of that head).
DIAGONAL_RELATIONS = ("norm", "residual", "gate", "attn_bias", "attn_scale")
# Relations whose edges all weigh 1 (structure, not parameters): statistics of weights leave them out.
UNIT_RELATIONS = ("residual", "gate", "attn_bias", "attn_scale")

SCALE, SIGN = "scale", "sign"          # f(s x) = s f(x) for every s > 0; f(-x) = -f(x)


class Sine(nn.Module):
    """sin(x), the SIREN activation (the frequency w0 lives in the weights)."""

    def forward(self, x):
        return torch.sin(x)


@dataclass(frozen=True)
class Activation:
    name: str
    module: type[nn.Module]                # what a spec's ``{"type": "activation", "fn": name}`` builds
    aten: tuple[str, ...]                  # "relu": the tracer reads torch.ops.aten.relu.default as it
    fn: Callable[[torch.Tensor], torch.Tensor]
    symmetries: frozenset[str] = frozenset()
    in_specs: bool = True                  # a spec may name it (gelu_tanh is GELU(approximate="tanh"))
    seeded: bool = True                    # its metanetwork embedding row is drawn from the seed; kinds added
    #                                        later start at zero, so a seed still trains the network it did


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.gelu(x, approximate="tanh")


VOCABULARY: tuple[Activation, ...] = (
    Activation("identity", nn.Identity, (), _identity, frozenset({SCALE, SIGN})),
    Activation("relu", nn.ReLU, ("relu",), torch.relu, frozenset({SCALE})),
    Activation("gelu", nn.GELU, ("gelu",), nn.functional.gelu),
    Activation("silu", nn.SiLU, ("silu",), nn.functional.silu),
    Activation("tanh", nn.Tanh, ("tanh",), torch.tanh, frozenset({SIGN})),
    Activation("sigmoid", nn.Sigmoid, ("sigmoid",), torch.sigmoid),
    Activation("leaky_relu", nn.LeakyReLU, ("leaky_relu",), nn.functional.leaky_relu, frozenset({SCALE})),
    Activation("relu6", nn.ReLU6, (), nn.functional.relu6),          # traced as hardtanh(0, 6)
    Activation("hardswish", nn.Hardswish, ("hardswish",), nn.functional.hardswish),
    Activation("sin", Sine, ("sin",), torch.sin, frozenset({SIGN})),
    Activation("hardsigmoid", nn.Hardsigmoid, ("hardsigmoid",), nn.functional.hardsigmoid),
    Activation("gelu_tanh", nn.GELU, (), _gelu_tanh, in_specs=False),  # traced as gelu(approximate="tanh")
    # New kinds go last: a kind's position is its code in saved metanetworks' activation embeddings.
    Activation("elu", nn.ELU, ("elu",), nn.functional.elu, seeded=False),              # alpha 1 only
)
ACTIVATIONS: tuple[str, ...] = tuple(a.name for a in VOCABULARY)
SEEDED_ACTIVATIONS = sum(a.seeded for a in VOCABULARY)       # a prefix of ACTIVATIONS
BY_NAME: dict[str, Activation] = {a.name: a for a in VOCABULARY}


def aten_activations() -> dict:
    """ATen op -> activation name, for the tracer."""
    aten = torch.ops.aten
    return {getattr(aten, op).default: a.name for a in VOCABULARY for op in a.aten}


def spec_activations() -> dict[str, type[nn.Module]]:
    """Activation name -> module class, for the names a spec may use."""
    return {a.name: a.module for a in VOCABULARY if a.in_specs}
