"""Read-only SQL over the catalog for users (``pipeline sql``, ``--where`` conditions of jobs).

Two locks: only SELECT-like statements are accepted (anything that writes, attaches, copies,
installs, loads or sets is refused by name), and the connection is sandboxed to the catalog
folder with external access disabled, a memory limit, and the configuration locked. Every
piece of SQL a user writes runs on such a connection (``readonly_connection``).

Queries have a time limit: ``run_interruptible`` runs the DuckDB call in a worker thread and
interrupts it (``con.interrupt()``) when the limit passes or on Ctrl-C, which DuckDB itself does
not notice while it computes.
"""
from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import duckdb
import pyarrow as pa

from graphstore import duck
from graphstore.catalog import Catalog
from zoocore.errors import CatalogError, QueryRefused, QueryTimeout

ALLOWED = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}
DEFAULT_TIMEOUT = 60.0
DEFAULT_MEMORY_SHARE = 0.25          # of physical memory, when no --memory-limit is given
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(%|B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
T = TypeVar("T")


def check_readonly(query: str) -> None:
    """Raise QueryRefused unless every statement of ``query`` only reads."""
    try:
        statements = duckdb.extract_statements(query)
    except duckdb.Error as exc:
        raise CatalogError(str(exc)) from exc
    if not statements:
        raise QueryRefused("empty query")
    for st in statements:
        if st.type not in ALLOWED:
            kind = st.type.name.lower()
            raise QueryRefused(f"{kind.upper()} statements are refused: `pipeline sql` is read-only "
                               "(SELECT, WITH ... SELECT, EXPLAIN, DESCRIBE, SUMMARIZE only)")


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
    return f"{value:g}{unit}"


def readonly_connection(catalog: Catalog | str | Path, memory_limit: str | None = None) -> duckdb.DuckDBPyConnection:
    """A connection over the catalog that can read nothing outside it and change nothing about
    itself: files outside the catalog, extensions, settings (memory limit included) are refused."""
    catalog = catalog if isinstance(catalog, Catalog) else Catalog(catalog)
    catalog.require()
    setting = memory_limit_setting(memory_limit)
    con = duck.connect(catalog)
    root = (catalog.root if catalog.remote else str(catalog.root.resolve())).replace("'", "''")
    con.execute(f"SET memory_limit = '{setting}'")
    con.execute(f"SET allowed_directories = ['{root}/']")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def run_interruptible(con: duckdb.DuckDBPyConnection, fn: Callable[[], T], timeout: float | None,
                      what: str = "query") -> T:
    """``fn()`` (DuckDB work on ``con``) in a worker thread, interrupted after ``timeout`` seconds
    (None or 0: no limit), raising QueryTimeout, or on Ctrl-C, re-raising KeyboardInterrupt."""
    out: dict = {}
    done = threading.Event()       # not Thread.join: a join interrupted by Ctrl-C misreports the thread

    def work():
        try:
            out["value"] = fn()
        except BaseException as exc:      # handed to the caller's thread
            out["error"] = exc
        finally:
            done.set()

    worker = threading.Thread(target=work, name="zoograph-query", daemon=True)
    deadline = time.monotonic() + timeout if timeout else None
    worker.start()
    try:
        while not done.is_set():
            left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if left <= 0:
                con.interrupt()
                done.wait(10)
                raise QueryTimeout(f"{what} stopped after {timeout:g} s (the time limit; raise it with "
                                   "--timeout SECONDS, 0 for none)")
            done.wait(left)
    except KeyboardInterrupt:
        con.interrupt()
        done.wait(10)
        raise
    if "error" in out:
        raise out["error"]
    return out["value"]


def run_readonly(catalog: Catalog | str | Path, query: str, params: Sequence | None = None,
                 timeout: float | None = DEFAULT_TIMEOUT, memory_limit: str | None = None) -> pa.Table:
    """Run a read-only query, stopped after ``timeout`` seconds, within ``memory_limit``;
    DuckDB's own message on a bad query."""
    check_readonly(query)
    con = readonly_connection(catalog, memory_limit)

    def execute() -> pa.Table:
        rel = con.sql(query, params=params) if params else con.sql(query)
        if rel is None:
            return pa.table({})
        return rel.arrow().read_all()

    try:
        return run_interruptible(con, execute, timeout)
    except duckdb.PermissionException as exc:
        raise QueryRefused(f"refused: {exc}") from exc
    except duckdb.OutOfMemoryException as exc:
        raise CatalogError(f"the query needs more memory than its limit of "
                           f"{memory_limit_setting(memory_limit)} (--memory-limit): {str(exc).splitlines()[0]}") from exc
    except duckdb.Error as exc:
        raise CatalogError(str(exc)) from exc
    finally:
        con.close()
