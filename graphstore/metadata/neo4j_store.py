"""Neo4j over Bolt with the official driver.

A user's query (``run``) is read record by record and stopped past ``MAX_ROWS`` rows, so a query
such as ``UNWIND range(1, 1000000000) AS i RETURN i`` cannot fill this process's memory; the server's
own memory per transaction is the server's setting (``db.memory.transaction.max``, set by the test
server and docker-compose.yml)."""
from __future__ import annotations

import contextlib
import logging
from typing import Any

from graphstore.metadata import queries as Q
from graphstore.metadata.base import MetadataStore, QueryResult
from zoocore.config import Neo4jSettings
from zoocore.errors import QueryTimeout, StoreError

_CONSTRAINTS = [
    "CREATE CONSTRAINT zoo_name IF NOT EXISTS FOR (n:Zoo) REQUIRE n.name IS UNIQUE",
    "CREATE CONSTRAINT dataset_name IF NOT EXISTS FOR (n:Dataset) REQUIRE n.name IS UNIQUE",
    "CREATE CONSTRAINT model_id IF NOT EXISTS FOR (n:Model) REQUIRE n.model_id IS UNIQUE",
    "CREATE CONSTRAINT architecture_id IF NOT EXISTS FOR (n:Architecture) REQUIRE n.architecture_id IS UNIQUE",
    "CREATE CONSTRAINT layer_id IF NOT EXISTS FOR (n:Layer) REQUIRE n.layer_id IS UNIQUE",
]
# At most this many rows of one user query are held here (a million rows of a few columns is some
# hundreds of MB of Python objects); more is refused with the advice to add LIMIT.
MAX_ROWS = 1_000_000


def _plain(value: Any) -> Any:
    from neo4j.graph import Node, Relationship

    if isinstance(value, (Node, Relationship)):
        return dict(value.items())
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


# the driver logs every server notification; they reach the user through QueryResult.notices
logging.getLogger("neo4j.notifications").setLevel(logging.ERROR)


class Neo4jStore(MetadataStore):
    backend = "neo4j"

    def __init__(self, settings: Neo4jSettings, connect_timeout: float = 10.0, read_only: bool = False):
        super().__init__(read_only)
        import neo4j
        from neo4j import exceptions as nx

        self.settings = settings
        self._tx = self._session = None
        auth = (settings.user or "neo4j", settings.password) if settings.password else None
        try:
            self._driver = neo4j.GraphDatabase.driver(settings.uri, auth=auth, connection_timeout=connect_timeout)
            self._driver.verify_connectivity()
        except nx.AuthError as exc:
            raise StoreError(f"Neo4j at {settings.uri} refused the credentials for user "
                             f"{settings.user or 'neo4j'!r}: {exc.message}") from exc
        except (nx.ServiceUnavailable, OSError, ValueError, nx.ConfigurationError) as exc:
            raise StoreError(f"cannot reach Neo4j at {settings.uri}: {exc}") from exc

    def describe(self) -> str:
        return f"neo4j:{self.settings.uri}"

    @contextlib.contextmanager
    def _errors(self, timeout: float | None):
        """The driver's errors as this project's: a time limit reached, a refusal, a lost server."""
        from neo4j import exceptions as nx

        try:
            yield
        except nx.Neo4jError as exc:
            if timeout and "TransactionTimedOut" in (exc.code or ""):
                raise QueryTimeout(f"query stopped after {timeout:g} s (the time limit; raise it with "
                                   "--timeout SECONDS, 0 for none)") from exc
            raise StoreError(f"{exc.code}: {exc.message}") from exc
        except (nx.ServiceUnavailable, nx.SessionExpired) as exc:
            raise StoreError(f"lost the connection to Neo4j at {self.settings.uri}: {exc}") from exc

    @staticmethod
    def _answer(keys, rows: list[list[Any]], summary) -> QueryResult:
        notices = [f"{n.get('code', '')}: {n.get('description', '')}".strip(": ")
                   for n in (summary.notifications or [])]
        return QueryResult(list(keys), rows, notices, getattr(summary, "query_type", None))

    def _execute(self, query: str, params: dict[str, Any] | None = None, timeout: float | None = None) -> QueryResult:
        import neo4j

        with self._errors(timeout):
            if self._tx is not None:
                result = self._tx.run(query, params or {})
                records, keys = list(result), result.keys()
                summary = result.consume()
            else:
                records, summary, keys = self._driver.execute_query(
                    neo4j.Query(query, timeout=timeout) if timeout else query, params or {},
                    database_=self.settings.database,
                    routing_=neo4j.RoutingControl.READ if self.read_only else neo4j.RoutingControl.WRITE)
        return self._answer(keys, [[_plain(v) for v in r.values()] for r in records], summary)

    def _ensure_schema(self) -> None:
        for c in _CONSTRAINTS:
            self._execute(c)

    def _ensure_model_properties(self, props: dict[str, str]) -> None:
        self._model_props.update({k: v for k, v in props.items() if k not in self._model_props})

    def _write(self, query: str, rows: list[dict]) -> None:
        self._execute(query, {"rows": rows})

    def _run(self, query: str, params: dict[str, Any]) -> QueryResult:
        if self._tx is not None:
            return self._execute(query, params, self.query_timeout)
        return self._bounded(query, params, self.query_timeout)

    def _bounded(self, query: str, params: dict[str, Any], timeout: float | None) -> QueryResult:
        """A user's query, its records read one by one and refused past ``MAX_ROWS``."""
        import neo4j

        mode = neo4j.READ_ACCESS if self.read_only else neo4j.WRITE_ACCESS
        with self._errors(timeout), self._driver.session(database=self.settings.database,
                                                         default_access_mode=mode) as session:
            result = session.run(neo4j.Query(query, timeout=timeout) if timeout else query, params or {})
            keys, rows = list(result.keys()), []
            for record in result:
                if len(rows) == MAX_ROWS:
                    raise StoreError(f"the query returns more than {MAX_ROWS} rows; add LIMIT (or aggregate)")
                rows.append([_plain(v) for v in record.values()])
            summary = result.consume()
        return self._answer(keys, rows, summary)

    def _check_plan(self, query: str, params: dict[str, Any]) -> None:
        """The server's own parser decides too: EXPLAIN plans the query without running it, and its
        query type must be 'r' (read only), not 'rw', 'w' or 's' (schema)."""
        from graphstore.metadata.read_only import CypherRefused

        kind = self._execute("EXPLAIN " + query, params, self.query_timeout).query_type
        if kind != "r":
            raise CypherRefused(f"Neo4j plans this query as type {kind!r}, not read-only ('r') (graphstore cypher "
                                "is read-only; an administrator can add --write)")

    def _clear(self) -> None:
        self._execute(Q.DELETE_ALL)

    def _begin(self) -> None:
        self._session = self._driver.session(database=self.settings.database)
        self._tx = self._session.begin_transaction()

    def _end(self, commit: bool) -> None:
        from neo4j import exceptions as nx

        tx, session, self._tx, self._session = self._tx, self._session, None, None
        try:
            tx.commit() if commit else tx.rollback()
        except nx.Neo4jError as exc:
            raise StoreError(f"{exc.code}: {exc.message}") from exc
        except (nx.ServiceUnavailable, nx.SessionExpired) as exc:
            raise StoreError(f"lost the connection to Neo4j at {self.settings.uri}: {exc}") from exc
        finally:
            session.close()

    def _commit(self) -> None:
        self._end(True)

    def _rollback(self) -> None:
        try:
            self._end(False)
        except StoreError:
            pass

    def close(self) -> None:
        driver = getattr(self, "_driver", None)
        if driver is not None:
            driver.close()
        self._driver = None
