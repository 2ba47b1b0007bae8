"""Trace a network once into a *plan*: its neuron layers and the operations between them.

Each operation kind reads itself from the trace (``pipeline.neural_graph.ops``: the tracer is
built from the kinds' registered mixins and dispatches on the ATen op); this module walks the
graph and keeps what is not an operation: inputs, activations, pooling and reshape steps.

The plan is architecture only (no weight values): which state-dict entry feeds which block of
edges, with shapes and hyper-parameters. Every checkpoint of one architecture shares one plan, so
converting a zoo traces each architecture once and then only does tensor work per checkpoint.

Tracing goes through ``torch.export`` (a torch.fx graph of ATen operations with shapes), so
residual adds, pooling, flatten and activations are read from the code, never guessed.
"""
from __future__ import annotations

import hashlib
import json
import math
import operator
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import torch

from pipeline.neural_graph.attention_core import AttentionCoreOps, attention_cores
from pipeline.neural_graph.composite import CompositeOps, composite_activations
from pipeline.neural_graph.concat import SPLIT_OPS, ConcatOps, layer_map, source_of, whole_layer
from pipeline.neural_graph.layout import PAD_OPS, PERMUTE_OPS, RESTRIDE_OPS, ROLL_OPS, SLICE_OPS, LayoutOps
from pipeline.neural_graph.ops import MODULE_HANDLERS, TRACE_HANDLERS, TRACER_MIXINS, Op, make_op, op_from_dict
from pipeline.neural_graph.ops.base import module_groups, type_name
from pipeline.neural_graph.ops.attention import attention_blocks
from pipeline.neural_graph.ops.base import node_shape
from pipeline.neural_graph.vocabulary import aten_activations
from zoocore.errors import UnsupportedModuleError

aten = torch.ops.aten
_getitem = operator.getitem

_ACTIVATION_OPS = aten_activations()     # relu6 (hardtanh 0..6) and gelu_tanh are told apart below
_PASSTHROUGH_OPS = {aten.clone.default, aten.alias.default, aten.detach.default, aten.dropout.default,
                    aten.contiguous.default, aten.lift_fresh_copy.default}
_POOL_OPS = {aten.max_pool2d_with_indices.default: "max_pool", aten.avg_pool2d.default: "avg_pool",
             aten._adaptive_avg_pool2d.default: "adaptive_avg_pool", aten.adaptive_max_pool2d.default: "adaptive_max_pool",
             aten.max_pool1d.default: "max_pool", aten.avg_pool1d.default: "avg_pool", aten.mean.dim: "mean_pool",
             aten.adaptive_avg_pool1d.default: "adaptive_avg_pool", aten.max_pool2d.default: "max_pool"}
_RESHAPE_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
                aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default}


# ATen op -> the tracer method reading it, for the steps between operations (the operation kinds
# register their own: ops.TRACE_HANDLERS); a step's handler wins where both name an op
STEP_HANDLERS: dict = {
    **dict.fromkeys([*_ACTIVATION_OPS, aten.hardtanh.default], "activation"), **dict.fromkeys(_POOL_OPS, "pool"),
    **dict.fromkeys(_RESHAPE_OPS, "reshape"), aten.cat.default: "cat", **dict.fromkeys(SPLIT_OPS, "split"),
    aten.transpose.int: "transpose", **dict.fromkeys(PERMUTE_OPS, "permute"),
    **dict.fromkeys(RESTRIDE_OPS, "restride"), **dict.fromkeys(SLICE_OPS, "slice"), **dict.fromkeys(PAD_OPS, "pad"),
    **dict.fromkeys(ROLL_OPS, "roll")}


@dataclass
class NeuronLayer:
    size: int
    kind: str            # input | linear | conv | norm | add | embedding
    activation: str = "identity"


@dataclass
class Plan:
    """Neuron layers, operations and non-parametric steps of one architecture."""

    layers: list[NeuronLayer]
    ops: list[Op]
    steps: list[dict[str, Any]]          # every traced step in order (pools, flattens included)
    output_layer: int
    kernel_shape: tuple[int, int]
    state_keys: list[str]
    buffer_keys: list[str]
    input_shape: list[int]
    input_dtype: str = "float32"
    signature: str = field(default="")

    def to_dict(self) -> dict[str, Any]:
        """The stored form: operations as their kinds' dicts (``Op.to_dict``)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["layers"] = [asdict(x) for x in self.layers]
        d["ops"] = [op.to_dict() for op in self.ops]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        d["layers"] = [NeuronLayer(**x) for x in d["layers"]]
        d["ops"] = [op_from_dict(x) for x in d["ops"]]
        d["kernel_shape"] = tuple(d["kernel_shape"])
        return cls(**d)


@dataclass
class _Val:
    """What an fx value is, in neuron terms."""

    layer: int | None            # neuron layer whose neurons index this tensor's neuron axis (None: see nmap)
    channels_last: bool          # neuron axis last (vectors, tokens) or dim 1 (feature maps)
    spatial: tuple[int, ...]     # per-neuron extent: (H, W) maps, (L,) 1d maps, () vectors
    folded: tuple[int, ...] | None = None   # tensor is flatten(neurons x folded) into features
    tokens: bool = False         # integer token ids (before an embedding)
    nmap: Any = None             # (..., 2) (layer, position) per neuron index when not one whole layer


def _clean_path(path) -> str:
    path = re.sub(r"^L\['[^']*'\]\.?", "", str(path))
    path = re.sub(r"getattr\((.*?), '([^']*)'\)", r"\1.\2", path)
    return re.sub(r"\[(\d+)\]", r".\1", path).strip(".")


def _module_path(node) -> tuple[str, str]:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", "<function>"
    path, typ = list(stack.values())[-1]
    path = _clean_path(path)
    name = typ.__module__ + "." + typ.__qualname__ if isinstance(typ, type) else str(typ)
    return path, name


def _unsupported(node, what: str, detail: str = "") -> UnsupportedModuleError:
    path, typ = _module_path(node)
    target = getattr(node.target, "__name__", str(node.target))
    return UnsupportedModuleError(path, f"{typ} (operation {target})" if typ != "<function>" else f"operation {target}",
                                  f"{what}: {detail}" if detail else what)


def _feeds_convolution(node) -> bool:
    """Whether a value reaches a convolution through shape-preserving ops only."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        for user in n.users:
            if user.name in seen:
                continue
            seen.add(user.name)
            if user.target is aten.convolution.default:
                return True
            if user.target in _PASSTHROUGH_OPS:
                todo.append(user)
    return False


_shape = node_shape


CONST = "const"          # a value computed from constants only (masks, position ids): no neurons


class _Tracer(*TRACER_MIXINS, ConcatOps, LayoutOps, AttentionCoreOps, CompositeOps):
    Val = _Val
    CONST = CONST

    def __init__(self, exported, constant_keys: frozenset = frozenset()):
        self.ep = exported
        sig = exported.graph_signature
        self.param_of: dict[str, str] = {}
        for spec in sig.input_specs:
            if spec.kind.name in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR") and spec.target is not None:
                self.param_of[spec.arg.name] = spec.target
        self.user_inputs = [s.arg.name for s in sig.input_specs if s.kind.name == "USER_INPUT"]
        self.state = exported.state_dict
        self.layers: list[NeuronLayer] = []
        self.ops: list[Op] = []
        self.steps: list[dict[str, Any]] = []
        self.vals: dict[str, Any] = {}
        self.used_keys: set[str] = set()
        self.blocks = attention_blocks(exported.graph, _clean_path)
        self.cores = attention_cores(exported.graph, _clean_path)
        self.composites = composite_activations(exported.graph, _clean_path)
        self.module_calls = {n.name: (handler, nodes) for handler, nodes in module_groups(
            exported.graph, _clean_path, lambda typ: MODULE_HANDLERS.get(type_name(typ))).values()
            for n in nodes}
        self.done_blocks: set[str] = set()
        self.constant_keys = set(constant_keys)     # non-persistent buffers: constants, not state

    # -------------------------------------------------------------- helpers
    def new_layer(self, size: int, kind: str) -> int:
        self.layers.append(NeuronLayer(size=int(size), kind=kind))
        return len(self.layers) - 1

    def key(self, arg) -> str | None:
        if arg is None:
            return None
        if not isinstance(arg, torch.fx.Node) or arg.name not in self.param_of:
            return None
        k = self.param_of[arg.name]
        self.used_keys.add(k)
        return k

    def val(self, node, arg) -> _Val:
        if not isinstance(arg, torch.fx.Node) or arg.name not in self.vals:
            raise _unsupported(node, "input that is not a neuron tensor",
                               f"argument {arg!r} is a constant or parameter used as data")
        v = self.vals[arg.name]
        if not isinstance(v, _Val):
            raise _unsupported(node, "input that is not a neuron tensor")
        return v

    def is_constant(self, node) -> bool:
        """Whether a node reads only constants (or nothing): arange, ones, masks, position ids."""
        for a in node.all_input_nodes:
            if self.vals.get(a.name) == CONST or self.param_of.get(a.name) in self.constant_keys:
                continue
            if a.op == "placeholder" and a.name in self.param_of and self.param_of[a.name] not in self.state:
                continue                        # lifted tensor constant
            return False
        return True

    def unsupported(self, node, what: str, detail: str = "") -> UnsupportedModuleError:
        return _unsupported(node, what, detail)

    def axes(self, v: _Val) -> int:
        """Number of neuron axes of a value (2 while a channel shuffle is in flight)."""
        return 1 if v.nmap is None else v.nmap.ndim - 1

    def width(self, v: _Val) -> int:
        """Number of neurons along a value's neuron axis."""
        return self.layers[v.layer].size if v.nmap is None else int(math.prod(v.nmap.shape[:-1]))

    def neuron_map(self, v: _Val) -> np.ndarray:
        return layer_map(v.layer, self.layers[v.layer].size) if v.nmap is None else v.nmap

    def from_map(self, nmap: np.ndarray, like: _Val) -> _Val:
        """A value of ``like``'s layout whose neurons are ``nmap`` (a plain layer value when it is one)."""
        layer = whole_layer(nmap, [x.size for x in self.layers]) if nmap.ndim == 2 else None
        return _Val(layer, like.channels_last, like.spatial, like.folded, nmap=None if layer is not None else nmap)

    def source(self, node, v: _Val) -> dict[str, Any]:
        """``src_layer`` (and ``src_segments`` for a concatenation) of an op reading ``v``."""
        if self.axes(v) != 1:
            raise _unsupported(node, "operation on channels regrouped by a view")
        if v.nmap is None:
            return {"src_layer": v.layer}
        return source_of(v.nmap, [x.size for x in self.layers])

    def layers_of(self, v: _Val) -> list[int]:
        return [v.layer] if v.nmap is None else sorted(set(v.nmap.reshape(-1, 2)[:, 0].tolist()))

    def add_op(self, node, **op) -> None:
        path, _ = _module_path(node)
        op.setdefault("path", path)
        rec = make_op(**op)
        self.ops.append(rec)
        self.steps.append({"step": rec.kind, "op": len(self.ops) - 1, "dst_layer": rec.dst_layer})

    # -------------------------------------------------------------- handlers
    def run(self) -> Plan:
        graph = self.ep.graph
        for node in graph.nodes:
            if node.op == "placeholder":
                if node.name in self.user_inputs:
                    self.placeholder(node)
                continue
            if node.op == "output":
                out = node.args[0]
                out = out[0] if isinstance(out, (tuple, list)) else out
                if len([a for a in node.args[0] if a is not None]) != 1:
                    raise _unsupported(node, "several outputs", "a neural graph has one output layer")
                v = self.val(node, out)
                return self.finish(v)
            if node.op != "call_function":
                raise _unsupported(node, f"graph node of kind {node.op}")
            self.call(node)
        raise _unsupported(None, "graph without output")  # pragma: no cover

    def placeholder(self, node) -> None:
        if len(self.user_inputs) != 1:
            raise UnsupportedModuleError("", f"{len(self.user_inputs)} inputs", "one input tensor is supported")
        val = node.meta["val"]
        shape = tuple(int(s) for s in val.shape)
        self.input_shape = list(shape[1:])
        self.input_dtype = str(val.dtype).replace("torch.", "")
        if not val.dtype.is_floating_point:
            self.vals[node.name] = _Val(layer=None, channels_last=True, spatial=tuple(shape[1:]), tokens=True)
            return
        if len(shape) == 2:
            self.vals[node.name] = _Val(self.new_layer(shape[1], "input"), True, ())
        elif len(shape) == 3 and not _feeds_convolution(node):      # (N, T, F): tokens, features last
            self.vals[node.name] = _Val(self.new_layer(shape[2], "input"), True, (shape[1],))
        elif len(shape) in (3, 4):
            self.vals[node.name] = _Val(self.new_layer(shape[1], "input"), False, tuple(shape[2:]))
        else:
            raise UnsupportedModuleError("", f"input of shape {shape}", "expected (N, F), (N, C, L) or (N, C, H, W)")

    def call(self, node) -> None:
        t = node.target
        block = self.blocks.get(node.name)
        if block is not None:
            if block.path not in self.done_blocks:
                self.done_blocks.add(block.path)
                self.attention_block(node, block)
            return
        core = self.cores.get(node.name)
        if core is not None:
            if node is core.nodes[-1]:          # read at its last node: every input is known by then
                self.attention_core(node, core)
            return
        comp = self.composites.get(node.name)
        if comp is not None:
            if node is comp.nodes[-1]:
                self.composite_activation(node, comp)
            return
        call = self.module_calls.get(node.name)
        if call is not None:
            if node is call[1][-1]:            # read at its last node: every input is known by then
                getattr(self, call[0])(node, call[1])
            return
        if self.is_constant(node):
            self.vals[node.name] = CONST
            return
        if t is _getitem:
            src = self.vals.get(node.args[0].name)
            if isinstance(src, tuple):
                i = node.args[1]
                if i < len(src) and src[i] is not None:
                    self.vals[node.name] = src[i]
                return
            raise _unsupported(node, "indexing into a tensor")
        if t in _PASSTHROUGH_OPS:
            v = self.val(node, node.args[0])
            self.vals[node.name] = v
            return
        if t is aten.t.default and isinstance(node.args[0], torch.fx.Node) and node.args[0].name in self.param_of:
            self.vals[node.name] = ("param_t", node.args[0])
            return
        handler = STEP_HANDLERS.get(t) or TRACE_HANDLERS.get(t)
        if handler is not None:
            return getattr(self, handler)(node)
        raise _unsupported(node, "not covered by the neural-graph converter")

    def activation(self, node) -> None:
        x = node.args[0]
        if node.target is aten.hardtanh.default:
            lo, hi = (list(node.args[1:]) + [-1.0, 1.0])[:2]
            if (lo, hi) != (0.0, 6.0):
                raise _unsupported(node, "hardtanh other than relu6")
            name = "relu6"
        else:
            name = _ACTIVATION_OPS[node.target]
            if name == "leaky_relu" and len(node.args) > 1 and float(node.args[1]) != 0.01:
                raise _unsupported(node, "leaky_relu with a slope other than 0.01")
            if name == "elu" and [float(a) for a in node.args[1:4]] not in ([], [1.0], [1.0, 1.0], [1.0, 1.0, 1.0]):
                raise _unsupported(node, "elu with an alpha or scale other than 1")
            if name == "gelu" and node.kwargs.get("approximate", "none") == "tanh":
                name = "gelu_tanh"
        self.apply_activation(node, x, name, node)

    def apply_activation(self, node, x, name: str, result, inside: set | None = None) -> None:
        """Give the layer of value ``x`` the activation ``name``; ``result`` is the activated
        node. ``inside``: node names of a composite activation (their reads of ``x`` are its own)."""
        v = self.val(node, x)
        readers = [u for u in x.users if u.name not in (inside or ())]
        if v.layer is None:
            raise _unsupported(node, f"{name} on concatenated neurons",
                               "activations must follow a layer whose outputs are used only by the activation")
        layer = self.layers[v.layer]
        if v.layer == 0 or layer.activation != "identity" or len(readers) > (0 if inside else 1) \
                or v.folded is not None:
            raise _unsupported(node, f"{name} where the graph cannot hold it",
                               "activations must follow a layer whose outputs are used only by the activation")
        layer.activation = name
        self.steps.append({"step": "activation", "fn": name, "layer": v.layer})
        self.vals[result.name] = v

    def pool(self, node) -> None:
        v = self.val(node, node.args[0])
        if v.channels_last or v.folded is not None:
            raise _unsupported(node, "pooling over neurons", "pooling must act on feature maps")
        out = _shape(node)
        spatial = out[2:] if len(out) > 2 else ()
        if node.target is aten.mean.dim and len(out) == 2:
            new = _Val(v.layer, True, (), nmap=v.nmap)
        else:
            new = _Val(v.layer, False, tuple(spatial), nmap=v.nmap)
        for layer in self.layers_of(v):
            self.steps.append({"step": _POOL_OPS[node.target], "layer": layer, "out": list(spatial)})
        self.vals[node.name] = (new, None) if node.target in (aten.max_pool2d_with_indices.default,
                                                               aten.adaptive_max_pool2d.default) else new

    def reshape(self, node) -> None:
        v = self.val(node, node.args[0])
        out = _shape(node)
        if v.tokens:
            self.vals[node.name] = _Val(None, True, tuple(out[1:]), tokens=True)
            return
        if self.group_view(node, v, out):
            return
        if self.axes(v) != 1:
            raise _unsupported(node, "reshape that mixes neurons", f"to {list(out)}")
        size = self.width(v)
        if not v.channels_last and v.folded is None:
            per = math.prod(v.spatial)
            if len(out) == 2 and out[1] == size * per:
                new = _Val(v.layer, True, (), folded=None if per == 1 else tuple(v.spatial), nmap=v.nmap)
            elif len(out) >= 2 and out[1] == size and math.prod(out[2:]) == per:
                new = _Val(v.layer, len(out) == 2, tuple(out[2:]), nmap=v.nmap)
            else:
                raise _unsupported(node, "reshape that mixes neurons", f"to {list(out)}")
        elif v.channels_last and out and out[-1] == size and v.folded is None:
            new = _Val(v.layer, True, tuple(out[1:-1]), nmap=v.nmap)
        elif v.folded is not None and len(out) == 2 and out[1] == size * math.prod(v.folded):
            new = v
        else:
            raise _unsupported(node, "reshape that mixes neurons", f"to {list(out)}")
        self.steps.append({"step": "reshape", "layer": self.layers_of(v)[0], "out": list(out[1:])})
        self.vals[node.name] = new

    def finish(self, v: _Val) -> Plan:
        if v.layer in (None, 0) or v.folded is not None or v.nmap is not None:
            raise UnsupportedModuleError("", "a network whose output is not a neuron layer")
        kh = max(op["kernel"][0] for op in self.ops)
        kw = max(op["kernel"][1] for op in self.ops)
        state_keys = [k for k in self.state.keys() if k not in self.constant_keys]
        unused = [k for k in state_keys if k not in self.used_keys]
        if unused:
            raise UnsupportedModuleError(unused[0].rsplit(".", 1)[0], "parameters the traced graph never reads",
                                         f"unused: {unused[:4]}")
        plan = Plan(layers=self.layers, ops=self.ops, steps=self.steps, output_layer=v.layer,
                    kernel_shape=(kh, kw), state_keys=state_keys,
                    buffer_keys=[op["nbt_key"] for op in self.ops if op.get("nbt_key")],
                    input_shape=self.input_shape, input_dtype=self.input_dtype)
        plan.signature = architecture_signature(plan)
        return plan


def architecture_signature(plan: Plan) -> str:
    """A structural hash: layer kinds, sizes, activations, operation shapes and wiring, and
    non-parametric steps; parameter names are left out (two spellings of one network agree)."""
    drop = {"path", "weight_key", "bias_key", "mean_key", "var_key", "nbt_key"}
    ops = [{k: v for k, v in op.to_dict().items() if k not in drop} | {"has_bias": op.get("bias_key") is not None}
           for op in plan.ops]
    body = {"layers": [asdict(x) for x in plan.layers], "ops": ops, "steps": plan.steps,
            "output": plan.output_layer, "input": plan.input_shape}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def plan_from_exported(exported, constant_keys=frozenset()) -> Plan:
    """Trace a ``torch.export.ExportedProgram`` into a Plan (raises UnsupportedModuleError).
    ``constant_keys``: buffers that are not part of the state dict (non-persistent ones)."""
    return _Tracer(exported, frozenset(constant_keys)).run()


def export_module(model: torch.nn.Module, example_input: torch.Tensor):
    """``torch.export`` a module in eval mode with one example input (batch of 2 to keep dims symbolic-free)."""
    model = model.eval()
    with torch.no_grad():
        return torch.export.export(model, (example_input,))


def plan_from_module(model: torch.nn.Module, example_input: torch.Tensor) -> Plan:
    """Trace an in-memory module: export it, then read the plan from the ATen graph."""
    return exported_plan(model, example_input)[0]


def exported_plan(model: torch.nn.Module, example_input: torch.Tensor):
    """(plan, ExportedProgram) of an in-memory module (the program to keep beside the plan)."""
    try:
        exported = export_module(model, example_input)
    except UnsupportedModuleError:
        raise
    except Exception as exc:  # torch.export failures: data-dependent control flow, etc.
        raise UnsupportedModuleError(type(model).__name__, "a module torch.export cannot trace",
                                     str(exc).splitlines()[0][:200]) from exc
    return plan_from_exported(exported, set(exported.state_dict) - set(model.state_dict())), exported


def traced_values(exported, constant_keys=frozenset()) -> list[tuple[str, _Val]]:
    """(graph node name, what its value is in neuron terms) for every node holding neurons, in
    graph order: how ``runnable.layer_nodes`` finds each layer's value inside the graph."""
    tracer = _Tracer(exported, frozenset(constant_keys))
    tracer.run()
    return [(node.name, tracer.vals[node.name]) for node in exported.graph.nodes
            if isinstance(tracer.vals.get(node.name), _Val)]
