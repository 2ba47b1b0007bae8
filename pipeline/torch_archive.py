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
  by the restricted unpickler above and handed to the deserializer already loaded;
- what is read is bounded before it is allocated (the ``MAX_*`` constants below): the zip
  directory's entry count, each member's declared size against a limit and against its
  compressed size (and no member inflates past what it declares), a sparse file, the bytes the
  tensors of one file materialise (no stride 0 or overlapping strides), symbolic-shape powers and
  module-stack nesting.

Every refusal is a :class:`CheckpointError` with one line that names what was refused.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import pickle
import re
import threading
import zipfile
from collections import OrderedDict
from pathlib import Path
from types import MappingProxyType
from typing import Any, BinaryIO

import torch

from zoocore.errors import CheckpointError, first_line

# Bounds. Each one is checked against the zip directory (or the file's size) before the bytes it
# bounds are read, so a reader's memory is known before it allocates; reading time is linear in it.
MAX_PICKLE_BYTES = 64 * 2**20          # data.pkl of a state dict is ~100 bytes per tensor: 64 MiB is ~600k tensors
MAX_MEMBER_BYTES = 16 * 2**30          # one storage; torch.save stores it uncompressed, so it is this big on disk
MAX_JSON_BYTES = 256 * 2**20           # a .pt2 archive's graph (a few MB for a large transformer)
MAX_BYTEORDER_BYTES = 16               # the member holds "little" or "big"
MAX_VERSION_BYTES = 64                 # a .pt2 archive's schema version: a short number
MAX_INFLATION_RATIO = 100              # declared/compressed size of a member: torch.save writes 1 (stored), a
#                                        re-zipped archive deflates weights ~1.1x and pickles ~5x; bombs reach 1000x
RATIO_FREE_BYTES = 2**20               # a member under 1 MiB may inflate at any ratio (an all-zero buffer
#                                        deflates 1000x), since it costs at most 1 MiB
READ_CHUNK_BYTES = 2**20               # a member is inflated 1 MiB at a time and never past its declared size
MAX_TENSORS = 200_000                  # tensors rebuilt from one data.pkl: a 70B-parameter model has ~1,000; each
#                                        costs ~400 bytes of Python objects even when empty
MAX_ARCHIVE_MEMBERS = MAX_TENSORS + 16  # one member per storage plus data.pkl, byteorder, version...; zipfile
#                                        holds ~400 bytes per directory entry, counted before it lists them
MAX_TENSOR_DIMS = 64                   # a state dict's tensors have a handful of dimensions
MAX_VIEW_FACTOR = 4                    # bytes the tensors of one file materialise, over the bytes its storages
#                                        hold: a weight and its transpose, or tied weights, make 2
VIEW_SLACK_BYTES = 2**20               # ... plus 1 MiB, so a file of a few scalar views of one storage reads
SPARSE_FREE_BYTES = 64 * 2**20         # a file up to 64 MiB is read even if sparse: it costs at most 64 MiB
MIN_STORED_FRACTION = 0.5              # a larger file must have at least half its length on disk: a file written
#                                        normally stores all of it; a hole is read back as zeros, i.e. allocated
TORCHSCRIPT_MEMBERS = ("constants.pkl", "code/", ".debug_pkl", "extra/", "attributes.pkl")

_DTYPES = MappingProxyType({
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128,
})


def refuse_sparse(path: str | Path, where: str) -> int:
    """The size of the file at ``path``; CheckpointError when it is over ``SPARSE_FREE_BYTES`` and
    less than ``MIN_STORED_FRACTION`` of it is stored on disk (holes read back as zeros: a file of a
    few stored bytes could make a reader allocate gigabytes). A hole is confirmed with
    ``SEEK_HOLE`` where the file system answers it, so one that reports no blocks is not refused."""
    st = os.stat(path)
    if st.st_size <= SPARSE_FREE_BYTES or st.st_blocks * 512 >= st.st_size * MIN_STORED_FRACTION:
        return st.st_size
    seek_hole = getattr(os, "SEEK_HOLE", None)
    if seek_hole is not None:
        try:
            with open(path, "rb") as fh:
                if os.lseek(fh.fileno(), 0, seek_hole) >= st.st_size:
                    return st.st_size
        except OSError:
            return st.st_size
    raise CheckpointError(f"{where}: a sparse file ({st.st_size} bytes long, {st.st_blocks * 512} stored on disk); "
                          f"a file over {SPARSE_FREE_BYTES} bytes must store at least {MIN_STORED_FRACTION:.0%} of "
                          "its length, so it is not read")


class _Frozen:
    """Base of the objects a pickle can reach through ``find_class`` or a storage reference: their
    attributes are set once, here, and neither ``BUILD`` (``__setstate__``) nor ``setattr`` can change
    them, so a crafted ``data.pkl`` cannot poison a later read (each load makes fresh ones anyway)."""

    __slots__ = ()

    def __init__(self, **values):
        for key, value in values.items():
            object.__setattr__(self, key, value)

    def __setattr__(self, key, value):
        raise CheckpointError(f"refused to set the attribute {str(key)[:40]!r} of {self!r}")

    def __delattr__(self, key):
        raise CheckpointError(f"refused to delete the attribute {str(key)[:40]!r} of {self!r}")

    def __setstate__(self, state):
        raise CheckpointError(f"refused to set the state of {self!r} (a pickle BUILD on a global)")


class _Global(_Frozen):
    """What ``GLOBAL module name`` becomes for a callable the reader allows: this module's function."""

    __slots__ = ("name", "fn")

    def __call__(self, *args):
        return self.fn(*args)

    def __repr__(self):
        return f"the global {self.name}"


class _StorageType(_Frozen):
    """What ``GLOBAL torch FloatStorage`` becomes: a dtype, not torch's class."""

    __slots__ = ("name", "dtype")

    def __repr__(self):
        return f"the global torch.{self.name}"


class _Storage(_Frozen):
    """A ``data/<key>`` member: its bytes (None when only shapes are read) as ``dtype``."""

    __slots__ = ("key", "dtype", "data", "numel")

    def __repr__(self):
        return f"storage {self.key!r}"


def _overlaps(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether two indices of a view of this size and stride could reach one element (a stride of 0
    over a dimension of more than one, or strides that interleave): such a view materialises more
    elements than its storage holds. Sufficient test, as torch's: dimensions by stride, each stride
    past the span of the smaller ones."""
    span = 0
    for n, s in sorted(((n, s) for n, s in zip(size, stride) if n > 1), key=lambda d: d[1]):
        if s <= span:
            return True
        span += (n - 1) * s
    return False


def _rebuild_parameter(data, requires_grad=False, hooks=None, *state):
    if not isinstance(data, torch.Tensor):
        raise CheckpointError("a parameter that is not a tensor")
    return torch.nn.Parameter(data, requires_grad=bool(requires_grad) and data.is_floating_point())


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles the ``data.pkl`` of a ``torch.save`` archive into dicts, lists and tensors only.

    Every global the pickle names is looked up in this load's own table (``OrderedDict``, the two
    rebuild functions, the typed storages), each a fresh, frozen object wrapping this module's
    functions; anything else is refused by name before it could be imported. Storages are read
    from the archive through ``read_storage(key, dtype, numel)``. Each tensor is checked before it
    is made: in its storage's bounds, no overlapping strides, at most ``MAX_TENSORS`` of them, and
    all of them together at most ``MAX_VIEW_FACTOR`` times the bytes of the storages referenced so
    far plus ``VIEW_SLACK_BYTES``. A tensor the pickle changed after it was made (``BUILD`` on a
    tensor calls its ``__setstate__``, i.e. ``set_``) is refused by :meth:`load`.
    """

    def __init__(self, file: BinaryIO, read_storage):
        super().__init__(file)
        self._read_storage = read_storage
        self._stored: dict[int, int] = {}       # id(storage) -> its bytes
        self._viewed = 0
        self._made: dict[int, tuple] = {}       # id -> (tensor, what it was made as)
        self._globals = MappingProxyType({
            ("collections", "OrderedDict"): _Global(name="collections.OrderedDict", fn=OrderedDict),
            ("torch._utils", "_rebuild_tensor_v2"): _Global(name="torch._utils._rebuild_tensor_v2",
                                                            fn=self._rebuild_tensor),
            ("torch._utils", "_rebuild_parameter"): _Global(name="torch._utils._rebuild_parameter",
                                                            fn=self._rebuild_parameter),
            **{("torch", name): _StorageType(name=name, dtype=dtype) for name, dtype in _DTYPES.items()},
        })

    def find_class(self, module: str, name: str):
        found = self._globals.get((module, name))
        if found is None:
            raise CheckpointError(f"refused to load the global {module}.{name}: a state dict holds tensors only "
                                  "(the file may carry code)")
        return found

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)
                and isinstance(pid[2], str) and isinstance(pid[4], int) and pid[4] >= 0):
            raise CheckpointError(f"refused an unknown persistent reference of kind {str(pid[:1])[:40]}")
        storage = self._read_storage(pid[2], pid[1].dtype, pid[4])
        self._stored[id(storage)] = storage.numel * storage.dtype.itemsize
        return storage

    def _made_as(self, tensor: torch.Tensor) -> torch.Tensor:
        self._made[id(tensor)] = (tensor, _signature(tensor))
        return tensor

    def _rebuild_tensor(self, storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None):
        count = len(self._made) + 1
        what = f"tensor #{count}"
        if not isinstance(storage, _Storage):
            raise CheckpointError(f"{what}: its storage is not one of the archive's data members")
        if not (isinstance(size, (tuple, list)) and isinstance(stride, (tuple, list))
                and len(size) <= MAX_TENSOR_DIMS and len(size) == len(stride)):
            raise CheckpointError(f"{what} (storage {storage.key!r}): a malformed size or stride")
        size, stride = tuple(size), tuple(stride)
        if not (type(offset) is int and all(type(x) is int and x >= 0 for x in size + stride) and offset >= 0):
            raise CheckpointError(f"{what} (storage {storage.key!r}): a malformed size, stride or offset")
        what = f"{what} of size {list(size)[:8]} and stride {list(stride)[:8]} (storage {storage.key!r})"
        numel = math.prod(size)
        if count > MAX_TENSORS:
            raise CheckpointError(f"{what}: more than {MAX_TENSORS} tensors in one file")
        if numel:
            last = offset + sum((n - 1) * s for n, s in zip(size, stride))
            if last >= storage.numel:
                raise CheckpointError(f"{what} reaches past its storage of {storage.numel} elements")
            if numel > storage.numel or _overlaps(size, stride):
                raise CheckpointError(f"{what} has overlapping strides: it would materialise {numel} elements "
                                      f"from a storage of {storage.numel}")
        self._viewed += numel * storage.dtype.itemsize
        budget = MAX_VIEW_FACTOR * sum(self._stored.values()) + VIEW_SLACK_BYTES
        if self._viewed > budget:
            raise CheckpointError(f"{what}: the file's tensors materialise over {budget} bytes, {MAX_VIEW_FACTOR}x "
                                  f"what its storages hold (+{VIEW_SLACK_BYTES})")
        if storage.data is None:          # shapes only: nothing was read
            return self._made_as(torch.empty(size, dtype=storage.dtype, device="meta"))
        flat = torch.frombuffer(storage.data, dtype=storage.dtype) if storage.numel else \
            torch.empty(0, dtype=storage.dtype)
        return self._made_as(flat.as_strided(size, stride, offset).clone())

    def _rebuild_parameter(self, data, requires_grad=False, hooks=None, *state):
        if not (isinstance(data, torch.Tensor) and id(data) in self._made):
            raise CheckpointError("a parameter that is not a tensor of this file")
        return self._made_as(_rebuild_parameter(data, requires_grad))

    def load(self):
        """The unpickled object, once every tensor in it is checked to be as it was made."""
        result = super().load()
        seen, todo = set(), [result]
        while todo:
            item = todo.pop()
            if id(item) in seen:
                continue
            seen.add(id(item))
            if isinstance(item, torch.Tensor):
                made = self._made.get(id(item))
                if made is None or made[0] is not item or _signature(item) != made[1]:
                    raise CheckpointError("a tensor the pickle changed after it was made (a BUILD on a tensor), "
                                          "or not made from the archive")
            elif isinstance(item, dict):
                todo.extend(item.keys())
                todo.extend(item.values())
                todo.extend(getattr(item, "__dict__", {}).values())
            elif isinstance(item, (list, tuple, set, frozenset)):
                todo.extend(item)
        return result


def _signature(t: torch.Tensor) -> tuple:
    """What a tensor was made as: class, geometry, memory, grad state and hooks."""
    return (type(t), t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.untyped_storage().data_ptr(),
            t.requires_grad, t._backward_hooks is None)


def refuse_torchscript(names: list[str], where: str) -> None:
    """A TorchScript archive is refused by its members, before anything in it is read."""
    for name in names:
        inner = name.split("/", 1)[1] if "/" in name else name
        if any(inner == m or inner.startswith(m) for m in TORCHSCRIPT_MEMBERS):
            raise CheckpointError(f"{where}: a TorchScript archive (member {name!r}), not a state dict; TorchScript "
                                  "runs code when loaded and is not read (save the weights with torch.save(model."
                                  "state_dict()) or as .safetensors)")


def _open_zip(raw, where: str) -> zipfile.ZipFile:
    """The zip archive, its directory's entry count checked before zipfile lists it."""
    try:
        end = zipfile._EndRecData(raw)          # the end-of-directory record zipfile itself reads first
    except (AttributeError, OSError):
        end = None
    if end and end[zipfile._ECD_ENTRIES_TOTAL] > MAX_ARCHIVE_MEMBERS:
        raise CheckpointError(f"{where}: the archive lists {end[zipfile._ECD_ENTRIES_TOTAL]} members, over the "
                              f"limit of {MAX_ARCHIVE_MEMBERS}")
    raw.seek(0)
    return zipfile.ZipFile(raw)


def check_member(info: zipfile.ZipInfo, limit: int, where: str) -> None:
    """Refuse a member, from its directory entry alone, whose declared size is over ``limit`` or,
    above ``RATIO_FREE_BYTES``, over ``MAX_INFLATION_RATIO`` times its compressed size, or which is
    compressed other than by deflate."""
    declared, stored, name = info.file_size, info.compress_size, info.filename
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise CheckpointError(f"{where}: member {name!r} uses compression method {info.compress_type}; only "
                              "stored and deflated members are read")
    if declared > limit:
        raise CheckpointError(f"{where}: member {name!r} declares {declared} bytes, over the limit of {limit}")
    if info.compress_type == zipfile.ZIP_STORED and declared != stored:
        raise CheckpointError(f"{where}: member {name!r} is stored uncompressed but declares {declared} bytes "
                              f"and stores {stored}")
    if declared > RATIO_FREE_BYTES and declared > MAX_INFLATION_RATIO * stored:
        raise CheckpointError(f"{where}: member {name!r} declares {declared} bytes from {stored} compressed, over "
                              f"the ratio of {MAX_INFLATION_RATIO} (a zip bomb?)")


def read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int, where: str) -> bytearray:
    """A member's bytes, checked by :func:`check_member` before anything is allocated, then inflated
    ``READ_CHUNK_BYTES`` at a time and refused if it inflates to more or less than it declares."""
    check_member(info, limit, where)
    declared, name = info.file_size, info.filename
    data = bytearray(declared)
    got = 0
    with zf.open(info) as fh:
        while True:
            chunk = fh.read(min(READ_CHUNK_BYTES, declared - got + 1))
            if not chunk:
                break
            if got + len(chunk) > declared:
                raise CheckpointError(f"{where}: member {name!r} inflates past the {declared} bytes it declares")
            data[got:got + len(chunk)] = chunk
            got += len(chunk)
    if got != declared:
        raise CheckpointError(f"{where}: member {name!r} is cut short ({got} of {declared} bytes)")
    return data


def load_torch_zip(source: str | Path | bytes | bytearray, where: str | None = None,
                   shapes_only: bool = False) -> Any:
    """The object a ``torch.save`` zip archive holds, read without torch.load: tensors, dicts, lists
    and plain values only. ``source`` is a path or the archive's bytes; ``shapes_only`` reads no
    tensor data and gives tensors on the meta device."""
    in_memory = isinstance(source, (bytes, bytearray))
    where = where or (str(source) if not in_memory else "archive")
    try:
        if not in_memory:
            refuse_sparse(source, where)
        with (io.BytesIO(source) if in_memory else open(source, "rb")) as raw:
            if not zipfile.is_zipfile(raw):
                raise CheckpointError(f"{where}: not a torch.save zip archive; pickle files of torch < 1.6 (and any "
                                      "other pickle) are not read, since unpickling runs code: re-save the weights "
                                      "as .safetensors or with a current torch.save")
            with _open_zip(raw, where) as zf:
                return _load_zip(zf, where, shapes_only)
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError,
            RecursionError, MemoryError, RuntimeError, OverflowError, pickle.UnpicklingError,
            UnicodeDecodeError) as exc:
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
    if order is not None and read_member(zf, order, MAX_BYTEORDER_BYTES, where).strip() not in (b"little", b""):
        raise CheckpointError(f"{where}: a big-endian archive is not supported")
    pickled = read_member(zf, infos[pkls[0]], MAX_PICKLE_BYTES, where)
    storages: dict[str, _Storage] = {}

    def read_storage(key: str, dtype: torch.dtype, numel: int) -> _Storage:
        if key in storages:
            return storages[key]
        info = infos.get(f"{prefix}/data/{key}")
        nbytes = numel * dtype.itemsize
        if info is None:
            raise CheckpointError(f"storage {key!r} is missing from the archive")
        if nbytes > MAX_MEMBER_BYTES or info.file_size != nbytes:
            raise CheckpointError(f"storage {key!r} holds {info.file_size} bytes, its tensor needs {nbytes}")
        if shapes_only:
            check_member(info, MAX_MEMBER_BYTES, where)         # refused as a full read would refuse it
        data = None if shapes_only else read_member(zf, info, MAX_MEMBER_BYTES, where)
        storages[key] = _Storage(key=key, dtype=dtype, data=data, numel=numel)
        return storages[key]

    try:
        return RestrictedUnpickler(io.BytesIO(pickled), read_storage).load()
    except CheckpointError as exc:
        raise CheckpointError(str(exc) if str(exc).startswith(f"{where}: ") else f"{where}: {exc}") from None


def load_tensor_dict(source: str | Path | bytes | bytearray, where: str | None = None,
                     shapes_only: bool = False) -> dict[str, torch.Tensor]:
    """A state dict of tensors from a ``torch.save`` archive (``{"state_dict": ...}`` unwrapped)."""
    where = where or (str(source) if not isinstance(source, (bytes, bytearray)) else "archive")
    state = load_torch_zip(source, where, shapes_only)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise CheckpointError(f"{where}: not a state dict of tensors")
    return dict(state)


# ------------------------------------------------------------------------------------ torch.export
_SYMBOLIC = re.compile(r"^[\sA-Za-z0-9_+\-*/%().,]*$")
_SYMBOL_WORDS = frozenset({"Mod", "FloorDiv", "CeilDiv", "floor", "ceiling", "Max", "Min", "Abs", "oo"})
MAX_EXPRESSION_CHARS = 1000           # sympy prints a shape as a short sum of products of symbols
MAX_EXPONENT = 64                     # sympy evaluates a**b of literals: a literal exponent up to 64 over a
#                                        1000-digit base costs milliseconds; 9**9**9 (nested) never ends
MAX_MODULE_STACK_CHARS = 64 * 2**10   # one node's nn_module_stack: a few hundred bytes per level
MAX_GETATTR_NESTING = 32              # getattr( nested in one module path (an nn.Sequential inside
#                                        another): each level costs _repair_module_paths a pass
_OPERATORS = {"getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pow", "eq", "ne", "lt",
              "le", "gt", "ge", "and_", "or_", "not_"}
_IO_OPS = {"from_file", "_save", "save", "load", "_load_for_mobile"}
_LOCK = threading.Lock()


def _check_expression(text: Any, where: str) -> None:
    """Refuse a symbolic shape (which torch hands to sympify, i.e. eval) unless it is short arithmetic
    over shape symbols whose powers, if any, have a literal exponent up to ``MAX_EXPONENT`` and a
    base without a power in it: sympy evaluates powers of literals, and a nested one never ends."""
    if not isinstance(text, str) or len(text) > MAX_EXPRESSION_CHARS or not _SYMBOLIC.match(text) or "__" in text:
        raise CheckpointError(f"{where}: refused a symbolic shape expression {str(text)[:60]!r} (only arithmetic "
                              f"over shape symbols, up to {MAX_EXPRESSION_CHARS} characters, is read)")
    for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text):
        if not re.fullmatch(r"[sui]\d+", word) and word not in _SYMBOL_WORDS:
            raise CheckpointError(f"{where}: refused the name {word!r} in a symbolic shape expression")
    for power in re.finditer(r"\*\*", text):
        exponent = re.match(r"\s*(\d+)\s*", text[power.end():])
        after = text[power.end() + exponent.end():] if exponent else ""
        if (exponent is None or int(exponent.group(1).lstrip("0")[:3] or 0) > MAX_EXPONENT
                or after.startswith(("**", ".")) or "**" in _power_base(text[:power.start()])):
            raise CheckpointError(f"{where}: refused the power in the symbolic shape expression {text[:60]!r} (an "
                                  f"exponent must be a literal up to {MAX_EXPONENT} over a base without a power)")


def _power_base(before: str) -> str:
    """The base of a power whose text ends ``before`` it: a parenthesised group or a name or number."""
    end = len(before.rstrip())
    if end and before[end - 1] == ")":
        depth = 0
        for i in range(end - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(before[i], 0)
            if depth == 0:
                return before[i:end]
        return before[:end]
    return re.search(r"[A-Za-z0-9_.]*$", before[:end]).group(0)


def _check_target(target: Any, where: str) -> None:
    if not isinstance(target, str):
        raise CheckpointError(f"{where}: a graph node without a target name")
    from pipeline.neural_graph.program_policy import refuse_target

    parts = target.split(".")
    if parts[0] == "_operator" and len(parts) == 2 and parts[1] in _OPERATORS:
        return
    if target.startswith("torch.ops.aten.") and len(parts) == 5 and parts[3] not in _IO_OPS:
        refuse_target(target, where)        # and only the kinds a kept program may call
        return
    raise CheckpointError(f"{where}: refused the graph call target {target[:80]!r} (only ATen operators are read)")


def check_exported_program(program: Any, where: str) -> None:
    """Walk a ``.pt2`` graph (parsed JSON) and refuse what torch's deserializer would evaluate or run,
    then what a kept program may not hold (``program_policy``: dead nodes, factories larger than
    the state, constants, layouts)."""
    from pipeline.neural_graph.program_policy import check_serialized

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
            stack.extend(reversed(item))          # nodes in graph order: the first refused is named
    current = torch._C._get_max_operator_version()
    opsets = program.get("opset_version") or {}
    if opsets.get("aten", current) != current or set(opsets) - {"aten"}:
        raise CheckpointError(f"{where}: operator set {opsets} is not this torch's (aten {current}); torch would "
                              "retrace, i.e. run, the graph to upgrade it, so it is not read")
    check_serialized(program, where)


def _read_member(zf: zipfile.ZipFile, name: str, limit: int, where: str) -> bytes:
    try:
        info = zf.getinfo(name)
    except KeyError:
        raise CheckpointError(f"{where}: not a torch.export archive (no member {name!r})") from None
    return bytes(read_member(zf, info, limit, where))


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
        refuse_sparse(path, where)
        if not zipfile.is_zipfile(path):
            raise CheckpointError(f"{where}: not a torch.export archive (not a zip file)")
        with open(path, "rb") as raw, _open_zip(raw, where) as zf:
            names = zf.namelist()
            refuse_torchscript(names, where)
            from torch._export.serde.schema import SCHEMA_VERSION

            version = _read_member(zf, "version", MAX_VERSION_BYTES, where).strip()
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


def _repair_module_paths(program: dict, where: str) -> None:
    """torch 2.2 writes a module path such as ``getattr(L['fn'], '0')`` (any ``nn.Sequential``
    child) into a comma-separated record its own reader splits on commas, so it cannot read back
    what it saved: rewrite such paths dotted (``L['fn'].0``, what the plan's tracer reads anyway).
    A stack over ``MAX_MODULE_STACK_CHARS`` or a path nesting ``getattr(`` more than
    ``MAX_GETATTR_NESTING`` deep is refused first (each level costs a pass over the path)."""
    for i, node in enumerate(program["graph_module"]["graph"]["nodes"]):
        meta = node.get("metadata") or {}
        stack = meta.get("nn_module_stack")
        if not isinstance(stack, str) or "getattr(" not in stack:
            continue
        what = f"{where}: refused the module stack of graph node {i} ({str(node.get('target'))[:60]})"
        if len(stack) > MAX_MODULE_STACK_CHARS:
            raise CheckpointError(f"{what}: {len(stack)} characters, over the limit of {MAX_MODULE_STACK_CHARS}")
        entries = []
        for entry in stack.split(";"):
            parts = entry.split(",")
            path = ",".join(parts[1:-1])
            if path.count("getattr(") > MAX_GETATTR_NESTING:
                raise CheckpointError(f"{what}: getattr( nested {path.count('getattr(')} deep in one module path, "
                                      f"over the limit of {MAX_GETATTR_NESTING}")
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
        _repair_module_paths(parsed, where)
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
