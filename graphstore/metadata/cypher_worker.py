"""The child process that runs one read-only Cypher query on the embedded store for
``LadybugStore`` with ``isolated`` set (``graphstore cypher`` without --write).

A query that crashes the database engine crashes this process only, a time limit holds even for
one long expression (the parent kills this process: graphstore.isolation), the store's folder is
mounted read-only here where the machine allows it, then the process's root becomes an empty folder
(``LOAD FROM '/etc/passwd'`` finds nothing, whatever the statement gate lets through), and memory is bounded twice: the engine's buffer
pool gets half the limit, and the address space may grow by the limit at most past what the open
store maps (``UNWIND range(1, 1000000000)`` ends in a one-line refusal, not a machine out of memory).
The answer is JSON: columns and rows.
"""
from __future__ import annotations

import datetime  # noqa: F401  the engine converts values through these modules, importing them on first use,
import decimal  # noqa: F401   which the worker's empty root (isolation.empty_root) would hide: imported here
import json
import os
import uuid  # noqa: F401

from graphstore.isolation import die_with_parent, empty_root, fail, limit_memory, read_only_mount, read_request

_OUT_OF_MEMORY = ("bad_alloc", "buffer pool is full", "out of memory")


def main() -> None:
    die_with_parent()
    request, result_fd = read_request()
    from graphstore.metadata.ladybug_store import LadybugStore
    from zoocore.errors import ZooGraphError

    limit = int(request["memory_limit"])
    try:
        store = LadybugStore(request["path"], read_only=True, buffer_pool_bytes=max(limit // 2, 16 << 20))
        read_only_mount(os.path.dirname(os.path.abspath(request["path"])))
        limit_memory(limit)
        empty_root()                    # the store is open: no other file need be visible
        result = store._run_here(request["query"], request["params"] or {})
    except MemoryError:
        fail("memory", "out of memory")
    except ZooGraphError as exc:
        if any(word in str(exc).lower() for word in _OUT_OF_MEMORY):
            fail("memory", str(exc))
        fail("error", str(exc))
    except RecursionError:
        fail("error", "the query is nested too deeply")
    with os.fdopen(result_fd, "w") as out:
        json.dump({"columns": result.columns, "rows": result.rows}, out, default=str)
    os._exit(0)


if __name__ == "__main__":
    main()
