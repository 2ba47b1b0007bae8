"""What a kept ``torch.export`` program may hold: checked where it is read, again where it runs.

A zoo's ``.pt2`` archive is a stranger's graph, and the catalog keeps it to run it later
(``runnable.Network``: merging, layer equivariance). A graph can hold more than the network: dead
nodes that read only constants and reach no output, built from ATen operators that trust their
arguments (``_sparse_coo_tensor_with_dims_and_tensors`` skips its index check, so ``_to_dense``
of an index of 1e9 writes past the heap). So a kept program holds only what the conversion needs:

- every call target is an ATen operator of a kind in :data:`ALLOWED_OPS` (what the plan's tracer
  reads: layers, activations, pools, reshapes, and the elementwise and index arithmetic of masks
  and position tables), or a plain ``_operator`` on shapes; never a sparse constructor, a
  conversion to or from a sparse layout, random or uninitialised memory, or file I/O;
- every node is on a path from the graph's inputs to its output: a node whose value reaches no
  output is refused (an unused output of a live node, which torch's reader writes as a
  ``getitem``, and assertions, which write nothing, must read live values);
- a factory (``full``, ``zeros``, ``ones``, ``arange``, ``new_zeros``, ...) has sizes written in
  the graph (or an input's own dimension), and makes no more elements than the state holds;
- tensor constants (lifted constants) hold no more elements, in all, than the state (parameters
  and buffers); every tensor is strided; inputs are parameters, buffers, constants and user
  inputs, outputs are user outputs.

One policy, two readers: :func:`check_serialized` walks an archive's JSON (``.pt2`` member or
``architectures.program_json``) before torch's deserializer sees it, :func:`check_exported` an
ExportedProgram with the tensors it will run on, right before it runs. Every refusal is one line
naming where and the node's target.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from zoocore.errors import CheckpointError

# ATen operator kinds (overload packets) a kept program may call. Sorted by why the conversion
# needs them; tests/pipeline/test_program_policy.py checks that every op the tracer handles is here.
LAYER_OPS = frozenset({
    "convolution", "addmm", "mm", "bmm", "linear", "t", "embedding", "_native_batch_norm_legit_no_training",
    "native_layer_norm", "native_group_norm", "_transformer_encoder_layer_fwd", "_softmax",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu"})
ACTIVATION_OPS = frozenset({"relu", "gelu", "silu", "tanh", "sigmoid", "leaky_relu", "hardswish", "sin",
                            "hardsigmoid", "elu", "hardtanh"})
POOL_OPS = frozenset({"max_pool2d_with_indices", "max_pool2d", "avg_pool2d", "_adaptive_avg_pool2d",
                      "adaptive_max_pool2d", "max_pool1d", "avg_pool1d", "adaptive_avg_pool1d", "mean"})
LAYOUT_OPS = frozenset({"view", "reshape", "_unsafe_view", "flatten", "squeeze", "unsqueeze", "cat", "split",
                        "split_with_sizes", "transpose", "permute", "as_strided", "slice", "select",
                        "constant_pad_nd", "roll", "expand", "clone", "alias", "detach", "dropout", "contiguous",
                        "lift_fresh_copy", "slice_scatter", "select_scatter", "_to_copy"})
ARITHMETIC_OPS = frozenset({"add", "sub", "rsub", "mul", "div", "neg", "pow", "exp", "log", "sqrt", "rsqrt",
                            "reciprocal", "abs", "ceil", "floor", "clamp", "clamp_min", "clamp_max", "erf",
                            "sum", "amax", "minimum", "maximum", "linalg_vector_norm", "eq", "ne", "lt", "le",
                            "gt", "ge", "where", "masked_fill", "logical_not", "logical_and", "logical_or",
                            "tril", "triu", "index", "_unsafe_index", "fill", "zero", "zeros_like",
                            "ones_like", "full_like", "sym_size"})
# factory kind -> its size arguments' names (numel is their product; arange: a range)
FACTORY_OPS = {"full": ("size",), "zeros": ("size",), "ones": ("size",), "new_zeros": ("size",),
               "new_ones": ("size",), "new_full": ("size",), "arange": (), "scalar_tensor": ()}
ASSERTION_OPS = frozenset({"_assert_async", "sym_constrain_range", "sym_constrain_range_for_size"})
ALLOWED_OPS = LAYER_OPS | ACTIVATION_OPS | POOL_OPS | LAYOUT_OPS | ARITHMETIC_OPS | set(FACTORY_OPS) | ASSERTION_OPS
OPERATORS = frozenset({"getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pow", "eq", "ne",
                       "lt", "le", "gt", "ge", "and_", "or_", "not_"})
INPUT_KINDS = ("parameter", "buffer", "tensor_constant", "user_input")
STRIDED = 7                       # torch._export.serde.schema.Layout.Strided


class Symbol(str):
    """A symbolic size (the name of the graph value holding it), as opposed to a literal."""


@dataclass
class Call:
    """One call node: its name, target (``torch.ops.aten.full.default`` / ``_operator.getitem``),
    the values it reads and writes, and its arguments by schema name."""

    name: str
    target: str
    reads: list[str]
    writes: list[str]
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class Program:
    """A program as the policy reads it, from either form."""

    inputs: dict[str, tuple[str, int | None]]      # value name -> (input kind, elements or None)
    calls: list[Call]
    outputs: list[str]
    output_kinds: list[str]


def allowed_target(target: str) -> bool:
    """Whether a call target (as the archive spells it) is one a kept program may call."""
    parts = target.split(".")
    if parts[0] == "_operator":
        return len(parts) == 2 and parts[1] in OPERATORS
    return (target.startswith("torch.ops.aten.") and len(parts) == 5 and parts[3] in ALLOWED_OPS
            and "out" not in parts[4])


def refuse_target(target: str, where: str) -> None:
    if not allowed_target(target):
        raise CheckpointError(f"{where}: refused the graph call target {target[:80]!r} (only ATen operators are "
                              "read, and of those only the kinds the neural-graph conversion covers)")


def _kind(target: str) -> str:
    parts = target.split(".")
    return parts[3] if len(parts) == 5 else ""


def check(program: Program, where: str) -> None:
    """Refuse what a kept program may not hold (see the module docstring)."""
    state = sum(n or 0 for kind, n in program.inputs.values() if kind in ("parameter", "buffer"))
    constants = 0
    for name, (kind, numel) in program.inputs.items():
        if kind not in INPUT_KINDS:
            raise CheckpointError(f"{where}: refused the graph input {name!r} of kind {kind} (programs take "
                                  "parameters, buffers, constants and tensors)")
        if kind == "tensor_constant":
            if numel is None:
                raise CheckpointError(f"{where}: refused the tensor constant {name!r}: its size is not fixed")
            constants += numel
    if constants > state:
        raise CheckpointError(f"{where}: refused a program whose tensor constants hold {constants} elements, more "
                              f"than its state's {state}")
    if set(program.output_kinds) - {"user_output"}:
        raise CheckpointError(f"{where}: refused a program with outputs of kind "
                              f"{sorted(set(program.output_kinds) - {'user_output'})} (a network returns its output)")
    producer = {value: call for call in program.calls for value in call.writes}
    input_dims: set[str] = set()
    for call in program.calls:
        refuse_target(call.target, where)
        kind = _kind(call.target)
        if kind == "sym_size" and call.reads and program.inputs.get(call.reads[0], ("",))[0] == "user_input":
            input_dims.update(call.writes)
        if call.args.get("layout") not in (None, STRIDED, torch.strided):
            raise CheckpointError(f"{where}: refused the graph node {call.name!r} ({call.target}): a tensor "
                                  "layout other than strided")
        if kind in FACTORY_OPS:
            numel = _factory_elements(call, input_dims, where)
            if numel > max(state, 1):
                raise CheckpointError(f"{where}: refused the graph node {call.name!r} ({call.target}): it makes "
                                      f"{numel} elements, more than the state's {state}")
        unknown = [v for v in call.reads if v not in producer and v not in program.inputs]
        if unknown:
            raise CheckpointError(f"{where}: the graph node {call.name!r} ({call.target}) reads {unknown[0]!r}, "
                                  "which no input or node gives")
    live: set[int] = set()
    todo = [producer[v] for v in program.outputs if v in producer]
    while todo:
        call = todo.pop()
        if id(call) in live:
            continue
        live.add(id(call))
        todo.extend(producer[v] for v in call.reads if v in producer)
    for call in program.calls:
        if id(call) in live:
            continue
        if (call.target == "_operator.getitem" or _kind(call.target) in ASSERTION_OPS and not call.writes) \
                and all(v in program.inputs or id(producer[v]) in live for v in call.reads):
            continue            # an unused output of a live node, or a check on live values
        raise CheckpointError(f"{where}: refused the graph node {call.name!r} ({call.target}): it is on no path "
                              "from the program's inputs to its output (a kept program holds only what computes it)")


def _factory_elements(call: Call, input_dims: set[str], where: str) -> int:
    """Elements a factory call makes: its sizes must be literals or inputs' own dimensions (the
    caller's batch), which count as 1."""

    def size(value, signed: bool = False) -> int | float:
        if isinstance(value, Symbol) and value in input_dims:
            return 1
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or (value < 0 and not signed):
            raise CheckpointError(f"{where}: refused the graph node {call.name!r} ({call.target}): a size "
                                  f"{str(value)[:40]!r} that is not written in the graph")
        return value

    kind = _kind(call.target)
    if kind == "scalar_tensor":
        return 1
    if kind == "arange":
        start, end = size(call.args.get("start", 0), True), size(call.args.get("end", 0), True)
        step = call.args.get("step", 1)
        if isinstance(step, bool) or not isinstance(step, (int, float)) or step == 0 or not math.isfinite(step):
            raise CheckpointError(f"{where}: refused the graph node {call.name!r} ({call.target}): step {step!r}")
        return max(0, math.ceil((end - start) / step))
    sizes = call.args.get(FACTORY_OPS[kind][0])
    if not isinstance(sizes, (list, tuple)):
        sizes = [sizes]
    return math.prod(int(size(s)) for s in sizes)


# ---------------------------------------------------------------------------------- the archive JSON
def _union(arg: Any, where: str) -> tuple[str, Any]:
    """(field, value) of a serialized union: the one field that is not null."""
    if not isinstance(arg, dict):
        raise CheckpointError(f"{where}: a malformed graph argument")
    set_ = [(k, v) for k, v in arg.items() if v is not None]
    if len(set_) != 1:
        raise CheckpointError(f"{where}: a malformed graph argument (fields {[k for k, _ in set_][:4]})")
    return set_[0]


def _names(arg: Any, where: str) -> list[str]:
    """The graph values a serialized argument names."""
    kind, value = _union(arg, where)
    try:
        if kind == "as_tensor":
            return [value["name"]]
        if kind == "as_tensors":
            return [v["name"] for v in value]
        if kind == "as_optional_tensors":
            return [v["as_tensor"] for v in value if v.get("as_tensor") is not None]
        if kind in ("as_sym_int", "as_sym_bool"):
            return [value["as_name"]] if value.get("as_name") is not None else []
        if kind in ("as_sym_ints", "as_sym_bools"):
            return [v["as_name"] for v in value if v.get("as_name") is not None]
    except (KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{where}: a malformed graph argument of kind {kind}") from None
    if kind in ("as_graph", "as_custom_obj"):
        raise CheckpointError(f"{where}: refused a graph argument of kind {kind} (programs call ATen operators "
                              "on tensors)")
    return []


def _value(arg: Any, where: str) -> Any:
    """A serialized argument's literal value (sizes, scalars, layout); symbolic sizes as Symbol."""
    kind, value = _union(arg, where)
    if kind in ("as_int", "as_float", "as_ints", "as_floats", "as_bools", "as_layout", "as_bool"):
        # (torch writes an empty list, such as the size of a scalar, as "as_bools": [])
        return value
    if kind == "as_sym_int":
        return Symbol(value["as_name"]) if value.get("as_name") is not None else value.get("as_int")
    if kind == "as_sym_ints":
        return [Symbol(v["as_name"]) if v.get("as_name") is not None else v.get("as_int") for v in value]
    return None


def _numel(meta: Any) -> int | None:
    if not isinstance(meta, dict) or meta.get("layout", STRIDED) != STRIDED:
        return None
    sizes = [s.get("as_int") if isinstance(s, dict) else None for s in meta.get("sizes") or []]
    return math.prod(sizes) if all(isinstance(s, int) and s >= 0 for s in sizes) else None


def serialized_program(program: Mapping, where: str) -> Program:
    """The policy's view of an archive's program JSON (``serialized_exported_program.json``)."""
    try:
        # a part left out is empty here (torch's deserializer refuses an incomplete program)
        module = program["graph_module"]
        graph, signature = module["graph"], module.get("signature") or {}
        metas = graph.get("tensor_values") or {}
        inputs: dict[str, tuple[str, int | None]] = {}
        for spec in signature.get("input_specs") or []:
            kind, value = _union(spec, where)
            for name in (_names(value["arg"], where) if kind == "user_input" else [value["arg"]["name"]]):
                numel = _numel(metas.get(name)) if name in metas else None
                if name in metas and numel is None and kind != "user_input":
                    raise CheckpointError(f"{where}: refused the graph input {name!r}: not a strided tensor of "
                                          "fixed size")
                inputs[name] = (kind, numel)
        calls = []
        for node in graph.get("nodes") or []:
            target = node["target"]
            if not isinstance(target, str):
                raise CheckpointError(f"{where}: a graph node without a target name")
            reads, args = [], {}
            for named in node["inputs"]:
                reads += _names(named["arg"], where)
                args[named["name"]] = _value(named["arg"], where)
            writes = [n for out in node["outputs"] for n in _names(out, where)]
            calls.append(Call(writes[0] if writes else target, target, reads, writes, args))
        for name, meta in metas.items():
            if isinstance(meta, dict) and meta.get("layout", STRIDED) != STRIDED:
                raise CheckpointError(f"{where}: refused the graph value {name!r}: a tensor layout other than "
                                      "strided")
        outputs = [n for out in graph.get("outputs") or [] for n in _names(out, where)]
        output_kinds = [_union(spec, where)[0] for spec in signature.get("output_specs") or []]
    except CheckpointError:
        raise
    except (KeyError, TypeError, AttributeError, IndexError) as exc:
        raise CheckpointError(f"{where}: a malformed exported program ({type(exc).__name__}: "
                              f"{str(exc)[:60]})") from None
    return Program(inputs, calls, outputs, output_kinds)


def check_serialized(program: Mapping, where: str) -> None:
    """Refuse an archive's program (parsed JSON) that holds more than the conversion needs."""
    check(serialized_program(program, where), where)


# ---------------------------------------------------------------------------------- an ExportedProgram
def _target_name(target: Any) -> str:
    """A call target spelt as the archive spells it."""
    if isinstance(target, torch._ops.OpOverload):
        namespace, name = target._schema.name.split("::")
        return f"torch.ops.{namespace}.{name}.{target._overloadname}"
    if getattr(target, "__module__", None) in ("_operator", "operator") and target is getattr(
            operator, getattr(target, "__name__", ""), None):
        return f"_operator.{target.__name__}"
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"


def _fx_value(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        return Symbol(value.name)
    if isinstance(value, (list, tuple)):
        return [_fx_value(v) for v in value]
    return value


def exported_program(exported, tensors: Mapping[str, tuple[str, torch.Tensor]]) -> Program:
    """The policy's view of an ExportedProgram: ``tensors`` maps each non-user input's value name
    to (kind, the tensor it will run on)."""
    inputs: dict[str, tuple[str, int | None]] = {}
    for spec in exported.graph_signature.input_specs:
        name = spec.arg.name
        if spec.kind.name == "USER_INPUT":
            inputs[name] = ("user_input", None)
            continue
        kind, tensor = tensors[name]
        inputs[name] = (kind, int(tensor.numel()) if tensor.layout == torch.strided else None)
    calls, outputs = [], []
    for node in exported.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            outputs = [n.name for n in node.all_input_nodes]
            continue
        target = _target_name(node.target) if node.op == "call_function" else f"{node.op} {node.target}"
        args: dict[str, Any] = {}
        schema = getattr(node.target, "_schema", None)
        if schema is not None:
            names = [a.name for a in schema.arguments]
            args = {names[i]: _fx_value(v) for i, v in enumerate(node.args) if i < len(names)}
        args |= {k: _fx_value(v) for k, v in node.kwargs.items()}
        writes = [] if schema is not None and not schema.returns else [node.name]
        calls.append(Call(node.name, target, [n.name for n in node.all_input_nodes], writes, args))
    kinds = [s.kind.name.lower() for s in exported.graph_signature.output_specs]
    return Program(inputs, calls, outputs, kinds)


def check_exported(exported, state: Mapping[str, torch.Tensor], where: str) -> None:
    """Refuse an ExportedProgram that holds more than the conversion needs, with the tensors it will
    run on: ``state`` (the model's own) and, for inputs it does not hold, the program's own
    (buffers that are not state, lifted constants). Parameters and buffers make the state that
    bounds factories and constants, as in the archive's graph."""
    tensors: dict[str, tuple[str, torch.Tensor]] = {}
    for spec in exported.graph_signature.input_specs:
        kind, target = spec.kind.name, spec.target
        if kind == "USER_INPUT":
            continue
        if kind == "CONSTANT_TENSOR":
            value = exported.tensor_constants.get(target)
        else:
            value = state.get(target, exported.state_dict.get(target))
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{where}: the program reads {target!r}, which it does not hold")
        if value.layout != torch.strided:
            raise CheckpointError(f"{where}: refused the program's tensor {target!r}: a layout other than strided")
        tensors[spec.arg.name] = ({"PARAMETER": "parameter", "BUFFER": "buffer"}.get(kind, "tensor_constant"), value)
    check(exported_program(exported, tensors), where)
