"""Metadata columns of ``models``: their names, and one stable type per column for a whole catalog.

A column's type is decided once and then kept:

- a column the catalog already holds values of keeps that type (``established_types`` reads it
  from the Parquet footers of the committed ``models`` files; the first part holding a value wins);
- a column new to the catalog takes the kind most of its values have in the zoo being ingested
  (numbers -> float64, booleans -> bool, text -> string; a tie goes to string, which loses nothing),
  so one ``n/a`` in a column of numbers does not turn it into text;
- a column with no value at all is written as Arrow's null type, which takes the type of the first
  real values later (DuckDB reads null with double as double).

A value that does not fit its column's type (a word in a number column) is recorded as null; the
caller warns about it, naming file, row and column, or refuses the zoo (``--on-bad-value refuse``).
``metadata_json`` keeps every value verbatim either way.
"""
from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from graphstore.schema import MODEL_CORE

MAX_NAME = 63                       # a graph-store property name (graphstore.metadata.base.PROPERTY_NAME)
NULL_WORDS = frozenset({"", "n/a", "na", "nan", "null", "none", "-", "?", "missing", "#n/a"})
NUMBER, BOOLEAN, TEXT = "number", "boolean", "text"
ARROW = {NUMBER: pa.float64(), BOOLEAN: pa.bool_(), TEXT: pa.string()}


def column_name(key: str) -> tuple[str, str | None]:
    """The column name of a metadata key, and a note when it had to be changed beyond the usual
    spelling (lower case, ``_`` for spaces and punctuation).

    Names are ASCII ``[a-z0-9_]``, start with a letter (a leading digit gets ``c_``:
    ``2nd_run`` -> ``c_2nd_run``), avoid the fixed columns and the names that start with ``_``, which
    the catalog's own views use (``_file``, ``_rn``) (both get a ``meta_`` prefix) and fit 63
    characters (longer ones are cut and end in a hash of the key), so every column is also a
    valid graph-store property. The mapping is deterministic.
    """
    clean = re.sub(r"[^a-z0-9_]", "_", key.strip().lower()) or "field"
    notes = []
    if not key.isascii():
        notes.append("non-ASCII characters replaced by _")
    if clean[0].isdigit():
        clean = "c_" + clean
        notes.append("a name may not start with a digit, so c_ was put in front")
    if clean in MODEL_CORE.names:
        clean = "meta_" + clean
    elif clean.startswith("_"):
        clean = "meta_" + clean
        notes.append("names starting with _ are the catalog's own, so meta_ was put in front")
    if len(clean) > MAX_NAME:
        clean = clean[:MAX_NAME - 9] + "_" + hashlib.sha1(key.encode()).hexdigest()[:8]
        notes.append(f"cut to {MAX_NAME} characters")
    note = f"metadata field {key!r} is stored as column {clean!r} ({'; '.join(notes)})" if notes else None
    return clean, note


def metadata_column_name(key: str) -> str:
    return column_name(key)[0]


def is_null(value: Any) -> bool:
    """None, NaN, or a word that means "no value" (n/a, NA, nan, null, -, empty)."""
    if value is None:
        return True
    if isinstance(value, float):
        return not math.isfinite(value)
    return isinstance(value, str) and value.strip().lower() in NULL_WORDS


def kind_of(value: Any) -> str | None:
    """number | boolean | text, or None for a null value."""
    if is_null(value):
        return None
    if isinstance(value, bool):
        return BOOLEAN
    if isinstance(value, (int, float)):
        return NUMBER
    return TEXT


def majority_kind(values: Iterable[Any]) -> str | None:
    """The kind most non-null values have; a tie goes to text; None when every value is null."""
    counts = {NUMBER: 0, BOOLEAN: 0, TEXT: 0}
    for v in values:
        k = kind_of(v)
        if k:
            counts[k] += 1
    best = max(counts.values())
    if best == 0:
        return None
    winners = [k for k, n in counts.items() if n == best]
    return TEXT if len(winners) > 1 else winners[0]


class BadValue(ValueError):
    """A value that does not fit its column's type."""


def coerce(value: Any, typ: pa.DataType) -> Any:
    """``value`` as a value of a column of type ``typ``; None for a null; raises BadValue when it
    does not fit."""
    if value is None:
        return None
    if pa.types.is_null(typ):
        return None
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        return value if isinstance(value, str) else str(value)
    if is_null(value):
        if isinstance(value, str) and value.strip() == "":
            return None
        raise BadValue(f"{value!r} means no value")
    if pa.types.is_boolean(typ):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise BadValue(f"{value!r} is not true or false")
    if pa.types.is_floating(typ) or pa.types.is_integer(typ):
        if isinstance(value, bool):
            raise BadValue(f"{value!r} is not a number")
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise BadValue(f"{value!r} is not a number") from None
        if not math.isfinite(f):
            raise BadValue(f"{value!r} is not a finite number")
        if pa.types.is_integer(typ):
            if f != int(f):
                raise BadValue(f"{value!r} is not a whole number")
            return int(f)
        return f
    return value


def type_label(typ: pa.DataType) -> str:
    if pa.types.is_floating(typ) or pa.types.is_integer(typ):
        return "numbers"
    if pa.types.is_boolean(typ):
        return "true/false values"
    return "text"


@dataclass
class ColumnDecision:
    name: str
    type: pa.DataType
    established: bool          # the catalog already held values of this column


def established_types(catalog) -> dict[str, pa.DataType]:
    """The type of every metadata column the catalog's committed ``models`` files hold values of
    (the first file, in commit order, with a non-null value decides). Reads Parquet footers only."""
    core = set(MODEL_CORE.names)
    out: dict[str, pa.DataType] = {}
    for f in catalog.files("models"):
        fh = catalog.fs.open(f, "rb") if catalog.remote else f
        try:
            pf = pq.ParquetFile(fh)
            schema, meta = pf.schema_arrow, pf.metadata
        finally:
            if catalog.remote:
                fh.close()
        for i, field in enumerate(schema):
            if field.name in core or field.name in out or pa.types.is_null(field.type):
                continue
            if _has_values(meta, i):
                out[field.name] = field.type
    return out


def _has_values(meta: pq.FileMetaData, column: int) -> bool:
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        stats = rg.column(column).statistics
        if stats is None or not stats.has_null_count or stats.null_count < rg.num_rows:
            return True
    return False


def decide_types(values_by_column: dict[str, list[Any]],
                 established: dict[str, pa.DataType]) -> dict[str, ColumnDecision]:
    """One type per column: the catalog's when it has one, else the zoo's majority kind."""
    out = {}
    for name, values in values_by_column.items():
        if name in established:
            out[name] = ColumnDecision(name, established[name], True)
        else:
            kind = majority_kind(values)
            out[name] = ColumnDecision(name, ARROW[kind] if kind else pa.null(), False)
    return out
