"""The child process that runs one user query for ``graphstore.sql.run_readonly``.

It reads a JSON request on standard input, locks itself down, runs the query on a
``readonly_connection`` and writes the result as an Arrow IPC stream on standard output. A query
DuckDB refuses or fails exits with ``REFUSED_EXIT`` and ``kind:message`` as the last line of
standard error. The locks, in order:

- SIGINT is ignored (the parent stops this process) and the process dies with its parent;
- where the machine allows it, a private mount namespace in which the catalog folder is mounted
  read-only (as root directly, otherwise inside a user namespace): even a statement that slipped
  past the parser and DuckDB's own access checks cannot change a byte of the catalog;
- the address space is limited to what the process holds now plus the memory limit, so no query
  (a huge list built in one expression included) takes more than its limit of memory;
- standard output is kept for the result alone.
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys
import tempfile

CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG = 1


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def die_with_parent() -> None:
    try:
        _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _mount_read_only(libc, path: bytes) -> bool:
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return False
    if libc.mount(path, path, None, MS_BIND | MS_REC, None) != 0:
        return False
    return libc.mount(b"none", path, None, MS_REMOUNT | MS_BIND | MS_RDONLY, None) == 0


def read_only_mount(path: str) -> str:
    """Mount ``path`` read-only in a private mount namespace of this process; returns how
    (``mount namespace``, ``user namespace``) or ``none`` where the machine allows neither."""
    if not sys.platform.startswith("linux"):
        return "none"
    try:
        libc = _libc()
    except OSError:
        return "none"
    target = os.path.realpath(path).encode()
    if libc.unshare(CLONE_NEWNS) == 0 and _mount_read_only(libc, target):
        return "mount namespace"
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
        return "none"
    try:
        with open("/proc/self/setgroups", "w") as fh:
            fh.write("deny")
        with open("/proc/self/uid_map", "w") as fh:
            fh.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as fh:
            fh.write(f"{gid} {gid} 1")
    except OSError:
        return "none"
    return "user namespace" if _mount_read_only(libc, target) else "none"


def limit_memory(limit_bytes: int) -> None:
    """Cap the address space at what this process maps now plus ``limit_bytes``."""
    with open("/proc/self/statm") as fh:
        mapped = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = mapped + limit_bytes
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def fail(kind: str, message: str) -> None:
    from graphstore.sql import REFUSED_EXIT

    text = " ".join(str(message).split())[:2000]
    sys.stderr.write(f"{kind}:{text}\n")
    sys.stderr.flush()
    os._exit(REFUSED_EXIT)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    result_fd = os.dup(1)
    os.dup2(2, 1)                       # anything printed by accident goes to stderr, not into the result
    request = json.loads(sys.stdin.buffer.read())
    from graphstore.catalog import Catalog

    catalog = Catalog(request["catalog"])
    sandbox = "remote" if catalog.remote else read_only_mount(str(catalog.root))
    os.environ["ZOOGRAPH_SQL_SANDBOX"] = sandbox

    import duckdb
    import pyarrow as pa

    from graphstore.sql import memory_limit_bytes, readonly_connection

    with tempfile.TemporaryDirectory(prefix="zoograph-sql-") as tmp:
        try:
            con = readonly_connection(catalog, request["memory_limit"], temp_dir=tmp)
            limit_memory(memory_limit_bytes(request["memory_limit"]))
            rel = con.sql(request["query"], params=request["params"]) if request["params"] else con.sql(request["query"])
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
