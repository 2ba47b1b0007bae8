"""Read-only SQL over the catalog for users (``pipeline sql``, ``--where`` conditions of jobs).

Three locks, each enough alone for what it guards:

1. **The statement.** DuckDB's own parser decides (``extract_statements`` and each statement's
   type): one SELECT-like statement (SELECT, WITH, FROM, VALUES, DESCRIBE, SUMMARIZE, SHOW), or
   EXPLAIN of one (never EXPLAIN ANALYZE, which runs its statement). Everything else is refused
   by its own name before a connection exists.
2. **The connection.** External access is disabled except for the catalog folder, the memory limit
   and every other setting are locked (``readonly_connection``).
3. **The process.** The query runs in a child process (``graphstore.sql_worker``) that sees the
   catalog through a read-only mount of its own (a private mount namespace, where the machine
   allows one: ``graphstore.isolation.read_only_mount``), holds an address-space limit of its
   memory limit, and is killed
   at the time limit, on Ctrl-C, or when this process dies. A query that crashes DuckDB crashes
   only that child; the caller gets one line.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Sequence

import duckdb
import pyarrow as pa

from graphstore import duck
from graphstore.catalog import Catalog
from graphstore.isolation import WorkerFailed, run_worker
from zoocore.errors import CatalogError, QueryRefused

DEFAULT_TIMEOUT = 60.0
DEFAULT_MEMORY_SHARE = 0.25          # of physical memory, when no --memory-limit is given
MIN_MEMORY = 16 * 2**20
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(%|B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_LEADING = re.compile(r"^(?:\s+|--[^\n]*(?:\n|$)|/\*.*?\*/)*", re.S)
_WORD = re.compile(r"[A-Za-z_]+")
READS = {duckdb.StatementType.SELECT}


def _statements(query: str) -> list:
    try:
        return duckdb.extract_statements(query)
    except duckdb.Error as exc:
        raise CatalogError(str(exc).strip().splitlines()[0]) from exc
    except RecursionError:
        raise QueryRefused("the statement is nested too deeply to parse") from None


def _after_keyword(text: str) -> str:
    """``text`` past its first keyword and any comments around it."""
    text = _LEADING.sub("", text, count=1)
    m = _WORD.match(text)
    return _LEADING.sub("", text[m.end():] if m else text, count=1)


def _statement_name(st) -> str:
    word = _WORD.match(_LEADING.sub("", st.query, count=1))
    return (word.group() if word else st.type.name).upper()


def check_readonly(query: str) -> None:
    """Raise QueryRefused unless ``query`` is one statement that only reads (decided by DuckDB's
    parser: see the module)."""
    statements = _statements(query)
    if not statements:
        raise QueryRefused("empty query")
    for st in statements:
        if st.type in READS:
            continue
        if st.type == duckdb.StatementType.EXPLAIN:
            rest = _after_keyword(st.query)
            if _WORD.match(rest) and _WORD.match(rest).group().upper() in ("ANALYZE", "ANALYSE"):
                raise QueryRefused("EXPLAIN ANALYZE statements are refused: they run the statement they explain "
                                   "(`pipeline sql` is read-only; plain EXPLAIN is allowed)")
            inner = _statements(rest.rstrip().rstrip(";"))
            if len(inner) == 1 and inner[0].type in READS:
                continue
        raise QueryRefused(f"{_statement_name(st)} statements are refused: `pipeline sql` is read-only "
                           "(SELECT, WITH ... SELECT, EXPLAIN, DESCRIBE, SUMMARIZE only)")
    if len(statements) > 1:
        raise QueryRefused(f"one statement at a time: the query holds {len(statements)} (separated by ;)")


def physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def memory_limit_setting(limit: str | None = None) -> str:
    """DuckDB's ``memory_limit`` for a user query: ``limit`` as DuckDB size text (``4GB``, ``512MB``)
    or a share of physical memory (``25%``); default 25% of physical memory (else 4GB)."""
    text = limit if limit is not None else f"{DEFAULT_MEMORY_SHARE * 100:g}%"
    m = _MEMORY.match(str(text))
    if not m or float(m.group(1)) <= 0:
        raise CatalogError(f"invalid memory limit {limit!r}: give a size such as 512MB, 4GB, or a share of "
                           "memory such as 25%")
    value, unit = float(m.group(1)), (m.group(2) or "B").upper()
    if unit == "%":
        total = physical_memory()
        if total is None:
            return "4GB"
        if value > 100:
            raise CatalogError(f"invalid memory limit {limit!r}: more than 100% of memory")
        return f"{max(int(total * value / 100) // 2**20, 16)}MiB"
    if value * _UNITS[unit] < MIN_MEMORY:
        raise CatalogError(f"invalid memory limit {limit!r}: a query needs at least 16MB")
    return f"{value:g}{unit}"


def memory_limit_bytes(setting: str) -> int:
    """The bytes of a ``memory_limit_setting`` result."""
    m = _MEMORY.match(setting)
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


def readonly_connection(catalog: Catalog | str | Path, memory_limit: str | None = None,
                        temp_dir: str | Path | None = None) -> duckdb.DuckDBPyConnection:
    """A connection over the catalog that can read nothing outside it and change nothing about
    itself: files outside the catalog, extensions, settings (memory limit included) are refused.
    ``temp_dir``: where DuckDB may spill (else nowhere)."""
    catalog = catalog if isinstance(catalog, Catalog) else Catalog(catalog)
    catalog.require()
    setting = memory_limit_setting(memory_limit)
    con = duck.connect(catalog)
    root = (catalog.root if catalog.remote else str(catalog.root.resolve())).replace("'", "''")
    con.execute("SET enable_progress_bar = false")
    if temp_dir is not None:
        con.execute("SET temp_directory = '" + str(temp_dir).replace("'", "''") + "'")
    con.execute(f"SET memory_limit = '{setting}'")
    con.execute(f"SET allowed_directories = ['{root}/']")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def run_readonly(catalog: Catalog | str | Path, query: str, params: Sequence | None = None,
                 timeout: float | None = DEFAULT_TIMEOUT, memory_limit: str | None = None) -> pa.Table:
    """Run a read-only query in the sandboxed worker process (``graphstore.sql_worker``), stopped
    after ``timeout`` seconds (None or 0: no limit), within ``memory_limit`` for the whole worker;
    DuckDB's own message on a bad query, one line for everything else. Ctrl-C stops the worker and
    re-raises KeyboardInterrupt."""
    check_readonly(query)
    catalog = catalog if isinstance(catalog, Catalog) else Catalog(catalog)
    catalog.require()
    setting = memory_limit_setting(memory_limit)
    request = {"catalog": str(catalog.root), "query": query, "params": list(params) if params else None,
               "memory_limit": setting}
    try:
        out = run_worker("graphstore.sql_worker", request, timeout)
    except WorkerFailed as exc:
        if exc.kind == "refused":
            raise QueryRefused(exc.message) from None
        if exc.kind == "memory" or exc.signal_name in ("SIGSEGV", "SIGABRT", "SIGKILL", "SIGBUS"):
            raise CatalogError(f"the query needs more memory than its limit of {setting} (--memory-limit): "
                               f"{exc.message}") from None
        raise CatalogError(exc.message) from None
    try:
        return pa.ipc.open_stream(out).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        raise CatalogError(f"the query worker returned a malformed result: {exc}") from exc
