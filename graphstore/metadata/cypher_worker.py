"""The child process that runs one read-only Cypher query on the embedded store for
``LadybugStore`` with ``isolated`` set (``graphstore cypher`` without --write).

A query that crashes the database engine crashes this process only, a time limit holds even for
one long expression (the parent kills this process: graphstore.isolation), and the store's folder
is mounted read-only here where the machine allows it. The answer is JSON: columns and rows.
"""
from __future__ import annotations

import json
import os

from graphstore.isolation import die_with_parent, fail, read_only_mount, read_request


def main() -> None:
    die_with_parent()
    request, result_fd = read_request()
    from graphstore.metadata.ladybug_store import LadybugStore
    from zoocore.errors import ZooGraphError

    try:
        store = LadybugStore(request["path"], read_only=True)
        read_only_mount(os.path.dirname(os.path.abspath(request["path"])))
        result = store._run_here(request["query"], request["params"] or {})
    except ZooGraphError as exc:
        fail("error", str(exc))
    except RecursionError:
        fail("error", "the query is nested too deeply")
    with os.fdopen(result_fd, "w") as out:
        json.dump({"columns": result.columns, "rows": result.rows}, out, default=str)
    os._exit(0)


if __name__ == "__main__":
    main()
