"""A converted model as a runnable network, from the catalog alone.

The exact inverse (``build.state_dict_from_graph``) gives a model's state dict back bit for bit;
this module gives the network that runs it, one way for every converted model: its architecture's
``torch.export`` graph (ATen operations) evaluated on that state dict.

- A model ingested with a JSON spec: the spec's module, exported once per architecture.
- A model ingested from a ``torch.export`` archive (``.pt2``) or traced from a module (Hugging Face
  folders): the program is kept in the catalog at ingest (``architectures.program_json``; the
  tensors that are not state, such as non-persistent buffers and lifted constants, in
  ``program_tensors`` as safetensors). Reading it back goes through the same checks as the archive
  did (``torch_archive.deserialize_program``): only ATen operators, plain shape arithmetic.

Before any program runs, :class:`Network` checks it once more with the tensors it will run on
(``program_policy.check_exported``): only the operator kinds the conversion covers, no node off
the path from the inputs to the output, factories and constants no larger than the state. So a
catalog written by an older version cannot smuggle in a graph ingest would now refuse.

Layer taps: each neuron layer's value inside the graph (after the layer's activation, before any
pooling or flattening; :func:`layer_nodes`), found by the plan's own tracer, so analyses read the
layers of an MLP, a residual batch-norm CNN or a transformer the same way.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipeline.neural_graph.program_policy import check_exported
from zoocore.errors import CheckpointError, first_line

STATE, CONSTANT = "state.", "constant."


def keep_program(exported, state_keys) -> tuple[str | None, bytes | None]:
    """(program JSON, tensors that are not in ``state_keys`` as safetensors bytes or None) of an
    ExportedProgram, for the catalog; (None, None) when torch cannot serialize it (the model then
    converts as before, and rebuilding it says why it cannot)."""
    from safetensors.torch import save
    from torch._export.serde.serialize import serialize

    keys = set(state_keys)
    extra = {STATE + k: v for k, v in exported.state_dict.items() if k not in keys}
    extra |= {CONSTANT + k: v for k, v in exported.tensor_constants.items()}
    tensors = save({k: v.detach().clone().contiguous() for k, v in extra.items()}) if extra else None
    kept = getattr(exported, "archive_program", None)     # read from a .pt2 archive: keep its own JSON
    if kept is not None:
        return kept.decode() if isinstance(kept, bytes) else kept, tensors
    for node in exported.graph.nodes:        # torch 2.2 writes module paths with commas it cannot read back
        stack = node.meta.get("nn_module_stack")
        if stack and any("," in path for path, _ in stack.values()):
            node.meta["nn_module_stack"] = {k: (path.replace(",", ""), typ) for k, (path, typ) in stack.items()}
    try:
        program = serialize(exported).exported_program.decode()
    except Exception:               # a graph torch's serializer does not cover
        return None, None
    return program, tensors


def program_from_catalog(program_json: str, program_tensors: bytes | None, state: dict[str, torch.Tensor],
                         where: str):
    """The kept program as an ExportedProgram holding ``state`` (checked as an archive is)."""
    from safetensors.torch import load

    from pipeline.torch_archive import deserialize_program

    try:
        extra = load(program_tensors) if program_tensors else {}
    except Exception as exc:
        raise CheckpointError(f"{where}: cannot read the program's tensors: {first_line(exc)}") from None
    full = {k[len(STATE):]: v for k, v in extra.items() if k.startswith(STATE)} | dict(state)
    constants = {k[len(CONSTANT):]: v for k, v in extra.items() if k.startswith(CONSTANT)}
    exported = deserialize_program(program_json, full, constants, where)
    check_exported(exported, state, where)           # with the tensors it holds, not their declared sizes
    return exported


def exported_from_spec(spec: dict):
    """The spec's module, exported (its weights are the random ones: :class:`Network` brings the state)."""
    from pipeline.neural_graph.plan import export_module
    from pipeline.spec import build_module, example_input

    return export_module(build_module(spec), example_input(spec))


def layer_nodes(exported, constant_keys=frozenset()) -> dict[int, tuple[str, str]]:
    """Per neuron layer of the plan traced from ``exported``: (first, last) graph node holding the
    layer's whole value in its own layout. The first is the writer's output (before the
    activation), the last is after the activation; pooled, flattened or regrouped values are not
    taps. Layer 0 is the input."""
    from pipeline.neural_graph.plan import traced_values

    first: dict[int, tuple] = {}
    taps: dict[int, tuple[str, str]] = {}
    for name, v in traced_values(exported, constant_keys):
        if v.layer is None or v.nmap is not None or v.folded is not None or v.tokens:
            continue
        key = (v.channels_last, v.spatial)
        if first.setdefault(v.layer, key) == key:
            taps[v.layer] = (taps.get(v.layer, (name,))[0], name)
    return taps


_SHAPED = ("view", "_unsafe_view", "reshape", "expand")
_BN_EVAL = torch.ops.aten._native_batch_norm_legit_no_training.default


def _exported_batch(exported) -> int | None:
    """The batch size the graph was exported with, or None if it is symbolic (any batch runs)."""
    for node in exported.graph.nodes:
        if node.op == "placeholder" and node.name in _user_inputs(exported):
            size = node.meta["val"].shape[0]
            return int(size) if isinstance(size, int) else None
    return None


def _user_inputs(exported) -> set[str]:
    return {s.arg.name for s in exported.graph_signature.input_specs if s.kind.name == "USER_INPUT"}


def _group_norm_any_batch(x, weight, bias, n, c, hxw, group, eps):
    """``aten.native_group_norm`` with its batch argument read off the input, not the graph."""
    return torch.ops.aten.native_group_norm.default(x, weight, bias, x.shape[0], c, hxw, group, eps)


def _batch_free(graph_module, batch: int):
    """``graph_module`` with reshapes that take any batch (a copy: a reshape's leading ``batch``
    made -1, its other sizes written out where it had a -1 of its own; a group norm reads the batch
    off its input), or the graph itself when nothing names the batch."""
    import copy

    gm = copy.deepcopy(graph_module)
    changed = False
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = getattr(node.target, "__name__", "").split(".")[0]
        if name in _SHAPED and len(node.args) > 1 and isinstance(node.args[1], (list, tuple)) and node.args[1] \
                and node.args[1][0] == batch:
            rest = list(node.args[1][1:])
            if -1 in rest and name != "expand" and "val" in node.meta:
                rest = [int(s) for s in node.meta["val"].shape[1:]]
            node.args = (node.args[0], [-1, *rest], *node.args[2:])
            changed = True
        elif node.target is torch.ops.aten.native_group_norm.default:
            node.target = _group_norm_any_batch
            changed = True
    if not changed:
        return graph_module
    gm.recompile()
    return gm


class Network(nn.Module):
    """An exported graph run on one state dict: ``net(x)`` is the model's output, ``net.taps(x)``
    its neuron layers' values. The tensors are buffers, so ``.to``, ``.double()`` work.

    Graphs exported with a fixed batch size (the usual ``.pt2``) run any batch: their reshapes are
    made batch-free when that gives the same answer as running the fixed batch chunk by chunk
    (checked once per architecture on the first batch), and run chunk by chunk otherwise.

    The program is checked first (``program_policy.check_exported``, ``where`` names it in the
    refusal): a graph holding more than the conversion needs never runs."""

    def __init__(self, exported, state: dict[str, torch.Tensor], where: str = "the network's program"):
        super().__init__()
        check_exported(exported, state, where)
        self.graph_module = exported.graph_module
        sig = exported.graph_signature
        self.slots: list[str | None] = []
        self.constant_keys: set[str] = set()       # buffers that are not state (non-persistent ones)
        for i, spec in enumerate(sig.input_specs):
            if spec.kind.name == "USER_INPUT":
                self.slots.append(None)
                continue
            target = spec.target
            if spec.kind.name == "CONSTANT_TENSOR":
                value = exported.tensor_constants[target]
            elif target in state:
                value = state[target]
            elif target in exported.state_dict:
                value = exported.state_dict[target]
                self.constant_keys.add(target)
            else:
                raise CheckpointError(f"the state dict has no {target!r}, which the network reads")
            self.register_buffer(f"slot{i}", torch.as_tensor(value).detach().clone())
            self.slots.append(f"slot{i}")
        self.input_keys = {s.arg.name: s.target for s in sig.input_specs if s.kind.name != "USER_INPUT"}
        kinds = [s.kind.name for s in sig.output_specs]
        self.output = kinds.index("USER_OUTPUT")
        self.batch = _exported_batch(exported)
        self._exported = exported

    def _args(self, x: torch.Tensor) -> list[Any]:
        return [x if s is None else getattr(self, s) for s in self.slots]

    def _call(self, gm, x: torch.Tensor, want: dict[str, int] | None):
        if want is None:
            out = gm(*self._args(x))
            return out[self.output] if isinstance(out, (tuple, list)) else out
        found: dict[int, torch.Tensor] = {}

        class Tap(torch.fx.Interpreter):
            def run_node(self, node):
                out = super().run_node(node)
                if node.name in want:
                    found[want[node.name]] = out
                return out

        Tap(gm).run(*self._args(x))
        return found

    def _chunked(self, x: torch.Tensor, want):
        b = self.batch
        pad = (-len(x)) % b
        xp = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))]) if pad else x
        parts = [self._call(self.graph_module, xp[i:i + b], want) for i in range(0, len(xp), b)]
        if want is None:
            return torch.cat(parts)[:len(x)]
        return {k: torch.cat([p[k] for p in parts])[:len(x)] for k in parts[0]}

    def _run(self, x: torch.Tensor, want):
        x = x.clone(memory_format=torch.contiguous_format)     # standard strides: the graph views were traced on them
        if self.batch is None or len(x) == self.batch:
            return self._call(self.graph_module, x, want)
        ex = self._exported
        if not hasattr(ex, "_zoograph_batch_free"):         # decided once per architecture
            gm, n = _batch_free(self.graph_module, self.batch), min(len(x), 4 * self.batch + 1)
            try:
                ok = torch.allclose(self._call(gm, x[:n], None), self._chunked(x[:n], None), rtol=1e-4, atol=1e-5)
            except RuntimeError:            # a shape the graph fixed elsewhere: run chunk by chunk
                ok = False
            ex._zoograph_batch_free = gm if ok else None
        gm = ex._zoograph_batch_free
        return self._chunked(x, want) if gm is None else self._call(gm, x, want)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, None)

    def batch_statistics(self, x: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Run ``x`` as one batch with every batch norm in training mode (normalising by the batch's
        own statistics, as ``module.train()`` does): per running-mean key, the batch's (mean,
        unbiased variance) of that norm's input, by the running-variance key's norm."""
        x = x.clone(memory_format=torch.contiguous_format)
        gm = self.graph_module
        if self.batch is not None and len(x) != self.batch:
            self._run(x[:1], None)                                  # decide the batch-free graph once
            gm = self._exported._zoograph_batch_free
            if gm is None:
                raise CheckpointError(f"this graph was exported for batches of {self.batch} only; batch-norm "
                                      "statistics need whole batches")
        keys, found = self.input_keys, {}

        class Train(torch.fx.Interpreter):
            def run_node(self, node):
                if node.op != "call_function" or node.target is not _BN_EVAL:
                    return super().run_node(node)
                args, _ = self.fetch_args_kwargs_from_env(node)
                inp, weight, bias, eps = args[0], args[1], args[2], args[-1]
                dims = [0, *range(2, inp.dim())]
                mean, var = inp.mean(dims), inp.var(dims, unbiased=False)
                found[keys[node.args[3].name]] = (mean, inp.var(dims, unbiased=True))
                shape = [1, -1] + [1] * (inp.dim() - 2)
                rstd = torch.rsqrt(var + eps)
                out = (inp - mean.view(shape)) * rstd.view(shape)
                if weight is not None:
                    out = out * weight.view(shape)
                if bias is not None:
                    out = out + bias.view(shape)
                return out, mean, rstd

        Train(gm).run(*self._args(x))
        return found

    def activations(self) -> list[str]:
        """Each neuron layer's activation, as the plan traced from this graph has it."""
        from pipeline.neural_graph.plan import plan_from_exported

        return [layer.activation for layer in plan_from_exported(self._exported, self.constant_keys).layers]

    def taps(self, x: torch.Tensor, after_activation: bool = True) -> dict[int, torch.Tensor]:
        """Each neuron layer's value on ``x`` (see :func:`layer_nodes`), output included."""
        ex = self._exported
        if not hasattr(ex, "_zoograph_layer_nodes"):
            ex._zoograph_layer_nodes = layer_nodes(ex, self.constant_keys)
        want = {(last if after_activation else first): layer
                for layer, (first, last) in ex._zoograph_layer_nodes.items()}
        return self._run(x, want)


def save_program_archive(path, program_json: str, state: dict[str, torch.Tensor],
                         program_tensors: bytes | None = None) -> None:
    """Write a ``torch.export`` archive (``.pt2``, the layout ``torch.export.save`` writes) of the
    kept program with ``state``: how a network without a spec leaves the catalog (merged weights)."""
    import io
    import json
    import zipfile

    from safetensors.torch import load
    from torch._export.serde.schema import SCHEMA_VERSION

    from pipeline.torch_archive import parameter_names

    extra = load(program_tensors) if program_tensors else {}
    params = parameter_names(json.loads(program_json))
    full = {k[len(STATE):]: v for k, v in extra.items() if k.startswith(STATE)} | dict(state)
    full = {k: nn.Parameter(v.detach().clone(), requires_grad=False) if k in params else v.detach().clone()
            for k, v in full.items()}
    constants = {k[len(CONSTANT):]: v for k, v in extra.items() if k.startswith(CONSTANT)}

    def saved(obj) -> bytes:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()

    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("serialized_exported_program.json", program_json)
        zf.writestr("serialized_state_dict.json", saved(full))
        zf.writestr("serialized_constants.json", saved(constants))
        zf.writestr("version", str(SCHEMA_VERSION))
