"""The operation record every kind extends, the kind names, and the registry that maps one to the other.

An operation joins a source neuron layer to a destination neuron layer with one block of edges. Its
record is a dataclass; ``to_dict`` gives the plan JSON's dict (the bytes stored in catalogs and
hashed into the architecture signature), ``op_from_dict`` reads it back through the registry. A
record also answers ``op["key"]`` / ``op.get("key")`` like that dict, for readers outside the
conversion (alignment, merging, tests) that only look fields up.

Two families share their edge rules: ``DiagonalOp`` (channel c -> channel c, one edge per
destination neuron: norms, residual sums, gates; ``UnitOp`` when the weight is 1 and no
parameter) and ``DenseOp`` (a weight tensor read as
(out, in-per-group, kh, kw) blocks: linear, conv, embeddings).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Mapping

import numpy as np
import torch

from pipeline.neural_graph.concat import source_layers
from zoocore.errors import GraphValidationError, SpecError


def optional(default=None):
    """A field the plan JSON leaves out while it is None (it was only ever written when set)."""
    return field(default=default, metadata={"omit_none": True})


def as_numpy(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu()
        if t.dtype != torch.float32 and t.is_floating_point():
            raise SpecError(f"only float32 weights are supported, found {t.dtype}")
        return t.numpy()
    return np.asarray(t)


def frame_offset(kernel, frame: tuple[int, int]) -> tuple[int, int]:
    """Top-left offset that centres a kh x kw kernel in the Kh x Kw frame."""
    return (frame[0] - kernel[0]) // 2, (frame[1] - kernel[1]) // 2


def type_name(typ) -> str:
    """The class name of an ``nn_module_stack`` entry's type: a class when traced in this process,
    its dotted name as a string when read back from a ``.pt2`` archive."""
    return typ.__name__ if isinstance(typ, type) else str(typ).rsplit(".", 1)[-1]


def module_groups(graph, clean, match) -> dict[str, tuple[Any, list]]:
    """The call_function nodes of an fx ``graph`` grouped by module call: for each node, the first
    ``nn_module_stack`` entry whose type ``match`` maps to a value other than None; by its path
    (``clean``ed), that value and the nodes in graph order."""
    groups: dict[str, tuple[Any, list]] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        for raw, typ in (node.meta.get("nn_module_stack") or {}).values():
            value = match(typ)
            if value is not None:
                groups.setdefault(clean(raw), (value, []))[1].append(node)
                break
    return groups


def node_shape(node) -> tuple[int, ...]:
    """Shape of an fx node's (first) value."""
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = val[0]
    return tuple(int(s) for s in val.shape)


@dataclass(kw_only=True)
class Op:
    """One operation of a plan: where it reads (``src_layer``, or ``src_segments`` for a
    concatenation), where it writes (``dst_layer``), its edge relation and kernel extent, and the
    module ``path`` it was traced from. ``buffers``: fixed integer or float tables the operation
    reads (a relative-position index, a coordinate table), kept in the plan as ``{key: {"values",
    "shape", "dtype"}}`` because they are architecture; the inverse writes them back
    (``invert_buffers``). ``constants``: the same for tables that are not state-dict entries
    (non-persistent buffers), kept for the signature and never written back."""

    kind: ClassVar[str]          # as stored in the plan JSON's ``kind`` (never rename one)
    diagonal: ClassVar[bool] = False
    running_stats: ClassVar[bool] = False      # a norm whose running mean and variance are node extras (batch norm)
    relation: str
    src_layer: int
    dst_layer: int
    kernel: list[int]
    path: str = ""
    src_segments: list[list[int]] | None = optional()
    buffers: dict[str, dict[str, Any]] | None = optional()
    constants: dict[str, dict[str, Any]] | None = optional()

    # ------------------------------------------------------------------ the plan JSON's dict

    @property
    def channelwise(self) -> bool:
        """Whether channel c of the source feeds channel c of the destination only (norms, residual
        sums, gates, depthwise convolutions): the two layers share one permutation."""
        return self.diagonal
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.metadata.get("omit_none"):
                continue
            out[f.name] = value
        return out

    def __getitem__(self, key: str):
        if key == "kind":
            return self.kind
        if key in self._names() and not (getattr(self, key) is None and self._omits(key)):
            return getattr(self, key)
        raise KeyError(key)

    def __setitem__(self, key: str, value) -> None:
        if key not in self._names():
            raise KeyError(f"{self.kind} operations have no field {key!r}")
        setattr(self, key, value)

    def __contains__(self, key: str) -> bool:
        try:
            self[key]
        except KeyError:
            return False
        return True

    def get(self, key: str, default=None):
        try:
            return self[key]
        except KeyError:
            return default

    def keys(self):
        return self.to_dict().keys()

    def items(self):
        return self.to_dict().items()

    @classmethod
    def _names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @classmethod
    def _omits(cls, key: str) -> bool:
        return next(f for f in fields(cls) if f.name == key).metadata.get("omit_none", False)

    # ------------------------------------------------------------------ build (plan + state -> graph)
    def bias_values(self, state: Mapping) -> np.ndarray | None:
        """The destination neurons' biases this operation sets, if any."""
        key = getattr(self, "bias_key", None)
        return as_numpy(state[key]) if key else None

    def node_stats(self, state: Mapping, extra: np.ndarray, do: int, c: int) -> None:
        """Write per-neuron statistics (``extra``'s two columns) of the destination neurons."""

    def expected_edges(self, sizes) -> int:
        raise NotImplementedError

    def edges(self, inputs: np.ndarray, state: Mapping, do: int, c: int, frame: tuple[int, int], i: int):
        """(src, dst, weight (E, Kh*Kw)) of this operation; ``inputs``: its input channels' nodes."""
        raise NotImplementedError

    # ------------------------------------------------------------------ inverse (graph -> state dict)
    def invert(self, out: dict, w: np.ndarray, dst: np.ndarray, c: int, *, graph, e: np.ndarray, do: int,
               inputs, local: np.ndarray, frame: tuple[int, int], i: int) -> None:
        """Write this operation's tensors into ``out`` from its edges: ``w`` (E, Kh, Kw) weights,
        ``dst`` destination index within the layer of ``c`` neurons."""
        raise NotImplementedError

    def invert_bias(self, out: dict, b: torch.Tensor) -> None:
        key = getattr(self, "bias_key", None)
        if key:
            out[key] = b

    def invert_buffers(self, out: dict) -> None:
        """Write back the state-dict tables kept in the plan (``buffers``), bit for bit."""
        for key, buf in (self.buffers or {}).items():
            out[key] = torch.tensor(buf["values"], dtype=getattr(torch, buf["dtype"])).reshape(buf["shape"])

    # ------------------------------------------------------------------ symmetries
    def permutation_ties(self, sizes) -> tuple[list[tuple[int, int]], set[int]]:
        """Neuron layers that must take one permutation (pairs) and layers that cannot move."""
        return [], set()

    def scaling_ties(self) -> tuple[list[tuple[int, int]], set[int]]:
        """Layers that must share one factor per neuron (pairs) and layers that take no factor."""
        return [], set()

    def rescale(self, i: int, s: np.ndarray, src: np.ndarray, dst: np.ndarray, e: np.ndarray,
                weight: np.ndarray, extra: np.ndarray) -> None:
        """Apply per-neuron factors ``s`` to this operation's edges (and statistics), in place."""
        weight[e] *= (s[dst] / s[src])[:, None]

    def incoming(self, w: np.ndarray, dst: np.ndarray, extra: np.ndarray):
        """Per edge, (squared, plain) effective incoming coefficients of its destination, or None
        when the operation carries no weight of the network."""
        return (w ** 2).sum(1), w.sum(1)

    # ------------------------------------------------------------------ summary
    def describe(self, sizes) -> str:
        """Short text for the architecture summary (without the activation)."""
        return f"{self.kind}({sizes[self.dst_layer]})"


@dataclass(kw_only=True)
class DiagonalOp(Op):
    """Channel c -> channel c: one edge per destination neuron, weight 1 or a per-channel parameter."""

    diagonal: ClassVar[bool] = True

    def expected_edges(self, sizes) -> int:
        return int(sizes[self.dst_layer])

    def diagonal_weight(self, state: Mapping, c: int) -> np.ndarray:
        key = getattr(self, "weight_key", None)
        return np.ones(c, np.float32) if key is None else as_numpy(state[key]).reshape(c)

    def edges(self, inputs, state, do, c, frame, i):
        if inputs.shape[0] != c:
            raise SpecError(f"op {i} ({self.kind}) joins {inputs.shape[0]} neurons to {c}")
        top, left = frame_offset(self.kernel, frame)
        src, dst = inputs, do + np.arange(c)
        vals = self.diagonal_weight(state, c)
        w = np.zeros((c,) + tuple(frame), np.float32)
        w[:, top, left] = vals
        return src, dst, w.reshape(c, frame[0] * frame[1])

    def invert(self, out, w, dst, c, *, graph, e, do, inputs, local, frame, i):
        pass                                   # weight 1: nothing to write back

    def permutation_ties(self, sizes):
        if self.src_segments is not None:
            return [], set(source_layers(self) + [self.dst_layer])
        return [(self.src_layer, self.dst_layer)], set()


@dataclass(kw_only=True)
class UnitOp(DiagonalOp):
    """Diagonal edges of weight 1 that carry no parameter of the network (residual sums, gates, a
    head's score term into its queries): no incoming coefficient, and a summary naming the sources."""

    def incoming(self, w, dst, extra):
        return None

    def describe(self, sizes) -> str:
        return f"{self.kind}({'+'.join(str(s) for s in source_layers(self))}->{self.dst_layer})"


@dataclass(kw_only=True)
class DenseOp(Op):
    """A weight tensor read as (out, in-per-group, kh, kw) blocks, one edge per block entry."""

    weight_key: str
    bias_key: str | None = None
    weight_shape: list[int]

    @property
    def n_groups(self) -> int:
        return 1

    def raw_weight(self, state: Mapping) -> np.ndarray:
        return as_numpy(state[self.weight_key])

    def weight_blocks(self, w: np.ndarray, src_size: int) -> np.ndarray:
        """The raw weight as (Cout, Cin_per_group, kh, kw)."""
        kh, kw = self.kernel
        return w.reshape(w.shape[0], w.shape[1], kh, kw)

    def weight_from_blocks(self, blocks: np.ndarray, c: int, cin: int) -> np.ndarray:
        """Inverse of ``weight_blocks``."""
        return blocks.reshape(self.weight_shape)

    def store_weight(self, out: dict, weight: np.ndarray) -> None:
        out[self.weight_key] = torch.from_numpy(np.ascontiguousarray(weight))

    def expected_edges(self, sizes) -> int:
        return int(np.prod(self.weight_shape)) // (self.kernel[0] * self.kernel[1])

    def edges(self, inputs, state, do, c, frame, i):
        blocks = self.weight_blocks(self.raw_weight(state), int(inputs.shape[0]))
        groups = self.n_groups
        kh, kw = self.kernel
        top, left = frame_offset(self.kernel, frame)
        cout, cin_g = blocks.shape[:2]
        o = np.arange(cout)[:, None]
        j = np.arange(cin_g)[None, :]
        src = inputs[((o // (cout // groups)) * cin_g + j).reshape(-1)]
        dst = np.broadcast_to(do + o, (cout, cin_g)).reshape(-1)
        w = np.zeros((cout, cin_g) + tuple(frame), np.float32)
        w[:, :, top:top + kh, left:left + kw] = blocks
        return src, dst, w.reshape(cout * cin_g, frame[0] * frame[1])

    def invert(self, out, w, dst, c, *, graph, e, do, inputs, local, frame, i):
        kh, kw = self.kernel
        top, left = frame_offset(self.kernel, frame)
        local[inputs] = np.arange(inputs.shape[0])
        src = local[graph.src[e]]
        local[inputs] = -1
        if e.shape[0] and src.min() < 0:
            raise GraphValidationError(f"op {i} ({self.kind}) has an edge from a neuron it does not read")
        cin = int(inputs.shape[0])
        groups = self.n_groups
        cin_g = cin // groups
        if e.shape[0] != c * cin_g:
            raise GraphValidationError(f"op {i} ({self.kind}) has {e.shape[0]} edges, expected {c * cin_g}")
        blocks = np.zeros((c, cin_g, kh, kw), np.float32)
        blocks[dst, src - (dst // (c // groups)) * cin_g] = w[:, top:top + kh, left:left + kw]
        self.store_weight(out, self.weight_from_blocks(blocks, c, cin))


@dataclass(kw_only=True)
class ChannelParams(DiagonalOp):
    """A diagonal operation whose edge weights are a per-channel parameter (gamma, a layer scale)."""

    weight_key: str | None = None
    bias_key: str | None = None
    param_shape: list[int] | None = optional()

    def invert(self, out, w, dst, c, *, graph, e, do, inputs, local, frame, i):
        if self.relation == "norm" and self.weight_key:
            top, left = frame_offset(self.kernel, frame)
            gamma = np.zeros(c, np.float32)
            gamma[dst] = w[:, top, left]
            out[self.weight_key] = torch.from_numpy(gamma.reshape(self.param_shape or [c]))


# --------------------------------------------------------------------------- the registry
REGISTRY: dict[str, type[Op]] = {}
TRACE_HANDLERS: dict[Any, str] = {}          # ATen op -> tracer method name
TRACER_MIXINS: list[type] = []
SPEC_HANDLERS: list[tuple[tuple[type, ...], str]] = []   # module classes -> spec planner method name
SPEC_MIXINS: list[type] = []
# JSON spec layer type -> builder(layer dict, example input, where) -> nn.Module (pipeline.spec.build_module)
SPEC_LAYERS: dict[str, Any] = {}
# nn.Module class name -> tracer method name: every ATen node inside such a module (torch.export writes
# nn.Upsample out as index arithmetic) is read as one call at the module's last node
MODULE_HANDLERS: dict[str, str] = {}


def register(*records: type[Op], tracer: type | None = None, aten: Mapping[Any, str] | None = None,
             spec: type | None = None, modules: Mapping[tuple[type, ...], str] | None = None,
             traced_modules: Mapping[str, str] | None = None, spec_layers: Mapping[str, Any] | None = None) -> None:
    """Register operation records under their kinds, with the tracer mixin (and the ATen ops its
    methods read, or the module classes, by name, whose ATen nodes it reads as one:
    ``traced_modules``), the spec-planner mixin (and the module classes its methods read) and the
    builders of the JSON spec layer types that make the kind's modules (``spec_layers``)."""
    for rec in records:
        if rec.kind in REGISTRY:
            raise ValueError(f"operation kind {rec.kind!r} is registered twice")
        REGISTRY[rec.kind] = rec
    if tracer is not None:
        TRACER_MIXINS.append(tracer)
    TRACE_HANDLERS.update(aten or {})
    MODULE_HANDLERS.update(traced_modules or {})
    if spec is not None:
        SPEC_MIXINS.append(spec)
    SPEC_HANDLERS.extend((modules or {}).items())
    for name, build in (spec_layers or {}).items():
        if name in SPEC_LAYERS:
            raise ValueError(f"spec layer type {name!r} is registered twice")
        SPEC_LAYERS[name] = build



def record_class(kind: str) -> type[Op]:
    try:
        return REGISTRY[kind]
    except KeyError:
        raise SpecError(f"unknown operation kind {kind!r}; known: {sorted(REGISTRY)}") from None


def make_op(kind: str, **fields_) -> Op:
    """A typed operation record from the kind name and its fields."""
    cls = record_class(kind)
    unknown = set(fields_) - cls._names()
    if unknown:
        raise SpecError(f"{kind} operation with unknown fields {sorted(unknown)}")
    return cls(**fields_)


def op_from_dict(d: Mapping[str, Any]) -> Op:
    """Read one operation of a stored plan's JSON."""
    d = dict(d)
    return make_op(d.pop("kind"), **d)
