"""The child process that runs one user query for ``graphstore.sql.run_readonly``
(``graphstore.isolation`` starts it and reads its answer).

It reads a JSON request on standard input, locks itself down, runs the query on a
``readonly_connection`` and writes the result as an Arrow IPC stream. The locks, in order:

- SIGINT is ignored (the parent stops this process) and the process dies with its parent;
- where the machine allows it, a private mount namespace in which the catalog folder is mounted
  read-only (as root directly, otherwise inside a user namespace): even a statement that slipped
  past the parser and DuckDB's own access checks cannot change a byte of the catalog; a catalog on
  object storage is read through a file-system client whose writing methods refuse;
- the address space is limited to what the process holds now plus the memory limit, so no query
  (a huge list built in one expression included) takes more than its limit of memory;
- standard output is kept for the result alone.
"""
from __future__ import annotations

import os
import tempfile

from graphstore.isolation import (die_with_parent, fail, limit_memory, read_only_filesystem, read_only_mount,
                                  read_request)


def main() -> None:
    die_with_parent()
    request, result_fd = read_request()
    from graphstore.catalog import Catalog

    catalog = Catalog(request["catalog"])
    if catalog.remote:
        read_only_filesystem(catalog.fs)            # the object store's client, as DuckDB will use it
    else:
        read_only_mount(str(catalog.root))

    import duckdb
    import pyarrow as pa

    from graphstore.sql import memory_limit_bytes, readonly_connection

    with tempfile.TemporaryDirectory(prefix="zoograph-sql-") as tmp:
        try:
            con = readonly_connection(catalog, request["memory_limit"], temp_dir=tmp)
            limit_memory(memory_limit_bytes(request["memory_limit"]))
            query, params = request["query"], request["params"]
            rel = con.sql(query, params=params) if params else con.sql(query)
            table = pa.table({}) if rel is None else rel.arrow().read_all()
        except duckdb.PermissionException as exc:
            fail("refused", f"refused: {exc}")
        except (duckdb.OutOfMemoryException, MemoryError) as exc:
            fail("memory", str(exc).splitlines()[0] if str(exc) else "out of memory")
        except duckdb.Error as exc:
            fail("error", str(exc))
        except RecursionError:
            fail("error", "the query is nested too deeply")
        with os.fdopen(result_fd, "wb") as out:
            with pa.ipc.new_stream(out, table.schema) as writer:
                writer.write_table(table)
    os._exit(0)


if __name__ == "__main__":
    main()
