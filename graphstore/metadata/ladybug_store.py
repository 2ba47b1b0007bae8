"""The embedded default: Ladybug (a maintained Kuzu fork), an on-disk Cypher database."""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any, Callable

from graphstore.metadata.base import MetadataStore, QueryResult, check_property
from zoocore.errors import QueryTimeout, StoreError

_DDL = [
    "CREATE NODE TABLE IF NOT EXISTS Zoo(name STRING PRIMARY KEY)",
    "CREATE NODE TABLE IF NOT EXISTS Dataset(name STRING PRIMARY KEY)",
    "CREATE NODE TABLE IF NOT EXISTS Model(model_id STRING PRIMARY KEY)",
    "CREATE NODE TABLE IF NOT EXISTS Architecture(architecture_id STRING PRIMARY KEY, summary STRING, "
    "num_params INT64, num_nodes INT64, num_edges INT64, num_layers INT64, num_conv INT64, num_linear INT64, "
    "has_batchnorm BOOLEAN, has_residual BOOLEAN)",
    "CREATE NODE TABLE IF NOT EXISTS Layer(layer_id STRING PRIMARY KEY, architecture_id STRING, position INT64, "
    "kind STRING, relation STRING, in_size INT64, out_size INT64, kernel_h INT64, kernel_w INT64, groups INT64, "
    "activation STRING)",
    "CREATE REL TABLE IF NOT EXISTS CONTAINS(FROM Zoo TO Model)",
    "CREATE REL TABLE IF NOT EXISTS HAS_ARCHITECTURE(FROM Model TO Architecture)",
    "CREATE REL TABLE IF NOT EXISTS HAS_LAYER(FROM Architecture TO Layer, position INT64)",
    "CREATE REL TABLE IF NOT EXISTS FEEDS(FROM Layer TO Layer)",
    "CREATE REL TABLE IF NOT EXISTS TRAINED_ON(FROM Model TO Dataset)",
    "CREATE REL TABLE IF NOT EXISTS SIMILAR_TO(FROM Model TO Model, score DOUBLE, run_id STRING)",
]
def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if not k.startswith("_")}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value

_TYPE_NAMES = {"BOOL": "BOOLEAN"}          # Ladybug's table_info name -> the DDL name property_type gives


class LadybugStore(MetadataStore):
    backend = "ladybug"
    _in_transaction = False
    isolated = False            # read-only user queries run in a child process (graphstore cypher)
    memory_limit: str | None = None     # of that child process (graphstore.sql.memory_limit_setting text)

    def __init__(self, path: str | Path, read_only: bool = False, buffer_pool_bytes: int | None = None):
        super().__init__(read_only)
        self._buffer_pool = {"buffer_pool_size": int(buffer_pool_bytes)} if buffer_pool_bytes else {}

        self.path = Path(path)
        if read_only and not self.path.exists():
            raise StoreError(f"no embedded graph store at {self.path} (`graphstore sync` builds it from the "
                             "catalog)")
        if not read_only:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._open()

    def _open(self) -> None:
        import ladybug

        try:
            try:
                self._db = ladybug.Database(str(self.path), read_only=self.read_only, **self._buffer_pool)
            except RuntimeError as exc:
                if not (self.read_only and "recovery" in str(exc).lower()):
                    raise
                self._recover()
                self._db = ladybug.Database(str(self.path), read_only=True, **self._buffer_pool)
            self._conn = ladybug.Connection(self._db)
        except RuntimeError as exc:
            raise StoreError(f"cannot open the embedded graph store at {self.path}: {exc}") from exc

    def _recover(self) -> None:
        """A writer was killed mid-write: its log must be replayed, which takes one read-write open
        (the store's own recovery); refused with what to do while another process writes."""
        import ladybug

        try:
            ladybug.Database(str(self.path), read_only=False).close()
        except RuntimeError as exc:
            raise StoreError(f"the embedded graph store at {self.path} needs recovery after an interrupted write "
                             f"and another process holds it ({str(exc).splitlines()[0]}); try again when it "
                             "finishes, or run `graphstore sync`") from exc

    def rebuild(self, write: Callable[["LadybugStore"], None]) -> None:
        """Build a fresh database with ``write`` beside this one and put it in this one's place by a
        rename: a failure, a crash or a kill at any moment leaves the old store or the new one,
        never a mix, and every property gets the type the catalog gives it."""
        if self.read_only:
            raise StoreError(f"{self.describe()} was opened read-only")
        for left in self.path.parent.glob(f".{self.path.name}.rebuild-*"):      # of a rebuild that was killed
            left.unlink(missing_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.rebuild-{uuid.uuid4().hex[:8]}")
        fresh = LadybugStore(tmp)
        try:
            write(fresh)
            fresh._execute("CHECKPOINT")
        except BaseException:
            fresh.close()
            for f in (tmp, Path(f"{tmp}.wal")):
                f.unlink(missing_ok=True)
            raise
        fresh.close()
        self.close()
        Path(f"{self.path}.wal").unlink(missing_ok=True)       # the old store's log, checkpointed on close
        os.replace(tmp, self.path)
        if Path(f"{tmp}.wal").exists():
            os.replace(f"{tmp}.wal", f"{self.path}.wal")
        self._model_props, self._schema_ready = {}, False
        self._open()

    def describe(self) -> str:
        return f"ladybug:{self.path}"

    def _execute(self, query: str, params: dict[str, Any] | None = None):
        try:
            return self._conn.execute(query, params or {})
        except RuntimeError as exc:
            raise StoreError(str(exc)) from exc

    def _ensure_schema(self) -> None:
        for ddl in _DDL:
            self._execute(ddl)
        info = self._execute('CALL table_info("Model") RETURN *').get_all()
        # table_info names a BOOLEAN column BOOL: compare the types the catalog's columns map to
        self._model_props = {row[1]: _TYPE_NAMES.get(row[2], row[2]) for row in info if row[1] != "model_id"}

    def _ensure_model_properties(self, props: dict[str, str]) -> None:
        """Add the properties the store lacks. A property of another type (a default such as
        ``label DOUBLE``, or a type a column once had) takes the catalog's type when no model holds
        a value of it; otherwise, or inside a transaction (Ladybug cannot change a column's type
        there), the write is refused and `graphstore sync`, which rebuilds the store from the
        catalog into a fresh database (``rebuild``), is the way out."""
        for name, typ in props.items():
            have = self._model_props.get(name)
            if have == typ or (have == "DOUBLE" and typ == "INT64"):       # an int is written as a double
                continue
            prop = check_property(name)
            if have is not None:
                held = self._execute(f"MATCH (m:Model) WHERE m.`{prop}` IS NOT NULL RETURN count(*)").get_all()[0][0]
                if held or self._in_transaction:
                    raise StoreError(f"the graph store's Model.{prop} is {have} and the catalog's column is {typ}: "
                                     "run `graphstore sync` to rebuild the graph from the catalog")
                self._execute(f"ALTER TABLE Model DROP `{prop}`")
            self._execute(f"ALTER TABLE Model ADD `{prop}` {typ}")
            self._model_props[name] = typ
            if have is not None:            # statements prepared for the old type crash the database
                self._execute("CHECKPOINT")
                self._forget_prepared()

    def _forget_prepared(self) -> None:
        """The connection caches prepared statements by their text; after a rollback or a property's
        change of type, one may name a column that no longer is what it was."""
        cache = getattr(self._conn, "_pybind_implicit_prepared_cache", None)
        if cache is not None:
            cache.clear()

    def _write(self, query: str, rows: list[dict]) -> None:
        self._execute(query, {"rows": rows})

    def _run(self, query: str, params: dict[str, Any]) -> QueryResult:
        if self.read_only and self.isolated:
            return self._run_in_worker(query, params)
        return self._run_here(query, params)

    def _run_in_worker(self, query: str, params: dict[str, Any]) -> QueryResult:
        """The query in a child process (graphstore.metadata.cypher_worker): killed at the time
        limit even inside one long expression, and a crash of the engine is one line here."""
        from graphstore.isolation import WorkerFailed, run_worker
        from graphstore.sql import memory_limit_bytes, memory_limit_setting

        setting = memory_limit_setting(self.memory_limit)
        request = {"path": str(self.path.resolve()), "query": query, "params": params,
                   "memory_limit": memory_limit_bytes(setting)}
        try:
            out = run_worker("graphstore.metadata.cypher_worker", request, self.query_timeout)
        except WorkerFailed as exc:
            if exc.kind == "memory":
                raise StoreError(f"the query needs more memory than its limit of {setting} (--memory-limit); "
                                 "nothing was changed") from None
            if exc.kind == "crash":
                raise StoreError(f"the query stopped its worker process with {exc.signal_name} (a crash of the "
                                 f"engine, or its memory limit of {setting}); nothing was changed") from None
            raise StoreError(exc.message) from None
        answer = json.loads(out)
        return QueryResult(answer["columns"], answer["rows"])

    def _run_here(self, query: str, params: dict[str, Any]) -> QueryResult:
        timeout = self.query_timeout
        if timeout:
            self._conn.set_query_timeout(max(1, round(timeout * 1000)))
        try:
            result = self._execute(query, params)
        except StoreError as exc:
            if timeout and str(exc).strip() == "Interrupted.":
                raise QueryTimeout(f"query stopped after {timeout:g} s (the time limit; raise it with "
                                   "--timeout SECONDS, 0 for none)") from exc
            raise
        finally:
            if timeout:
                self._conn.set_query_timeout(0)
        if isinstance(result, list):
            result = result[-1]
        columns = result.get_column_names()
        rows = [[_plain(v) for v in row] for row in result.get_all()]
        return QueryResult(columns, rows)

    def _clear(self) -> None:
        self.ensure_schema()
        for rel in ("CONTAINS", "HAS_ARCHITECTURE", "HAS_LAYER", "FEEDS", "TRAINED_ON", "SIMILAR_TO"):
            self._execute(f"MATCH ()-[r:{rel}]->() DELETE r")
        for label in ("Zoo", "Dataset", "Model", "Architecture", "Layer"):
            self._execute(f"MATCH (n:{label}) DELETE n")

    def _begin(self) -> None:
        self._execute("BEGIN TRANSACTION")
        self._in_transaction = True

    def _commit(self) -> None:
        self._execute("COMMIT")
        self._in_transaction = False

    def _rollback(self) -> None:
        self._in_transaction = False
        try:
            self._execute("ROLLBACK")
        except StoreError:          # the database may have rolled back already after a failed statement
            pass
        self._forget_prepared()

    def close(self) -> None:
        conn, db = getattr(self, "_conn", None), getattr(self, "_db", None)
        if conn is not None:
            conn.close()
        if db is not None:
            db.close()
        self._conn = self._db = None
