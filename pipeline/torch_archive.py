"""Reading ``torch.save`` and ``torch.export`` archives without handing them to torch.

torch 2.2.1 (the newest DGL allows) is not safe on hostile files even with
``torch.load(weights_only=True)``: a TorchScript archive is passed to ``torch.jit.load``, which runs
the archive's ``__setstate__`` (the class of CVE-2025-32434), and ``torch.export.load`` calls a plain
``torch.load`` on two inner members and ``sympy.sympify`` (``eval``) on symbolic-shape strings.
So this module parses the zip itself:

- a TorchScript archive (``constants.pkl``, ``code/`` members) is refused by its members before
  anything is read;
- ``data.pkl`` is read by :class:`RestrictedUnpickler`, which knows exactly the handful of globals
  a state dict of tensors needs (``OrderedDict``, ``_rebuild_tensor_v2``, ``_rebuild_parameter``,
  the typed storages) and maps each to a function of this module: any other global is refused by
  name, so no callable from the file is ever looked up, let alone called;
- tensor bytes come from the archive's ``data/<key>`` members, their sizes checked against the
  declared shapes, strides and offsets before a tensor is made;
- a ``.pt2`` archive's graph (JSON) is checked before torch's deserializer sees it: symbolic
  expressions must be plain arithmetic over shape symbols, call targets must be ATen operators
  (never file I/O ones) or plain operators, the operator-set version must be the current one (an
  older one would make torch retrace, i.e. run, the graph). Its state dict and constants are read
  by the restricted unpickler above and handed to the deserializer already loaded.

Every refusal is a :class:`CheckpointError` with one line that names what was refused.
"""
from __future__ import annotations

import contextlib
import io
import json
import pickle
import re
import threading
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, BinaryIO

import torch

from zoocore.errors import CheckpointError, first_line

MAX_PICKLE_BYTES = 64 * 2**20          # data.pkl of a state dict is a few kB per tensor
MAX_MEMBER_BYTES = 16 * 2**30          # one tensor's storage
MAX_JSON_BYTES = 256 * 2**20           # a .pt2 archive's graph
TORCHSCRIPT_MEMBERS = ("constants.pkl", "code/", ".debug_pkl", "extra/", "attributes.pkl")

_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128,
}


class _StorageType:
    """What ``GLOBAL torch FloatStorage`` becomes: a dtype, not torch's class."""

    def __init__(self, name: str):
        self.dtype = _DTYPES[name]


class _Storage:
    def __init__(self, dtype: torch.dtype, data: bytes, numel: int):
        self.dtype, self.data, self.numel = dtype, data, numel


def _rebuild_tensor(storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    if not isinstance(storage, _Storage):
        raise CheckpointError("a tensor whose storage is not one of the archive's data members")
    size, stride = tuple(size), tuple(stride)
    if not (isinstance(offset, int) and all(isinstance(x, int) and x >= 0 for x in size + stride)
            and len(size) == len(stride) and offset >= 0):
        raise CheckpointError("a tensor with a malformed size, stride or offset")
    if all(size):
        last = offset + sum((n - 1) * s for n, s in zip(size, stride))
        if last >= storage.numel:
            raise CheckpointError(f"a tensor of size {list(size)} reaches past its storage of {storage.numel} elements")
    if storage.data is None:          # shapes only: nothing was read
        return torch.empty(size, dtype=storage.dtype, device="meta")
    flat = torch.frombuffer(bytearray(storage.data), dtype=storage.dtype) if storage.numel else \
        torch.empty(0, dtype=storage.dtype)
    return flat.as_strided(size, stride, offset).clone()


def _rebuild_parameter(data, requires_grad=False, hooks=None, *state):
    if not isinstance(data, torch.Tensor):
        raise CheckpointError("a parameter that is not a tensor")
    return torch.nn.Parameter(data, requires_grad=bool(requires_grad) and data.is_floating_point())


_SAFE_GLOBALS = {
    ("collections", "OrderedDict"): OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    **{("torch", name): _StorageType(name) for name in _DTYPES},
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles the ``data.pkl`` of a ``torch.save`` archive into dicts, lists and tensors only.

    Every global the pickle names is looked up in ``_SAFE_GLOBALS`` (this module's own functions);
    anything else is refused by name before it could be imported. Storages are read from the
    archive through ``read_storage(key, dtype, numel)``.
    """

    def __init__(self, file: BinaryIO, read_storage):
        super().__init__(file)
        self._read_storage = read_storage

    def find_class(self, module: str, name: str):
        found = _SAFE_GLOBALS.get((module, name))
        if found is None:
            raise CheckpointError(f"refused to load the global {module}.{name}: a state dict holds tensors only "
                                  "(the file may carry code)")
        return found

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)
                and isinstance(pid[2], str) and isinstance(pid[4], int) and pid[4] >= 0):
            raise CheckpointError(f"refused an unknown persistent reference of kind {str(pid[:1])[:40]}")
        return self._read_storage(pid[2], pid[1].dtype, pid[4])


def refuse_torchscript(names: list[str], where: str) -> None:
    """A TorchScript archive is refused by its members, before anything in it is read."""
    for name in names:
        inner = name.split("/", 1)[1] if "/" in name else name
        if any(inner == m or inner.startswith(m) for m in TORCHSCRIPT_MEMBERS):
            raise CheckpointError(f"{where}: a TorchScript archive (member {name!r}), not a state dict; TorchScript "
                                  "runs code when loaded and is not read (save the weights with torch.save(model."
                                  "state_dict()) or as .safetensors)")


def load_torch_zip(source: str | Path | bytes, where: str | None = None, shapes_only: bool = False) -> Any:
    """The object a ``torch.save`` zip archive holds, read without torch.load: tensors, dicts, lists
    and plain values only. ``source`` is a path or the archive's bytes; ``shapes_only`` reads no
    tensor data and gives tensors on the meta device."""
    where = where or (str(source) if not isinstance(source, bytes) else "archive")
    raw = io.BytesIO(source) if isinstance(source, bytes) else source
    try:
        if not zipfile.is_zipfile(raw):
            raise CheckpointError(f"{where}: not a torch.save zip archive; pickle files of torch < 1.6 (and any "
                                  "other pickle) are not read, since unpickling runs code: re-save the weights "
                                  "as .safetensors or with a current torch.save")
        with zipfile.ZipFile(raw) as zf:
            return _load_zip(zf, where, shapes_only)
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError,
            RecursionError, MemoryError, RuntimeError, pickle.UnpicklingError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{where}: cannot read the archive: {first_line(exc)}") from exc


def _load_zip(zf: zipfile.ZipFile, where: str, shapes_only: bool = False) -> Any:
    infos = {i.filename: i for i in zf.infolist()}
    refuse_torchscript(list(infos), where)
    pkls = [n for n in infos if n.endswith("data.pkl") and n.count("/") == 1]
    if len(pkls) != 1:
        raise CheckpointError(f"{where}: not a torch.save archive (expected one <name>/data.pkl member, "
                              f"found {len(pkls)})")
    prefix = pkls[0].rsplit("/", 1)[0]
    order = infos.get(f"{prefix}/byteorder")
    if order is not None and zf.read(order).strip() not in (b"little", b""):
        raise CheckpointError(f"{where}: a big-endian archive is not supported")
    if infos[pkls[0]].file_size > MAX_PICKLE_BYTES:
        raise CheckpointError(f"{where}: data.pkl declares {infos[pkls[0]].file_size} bytes, more than a state "
                              f"dict's {MAX_PICKLE_BYTES}")
    storages: dict[str, _Storage] = {}

    def read_storage(key: str, dtype: torch.dtype, numel: int) -> _Storage:
        if key in storages:
            return storages[key]
        info = infos.get(f"{prefix}/data/{key}")
        nbytes = numel * dtype.itemsize
        if info is None:
            raise CheckpointError(f"{where}: storage {key!r} is missing from the archive")
        if nbytes > MAX_MEMBER_BYTES or info.file_size != nbytes:
            raise CheckpointError(f"{where}: storage {key!r} holds {info.file_size} bytes, its tensor needs {nbytes}")
        storages[key] = _Storage(dtype, None if shapes_only else zf.read(info), numel)
        return storages[key]

    try:
        return RestrictedUnpickler(io.BytesIO(zf.read(infos[pkls[0]])), read_storage).load()
    except CheckpointError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def load_tensor_dict(source: str | Path | bytes, where: str | None = None,
                     shapes_only: bool = False) -> dict[str, torch.Tensor]:
    """A state dict of tensors from a ``torch.save`` archive (``{"state_dict": ...}`` unwrapped)."""
    where = where or (str(source) if not isinstance(source, bytes) else "archive")
    state = load_torch_zip(source, where, shapes_only)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise CheckpointError(f"{where}: not a state dict of tensors")
    return dict(state)


# ------------------------------------------------------------------------------------ torch.export
_SYMBOLIC = re.compile(r"^[\sA-Za-z0-9_+\-*/%().,]*$")
_SYMBOL_WORDS = {"Mod", "FloorDiv", "CeilDiv", "floor", "ceiling", "Max", "Min", "Abs", "oo"}
_OPERATORS = {"getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pow", "eq", "ne", "lt",
              "le", "gt", "ge", "and_", "or_", "not_"}
_IO_OPS = {"from_file", "_save", "save", "load", "_load_for_mobile"}
_LOCK = threading.Lock()


def _check_expression(text: Any, where: str) -> None:
    if not isinstance(text, str) or len(text) > 1000 or not _SYMBOLIC.match(text) or "__" in text:
        raise CheckpointError(f"{where}: refused a symbolic shape expression {str(text)[:60]!r} (only arithmetic "
                              "over shape symbols is read)")
    for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text):
        if not re.fullmatch(r"[sui]\d+", word) and word not in _SYMBOL_WORDS:
            raise CheckpointError(f"{where}: refused the name {word!r} in a symbolic shape expression")


def _check_target(target: Any, where: str) -> None:
    if not isinstance(target, str):
        raise CheckpointError(f"{where}: a graph node without a target name")
    parts = target.split(".")
    if parts[0] == "_operator" and len(parts) == 2 and parts[1] in _OPERATORS:
        return
    if target.startswith("torch.ops.aten.") and len(parts) == 5 and parts[3] not in _IO_OPS:
        return
    raise CheckpointError(f"{where}: refused the graph call target {target[:80]!r} (only ATen operators are read)")


def check_exported_program(program: Any, where: str) -> None:
    """Walk a ``.pt2`` graph (parsed JSON) and refuse what torch's deserializer would evaluate or run."""
    stack = [program]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                if key == "expr_str":
                    _check_expression(value, where)
                elif key == "target" and "inputs" in item:
                    _check_target(value, where)
                else:
                    stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)
    current = torch._C._get_max_operator_version()
    opsets = program.get("opset_version") or {}
    if opsets.get("aten", current) != current or set(opsets) - {"aten"}:
        raise CheckpointError(f"{where}: operator set {opsets} is not this torch's (aten {current}); torch would "
                              "retrace, i.e. run, the graph to upgrade it, so it is not read")


def _read_member(zf: zipfile.ZipFile, name: str, limit: int, where: str) -> bytes:
    try:
        info = zf.getinfo(name)
    except KeyError:
        raise CheckpointError(f"{where}: not a torch.export archive (no member {name!r})") from None
    if info.file_size > limit:
        raise CheckpointError(f"{where}: member {name!r} declares {info.file_size} bytes, over the limit of {limit}")
    return zf.read(info)


def _inner_dict(data: bytes, where: str) -> dict:
    """A ``.pt2`` archive's state dict or constants: a ``torch.save`` archive of tensors, or nothing."""
    return load_tensor_dict(data, where) if data else {}


@contextlib.contextmanager
def _preloaded_artifacts():
    """torch's deserializer calls ``deserialize_torch_artifact`` (a plain torch.load) on the state
    dict and constants; hand it the dicts already read here instead, and refuse anything else."""
    from torch._export.serde import serialize

    original = serialize.deserialize_torch_artifact

    def preloaded(value):
        if isinstance(value, dict):
            return value
        raise CheckpointError("refused to hand archive bytes to torch.load")

    with _LOCK:
        serialize.deserialize_torch_artifact = preloaded
        try:
            yield
        finally:
            serialize.deserialize_torch_artifact = original


def load_exported(path: str | Path):
    """A ``torch.export`` archive (``.pt2``) as an ExportedProgram, read as the module describes."""
    where = str(path)
    try:
        if not zipfile.is_zipfile(path):
            raise CheckpointError(f"{where}: not a torch.export archive (not a zip file)")
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            refuse_torchscript(names, where)
            from torch._export.serde.schema import SCHEMA_VERSION

            version = _read_member(zf, "version", 64, where).strip()
            if version != str(SCHEMA_VERSION).encode():
                raise CheckpointError(f"{where}: torch.export schema version {version[:20]!r}, this torch reads "
                                      f"{SCHEMA_VERSION}")
            program = _read_member(zf, "serialized_exported_program.json", MAX_JSON_BYTES, where)
            state = _inner_dict(_read_member(zf, "serialized_state_dict.json", MAX_MEMBER_BYTES, where),
                                f"{where} (its state dict)")
            constants = _inner_dict(_read_member(zf, "serialized_constants.json", MAX_MEMBER_BYTES, where),
                                    f"{where} (its constants)")
        return deserialize_program(program, state, constants, where)
    except CheckpointError:
        raise
    except Exception as exc:        # zip and JSON errors on malformed input
        raise CheckpointError(f"{where}: cannot load torch.export archive: {first_line(exc)}") from exc


def parameter_names(program: dict) -> set:
    """The state-dict keys a ``.pt2`` program reads as parameters (not buffers or constants)."""
    return {(spec.get("parameter") or {}).get("parameter_name")
            for spec in program["graph_module"]["signature"]["input_specs"]}


def _repair_module_paths(program: dict) -> None:
    """torch 2.2 writes a module path such as ``getattr(L['fn'], '0')`` (any ``nn.Sequential``
    child) into a comma-separated record its own reader splits on commas, so it cannot read back
    what it saved: rewrite such paths dotted (``L['fn'].0``, what the plan's tracer reads anyway)."""
    for node in program["graph_module"]["graph"]["nodes"]:
        meta = node.get("metadata") or {}
        stack = meta.get("nn_module_stack")
        if not isinstance(stack, str) or "getattr(" not in stack:
            continue
        entries = []
        for entry in stack.split(";"):
            parts = entry.split(",")
            path = ",".join(parts[1:-1])
            while "getattr(" in path:
                fixed = re.sub(r"getattr\(([^(),]*), '([^']*)'\)", r"\1.\2", path)
                if fixed == path:
                    break
                path = fixed
            entries.append(",".join([parts[0], path.replace(",", ""), parts[-1]]) if len(parts) > 2 else entry)
        meta["nn_module_stack"] = ";".join(entries)


def deserialize_program(program: bytes | str, state: dict, constants: dict, where: str):
    """An ExportedProgram from its graph (the JSON of a ``.pt2`` archive, or of the catalog's
    ``architectures.program_json``) and tensors already read: the graph is checked first, as above."""
    try:
        if len(program) > MAX_JSON_BYTES:
            raise CheckpointError(f"{where}: the exported program is over {MAX_JSON_BYTES} bytes")
        parsed = json.loads(program)
        if not isinstance(parsed, dict):
            raise CheckpointError(f"{where}: the exported program is not a JSON object")
        check_exported_program(parsed, where)
        _repair_module_paths(parsed)
        params = parameter_names(parsed)
        state = {k: torch.nn.Parameter(v, requires_grad=False)
                 if k in params and not isinstance(v, torch.nn.Parameter) else v for k, v in state.items()}
        from torch._export.serde.schema import ExportedProgram as SerializedProgram
        from torch._export.serde.serialize import (ExportedProgramDeserializer, SerializedArtifact,
                                                   _dict_to_dataclass)

        serialized = _dict_to_dataclass(SerializedProgram, parsed)
        with _preloaded_artifacts():
            exported = ExportedProgramDeserializer().deserialize(SerializedArtifact(serialized, state, constants))
        exported.archive_program = json.dumps(parsed)       # checked and repaired: what the catalog keeps
        return exported
    except CheckpointError:
        raise
    except RecursionError:
        raise CheckpointError(f"{where}: the exported program is nested too deeply to read") from None
    except Exception as exc:        # torch's deserializer raises many kinds on malformed input
        raise CheckpointError(f"{where}: cannot load torch.export archive: {first_line(exc)}") from exc
