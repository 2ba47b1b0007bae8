"""Readers bound what they allocate by the bytes a file actually stores (security issue: each hole
below was demonstrated). Every hostile file is written for real (sparse ones with ``truncate`` or a
seek, so no disk is used), refused with one line naming it, and a normal file still reads."""
from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import struct
import time
import tracemalloc
import zipfile
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from pipeline import checkpoints, torch_archive
from pipeline.cli import main as pipeline_cli
from pipeline.formats.model_zoos import MAX_RESULT_LINE_BYTES, results_by_epoch
from pipeline.formats.small_cnn_zoo import NpyRows, SmallCNNZoo, read_layout
from tests.fixtures.model_zoos import write_model_zoo
from tests.fixtures.small_cnn_zoo import write_small_cnn_zoo
from zoocore.errors import CheckpointError, ZooGraphError

MiB = 2**20


def _refused(call, error, *words):
    """The one-line message ``call`` is refused with, checked to hold ``words``."""
    with pytest.raises(error) as exc:
        call()
    message = str(exc.value)
    assert "\n" not in message and all(w in message for w in words), message
    return message


# --------------------------------------------------------------------------- writing archives by hand
def _zip(path: Path, members: list[tuple], claim_entries: int | None = None) -> Path:
    """A zip written byte by byte. A member is ``(name, data)`` (stored), ``(name, hole_bytes)``
    (stored, its bytes a hole: the file is sparse) or ``(name, payload, method, crc, declared)``;
    ``claim_entries``: a zip64 end record that claims this many entries."""
    date = (1 << 5) | 1                                     # 1980-01-01
    central = io.BytesIO()
    with open(path, "wb") as fh:
        for member in members:
            name, data = member[0], member[1]
            if len(member) == 5:
                method, crc, declared, size = member[2], member[3], member[4], len(data)
            elif isinstance(data, int):
                method, crc, declared, size = 0, _zero_crc(data), data, data
            else:
                method, crc, declared, size = 0, zlib.crc32(data), len(data), len(data)
            raw, offset = name.encode(), fh.tell()
            fh.write(struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, method, 0, date, crc, size, declared, len(raw), 0)
                     + raw)
            if isinstance(data, int):
                fh.seek(data, os.SEEK_CUR)                  # a hole: nothing stored
            else:
                fh.write(data)
            central.write(struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, method, 0, date, crc, size, declared,
                                      len(raw), 0, 0, 0, 0, 0, offset) + raw)
        start, count = fh.tell(), len(members)
        fh.write(central.getvalue())
        if claim_entries is not None:
            end64 = fh.tell()
            fh.write(struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, claim_entries, claim_entries,
                                 len(central.getvalue()), start))
            fh.write(struct.pack("<4sLQL", b"PK\x06\x07", 0, end64, 1))
            count = 0xFFFF
        fh.write(struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count, len(central.getvalue()), start, 0))
    return path


def _zero_crc(n: int) -> int:
    crc, block = 0, bytes(MiB)
    while n:
        crc, n = zlib.crc32(block[:min(n, MiB)], crc), n - min(n, MiB)
    return crc


def _deflated(data: bytes, declared: int | None = None, crc_of: bytes | None = None) -> tuple:
    z = zlib.compressobj(9, zlib.DEFLATED, -15)
    payload = z.compress(data) + z.flush()
    return payload, zipfile.ZIP_DEFLATED, zlib.crc32(data if crc_of is None else crc_of), \
        len(data) if declared is None else declared


class _Ref:
    """A storage reference: pickled as torch.save does, ``("storage", FloatStorage, key, "cpu", numel)``."""

    def __init__(self, key: str, numel: int):
        self.key, self.numel = key, numel


class _View:
    """A tensor as torch.save pickles it: ``_rebuild_tensor_v2(storage, offset, size, stride, ...)``."""

    def __init__(self, ref: _Ref, size, stride, offset=0):
        self.args = (ref, offset, tuple(size), tuple(stride), False, OrderedDict())

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, self.args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel) if isinstance(obj, _Ref) else None


def _state_pickle(state) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(state)
    return buf.getvalue()


def _archive(path: Path, pickled: bytes, storages: dict[str, bytes | int]) -> Path:
    return _zip(path, [("archive/data.pkl", pickled), ("archive/byteorder", b"little"),
                       *((f"archive/data/{k}", v) for k, v in storages.items())])


def _good_pt(tmp_path: Path) -> tuple[Path, dict]:
    base = torch.arange(12.0).reshape(3, 4)
    state = {"w": base, "wt": base.t(), "row": base[1], "tied": base.view(12)}
    torch.save(state, tmp_path / "good.pt")
    return tmp_path / "good.pt", state


def _loads(path: Path, state: dict) -> None:
    got = checkpoints.load_state_dict(path)
    assert set(got) == set(state) and all(torch.equal(got[k], v) for k, v in state.items())


# --------------------------------------------------------------------------- 1. views past their storage
def test_a_stride_0_view_of_one_stored_float_is_refused_before_it_materialises(tmp_path):
    """The issue's file: torch.save of a 1-element tensor expanded to 5e8 elements (2 GB if made)."""
    path = tmp_path / "expand.pt"
    torch.save({"w": torch.zeros(1).expand(500_000_000)}, path)
    assert path.stat().st_size < 2000
    tracemalloc.start()
    for read in (checkpoints.load_state_dict, checkpoints.tensor_shapes):
        _refused(lambda: read(path), CheckpointError, str(path), "tensor #1", "[500000000]", "stride [0]",
                 "overlapping strides")
    assert tracemalloc.get_traced_memory()[1] < 8 * MiB
    tracemalloc.stop()


def test_overlapping_strides_and_views_past_the_file_budget_are_refused(tmp_path):
    ref = _Ref("0", 16)
    path = _archive(tmp_path / "overlap.pt", _state_pickle({"w": _View(ref, (4, 4), (1, 1))}), {"0": bytes(64)})
    _refused(lambda: checkpoints.load_state_dict(path), CheckpointError, str(path), "overlapping strides")
    big = _Ref("0", MiB // 4)                          # 1 MiB stored; every view is a fair one of it
    views = {f"v{i}": _View(big, (MiB // 4,), (1,)) for i in range(6)}
    path = _archive(tmp_path / "views.pt", _state_pickle(views), {"0": bytes(MiB)})
    _refused(lambda: checkpoints.load_state_dict(path), CheckpointError, str(path), "tensor #6",
             f"{torch_archive.MAX_VIEW_FACTOR}x what its storages hold")
    good, state = _good_pt(tmp_path)                  # a weight, its transpose, a row and a tied copy
    _loads(good, state)


# --------------------------------------------------------------------------- 2. members that inflate
def test_deflated_members_are_bounded_by_their_compressed_size_before_they_are_read(tmp_path):
    pkl = _state_pickle({"w": _View(_Ref("0", 2 * MiB), (2 * MiB,), (1,))})
    path = _zip(tmp_path / "bomb.pt", [("archive/data.pkl", pkl), ("archive/byteorder", b"little"),
                                       ("archive/data/0", *_deflated(bytes(8 * MiB)))])
    for read in (checkpoints.load_state_dict, checkpoints.tensor_shapes):
        _refused(lambda: read(path), CheckpointError, str(path), "'archive/data/0'", "over the ratio of 100")
    path = _zip(tmp_path / "pkl.pt", [("archive/data.pkl", *_deflated(pkl, declared=100 * MiB))])
    _refused(lambda: checkpoints.load_state_dict(path), CheckpointError, str(path), "'archive/data.pkl' declares",
             f"over the limit of {torch_archive.MAX_PICKLE_BYTES}")
    path = _zip(tmp_path / "order.pt", [("archive/data.pkl", pkl), ("archive/byteorder", *_deflated(bytes(4096)))])
    _refused(lambda: checkpoints.load_state_dict(path), CheckpointError, "'archive/byteorder'", "limit of 16")
    bz = ("archive/byteorder", b"BZh9", zipfile.ZIP_BZIP2, 0, 6)
    path = _zip(tmp_path / "bz.pt", [("archive/data.pkl", pkl), bz])
    _refused(lambda: checkpoints.load_state_dict(path), CheckpointError, "compression method 12")
    path = _zip(tmp_path / "dir.pt", [("archive/data.pkl", pkl)], claim_entries=10**9)   # zipfile would list them
    _refused(lambda: checkpoints.load_state_dict(path), CheckpointError, str(path), "lists 1000000000 members")


def test_a_member_is_never_inflated_past_the_size_it_declares(tmp_path):
    """byteorder declares 6 bytes, its deflate stream goes on for 32 MiB: 6 bytes are inflated."""
    state = {"w": torch.arange(3.0)}
    torch.save(state, tmp_path / "src.pt")
    with zipfile.ZipFile(tmp_path / "src.pt") as zf:
        members = [(i.filename, zf.read(i)) for i in zf.infolist()]
    order = next(n for n, _ in members if n.endswith("/byteorder"))
    long = _deflated(b"little" + bytes(32 * MiB), declared=6, crc_of=b"little")
    path = _zip(tmp_path / "long.pt", [(order, *long) if n == order else (n, d) for n, d in members])
    tracemalloc.start()
    start = time.monotonic()
    _loads(path, state)
    assert tracemalloc.get_traced_memory()[1] < 4 * MiB and time.monotonic() - start < 1
    tracemalloc.stop()


def test_a_sparse_checkpoint_is_refused_before_its_holes_are_read(tmp_path):
    numel = 50 * MiB                                          # 200 MiB of floats, none stored
    pkl = _state_pickle({"w": _View(_Ref("0", numel), (numel,), (1,))})
    path = _archive(tmp_path / "sparse.pt", pkl, {"0": 4 * numel})
    assert path.stat().st_size > 200 * MiB and path.stat().st_blocks * 512 < MiB
    _refused(lambda: checkpoints.load_state_dict(path), CheckpointError, str(path), "a sparse file")
    safetensors = tmp_path / "sparse.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [numel], "data_offsets": [0, 4 * numel]}}).encode()
    safetensors.write_bytes(struct.pack("<Q", len(header)) + header)
    os.truncate(safetensors, 8 + len(header) + 4 * numel)
    _refused(lambda: checkpoints.load_state_dict(safetensors), CheckpointError, str(safetensors), "a sparse file")
    assert checkpoints.tensor_shapes(safetensors) == {"w": (numel,)}      # the header alone is still read


# --------------------------------------------------------------------------- 3. state poisoning
P = pickle


def _text(s: str) -> bytes:
    return P.SHORT_BINUNICODE + bytes([len(s)]) + s.encode()


def _global(module: str, name: str) -> bytes:
    return P.GLOBAL + f"{module}\n{name}\n".encode()


_TENSOR = (_global("torch._utils", "_rebuild_tensor_v2") + P.MARK + P.MARK + _text("storage")
           + _global("torch", "FloatStorage") + _text("0") + _text("cpu") + P.BININT1 + b"\x01" + P.TUPLE
           + P.BINPERSID + P.BININT1 + b"\x00" + P.BININT1 + b"\x01" + P.TUPLE1 + P.BININT1 + b"\x01" + P.TUPLE1
           + P.NEWFALSE + P.NONE + P.TUPLE + P.REDUCE)
POISONS = {
    # GLOBAL torch FloatStorage, then BUILD {"dtype": None}: every later read of a float tensor failed
    "storage-type": (_global("torch", "FloatStorage") + P.EMPTY_DICT + _text("dtype") + P.NONE + P.SETITEM
                     + P.BUILD + P.POP + P.EMPTY_DICT, "refused to set the state of the global torch.FloatStorage"),
    # BUILD (None, {"__defaults__": ()}) on the rebuild function: setattr on a shared function
    "function": (_global("torch._utils", "_rebuild_tensor_v2") + P.NONE + P.EMPTY_DICT + _text("__defaults__")
                 + P.EMPTY_TUPLE + P.SETITEM + P.TUPLE2 + P.BUILD + P.POP + P.EMPTY_DICT,
                 "refused to set the state of the global torch._utils._rebuild_tensor_v2"),
    "class": (_global("collections", "OrderedDict") + P.EMPTY_DICT + _text("fromkeys") + P.NONE + P.SETITEM
              + P.BUILD + P.POP + P.EMPTY_DICT, "refused to set the state of the global collections.OrderedDict"),
    # BUILD (t, 0, [1e8], [0]) on a tensor: Tensor.__setstate__ calls t.set_(...), a stride-0 view
    "tensor": (P.EMPTY_DICT + _text("w") + _TENSOR + P.BINPUT + b"\x00" + P.MARK + P.BINGET + b"\x00"
               + P.BININT1 + b"\x00" + P.BININT + struct.pack("<i", 10**8) + P.TUPLE1 + P.BININT1 + b"\x00"
               + P.TUPLE1 + P.TUPLE + P.BUILD + P.SETITEM, "a tensor the pickle changed after it was made"),
}


@pytest.mark.parametrize("name", list(POISONS))
def test_a_pickle_cannot_poison_the_reader_for_the_reads_after_it(tmp_path, name):
    body, words = POISONS[name]
    path = _archive(tmp_path / f"{name}.pt", P.PROTO + b"\x02" + body + P.STOP, {"0": bytes(4)})
    _refused(lambda: torch_archive.load_torch_zip(path), CheckpointError, str(path), words)
    good, state = _good_pt(tmp_path)
    _loads(good, state)
    with pytest.raises(TypeError):
        torch_archive._DTYPES["FloatStorage"] = torch.int8


# --------------------------------------------------------------------------- 4. .pt2 graphs that hang
@pytest.fixture(scope="module")
def pt2(tmp_path_factory):
    path = tmp_path_factory.mktemp("pt2") / "net.pt2"
    net = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.ReLU())
    torch.export.save(torch.export.export(net, (torch.randn(1, 2),)), path)
    return path


def _rewrite_program(src: Path, dst: Path, change) -> Path:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("serialized_exported_program.json"):
                program = json.loads(data)
                change(program)
                data = json.dumps(program).encode()
            zout.writestr(info, data)
    return dst


@pytest.mark.parametrize("expr, words", [("9**9**9", "refused the power"), ("(9**64)**64", "refused the power"),
                                         ("Max(9**9, s0)**2", "refused the power"), ("s0**100", "refused the power"),
                                         ("2**s0", "refused the power"), ("9" * 1001, "up to 1000 characters")])
def test_symbolic_sizes_that_sympy_would_never_finish_are_refused(pt2, tmp_path, expr, words):
    def change(program):
        program["graph_module"]["graph"]["sym_int_values"]["s9"] = {"as_expr": {"expr_str": expr, "hint": None},
                                                                    "as_int": None}     # torch sympifies it

    path = _rewrite_program(pt2, tmp_path / "power.pt2", change)
    start = time.monotonic()
    _refused(lambda: checkpoints.load_exported(path), CheckpointError, str(path), words)
    assert time.monotonic() - start < 2


@pytest.mark.parametrize("expr", ["s0", "2*s0**2 + 1", "FloorDiv(s0, 2)**2*s1", "(s0 + 1)**3", "s0 ** 2"])
def test_small_powers_of_shape_symbols_are_still_read(expr):
    torch_archive._check_expression(expr, "x.pt2")


@pytest.mark.parametrize("depth, words", [(40_000, "characters, over the limit"), (33, "nested 33 deep")])
def test_a_module_stack_nested_past_the_bound_is_refused_by_name(pt2, tmp_path, depth, words):
    def change(program):
        path = "getattr(" * depth + "L['fn']" + ", '0')" * depth
        program["graph_module"]["graph"]["nodes"][0]["metadata"]["nn_module_stack"] = f"fn,{path},Sequential"

    path = _rewrite_program(pt2, tmp_path / "stack.pt2", change)
    start = time.monotonic()
    _refused(lambda: checkpoints.load_exported(path), CheckpointError, str(path), "module stack of graph node 0",
             words)
    assert time.monotonic() - start < 2
    x = torch.randn(1, 2)
    assert checkpoints.load_exported(pt2).module()(x).shape == (1, 2)       # the real archive still reads


# --------------------------------------------------------------------------- 5. Small CNN Zoo
@pytest.fixture
def small_zoo(tmp_path):
    write_small_cnn_zoo(tmp_path / "zoo", n_runs=2, crashed_runs=0)
    return tmp_path / "zoo"


def _npy_header(path: Path, shape: tuple[int, int]) -> int:
    """Write only a float32 .npy header declaring ``shape``; the data bytes it declares."""
    with open(path, "wb") as fh:
        np.lib.format.write_array_header_1_0(fh, {"descr": "<f4", "fortran_order": False, "shape": shape})
        return fh.tell()


def test_weights_npy_must_store_the_bytes_its_header_declares(small_zoo):
    weights = small_zoo / "weights.npy"
    rows = NpyRows(weights).shape[0]                                        # the normal file reads
    data = weights.read_bytes()
    weights.write_bytes(data[:-4])
    _refused(lambda: NpyRows(weights), ZooGraphError, str(weights), f"declares {rows * 4970 * 4}")
    os.truncate(weights, _npy_header(weights, (1, 400_000_000)) + 1_600_000_000)      # the file
    _refused(lambda: NpyRows(weights), ZooGraphError, str(weights), "rows of 400000000 values")
    os.truncate(weights, _npy_header(weights, (100_000, 4970)) + 100_000 * 4970 * 4)  # 2 GB, none stored
    _refused(lambda: NpyRows(weights), ZooGraphError, str(weights), "a sparse file")
    with open(weights, "wb") as fh:                                          # a header of 1 GB
        fh.write(b"\x93NUMPY\x02\x00" + struct.pack("<I", 2**30))
    os.truncate(weights, 2**30 + 12)
    _refused(lambda: NpyRows(weights), ZooGraphError, str(weights), "a header of 1073741824 bytes")


@pytest.mark.parametrize("value", ["inf", "nan", "-16", "1.5", "1e3", "99999999999"])
def test_layout_indices_are_whole_numbers_or_one_line_refusals(small_zoo, value):
    layout = small_zoo / "layout.csv"
    lines = layout.read_text().splitlines()
    head = lines[0].split(",")
    row = lines[1].split(",")
    row[head.index("start_idx")] = value
    layout.write_text("\n".join([lines[0], ",".join(row), *lines[2:]]) + "\n")
    _refused(lambda: read_layout(layout), ZooGraphError, str(layout), "row 2: start_idx", "is not a column index")


def test_a_layout_with_inf_is_refused_by_the_cli_in_one_line(small_zoo, tmp_path):
    layout = small_zoo / "layout.csv"
    layout.write_text(layout.read_text().replace(",0,", ",inf,", 1))
    res = CliRunner().invoke(pipeline_cli, ["ingest", str(small_zoo), "--catalog", str(tmp_path / "cat")])
    assert res.exit_code == 1 and "Traceback" not in res.output and "start_idx 'inf'" in res.output, res.output


def _metrics_lines(zoo: Path) -> list[bytes]:
    with gzip.open(zoo / "metrics.csv.gz", "rb") as fh:
        return fh.read().splitlines(keepends=True)


def test_metrics_csv_gz_is_read_within_an_inflation_and_a_row_budget(small_zoo):
    metrics = small_zoo / "metrics.csv.gz"
    n = len(SmallCNNZoo(small_zoo).members())                              # the normal file reads
    assert n > 0
    header, *rows = _metrics_lines(small_zoo)
    commas = gzip.compress(b"," * MiB)                                   # the file: one 64M-field row
    metrics.write_bytes(gzip.compress(header) + commas * 64 + gzip.compress(b"\n"))     # (gzip members concatenate)
    assert metrics.stat().st_size < 200_000
    tracemalloc.start()
    _refused(lambda: SmallCNNZoo(small_zoo).members(), ZooGraphError, str(metrics), "line 2 ends a record of over")
    assert tracemalloc.get_traced_memory()[1] < 32 * MiB
    tracemalloc.stop()
    with gzip.open(metrics, "wb", compresslevel=9) as fh:                  # real rows padded under the cap
        fh.write(header)                                                   # to 800 kB, 1000x deflated
        for row in rows:
            fh.write(row.rstrip(b"\r\n") + b",x" * (400 * 1024) + b"\n")
    _refused(lambda: SmallCNNZoo(small_zoo).members(), ZooGraphError, str(metrics), "inflates past",
             "200x its compressed size")
    with gzip.open(metrics, "wb", compresslevel=1) as fh:                  # one record over many short lines
        fh.write(header + b'"' + os.urandom(MiB).hex().replace("0", '\n","').encode() + b'"\n')
    _refused(lambda: SmallCNNZoo(small_zoo).members(), ZooGraphError, str(metrics), "ends a record of over")


# --------------------------------------------------------------------------- 6. Model Zoos
def test_a_huge_or_long_lined_result_json_is_refused_by_name(tmp_path):
    info = write_model_zoo(tmp_path / "z", kind="CNN", n_models=1, epochs=(0, 1), seed=4)
    trial = next((tmp_path / "z").rglob(f"{next(iter(info))}"))
    assert set(results_by_epoch(trial)) >= {1}                              # the normal file reads
    result = trial / "result.json"
    os.truncate(result, 2**30)                                              # the 1 GB sparse file
    _refused(lambda: results_by_epoch(trial), ZooGraphError, str(result), "over the limit of 67108864")
    result.write_bytes(b'{"training_iteration": 1, "x": "' + b"a" * (MAX_RESULT_LINE_BYTES + 10) + b'"}\n')
    _refused(lambda: results_by_epoch(trial), ZooGraphError, str(result), "line 1 is over 1048576 bytes")
