"""Read-only SQL over the catalog for users (``pipeline sql``).

Two locks: only SELECT-like statements are accepted (anything that writes, attaches, copies,
installs, loads or sets is refused by name), and the connection is sandboxed to the catalog
folder with external access disabled and the configuration locked.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import duckdb
import pyarrow as pa

from graphstore import duck
from graphstore.catalog import Catalog
from pipeline.errors import CatalogError, QueryRefused

ALLOWED = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}


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


def readonly_connection(catalog: Catalog | str | Path) -> duckdb.DuckDBPyConnection:
    catalog = catalog if isinstance(catalog, Catalog) else Catalog(catalog)
    catalog.require()
    con = duck.connect(catalog)
    root = (catalog.root if catalog.remote else str(catalog.root.resolve())).replace("'", "''")
    con.execute(f"SET allowed_directories = ['{root}/']")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def run_readonly(catalog: Catalog | str | Path, query: str, params: Sequence | None = None) -> pa.Table:
    """Run a read-only query; DuckDB's own message on a bad query."""
    check_readonly(query)
    con = readonly_connection(catalog)
    try:
        rel = con.sql(query, params=params) if params else con.sql(query)
        if rel is None:
            return pa.table({})
        return rel.arrow().read_all()
    except duckdb.PermissionException as exc:
        raise QueryRefused(f"refused: {exc}") from exc
    except duckdb.Error as exc:
        raise CatalogError(str(exc)) from exc
    finally:
        con.close()
