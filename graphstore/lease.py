"""Leases on the temporary folders of catalog writes: whose write it is, and whether it is abandoned.

Every write to the catalog (a part, a run's results, a run's artifacts) goes into a temporary
folder ``_tmp-*`` that is renamed into place when complete. A writer puts a lease file
``_LEASE`` in that folder before anything else, recording its pid, host and start time, and,
on a local file system, holds an exclusive ``flock`` on it until the folder is renamed. The
kernel drops the lock when the process dies in any way (kill -9 included), and keeps it while
the process is merely stopped or slow, so on a local catalog "the lock can be taken" is exact
proof that nobody is writing there any more.

``abandoned`` decides whether a cleaner may remove a temporary folder:

- local folder, lease present: abandoned iff its lock can be taken (where the file system
  cannot lock, the pid rule below applies);
- lease recorded on this host: abandoned iff that pid is no longer running;
- lease recorded on another host, or on object storage where nothing can be locked: abandoned
  only when older than ``STALE_AFTER`` (a day by default; ``ZOOGRAPH_LEASE_STALE_SECONDS``);
- no lease: locally a writer makes its lease in a staging folder ``.new-*`` renamed to
  ``_tmp-*`` afterwards, so a ``_tmp-*`` folder without one is an older version's leftover
  (abandoned) and a staging folder without one is abandoned after ``NO_LEASE_GRACE`` (ten
  minutes; a live writer creates its lease microseconds after the folder); on object storage,
  when its files have not changed for ``STALE_AFTER``.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

LEASE = "_LEASE"
NO_LEASE_GRACE = 600.0


def stale_after() -> float:
    """Seconds after which a lease that cannot be checked otherwise counts as abandoned."""
    return float(os.environ.get("ZOOGRAPH_LEASE_STALE_SECONDS", 24 * 3600))


def lease_record() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this host (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:         # someone else's process: alive
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _record_abandoned(record: dict | None, age: float | None) -> bool:
    """The pid/host/age rule."""
    if isinstance(record, dict) and isinstance(record.get("pid"), int):
        if record.get("host") == socket.gethostname():
            return not pid_alive(record["pid"])
        started = record.get("started")
        if isinstance(started, (int, float)):
            return time.time() - started > stale_after()
    return age is not None and age > stale_after()


@dataclass
class LocalLease:
    """The lease of a local temporary folder, locked for as long as this object is open."""

    folder: Path
    fd: int

    @classmethod
    def take(cls, folder: Path) -> "LocalLease":
        """Create and lock the lease of a freshly made ``folder``."""
        path = folder / LEASE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:        # blocking: a cleaner may hold it for the instant it takes to look inside
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as exc:     # a file system without locks: the pid/host record still holds
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP):
                    raise
            os.write(fd, json.dumps(lease_record()).encode())
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(folder, fd)

    def release(self, final: Path | None = None) -> None:
        """Drop the lease; ``final`` is where the folder went (its lease file is removed there)."""
        if self.fd < 0:
            return
        if final is not None:
            try:
                os.unlink(Path(final) / LEASE)
            except FileNotFoundError:
                pass
        os.close(self.fd)
        self.fd = -1


def local_abandoned(folder: Path) -> bool:
    """Whether nobody can still be writing into the local temporary ``folder``.

    A writer makes its lease in a staging folder (``.new-*``) and only then renames it to
    ``_tmp-*``, so a ``_tmp-*`` folder without a lease was not made by a live writer of this
    version (an older version's leftover): abandoned. A staging folder without a lease is a writer
    between ``mkdir`` and its lease, or one that died there: only age tells them apart.
    """
    staged = not folder.name.startswith("_tmp-")
    try:
        fd = os.open(folder / LEASE, os.O_RDONLY)
    except FileNotFoundError:
        if not staged:
            return folder.exists()
        try:
            return time.time() - folder.stat().st_mtime > NO_LEASE_GRACE
        except FileNotFoundError:
            return False               # gone already (committed or cleaned by someone else)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False               # a live writer holds it (running, stopped or slow)
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            return _record_abandoned(_read_record(fd), None)
        if _read_record(fd) is None and staged:
            # lock free but no record yet: a writer between creating and locking its lease, or one
            # that died there
            return time.time() - os.fstat(fd).st_mtime > NO_LEASE_GRACE
        return True
    finally:
        os.close(fd)


def _read_record(fd: int) -> dict | None:
    try:
        data = os.pread(fd, 4096, 0)
        record = json.loads(data) if data else None
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def remote_abandoned(fs, key: str) -> bool:
    """Whether an uncommitted folder on object storage is provably abandoned (pid/host/age rule;
    nothing can be locked there)."""
    lease = f"{key}/{LEASE}"
    record = None
    try:
        if fs.exists(lease):
            record = json.loads(fs.cat_file(lease))
    except (OSError, ValueError):
        record = None
    age = None
    try:
        stamps = [_mtime(fs.info(p)) for p in fs.find(key)]
        stamps = [s for s in stamps if s is not None]
        age = time.time() - max(stamps) if stamps else None
    except OSError:
        pass
    return _record_abandoned(record, age)


def _mtime(info: dict) -> float | None:
    for k in ("LastModified", "mtime", "last_modified", "created"):
        v = info.get(k)
        if v is None:
            continue
        if hasattr(v, "timestamp"):
            return v.timestamp()
        if isinstance(v, (int, float)):
            return float(v)
    return None


def remote_lease_bytes() -> bytes:
    return json.dumps(lease_record()).encode()
