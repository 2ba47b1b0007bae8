"""DuckDB over the catalog: one view per relation, and the one function that streams results.

Views are bound to the files present at connect time; reconnect after a write to see it.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import duckdb
import pyarrow as pa

from graphstore.catalog import Catalog
from graphstore.schema import FIXED_SCHEMAS, INGEST_RELATIONS, RESULT_RELATIONS

_FIRST_COPY = ("SELECT * EXCLUDE (_rn, _file) FROM (SELECT *, row_number() OVER (PARTITION BY model_id "
               "ORDER BY ingested_at, _file) AS _rn FROM {src}) WHERE _rn = 1")
_DEDUP = {
    "architectures": "SELECT * EXCLUDE (_rn, _file) FROM (SELECT *, row_number() OVER (PARTITION BY architecture_id "
                     "ORDER BY {order}) AS _rn FROM {src}) WHERE _rn = 1",
    "ingest_errors": "SELECT * EXCLUDE (_rn) FROM (SELECT *, row_number() OVER (PARTITION BY source_path "
                     "ORDER BY failed_at DESC) AS _rn FROM {src}) WHERE _rn = 1 "
                     "AND source_path NOT IN (SELECT source_path FROM models)",
}
# Rows a model has in parts other than the one its ``models`` row comes from: two writers (shards on
# two machines) that ingested copies of one checkpoint at the same moment both committed it.
_SHADOWED = ("SELECT model_id, regexp_replace(_file, '/[^/]*$', '') AS part FROM (SELECT model_id, _file, "
             "row_number() OVER (PARTITION BY model_id ORDER BY ingested_at, _file) AS rn FROM {src}) WHERE rn > 1")
_PER_MODEL = ("layers", "nodes", "edges")
_WITHOUT_SHADOWED = ("SELECT x.* EXCLUDE (_file) FROM {src} x ANTI JOIN _shadowed s "
                     "ON s.model_id = x.model_id AND s.part = regexp_replace(x._file, '/[^/]*$', '')")
# The ``architectures`` view has one row per architecture (for its plan and summary); a model's own
# spec and program come from the rows of its own part and zoo, never another zoo's: one zoo's .pt2
# archive must not become the network of every model of its architecture (see
# jobs.analysis.catalog_models). ``_architecture_rows``: every architectures row with its part and
# that part's zoo; ``_model_parts``: the part and zoo of each model's first committed row.
_ARCHITECTURE_ROWS = ("SELECT a.*, z.zoo FROM (SELECT architecture_id, plan_json, spec_json, {program}, "
                      "regexp_replace(_file, '/[^/]*$', '') AS part FROM {src}) a LEFT JOIN (SELECT DISTINCT zoo, "
                      "regexp_replace(_file, '/[^/]*$', '') AS part FROM {models}) z USING (part)")
_MODEL_PARTS = ("SELECT model_id, zoo, part FROM (SELECT model_id, zoo, regexp_replace(_file, '/[^/]*$', '') "
                "AS part, row_number() OVER (PARTITION BY model_id ORDER BY ingested_at, _file) AS _rn FROM {src}) "
                "WHERE _rn = 1")
_NO_ROWS = {"_architecture_rows": "SELECT NULL::VARCHAR AS architecture_id, NULL::VARCHAR AS plan_json, NULL::VARCHAR "
                                  "AS spec_json, NULL::VARCHAR AS program_json, NULL::BLOB AS program_tensors, "
                                  "NULL::VARCHAR AS part, NULL::VARCHAR AS zoo WHERE false",
            "_model_parts": "SELECT NULL::VARCHAR AS model_id, NULL::VARCHAR AS zoo, NULL::VARCHAR AS part WHERE false"}


def _source(files, with_file: bool = False) -> str:
    paths = ", ".join("'" + str(p).replace("'", "''") + "'" for p in files)
    return f"read_parquet([{paths}], union_by_name = true" + (", filename = '_file')" if with_file else ")")


def connect(catalog: Catalog | str, relations: Sequence[str] | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with a view per catalog relation (empty views where the
    catalog has no files yet, typed by the relation's schema).

    A model is read from one part only: ``models`` keeps its first committed row, and where two
    parts hold the same model (concurrent writers), ``layers`` / ``nodes`` / ``edges`` drop the
    rows of the other parts, so a graph is never doubled.
    """
    catalog = catalog if isinstance(catalog, Catalog) else Catalog(catalog)
    con = duckdb.connect()
    if catalog.remote:          # DuckDB reads object storage through the catalog's own fsspec file system
        con.register_filesystem(catalog.fs)
    wanted = list(relations or (INGEST_RELATIONS + RESULT_RELATIONS))
    shadowed = False
    model_files = catalog.files("models") if set(wanted) & {"models", *_PER_MODEL} else []
    if model_files and set(wanted) & set(_PER_MODEL):
        # tables, not registered Arrow objects: cursors (the loader's threads) must see them too
        con.execute("CREATE TABLE _shadowed AS " + _SHADOWED.format(src=_source(model_files, True)))
        shadowed = con.execute("SELECT count(*) FROM _shadowed").fetchone()[0] > 0
    for relation in wanted:
        files = model_files if relation == "models" else catalog.files(relation)
        if not files:
            con.register("_schema", FIXED_SCHEMAS[relation].empty_table())
            con.execute(f"CREATE TABLE _empty_{relation} AS SELECT * FROM _schema")
            con.unregister("_schema")
            body = f"SELECT * FROM _empty_{relation}"
        elif relation == "models":
            body = _FIRST_COPY.format(src=_source(files, True))
        elif relation in _PER_MODEL and shadowed:
            body = _WITHOUT_SHADOWED.format(src=_source(files, True))
        elif relation == "architectures":
            src = _source(files, True)
            cols = {r[0] for r in con.execute(f"DESCRIBE SELECT * FROM {src}").fetchall()}
            # the first committed row that kept the architecture's program, where one did (parts written
            # since); a model's own program is looked up by part and zoo (_architecture_rows), not here
            body = _DEDUP[relation].format(src=src, order="program_json IS NULL, _file" if "program_json" in cols
                                           else "_file")
        else:
            body = _DEDUP.get(relation, "SELECT * FROM {src}").format(src=_source(files))
        con.execute(f"CREATE OR REPLACE VIEW {relation} AS {body}")
        _add_missing_columns(con, relation, body)
        if relation == "architectures":
            _architecture_parts(con, files, model_files or catalog.files("models"))
    return con


def _architecture_parts(con, files, model_files) -> None:
    """The views ``_architecture_rows`` and ``_model_parts`` (see ``_ARCHITECTURE_ROWS``): typed and
    empty where the catalog has no files; a part written before programs were kept has none."""
    bodies = dict(_NO_ROWS)
    if model_files:
        models = _source(model_files, True)
        bodies["_model_parts"] = _MODEL_PARTS.format(src=models)
        if files:
            src = _source(files, True)
            cols = {r[0] for r in con.execute(f"DESCRIBE SELECT * FROM {src}").fetchall()}
            program = "program_json, program_tensors" if "program_json" in cols else \
                "NULL::VARCHAR AS program_json, NULL::BLOB AS program_tensors"
            bodies["_architecture_rows"] = _ARCHITECTURE_ROWS.format(src=src, program=program, models=models)
    for name, body in bodies.items():
        con.execute(f"CREATE OR REPLACE VIEW {name} AS {body}")


_SQL_TYPES = {pa.string(): "VARCHAR", pa.float64(): "DOUBLE", pa.float32(): "FLOAT", pa.int64(): "BIGINT",
              pa.int32(): "INTEGER", pa.int8(): "TINYINT", pa.bool_(): "BOOLEAN", pa.binary(): "BLOB",
              pa.timestamp("us", tz="UTC"): "TIMESTAMPTZ"}


def _sql_type(t: pa.DataType) -> str:
    if pa.types.is_list(t):
        return _sql_type(t.value_type) + "[]"
    return _SQL_TYPES.get(t, "VARCHAR")


def _add_missing_columns(con, relation: str, body: str) -> None:
    """Give the view of ``relation`` the columns of its schema that its files lack (parts written
    before a column was added, e.g. ``runs.method``) as typed nulls, so queries may name every
    column. The view's columns come from the catalog, bound once when it was created."""
    schema = FIXED_SCHEMAS.get(relation)
    if schema is None:
        return
    have = {r[0] for r in con.execute("SELECT column_name FROM duckdb_columns() WHERE table_name = ?",
                                      [relation]).fetchall()}
    missing = [f for f in schema if f.name not in have]
    if missing:
        extra = ", ".join(f"CAST(NULL AS {_sql_type(f.type)}) AS {f.name}" for f in missing)
        con.execute(f"CREATE OR REPLACE VIEW {relation} AS SELECT *, {extra} FROM ({body})")


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
