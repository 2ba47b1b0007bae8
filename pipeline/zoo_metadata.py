"""A zoo's model attributes: ``metrics.csv`` rows and sidecar fields, typed for the catalog.

Read once, in the main process, before any checkpoint is converted, so that every problem is known
before anything is written:

- ``metrics.csv`` must be UTF-8 text (a BOM is fine); otherwise the zoo is refused with the line
  and column of the first bad byte;
- a row names its checkpoint by the path relative to the zoo folder (``a/m.safetensors``); a bare
  file name is accepted where it names one checkpoint of the zoo only;
- a checkpoint listed twice in ``metrics.csv`` keeps its last row, with a warning naming both rows;
- a quote that is never closed, or a quoted file name that runs over several lines, refuses the
  zoo (a lenient reader would silently swallow the rows after it);
- two ``metrics.csv`` headers that make one column (``Test Accuracy`` and ``test_accuracy``) refuse
  the zoo; the same field given by a sidecar and by ``metrics.csv`` under two spellings is one
  column (``metrics.csv`` wins, as it does for the same spelling);
- every value gets its column's catalog-wide type (graphstore.column_types); a value that does not
  fit is recorded as null with a warning naming file, row and column, or, with
  ``on_bad_value="refuse"``, the zoo is refused before anything is written.
"""
from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphstore.column_types import BadValue, ColumnDecision, coerce, column_name, decide_types, type_label
from pipeline import checkpoints
from zoocore.errors import ZooGraphError
from zoocore.names import inside_folder

ON_BAD_VALUE = ("null", "refuse")
MAX_LISTED = 10
# A metrics.csv is read whole, so it is bounded: 64 MB holds a row of a few hundred fields for each of
# a million models, ten times the largest published zoo.
MAX_METRICS_BYTES = 64 << 20


@dataclass
class Row:
    """The attributes of one checkpoint: raw values by original key, and where each came from."""
    values: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)      # key -> "ZOO/metrics.csv row 7" / "ZOO/x.json"
    source: str = "metrics.csv"
    raw: dict[str, Any] = field(default_factory=dict)         # merged values by original key (metadata_json)


@dataclass
class ZooMetadata:
    raw: dict[str, dict[str, Any]]              # checkpoint path -> merged raw attributes (metadata_json)
    columns: dict[str, dict[str, Any]]          # checkpoint path -> typed values by column name
    types: dict[str, ColumnDecision]            # column name -> its type
    warnings: list[str]


def parse_cell(text: str) -> Any:
    if text == "":
        return None
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _decode(path: Path) -> str:
    size = path.stat().st_size
    if size > MAX_METRICS_BYTES:
        raise ZooGraphError(f"{path}: {size} bytes, over the limit of {MAX_METRICS_BYTES} for a metrics file "
                            "(nothing was written)")
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line_start = data.rfind(b"\n", 0, exc.start) + 1
        line_no = data.count(b"\n", 0, exc.start) + 1
        header = data.split(b"\n", 1)[0].decode("utf-8", "replace").rstrip("\r").split(",")
        col = data[line_start:exc.start].count(b",")
        where = f"line {line_no}" + (f", column {header[col]!r}" if line_no > 1 and col < len(header) else "")
        raise ZooGraphError(f"{path} is not UTF-8 text: byte 0x{data[exc.start]:02x} at {where} "
                            "(save the file as UTF-8 and ingest again; nothing was written)") from None


def metrics_key(name: str, zoo_dir: Path | None = None) -> str:
    """The key a checkpoint is listed under: its path relative to the zoo, with ``/``."""
    text = name.strip().replace("\\", "/")
    if zoo_dir is not None and Path(text).is_absolute():
        try:
            text = Path(text).resolve().relative_to(zoo_dir.resolve()).as_posix()
        except ValueError:
            pass
    while text.startswith("./"):
        text = text[2:]
    return text


def read_metrics_csv(zoo_dir: Path, warnings: list[str]) -> dict[str, Row]:
    """``metrics.csv`` rows by checkpoint path relative to the zoo (``metrics_key``; ``hparams``
    JSON expanded into fields)."""
    path = zoo_dir / "metrics.csv"
    if not path.exists():
        return {}
    inside_folder(zoo_dir, path)
    out: dict[str, Row] = {}
    first_row: dict[str, int] = {}
    reader = csv.reader(io.StringIO(_decode(path), newline=""), strict=True)
    try:
        header = next(reader, None)
        if not header:
            return {}
        seen: dict[str, str] = {}
        for h in header[1:]:
            name = column_name(h)[0]
            if name in seen:
                raise ZooGraphError(f"{path}: columns {seen[name]!r} and {h!r} both become column {name!r}; "
                                    "rename or drop one (nothing was written)")
            seen[name] = h
        for row in reader:
            if not row or not row[0].strip():
                continue
            line = reader.line_num
            where = f"{path} row {line}"
            if "\n" in row[0] or "\r" in row[0]:
                raise ZooGraphError(f"{where}: the file name runs over several lines (a quote left open?); fix the "
                                    "quoting (nothing was written)")
            values = {h: parse_cell(v) for h, v in zip(header[1:], row[1:])}
            origin = {h: where for h in values}
            hp = values.pop("hparams", None)
            if isinstance(hp, str):
                try:
                    parsed = json.loads(hp)
                except json.JSONDecodeError:
                    parsed = None
                if isinstance(parsed, dict):
                    kept = {k: v for k, v in values.items() if v is not None}
                    values = {**parsed, **kept}
                    origin = {**{k: f"{where} (hparams)" for k in parsed}, **{k: where for k in kept}}
                else:
                    values["hparams"] = hp
            name = metrics_key(row[0], zoo_dir)
            if name in out:
                warnings.append(f"{path}: {name} is listed twice (rows {first_row[name]} and {line}); "
                                f"row {line} is used")
            else:
                first_row[name] = line
            out[name] = Row(values, origin)
    except csv.Error as exc:
        hint = " (a quote left open?)" if "end of data" in str(exc) else ""
        raise ZooGraphError(f"{path} line {reader.line_num}: not valid CSV: {exc}{hint} "
                            "(nothing was written)") from None
    return out


def sidecar_row(checkpoint: Path, zoo_dir: Path) -> Row:
    """The attributes a checkpoint's JSON sidecar gives (``metadata`` and ``metrics``); an unreadable
    sidecar gives none here (the checkpoint itself is then reported by the conversion)."""
    try:
        inside_folder(zoo_dir, checkpoints.sidecar_path(checkpoint))    # a link out is never opened
        side = checkpoints.read_sidecar(checkpoint)
    except Exception:   # reported with the checkpoint's conversion error
        return Row()
    where = str(checkpoints.sidecar_path(checkpoint))
    values = {}
    for part in ("metadata", "metrics"):
        if isinstance(side.get(part), dict):
            values.update(side[part])
    values = {k: v for k, v in values.items() if not isinstance(v, (dict, list))}
    return Row(values, {k: where for k in values}, "sidecars")


def _listed_row(rows: dict[str, Row], checkpoint: Path, zoo_dir: Path, by_name: dict[str, int],
                warnings: list[str]) -> Row:
    """The metrics.csv row of ``checkpoint``: by its path relative to the zoo, else by its bare file
    name when no other checkpoint of the zoo has that name."""
    try:                # as found in the zoo: a link is listed by its own name, not its target's
        rel = checkpoint.relative_to(zoo_dir).as_posix()
    except ValueError:
        rel = metrics_key(str(checkpoint.resolve()), zoo_dir)
    if rel in rows:
        return rows[rel]
    if checkpoint.name in rows:
        if by_name.get(checkpoint.name, 0) == 1:
            return rows[checkpoint.name]
        warnings.append(f"metrics.csv lists {checkpoint.name!r}, which names {by_name[checkpoint.name]} checkpoints "
                        f"of the zoo; {rel} gets no metrics row (list it by its path relative to the zoo)")
    return Row()


def zoo_metadata(zoo_dir: Path, files: list[Path], established: dict, on_bad_value: str = "null",
                 zoo_files: list[Path] | None = None) -> ZooMetadata:
    """Merged, typed attributes of ``files`` (checkpoints of ``zoo_dir``); see the module docstring.
    ``zoo_files`` (default ``files``): the checkpoints whose values decide a new column's type, the
    whole zoo when ``files`` is one shard of it, so that every shard decides alike.
    Raises ZooGraphError (before anything is written) for an unreadable ``metrics.csv`` and, with
    ``on_bad_value="refuse"``, for any value that does not fit its column."""
    if on_bad_value not in ON_BAD_VALUE:
        raise ValueError(f"on_bad_value must be one of {ON_BAD_VALUE}")
    warnings: list[str] = []
    csv_rows = read_metrics_csv(zoo_dir, warnings)
    merged: dict[str, Row] = {}
    spellings: dict[str, dict[str, str]] = {}          # column -> raw key -> a file it came from
    wanted = {str(p) for p in files}
    everything = list(files) + [p for p in (zoo_files or []) if str(p) not in wanted]
    by_name: dict[str, int] = {}
    for p in everything:
        by_name[p.name] = by_name.get(p.name, 0) + 1
    for p in everything:
        row = _listed_row(csv_rows, p, zoo_dir, by_name, warnings)
        side = sidecar_row(p, zoo_dir)
        out = Row()
        for src in (side, row):                          # metrics.csv last: it wins
            for k, v in src.values.items():
                if isinstance(v, (dict, list)):
                    continue
                name = column_name(k)[0]
                spellings.setdefault(name, {}).setdefault(k, src.source)
                if v is None and name in out.values:
                    continue
                out.values[name], out.origin[name], out.raw[k] = v, src.origin[k], v
        merged[str(p)] = out
    for name, keys in sorted(spellings.items()):
        notes = {column_name(k)[1] for k in keys} - {None}
        warnings.extend(sorted(notes))
        if len(keys) > 1:
            given = ", ".join(f"{k!r} ({src})" for k, src in sorted(keys.items()))
            warnings.append(f"column {name!r} is given as {given}; one column, metrics.csv wins where both are set")

    return typed_rows(merged, wanted, spellings, established, on_bad_value, warnings)


def typed_rows(merged: dict[str, Row], wanted: set[str], spellings: dict[str, Any], established: dict,
               on_bad_value: str, warnings: list[str]) -> ZooMetadata:
    """Give every value of ``merged`` (rows by member key, values by column name) its column's
    catalog-wide type; the members outside ``wanted`` (other shards) only help decide new columns'
    types. Raises ZooGraphError, with ``on_bad_value="refuse"``, for a value that does not fit."""
    types = decide_types({name: [r.values.get(name) for r in merged.values()] for name in spellings}, established)
    columns: dict[str, dict[str, Any]] = {}
    bad: list[str] = []
    for path, r in merged.items():
        if path not in wanted:
            continue
        typed = {}
        for name, v in r.values.items():
            decision = types[name]
            try:
                typed[name] = coerce(v, decision.type)
            except BadValue as exc:
                typed[name] = None
                whose = "the catalog's" if decision.established else "this zoo's"
                bad.append(f"{r.origin[name]} ({Path(path).name}), column {name!r}: {exc} ({whose} {name} "
                           f"holds {type_label(decision.type)})")
        columns[path] = typed
    if bad and on_bad_value == "refuse":
        listed = "\n  ".join(bad[:MAX_LISTED]) + (f"\n  ... and {len(bad) - MAX_LISTED} more"
                                                  if len(bad) > MAX_LISTED else "")
        raise ZooGraphError(f"{len(bad)} value(s) do not fit their column (nothing was written; fix them, or "
                            f"use --on-bad-value null to record them as null):\n  {listed}")
    warnings.extend(f"{b}; recorded as null" for b in bad)
    return ZooMetadata({p: r.raw for p, r in merged.items() if p in wanted}, columns, types, warnings)


def table_rows(records: dict[str, dict[str, Any]], where: str, wanted: set[str], established: dict,
               on_bad_value: str = "null") -> ZooMetadata:
    """Typed metadata of members whose attributes one table gives (``records``: member key -> raw
    values by original field name; ``where``: the file named in warnings)."""
    if on_bad_value not in ON_BAD_VALUE:
        raise ValueError(f"on_bad_value must be one of {ON_BAD_VALUE}")
    warnings: list[str] = []
    names = {k: column_name(k) for rec in records.values() for k in rec}
    seen: dict[str, str] = {}
    for k, (name, note) in sorted(names.items()):
        if note:
            warnings.append(note)
        if name in seen and seen[name] != k:
            raise ZooGraphError(f"{where}: fields {seen[name]!r} and {k!r} both become column {name!r} "
                                "(nothing was written)")
        seen[name] = k
    merged = {}
    for key, rec in records.items():
        values = {names[k][0]: v for k, v in rec.items() if not isinstance(v, (dict, list))}
        merged[key] = Row(values, {n: where for n in values}, where, dict(rec))
    return typed_rows(merged, wanted, seen, established, on_bad_value, warnings)
