"""A spec is checked against its checkpoint before anything is built from it.

A spec is a few hundred bytes that can declare any size (``out_features: 100000000``); the
checkpoint's tensors are what is really there. So the spec's network is first built on PyTorch's
``meta`` device, which records shapes and allocates nothing, and its parameter and buffer shapes
are compared with the shapes the checkpoint declares (read from the file's header or index,
without loading the data). Only a spec that agrees with the file, and whose activations for one
sample stay within ``MAX_ACTIVATION`` elements, is ever built for real.
"""
from __future__ import annotations

import math
import re
from typing import Mapping, Sequence

import torch

from pipeline.spec import build_module, spec_hash
from zoocore.errors import SpecError

MAX_ACTIVATION = 2 ** 26             # elements of one sample's largest activation (256 MB of float32)
_CACHE: dict[str, "SpecShapes"] = {}
_CACHE_SIZE = 256


class SpecShapes:
    """The parameter and buffer shapes a spec declares, and its largest activation for one sample."""

    def __init__(self, params: dict[str, tuple[int, ...]], buffers: dict[str, tuple[int, ...]],
                 largest_activation: tuple[str, tuple[int, ...]]):
        self.params, self.buffers, self.largest_activation = params, buffers, largest_activation

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.params.values())


def spec_shapes(spec: dict) -> SpecShapes:
    """Shapes of the spec's network, computed on the meta device (nothing allocated)."""
    key = spec_hash(spec)
    if key in _CACHE:
        return _CACHE[key]
    largest: list = ["input", (0,)]

    def hook(module, _inputs, output):
        if isinstance(output, torch.Tensor) and output[0].numel() > math.prod(largest[1]):
            largest[:] = [getattr(module, "_spec_path", "?"), tuple(output.shape[1:])]

    try:
        with torch.device("meta"):
            net = build_module(spec)
            for name, mod in net.named_modules():
                mod._spec_path = name
                mod.register_forward_hook(hook)
            from pipeline.spec import example_input

            x = example_input(spec, 1)
            if x.numel() > MAX_ACTIVATION:
                largest[:] = ["input", tuple(x.shape[1:])]
            else:
                with torch.no_grad():
                    net(x)
    except NotImplementedError as exc:       # an operation without a meta kernel: no bound can be given
        raise SpecError(f"cannot check this spec's shapes before building it: {str(exc).splitlines()[0]}") from exc
    except RuntimeError as exc:              # e.g. a negative size
        raise SpecError(f"invalid spec: {str(exc).splitlines()[0]}") from exc
    shapes = SpecShapes({k: tuple(p.shape) for k, p in net.named_parameters()},
                        {k: tuple(b.shape) for k, b in net.named_buffers()},
                        (largest[0], tuple(largest[1])))
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = shapes
    return shapes


def layer_of(key: str, spec: dict | None = None) -> str:
    """``layers.3.body.1.weight`` -> ``layers[3].body[1] (linear)``: the spec layer a state key belongs to."""
    path = key.rsplit(".", 1)[0]
    text = re.sub(r"\.(\d+)", r"[\1]", path)
    node = spec
    try:
        for part in path.split("."):
            node = node[int(part)] if part.isdigit() else node[part]
        kind = node.get("type") if isinstance(node, dict) else None
    except (KeyError, IndexError, TypeError, ValueError):
        kind = None
    return f"{text} ({kind})" if kind else text


def check_spec_shapes(spec: dict, shapes: Mapping[str, Sequence[int]], source: str) -> SpecShapes:
    """Refuse ``spec`` unless every parameter and buffer it declares has the shape the
    checkpoint ``source`` holds for it (``shapes``), before any of it is allocated."""
    declared = spec_shapes(spec)
    file_params = 0
    for key, shape in {**declared.params, **declared.buffers}.items():
        held = shapes.get(key)
        if held is None:
            if key in declared.params:
                raise SpecError(f"{source}: the spec's {layer_of(key, spec)} declares {key} of shape {list(shape)}, "
                                "which the checkpoint does not have")
            continue
        if tuple(held) != tuple(shape):
            raise SpecError(f"{source}: the spec's {layer_of(key, spec)} declares {key} of shape {list(shape)}, "
                            f"the checkpoint holds {list(held)}")
        if key in declared.params:
            file_params += math.prod(held)
    if file_params != declared.num_params:      # cannot happen when every shape agrees; a last guard
        raise SpecError(f"{source}: the spec declares {declared.num_params:,} parameters, the checkpoint holds "
                        f"{file_params:,}")
    name, act = declared.largest_activation
    if math.prod(act) > MAX_ACTIVATION:
        where = "input" if name == "input" else layer_of(name + ".output", spec)
        raise SpecError(f"{source}: the spec's {where} has an activation of shape {list(act)} for one sample "
                        f"({math.prod(act):,} elements; the limit is {MAX_ACTIVATION:,})")
    return declared
