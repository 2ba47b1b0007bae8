"""DuckDB over the catalog: one view per relation, and the one function that streams results.

Views are bound to the files present at connect time; reconnect after a write to see it.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import duckdb
import pyarrow as pa

from graphstore.catalog import Catalog
from graphstore.schema import FIXED_SCHEMAS, INGEST_RELATIONS, RESULT_RELATIONS

_DEDUP = {
    "models": "SELECT * EXCLUDE (_rn) FROM (SELECT *, row_number() OVER (PARTITION BY model_id "
              "ORDER BY ingested_at) AS _rn FROM {src}) WHERE _rn = 1",
    "architectures": "SELECT * EXCLUDE (_rn) FROM (SELECT *, row_number() OVER (PARTITION BY architecture_id "
                     "ORDER BY architecture_id) AS _rn FROM {src}) WHERE _rn = 1",
    "ingest_errors": "SELECT * EXCLUDE (_rn) FROM (SELECT *, row_number() OVER (PARTITION BY source_path "
                     "ORDER BY failed_at DESC) AS _rn FROM {src}) WHERE _rn = 1 "
                     "AND source_path NOT IN (SELECT source_path FROM models)",
}


def _source(files) -> str:
    paths = ", ".join("'" + str(p).replace("'", "''") + "'" for p in files)
    return f"read_parquet([{paths}], union_by_name = true)"


def connect(catalog: Catalog | str, relations: Sequence[str] | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with a view per catalog relation (empty views where the
    catalog has no files yet, typed by the relation's schema)."""
    catalog = catalog if isinstance(catalog, Catalog) else Catalog(catalog)
    con = duckdb.connect()
    for relation in relations or (INGEST_RELATIONS + RESULT_RELATIONS):
        files = catalog.files(relation)
        if files:
            src = _source(files)
        else:
            empty = FIXED_SCHEMAS[relation].empty_table()
            con.register(f"_empty_{relation}", empty)
            src = f"_empty_{relation}"
        body = _DEDUP.get(relation, "SELECT * FROM {src}").format(src=src)
        con.execute(f"CREATE OR REPLACE VIEW {relation} AS {body}")
    return con


def stream(con: duckdb.DuckDBPyConnection, query: str, params: Sequence | dict | None = None,
           batch_size: int = 65_536, private_cursor: bool = True) -> Iterator[pa.RecordBatch]:
    """Stream a query's result as Arrow record batches.

    By default on a private cursor of ``con``, so a reader left half-read does not block other
    queries on ``con``; ``private_cursor=False`` streams on ``con`` itself (a cursor that holds
    registered tables the query needs).
    """
    cur = con.cursor() if private_cursor else con
    try:
        reader = cur.sql(query, params=params).to_arrow_reader(batch_size=batch_size) if params is not None \
            else cur.sql(query).to_arrow_reader(batch_size=batch_size)
        for batch in reader:
            yield batch
    finally:
        if private_cursor:
            cur.close()


def table(con: duckdb.DuckDBPyConnection, query: str, params: Sequence | dict | None = None) -> pa.Table:
    """A (small) query result as one Arrow table, with its schema even when it has no rows."""
    cur = con.cursor()
    try:
        return cur.sql(query, params=params).to_arrow_reader().read_all()
    finally:
        cur.close()


def model_ids(con: duckdb.DuckDBPyConnection) -> set[str]:
    return {row[0] for row in con.execute("SELECT model_id FROM models").fetchall()}
