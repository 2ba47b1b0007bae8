"""Trace a network once into a *plan*: its neuron layers and the operations between them.

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
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from pipeline.neural_graph.attention_core import AttentionCoreOps, attention_cores
from pipeline.neural_graph.composite import CompositeOps, composite_activations
from pipeline.neural_graph.concat import SPLIT_OPS, ConcatOps, layer_map, source_of, whole_layer
from pipeline.neural_graph.gate import GateOps
from pipeline.neural_graph.layout import PAD_OPS, PERMUTE_OPS, RESTRIDE_OPS, ROLL_OPS, SLICE_OPS, LayoutOps
from pipeline.neural_graph.tokens import EXPAND_OPS, SELECT_OPS, TokenOps
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


@dataclass
class NeuronLayer:
    size: int
    kind: str            # input | linear | conv | norm | add | embedding
    activation: str = "identity"


@dataclass
class Plan:
    """Neuron layers, operations and non-parametric steps of one architecture."""

    layers: list[NeuronLayer]
    ops: list[dict[str, Any]]
    steps: list[dict[str, Any]]          # every traced step in order (pools, flattens included)
    output_layer: int
    kernel_shape: tuple[int, int]
    state_keys: list[str]
    buffer_keys: list[str]
    input_shape: list[int]
    input_dtype: str = "float32"
    signature: str = field(default="")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        d["layers"] = [NeuronLayer(**x) for x in d["layers"]]
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


def _shape(node) -> tuple[int, ...]:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = val[0]
    return tuple(int(s) for s in val.shape)


CONST = "const"          # a value computed from constants only (masks, position ids): no neurons


class _Tracer(ConcatOps, GateOps, LayoutOps, TokenOps, AttentionCoreOps, CompositeOps):
    Val = _Val

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
        self.ops: list[dict[str, Any]] = []
        self.steps: list[dict[str, Any]] = []
        self.vals: dict[str, Any] = {}
        self.used_keys: set[str] = set()
        self.blocks = _attention_blocks(exported.graph)
        self.cores = attention_cores(exported.graph, _clean_path)
        self.composites = composite_activations(exported.graph, _clean_path)
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
        self.ops.append(op)
        self.steps.append({"step": op["kind"], "op": len(self.ops) - 1, "dst_layer": op.get("dst_layer")})

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
        if self.is_constant(node):
            self.vals[node.name] = CONST
            return
        if t is aten._transformer_encoder_layer_fwd.default:
            return self.encoder_layer(node)
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
        if t is aten.convolution.default:
            return self.conv(node)
        if t in (aten.addmm.default, aten.mm.default, aten.linear.default):
            return self.linear(node)
        if t is aten._native_batch_norm_legit_no_training.default:
            return self.batch_norm(node)
        if t is aten.native_layer_norm.default:
            return self.layer_norm(node)
        if t in _ACTIVATION_OPS or t is aten.hardtanh.default:
            return self.activation(node)
        if t is aten.add.Tensor:
            return self.add(node)
        if t in _POOL_OPS:
            return self.pool(node)
        if t in _RESHAPE_OPS:
            return self.reshape(node)
        if t is aten.embedding.default:
            return self.embedding(node)
        if t is aten.cat.default:
            return self.cat(node)
        if t in SPLIT_OPS:
            return self.split(node)
        if t is aten.transpose.int:
            return self.transpose(node)
        if t is aten.mul.Tensor:
            return self.mul(node)
        if t in PERMUTE_OPS:
            return self.permute(node)
        if t in RESTRIDE_OPS:
            return self.restride(node)
        if t in SLICE_OPS:
            return self.slice(node)
        if t in PAD_OPS:
            return self.pad(node)
        if t in ROLL_OPS:
            return self.roll(node)
        if t in EXPAND_OPS:
            return self.expand(node)
        if t in SELECT_OPS:
            return self.select(node)
        raise _unsupported(node, "not covered by the neural-graph converter")

    def conv(self, node) -> None:
        x, w, b, stride, padding, dilation, transposed, _out_pad, groups = node.args
        if transposed:
            raise _unsupported(node, "transposed convolution")
        v = self.val(node, x)
        wkey = self.key(w)
        if wkey is None:
            raise _unsupported(node, "convolution whose weight is not a parameter")
        wshape = list(self.state[wkey].shape)
        cout, cin_g = wshape[0], wshape[1]
        kernel = wshape[2:]
        kh, kw = (1, kernel[0]) if len(kernel) == 1 else (kernel[0], kernel[1])
        if cin_g * groups != self.width(v) or v.folded is not None:
            raise _unsupported(node, "convolution whose input channels do not match the neurons")
        src = self.source(node, v)
        dst = self.new_layer(cout, "conv")
        self.add_op(node, kind="conv", relation="conv", **src, dst_layer=dst, weight_key=wkey,
                    bias_key=self.key(b), weight_shape=wshape, kernel=[kh, kw], groups=int(groups),
                    stride=list(stride), padding=list(padding), dilation=list(dilation))
        self.vals[node.name] = _Val(dst, False, _shape(node)[2:])

    def linear(self, node) -> None:
        if node.target is aten.addmm.default:
            b, x, wt = node.args[:3]
            if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
                raise _unsupported(node, "scaled addmm")
        elif node.target is aten.mm.default:
            x, wt = node.args
            b = None
        else:
            x, w, b = (list(node.args) + [None])[:3]
            wt = ("direct", w)
        ref = self.vals.get(wt.name) if isinstance(wt, torch.fx.Node) else wt
        if isinstance(wt, torch.fx.Node) and wt.name in self.param_of:
            ref = ("in_out", wt)                # x @ W with W stored (in, out): GPT-2's Conv1D
        if not (isinstance(ref, tuple) and ref[0] in ("param_t", "direct", "in_out")):
            raise _unsupported(node, "matrix product with a non-parameter operand")
        wkey = self.key(ref[1])
        bkey = self.key(b)
        if wkey is None:
            raise _unsupported(node, "linear layer whose weight is not a parameter")
        v = self.val(node, x)
        out_f, in_f = (int(s) for s in self.state[wkey].shape)
        transposed = ref[0] == "in_out"
        if transposed:
            out_f, in_f = in_f, out_f
        size = self.width(v)
        if v.folded is not None and v.nmap is not None:
            raise _unsupported(node, "linear layer on a flattened map of concatenated channels")
        if v.folded is not None:
            fold = v.folded
            if transposed:
                raise _unsupported(node, "(in, out) weight on a flattened map")
            if size * math.prod(fold) != in_f:
                raise _unsupported(node, "linear layer whose inputs do not match the flattened map")
            kh, kw = (1, fold[0]) if len(fold) == 1 else (fold[0], fold[1]) if len(fold) == 2 else (1, 1)
            relation = "conv"   # a linear layer after pooling + flatten is a (kh x kw) "valid" conv
        else:
            if size != in_f:
                raise _unsupported(node, "linear layer whose inputs do not match the neurons",
                                   f"{in_f} inputs, {size} neurons")
            kh, kw, relation = 1, 1, "linear"
        src = self.source(node, v)
        dst = self.new_layer(out_f, "linear")
        self.add_op(node, kind="linear", relation=relation, **src, dst_layer=dst, weight_key=wkey,
                    bias_key=bkey, weight_shape=[out_f, in_f], kernel=[kh, kw], groups=1,
                    **({"transposed": True} if transposed else {}))
        self.vals[node.name] = _Val(dst, True, v.spatial if v.channels_last else ())

    def _norm_target(self, node, v: _Val, kind: str) -> int:
        if v.folded is not None or v.tokens:
            raise _unsupported(node, f"{kind} over a flattened map")
        return self.new_layer(self.width(v), "norm")

    def batch_norm(self, node) -> None:
        x, w, b, rm, rv, momentum, eps = node.args
        v = self.val(node, x)
        src = self.source(node, v)
        dst = self._norm_target(node, v, "batch norm")
        wkey = self.key(w)
        prefix = (wkey or self.key(rm) or "").rsplit(".", 1)[0]
        nbt = prefix + ".num_batches_tracked" if prefix + ".num_batches_tracked" in self.state else None
        if nbt:
            self.used_keys.add(nbt)
        self.add_op(node, kind="batch_norm", relation="norm", **src, dst_layer=dst, weight_key=wkey,
                    bias_key=self.key(b), mean_key=self.key(rm), var_key=self.key(rv), nbt_key=nbt,
                    eps=float(eps), momentum=float(momentum), kernel=[1, 1])
        self.vals[node.name] = (_Val(dst, v.channels_last, v.spatial),)

    def layer_norm(self, node) -> None:
        x, shape, w, b, eps = node.args
        v = self.val(node, x)
        if not v.channels_last or list(shape) != [self.width(v)]:
            raise _unsupported(node, "layer norm over more than the neuron axis", f"normalized_shape={list(shape)}")
        src = self.source(node, v)
        dst = self._norm_target(node, v, "layer norm")
        self.add_op(node, kind="layer_norm", relation="norm", **src, dst_layer=dst,
                    weight_key=self.key(w), bias_key=self.key(b), eps=float(eps), kernel=[1, 1])
        self.vals[node.name] = (_Val(dst, v.channels_last, v.spatial),)

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

    def add(self, node) -> None:
        a, b = node.args[:2]
        for x, p in ((a, b), (b, a)):
            if (isinstance(p, torch.fx.Node) and p.name in self.param_of and isinstance(x, torch.fx.Node)
                    and isinstance(self.vals.get(x.name), _Val)):
                v = self.vals[x.name]
                if len(self.state[self.param_of[p.name]].shape) > 1:
                    return self.position_add(node, v, p)
                return self.bias_add(node, v, p)
        if node.kwargs.get("alpha", 1) != 1 or not isinstance(b, torch.fx.Node):
            raise _unsupported(node, "addition of a constant or a scaled tensor")
        va, vb = self.val(node, a), self.val(node, b)
        if (self.width(va) != self.width(vb) or va.folded or vb.folded
                or va.channels_last != vb.channels_last or (va.layer == vb.layer and va.layer is not None)):
            raise _unsupported(node, "addition of tensors that are not matching neuron layers")
        # Fold the skip into an operand that nothing else reads and whose activation is not yet applied.
        for target, other, fx in ((va, vb, a), (vb, va, b)):
            if target.layer is None:
                continue
            layer = self.layers[target.layer]
            if target.layer != 0 and layer.activation == "identity" and len(fx.users) == 1 and layer.kind != "input":
                self.add_op(node, kind="residual", relation="residual", **self.source(node, other),
                            dst_layer=target.layer, kernel=[1, 1])
                self.vals[node.name] = target
                return
        srcs = [self.source(node, v) for v in (va, vb)]
        dst = self.new_layer(self.width(va), "add")
        for src in srcs:
            self.add_op(node, kind="residual", relation="residual", **src, dst_layer=dst, kernel=[1, 1])
        self.vals[node.name] = _Val(dst, va.channels_last, va.spatial)

    def bias_add(self, node, v: _Val, b) -> None:
        """``mm`` then ``+ bias``: how a linear layer on 3-d input exports; fold the bias into it."""
        key = self.key(b)
        op = self.ops[-1] if self.ops else None
        if (op is None or v.layer is None or op["dst_layer"] != v.layer or op.get("bias_key") is not None or op["kind"] != "linear"
                or tuple(self.state[key].shape) != (self.layers[v.layer].size,)):
            raise _unsupported(node, "addition of a parameter that is not the bias of the layer before it")
        op["bias_key"] = key
        self.vals[node.name] = v

    def _attention(self, node, v: _Val, embed: int, in_w: str, in_b: str | None, out_w: str,
                   out_b: str | None, heads: int) -> _Val:
        """Q, K, V neuron layers from the input and an O layer from V: four typed edge blocks."""
        if v.layer is None or not v.channels_last or self.layers[v.layer].size != embed:
            raise _unsupported(node, "attention whose input is not a layer of embed_dim neurons")
        qkv = []
        for i, rel in enumerate(("attn_q", "attn_k", "attn_v")):
            dst = self.new_layer(embed, "attention")
            self.add_op(node, kind="linear", relation=rel, src_layer=v.layer, dst_layer=dst, weight_key=in_w,
                        bias_key=in_b, rows=[i * embed, (i + 1) * embed], param_shape=[3 * embed, embed],
                        weight_shape=[embed, embed], kernel=[1, 1], groups=1, heads=heads)
            qkv.append(dst)
        out = self.new_layer(embed, "attention_out")
        self.add_op(node, kind="linear", relation="attn_o", src_layer=qkv[2], dst_layer=out, weight_key=out_w,
                    bias_key=out_b, weight_shape=[embed, embed], kernel=[1, 1], groups=1, heads=heads)
        for k in (in_w, in_b, out_w, out_b):
            if k:
                self.used_keys.add(k)
        return _Val(out, True, v.spatial)

    def attention_block(self, node, block: "_Block") -> None:
        """An nn.MultiheadAttention traced into many ATen ops: handled as one block."""
        inputs = {a.name for n in block.nodes for a in n.all_input_nodes
                  if a.name not in block.names and a.name not in self.param_of}
        neuron_vals = [self.vals[i] for i in inputs if isinstance(self.vals.get(i), _Val)]
        if len(inputs) != 1 or len(neuron_vals) != 1:
            raise _unsupported(node, "attention other than self-attention on one input")
        p = block.path + "."
        keys = {k: p + k for k in ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")}
        if keys["in_proj_weight"] not in self.state:
            raise _unsupported(node, "attention with separate q/k/v projection weights")
        embed = int(self.state[keys["out_proj.weight"]].shape[0])
        out = self._attention(node, neuron_vals[0], embed, keys["in_proj_weight"],
                              keys["in_proj_bias"] if keys["in_proj_bias"] in self.state else None,
                              keys["out_proj.weight"],
                              keys["out_proj.bias"] if keys["out_proj.bias"] in self.state else None,
                              _heads(block, embed))
        for n in block.outputs:
            self.vals[n.name] = out

    def encoder_layer(self, node) -> None:
        """``TransformerEncoderLayer``'s fused fast path, decomposed into its parts."""
        (src, embed, heads, qkv_w, qkv_b, proj_w, proj_b, use_gelu, norm_first, eps,
         n1w, n1b, n2w, n2b, f1w, f1b, f2w, f2b) = node.args[:18]
        if len(node.args) > 18 and node.args[18] is not None:
            raise _unsupported(node, "encoder layer with an attention mask")
        x = self.val(node, src)
        if x.layer is None:
            raise _unsupported(node, "encoder layer on concatenated neurons")
        k = self.key
        act = "gelu" if use_gelu else "relu"

        def norm(v, w, b):
            dst = self.new_layer(self.layers[v.layer].size, "norm")
            self.add_op(node, kind="layer_norm", relation="norm", src_layer=v.layer, dst_layer=dst,
                        weight_key=k(w), bias_key=k(b), eps=float(eps), kernel=[1, 1])
            return _Val(dst, True, v.spatial)

        def linear(v, w, b, activation="identity"):
            wk = k(w)
            out_f, in_f = (int(s) for s in self.state[wk].shape)
            dst = self.new_layer(out_f, "linear")
            self.add_op(node, kind="linear", relation="linear", src_layer=v.layer, dst_layer=dst, weight_key=wk,
                        bias_key=k(b), weight_shape=[out_f, in_f], kernel=[1, 1], groups=1)
            self.layers[dst].activation = activation
            return _Val(dst, True, v.spatial)

        def residual(skip, target):
            self.add_op(node, kind="residual", relation="residual", src_layer=skip.layer, dst_layer=target.layer,
                        kernel=[1, 1])
            return target

        def attention(v):
            return self._attention(node, v, int(embed), k(qkv_w), k(qkv_b), k(proj_w), k(proj_b), int(heads))

        if norm_first:
            h = residual(x, attention(norm(x, n1w, n1b)))
            out = residual(h, linear(linear(norm(h, n2w, n2b), f1w, f1b, act), f2w, f2b))
        else:
            h = norm(residual(x, attention(x)), n1w, n1b)
            out = norm(residual(h, linear(linear(h, f1w, f1b, act), f2w, f2b)), n2w, n2b)
        self.vals[node.name] = out

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

    def embedding(self, node) -> None:
        w, idx = node.args[:2]
        v = self.vals.get(idx.name)
        wkey = self.key(w)
        if not ((isinstance(v, _Val) and v.tokens) or v == CONST) or wkey is None:
            raise _unsupported(node, "embedding of something other than the input tokens or constant ids",
                               "positions, token types")
        num, dim = (int(s) for s in self.state[wkey].shape)
        src = self.new_layer(num, "input")
        dst = self.new_layer(dim, "embedding")
        self.add_op(node, kind="embedding", relation="embedding", src_layer=src, dst_layer=dst, weight_key=wkey,
                    bias_key=None, weight_shape=[num, dim], kernel=[1, 1])
        self.vals[node.name] = _Val(dst, True, tuple(_shape(node)[1:-1]))

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


@dataclass
class _Block:
    path: str
    heads: int
    nodes: list
    names: set
    outputs: list


def _attention_blocks(graph) -> dict[str, _Block]:
    """Nodes that belong to an nn.MultiheadAttention call, by node name."""
    blocks: dict[str, _Block] = {}
    by_path: dict[str, _Block] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        for key, (raw, typ) in (node.meta.get("nn_module_stack") or {}).items():
            if isinstance(typ, type) and issubclass(typ, torch.nn.MultiheadAttention):
                path = _clean_path(raw)
                blk = by_path.setdefault(path, _Block(path, 0, [], set(), []))
                blk.nodes.append(node)
                blk.names.add(node.name)
                blocks[node.name] = blk
                break
    for blk in by_path.values():
        blk.outputs = [n for n in blk.nodes if any(u.name not in blk.names for u in n.users)]
    return blocks


def _heads(block: _Block, embed: int) -> int:
    """Heads of an attention block, read from the q/k/v reshape to (L, B * heads, head_dim)."""
    for n in block.nodes:
        if n.target is aten.div.Tensor:          # q / sqrt(head_dim) once per call
            shape = _shape(n)
            if len(shape) == 3 and 0 < shape[-1] < embed and embed % shape[-1] == 0:
                return embed // shape[-1]
    return 1


def architecture_signature(plan: Plan) -> str:
    """A structural hash: layer kinds, sizes, activations, operation shapes and wiring, and
    non-parametric steps; parameter names are left out (two spellings of one network agree)."""
    drop = {"path", "weight_key", "bias_key", "mean_key", "var_key", "nbt_key"}
    ops = [{k: v for k, v in op.items() if k not in drop} | {"has_bias": op.get("bias_key") is not None}
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
    try:
        exported = export_module(model, example_input)
    except UnsupportedModuleError:
        raise
    except Exception as exc:  # torch.export failures: data-dependent control flow, etc.
        raise UnsupportedModuleError(type(model).__name__, "a module torch.export cannot trace",
                                     str(exc).splitlines()[0][:200]) from exc
    return plan_from_exported(exported, set(exported.state_dict) - set(model.state_dict()))
