"""The Small CNN Zoo (Unterthiner et al. 2020, "Predicting Neural Network Accuracy from Weights").

A zoo folder (one per data set) holds:

- ``weights.npy``: a float32 matrix, one row of flattened TensorFlow parameters per checkpoint
  (conv kernels HWIO, the dense kernel (in, out)); read a row at a time at its offset in the file
  (``NpyRows``), so the 5.4 GB matrices of the published zoo are never held;
- ``layout.csv``: which columns of a row hold which variable (``varname``, ``start_idx``,
  ``end_idx``, ``shape``);
- ``metrics.csv.gz``: one row per checkpoint, in the rows' order (``config.*`` hyperparameters,
  ``modeldir``, ``step``, ``test_accuracy``, ``train_accuracy``, losses); the ``config.*`` fields
  become model columns ``config_activation``, ``config_learning_rate``, ...

The network: 1-channel input (28x28 for mnist and fashion_mnist, 32x32 for cifar10 and
svhn_cropped), 3x3 convolutions with stride 2 and Keras' default 'valid' padding (the published
training code, ``dnn_predict_accuracy/train_network.py``, passes none: 28 -> 13 -> 6 -> 2), the activation of ``config.activation`` after each, global average pooling, a dense
layer. Every training run (``modeldir``) is checkpointed at several steps; by default its final
checkpoint (``step`` equal to ``config.epochs``) is ingested, ``steps="all"`` ingests every
checkpoint as its own model. ``padding="same"`` reads zoos of the same layout trained with
TensorFlow's 'SAME' padding (for stride 2 on an even side the extra row and column go after, not
before: an explicit ``zeropad`` layer in the spec). Two runs can start from one initialisation, so a checkpoint's model
id covers its run and step besides its weights.
"""
from __future__ import annotations

import csv
import gzip
import io
import math
import os
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.formats.base import STEPS, Member, ZooFormat
from pipeline.neural_graph.convert import Converted, PlanCache, convert_state_dict
from pipeline.torch_archive import refuse_sparse
from pipeline.zoo_metadata import ZooMetadata, parse_cell, table_rows
from zoocore.errors import CheckpointError, ZooGraphError

FILES = ("weights.npy", "layout.csv", "metrics.csv.gz")
SIDES = {"mnist": 28, "fashion_mnist": 28, "cifar10": 32, "svhn_cropped": 32, "svhn": 32}
ACTIVATIONS = {"relu": "relu", "tanh": "tanh", "sigmoid": "sigmoid", "elu": "elu", "linear": "identity",
               "identity": "identity", "gelu": "gelu", "swish": "silu", "silu": "silu", "relu6": "relu6"}
PADDINGS = ("valid", "same")

# Bounds, each checked before the bytes it bounds are read.
MAX_LAYOUT_BYTES = 2**20            # layout.csv: one short line per variable (8 in the published zoo)
MAX_ROW_COLUMNS = 2**20             # parameters per row: the published network has 4,970; a row is read whole for
#                                     each model (4 MiB of float32 at this bound)
MAX_INDEX_DIGITS = 10               # a start_idx/end_idx or a shape dimension: at most MAX_ROW_COLUMNS anyway
MAX_NPY_HEADER_BYTES = 10_000       # numpy's own max_header_size: the header is a short dict literal
MAX_METRICS_RATIO = 200             # metrics.csv.gz inflates at most 200x: CSV text deflates 5-20x, a bomb 1000x
METRICS_RATIO_FREE_BYTES = 2**20    # ... except its first MiB (a tiny file of repeated rows deflates further)
MAX_METRICS_BYTES = 2**30           # and at most 1 GiB in all: the published 270,000 rows inflate to ~100 MB
MAX_METRICS_ROW_BYTES = 2**20       # one CSV record (a quoted field's lines included): the published ones are
#                                     ~300 bytes; a record is split into its fields only once it fits


# --------------------------------------------------------------------------- layout.csv
def _column(header: list[str], name: str, where: str) -> int:
    low = [h.strip().lower() for h in header]
    if name not in low:
        raise ZooGraphError(f"{where}: no {name!r} column (it has {', '.join(h for h in header if h) or 'none'}); "
                            "nothing was written")
    return low.index(name)


def _index(text: str, path: Path, row: int, column: str) -> int:
    """A column index of layout.csv: a whole number (``16`` or ``16.0``), at most ``MAX_INDEX_DIGITS``
    digits; ZooGraphError, one line, for anything else (``inf``, ``nan``, ``-1``, ``1.5``)."""
    m = re.fullmatch(r"\+?(\d{1,%d})(?:\.0*)?" % MAX_INDEX_DIGITS, text.strip())
    if m is None:
        raise ZooGraphError(f"{path}: row {row}: {column} {text.strip()[:20]!r} is not a column index (a whole "
                            "number from 0); nothing was written")
    return int(m.group(1))


def _shape(text: str, path: Path, row: int) -> tuple[int, ...]:
    dims = re.findall(r"\d+", text)
    if len(dims) > 4 or any(len(d) > MAX_INDEX_DIGITS for d in dims):
        raise ZooGraphError(f"{path}: row {row}: shape {text.strip()[:40]!r} is not the shape of a kernel or a bias; "
                            "nothing was written")
    return tuple(int(d) for d in dims)


def read_layout(path: Path) -> list[tuple[str, int, int, tuple[int, ...]]]:
    """(variable, start, end (exclusive), shape) in column order; ZooGraphError for a layout this
    importer cannot read. At most ``MAX_LAYOUT_BYTES`` are read."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_LAYOUT_BYTES + 1)
        if len(raw) > MAX_LAYOUT_BYTES:
            raise ZooGraphError(f"{path}: over {MAX_LAYOUT_BYTES} bytes, not a layout of a few variables; nothing "
                                "was written")
        rows = list(csv.reader(io.StringIO(raw.decode("utf-8-sig"))))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ZooGraphError(f"{path}: not a readable CSV file ({exc}); nothing was written") from None
    if not rows:
        raise ZooGraphError(f"{path} is empty; nothing was written")
    header = rows[0]
    cols = [_column(header, n, str(path)) for n in ("varname", "start_idx", "end_idx", "shape")]
    out = []
    for line, r in enumerate(rows[1:], start=2):
        if not any(c.strip() for c in r):
            continue
        if len(r) <= max(cols):
            raise ZooGraphError(f"{path}: row {line} is not varname, start_idx, end_idx, shape; nothing was written")
        out.append((r[cols[0]].strip(), _index(r[cols[1]], path, line, "start_idx"),
                    _index(r[cols[2]], path, line, "end_idx"), _shape(r[cols[3]], path, line)))
    out.sort(key=lambda v: v[1])
    sizes = [math.prod(s) for *_, s in out]
    if all(e - s == n for (_, s, e, _), n in zip(out, sizes)):
        pass
    elif all(e - s + 1 == n for (_, s, e, _), n in zip(out, sizes)):
        out = [(v, s, e + 1, sh) for v, s, e, sh in out]
    else:
        raise ZooGraphError(f"{path}: start_idx/end_idx do not agree with the shapes; nothing was written")
    if any(out[i][2] != out[i + 1][1] for i in range(len(out) - 1)) or (out and out[0][1] != 0):
        raise ZooGraphError(f"{path}: the variables do not tile the columns of weights.npy; nothing was written")
    return out


def _stem(varname: str) -> str:
    """``sequential/conv2d_1/kernel:0`` -> ``sequential/conv2d_1``: the layer a variable belongs to."""
    name = varname.split(":", 1)[0]
    return name.rsplit("/", 1)[0] if "/" in name else re.sub(r"[._]?(kernel|bias|weight)$", "", name)


def layers_of(layout: list[tuple[str, int, int, tuple[int, ...]]], where: str) -> list[dict[str, Any]]:
    """The layers in network order (their variables' order in the row; TensorFlow writes a
    layer's bias before its kernel): {"kind": "conv"|"dense", "kernel": (start, end, shape),
    "bias": (start, end, shape) | None}."""
    groups: dict[str, dict[str, Any]] = {}
    for var, s, e, shape in layout:
        g = groups.setdefault(_stem(var), {"start": s, "kernel": None, "bias": None, "name": _stem(var)})
        slot = "kernel" if len(shape) in (2, 4) else "bias" if len(shape) == 1 else None
        if slot is None:
            raise ZooGraphError(f"{where}: variable {var!r} of shape {list(shape)} is not a conv kernel, a dense "
                                "kernel or a bias; nothing was written")
        if g[slot] is not None:
            raise ZooGraphError(f"{where}: layer {g['name']!r} has two {slot}s; nothing was written")
        g[slot] = (s, e, shape)
    layers = sorted(groups.values(), key=lambda g: g["start"])
    for g in layers:
        if g["kernel"] is None:
            raise ZooGraphError(f"{where}: layer {g['name']!r} has a bias but no kernel; nothing was written")
        g["kind"] = "conv" if len(g["kernel"][2]) == 4 else "dense"
        if g["bias"] is not None and g["bias"][2][0] != g["kernel"][2][-1]:
            raise ZooGraphError(f"{where}: layer {g['name']!r} has a bias of {g['bias'][2][0]} for "
                                f"{g['kernel'][2][-1]} outputs; nothing was written")
    kinds = [g["kind"] for g in layers]
    if not kinds or kinds[-1] != "dense" or kinds.count("dense") != 1 or "conv" not in kinds:
        raise ZooGraphError(f"{where}: expected convolutions followed by one dense layer, found "
                            f"{' -> '.join(kinds) or 'no layers'}; nothing was written")
    return layers


# --------------------------------------------------------------------------- the network
def same_padding(side: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow 'SAME' padding of one axis: (before, after); the odd pixel goes after."""
    out = -(-side // stride)
    total = max((out - 1) * stride + kernel - side, 0)
    return total // 2, total - total // 2


def spec_for(layers: list[dict[str, Any]], side: int, activation: str, padding: str = "valid",
             stride: int = 2) -> tuple[dict, list[str]]:
    """The JSON spec of the network and, per layout layer, its state-dict prefix (``padding``:
    TensorFlow's ``valid`` or ``same``)."""
    out: list[dict[str, Any]] = []
    prefixes = []
    h = w = side
    for layer in layers:
        if layer["kind"] == "conv":
            kh, kw, _, cout = layer["kernel"][2]
            (pt, pb), (pl, pr) = ((same_padding(h, kh, stride), same_padding(w, kw, stride)) if padding == "same"
                                  else ((0, 0), (0, 0)))
            pad = 0
            if (pt, pb, pl, pr) != (pt, pt, pt, pt):
                out.append({"type": "zeropad", "padding": [pl, pr, pt, pb]})
            else:
                pad = pt
            prefixes.append(f"layers.{len(out)}")
            out.append({"type": "conv2d", "out_channels": int(cout), "kernel_size": [int(kh), int(kw)],
                        "stride": stride, "padding": pad, "bias": layer["bias"] is not None})
            if activation != "identity":
                out.append({"type": "activation", "fn": activation})
            h, w = (-(-h // stride), -(-w // stride)) if padding == "same" else ((h - kh) // stride + 1,
                                                                                (w - kw) // stride + 1)
        else:
            out += [{"type": "adaptive_avgpool", "output_size": 1}, {"type": "flatten"}]
            prefixes.append(f"layers.{len(out)}")
            out.append({"type": "linear", "out_features": int(layer["kernel"][2][1]),
                        "bias": layer["bias"] is not None})
    return {"format": "zoograph.spec/1", "input_shape": [1, side, side], "layers": out}, prefixes


def state_dict(row: np.ndarray, layers: list[dict[str, Any]], prefixes: list[str]) -> dict[str, torch.Tensor]:
    """A row of weights.npy as the spec network's state dict (HWIO -> OIHW, (in, out) -> (out, in))."""
    state = {}
    for layer, prefix in zip(layers, prefixes):
        s, e, shape = layer["kernel"]
        k = np.asarray(row[s:e], dtype=np.float32).reshape(shape)
        k = k.transpose(3, 2, 0, 1) if layer["kind"] == "conv" else k.T
        state[f"{prefix}.weight"] = torch.from_numpy(np.ascontiguousarray(k))
        if layer["bias"] is not None:
            s, e, _ = layer["bias"]
            state[f"{prefix}.bias"] = torch.from_numpy(np.array(row[s:e], dtype=np.float32))
    return state


# --------------------------------------------------------------------------- weights.npy
class NpyRows:
    """Rows of a 2-d float ``.npy`` matrix read one at a time with ``pread``: never the whole
    matrix, and no memory map either (pages of a map that rows were read from count as the
    process's resident memory until it ends: a 5.4 GB matrix would grow every worker by the
    part it read). The header is parsed by numpy without pickle; an object array is refused.

    Budget, checked before any row is read: a header of at most ``MAX_NPY_HEADER_BYTES``, a row
    of at most ``MAX_ROW_COLUMNS`` values (one row is held at a time), and rows x columns x item
    size equal to the bytes after the header, stored on disk (a truncated, padded or sparse file
    is refused)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as fh:
                version = np.lib.format.read_magic(fh)
                read = {(1, 0): np.lib.format.read_array_header_1_0,
                        (2, 0): np.lib.format.read_array_header_2_0}.get(version)
                if read is None:
                    raise ValueError(f".npy format version {version}")
                start = fh.tell()
                length = fh.read(2 if version == (1, 0) else 4)
                declared = struct.unpack("<H" if version == (1, 0) else "<I", length)[0]
                if declared > MAX_NPY_HEADER_BYTES:
                    raise ValueError(f"a header of {declared} bytes, over the limit of {MAX_NPY_HEADER_BYTES}")
                fh.seek(start)
                shape, fortran, dtype = read(fh, max_header_size=MAX_NPY_HEADER_BYTES)
                self.offset = fh.tell()
        except (ValueError, OSError, struct.error) as exc:
            raise ZooGraphError(f"{path}: not a readable .npy matrix ({str(exc).splitlines()[0]}); "
                                "nothing was written") from None
        if len(shape) != 2 or dtype.kind != "f" or dtype.hasobject or fortran or min(shape) < 0:
            raise ZooGraphError(f"{path}: expected a 2-d float matrix in C order, found {dtype} of shape "
                                f"{list(shape)}{' (Fortran order)' if fortran else ''}; nothing was written")
        if not 0 < shape[1] <= MAX_ROW_COLUMNS:
            raise ZooGraphError(f"{path}: rows of {shape[1]} values, outside 1 to {MAX_ROW_COLUMNS} (the published "
                                "networks have 4,970); nothing was written")
        self.shape, self.dtype = tuple(shape), dtype
        self.row_bytes = shape[1] * dtype.itemsize
        stored = path.stat().st_size - self.offset
        if stored != shape[0] * self.row_bytes:
            raise ZooGraphError(f"{path} holds {stored} bytes of data, its header ({list(shape)} of {dtype}) declares "
                                f"{shape[0] * self.row_bytes}; nothing was written")
        try:
            refuse_sparse(path, str(path))
        except CheckpointError as exc:
            raise ZooGraphError(f"{exc}; nothing was written") from None
        self._fd: int | None = None

    def __getitem__(self, i: int) -> np.ndarray:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        data = os.pread(self._fd, self.row_bytes, self.offset + int(i) * self.row_bytes)
        if len(data) != self.row_bytes:
            raise CheckpointError(f"{self.path}: row {i} is cut short")
        return np.frombuffer(data, self.dtype).astype(np.float32)


class _MetricsLines:
    """The text lines of metrics.csv.gz for ``csv.reader``, inflated within a budget stated before
    reading: at most ``MAX_METRICS_RATIO`` times the compressed size (past the first
    ``METRICS_RATIO_FREE_BYTES``) and ``MAX_METRICS_BYTES`` in all, a line read only up to
    ``MAX_METRICS_ROW_BYTES``, and a record (its caller resets ``record_bytes`` after each) of at
    most that many bytes over its lines; ZooGraphError, one line, past any of them."""

    def __init__(self, gz: gzip.GzipFile, path: Path, compressed: int):
        self.gz, self.path = gz, path
        self.budget = min(max(MAX_METRICS_RATIO * compressed, METRICS_RATIO_FREE_BYTES), MAX_METRICS_BYTES)
        self.inflated = self.record_bytes = self.line = 0

    def __iter__(self):
        return self

    def __next__(self) -> str:
        data = self.gz.readline(MAX_METRICS_ROW_BYTES + 1)
        if not data:
            raise StopIteration
        self.line += 1
        self.inflated += len(data)
        self.record_bytes += len(data)
        if self.record_bytes > MAX_METRICS_ROW_BYTES:
            raise ZooGraphError(f"{self.path}: line {self.line} ends a record of over {MAX_METRICS_ROW_BYTES} bytes "
                                "(a metrics row is a few hundred); nothing was written")
        if self.inflated > self.budget:
            raise ZooGraphError(f"{self.path}: inflates past {self.budget} bytes (at most {MAX_METRICS_RATIO}x its "
                                f"compressed size and {MAX_METRICS_BYTES} bytes); nothing was written")
        return data.decode("utf-8-sig" if self.line == 1 else "utf-8")


# --------------------------------------------------------------------------- the format
class SmallCNNZoo(ZooFormat):
    name = "small-cnn-zoo"
    options = ("steps", "input_side", "padding")

    def __init__(self, zoo_dir, steps: str = "final", input_side: int | None = None, padding: str = "valid"):
        super().__init__(zoo_dir, steps=steps, input_side=input_side, padding=padding)
        self.steps, self.padding = self.choice("steps", steps, STEPS), self.choice("padding", padding, PADDINGS)
        self.input_side = input_side
        self._rows: dict[str, dict[str, Any]] = {}      # member key -> raw metrics row (main process only)
        self._weights = None                            # weights.npy's rows (NpyRows), opened once per process
        self._layers: list[dict[str, Any]] | None = None
        self._specs: dict[tuple[int, str], tuple[dict, list[str]]] = {}

    def __getstate__(self):      # workers get names and options; they open the matrix themselves
        return {**self.__dict__, "_weights": None, "_rows": {}, "_layers": None, "_specs": {}}

    @classmethod
    def detect(cls, zoo_dir: Path) -> bool:
        return all((Path(zoo_dir) / f).is_file() for f in FILES)

    # ------------------------------------------------------------------ main process
    def weights(self) -> "NpyRows":
        if self._weights is None:
            self._weights = NpyRows(self.inside(self.zoo_dir / "weights.npy"))
        return self._weights

    def layers(self) -> list[dict[str, Any]]:
        if self._layers is None:
            path = self.inside(self.zoo_dir / "layout.csv")
            layers = layers_of(read_layout(path), str(path))
            width = max(l[k][1] for l in layers for k in ("kernel", "bias") if l[k])
            cols = self.weights().shape[1]
            if width != cols:
                raise ZooGraphError(f"{path} describes {width} columns, weights.npy has {cols}; nothing was written")
            self._layers = layers
        return self._layers

    def members(self) -> list[Member]:
        self.layers()
        path = self.inside(self.zoo_dir / "metrics.csv.gz")
        rows = self.weights().shape[0]
        out: list[Member] = []
        runs: set[str] = set()
        final_runs: set[str] = set()
        count = 0
        try:
            with open(path, "rb") as raw, gzip.GzipFile(fileobj=raw, mode="rb") as gz:
                lines = _MetricsLines(gz, path, os.fstat(raw.fileno()).st_size)
                reader = csv.reader(lines)
                names = [h.strip() for h in next(reader, None) or []]
                lines.record_bytes = 0
                step_i = _column(names, "step", str(path))
                run_i = _column(names, "modeldir", str(path))
                lower = [h.lower() for h in names]
                epochs_i = lower.index("config.epochs") if "config.epochs" in lower else None
                keep = [i for i, h in enumerate(names) if h and not h.lower().startswith("unnamed")]
                for row in reader:
                    lines.record_bytes = 0
                    if not row:
                        continue
                    n, count = count, count + 1
                    if n >= rows:
                        break
                    run, step = row[run_i], parse_cell(row[step_i])
                    runs.add(run)
                    final = epochs_i is not None and step == parse_cell(row[epochs_i])
                    if final:
                        final_runs.add(run)
                    elif self.steps == "final":
                        continue
                    key = f"weights.npy#{n}"
                    values = {names[i]: parse_cell(row[i]) for i in keep if i < len(row)}
                    self.side(values)              # an unknown data set refuses the zoo here, not per model
                    self._rows[key] = values
                    out.append(Member(key, f"step {step}", f"{run}@{step}"))
        except (OSError, EOFError, UnicodeDecodeError, csv.Error, IndexError) as exc:
            raise ZooGraphError(f"{path}: cannot read it ({str(exc).splitlines()[0]}); nothing was written") from None
        if count != rows:
            raise ZooGraphError(f"{path} has {'more' if count > rows else count} rows, weights.npy has {rows}: the "
                                "two must list the same checkpoints in the same order; nothing was written")
        self.unfinished = len(runs - final_runs) if self.steps == "final" else 0
        if not out:
            raise ZooGraphError(f"{path}: no checkpoint to ingest (no step equals config.epochs; try --steps all); "
                                "nothing was written")
        return out

    def side(self, values: dict[str, Any]) -> int:
        if self.input_side:
            return int(self.input_side)
        ds = str(values.get("config.dataset", "")).lower()
        if ds not in SIDES:
            raise ZooGraphError(f"config.dataset {ds!r} has no known image side (known: {', '.join(sorted(SIDES))}); "
                                "give it with --input-side; nothing was written")
        return SIDES[ds]

    def metadata(self, members, all_members, established, on_bad_value) -> ZooMetadata:
        wanted = {m.key for m in members}
        meta = table_rows({m.key: self._rows[m.key] for m in all_members}, str(self.zoo_dir / "metrics.csv.gz"),
                          wanted, established, on_bad_value)
        if getattr(self, "unfinished", 0):
            meta.warnings.append(f"{self.unfinished} training runs have no final checkpoint (step = config.epochs) "
                                 "and were left out; --steps all ingests every checkpoint")
        return meta

    # ------------------------------------------------------------------ workers
    def convert(self, member: Member, metadata: dict[str, Any], cache: PlanCache) -> Converted:
        act = str(metadata.get("config.activation", "relu"))
        fn = ACTIVATIONS.get(act.lower())
        if fn is None:
            raise CheckpointError(f"config.activation {act!r} is not one this importer knows "
                                  f"({', '.join(sorted(ACTIVATIONS))})")
        layers = self.layers()
        key = (self.side(metadata), fn)
        if key not in self._specs:
            self._specs[key] = spec_for(layers, *key, padding=self.padding)
        spec, prefixes = self._specs[key]
        row = self.weights()[int(member.key.rsplit("#", 1)[1])]
        if not np.all(np.isfinite(row)):
            raise CheckpointError("the row holds NaN or infinite weights")
        return convert_state_dict(state_dict(row, layers, prefixes), spec, cache, member.key)
