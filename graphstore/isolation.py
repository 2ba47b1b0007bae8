"""Running one user query in a child process: the process boundary that time limits, memory
limits, Ctrl-C and crashes need.

``run_worker`` starts ``python -m MODULE`` with a JSON request on standard input and returns what
the worker writes on standard output. The worker is killed when the time limit passes (a single
long expression included, which no database checks for interruption), on Ctrl-C (the worker
ignores SIGINT; this process stops it and re-raises KeyboardInterrupt) and when this process dies
(``die_with_parent``). A worker that refuses or fails a query exits with ``REFUSED_EXIT`` and
``kind:message`` as the last line of standard error (``fail``); one that crashes (a signal) is
reported in one line. Workers: ``graphstore.sql_worker``, ``graphstore.metadata.cypher_worker``.
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from zoocore.errors import QueryTimeout

REFUSED_EXIT = 3
PR_SET_PDEATHSIG = 1


class WorkerFailed(Exception):
    """The worker refused or failed the query (``kind``: refused, memory, timeout, error) or died
    (``kind`` crash, ``signal`` its name)."""

    def __init__(self, kind: str, message: str, signal_name: str | None = None):
        super().__init__(message)
        self.kind, self.message, self.signal_name = kind, message, signal_name


def _env() -> dict:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)          # the project, importable in the child
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    try:
        proc.communicate(timeout=10)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        pass


def run_worker(module: str, request: dict[str, Any], timeout: float | None, what: str = "query") -> bytes:
    """The standard output of worker ``module`` given ``request``; see the module docstring."""
    data = json.dumps(request, default=str).encode()
    proc = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_env())
    try:
        out, err = proc.communicate(data, timeout=timeout or None)
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise QueryTimeout(f"{what} stopped after {timeout:g} s (the time limit; raise it with --timeout SECONDS, "
                           "0 for none)") from None
    except BaseException:               # Ctrl-C, or anything else: the worker never outlives the call
        _stop(proc)
        raise
    if proc.returncode == 0:
        return out
    lines = err.decode("utf-8", "replace").strip().splitlines()
    if proc.returncode == REFUSED_EXIT and lines:
        kind, _, text = lines[-1].partition(":")
        raise WorkerFailed(kind, text)
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        raise WorkerFailed("crash", f"the {what} stopped its worker process with {name}; nothing was changed", name)
    raise WorkerFailed("error", f"the {what} worker failed (exit {proc.returncode}): "
                                f"{lines[-1][:300] if lines else 'no message'}")


# ------------------------------------------------------------------------------ in the worker
def die_with_parent() -> None:
    """Ignore Ctrl-C (the parent stops this process) and die when the parent dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass


def read_request() -> tuple[dict, int]:
    """The request, and a file descriptor for the result: standard output is pointed at standard
    error, so nothing printed by accident lands in the result."""
    result_fd = os.dup(1)
    os.dup2(2, 1)
    return json.loads(sys.stdin.buffer.read()), result_fd


def fail(kind: str, message: str) -> None:
    text = " ".join(str(message).split())[:2000]
    sys.stderr.write(f"{kind}:{text}\n")
    sys.stderr.flush()
    os._exit(REFUSED_EXIT)


CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18


def _libc():
    return ctypes.CDLL(None, use_errno=True)


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


def empty_root() -> bool:
    """Make this process's root an empty folder that no longer exists anywhere (chroot into a fresh
    temporary folder, then remove it): nothing outside what is already open can be read. Call it
    after every file the process needs is open and every module it needs imported. Returns whether
    the machine allowed it (root, or the user namespace ``read_only_mount`` entered)."""
    import tempfile

    folder = tempfile.mkdtemp(prefix="zoograph-view-")
    parent = os.open(os.path.dirname(folder), os.O_RDONLY)
    try:
        os.chdir(folder)
        os.chroot(folder)
        os.chdir("/")
        return True
    except OSError:
        return False
    finally:
        try:
            os.rmdir(os.path.basename(folder), dir_fd=parent)
        except OSError:
            pass
        os.close(parent)


def limit_memory(limit_bytes: int) -> None:
    """Cap the address space at what this process maps now plus ``limit_bytes``."""
    with open("/proc/self/statm") as fh:
        mapped = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = mapped + limit_bytes
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


_WRITING = ("rm", "rm_file", "_rm", "rmdir", "mv", "move", "rename", "mkdir", "makedirs", "touch", "put", "put_file",
            "pipe", "pipe_file", "cp_file", "copy", "write_bytes", "write_text", "setxattr")


def read_only_filesystem(fs) -> None:
    """Make an fsspec file system object (a catalog on object storage, as DuckDB reads it in the
    SQL worker) refuse every write: opening for writing and the methods that change objects."""
    def refuse(*args, **kwargs):
        raise PermissionError("the query worker's view of the catalog is read-only")

    opener = fs.open

    def open_read_only(path, mode="rb", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            refuse()
        return opener(path, mode, *args, **kwargs)

    fs.open = open_read_only
    for name in _WRITING:
        if hasattr(fs, name):
            setattr(fs, name, refuse)
