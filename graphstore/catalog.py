"""The Parquet catalog: a folder of immutable *parts*, each committed by one atomic rename.

Layout::

    CATALOG/
      parts/<part_id>/{models,architectures,layers,nodes,edges,ingest_errors}.parquet
      results/<run_id>/{runs,predictions,embeddings,similarities}.parquet
      artifacts/<run_id>/...            (trained metanetworks)
      graph.lbug                        (the embedded graph store, rebuildable from Parquet)

A part is written under ``_tmp-<part_id>`` and renamed into place when every file is complete, so
a crash or kill at any moment leaves either the whole part or nothing visible; a run's artifacts
are committed the same way, as one folder. Each temporary folder carries a lease
(graphstore.lease: pid, host, start time, and a lock held while writing), and
``Catalog.clean_incomplete`` removes only the leftovers whose writer is provably gone, never the
folder of a writer still at work. Part ids carry a shard label and a random suffix, so several
writers (shards, machines) never collide.

A catalog can also live on object storage: a URL root such as ``s3://bucket/catalog`` is read and
written through fsspec (``s3fs`` for ``s3://``; credentials and endpoint from the usual
``AWS_*`` environment variables), and DuckDB reads its Parquet through the same file system.
Object stores have no directory rename, so there a part's files are written in place after its
lease and a ``_COMMITTED`` marker is written last; readers list only marked parts, so the
visibility rule is the same: the whole part or nothing.
"""
from __future__ import annotations

import datetime as dt
import os
import shutil
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from graphstore.lease import LEASE, LocalLease, local_abandoned, remote_abandoned, remote_lease_bytes
from graphstore.schema import RESULT_RELATIONS
from zoocore.config import is_url
from zoocore.errors import CatalogError
from zoocore.names import check_name

ROW_GROUP_ROWS = {"edges": 262_144, "nodes": 262_144, "layers": 65_536}


def now_utc() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


COMMITTED = "_COMMITTED"


class Catalog:
    """A catalog folder, or a URL on object storage; creates its sub-folders on first write.

    ``root`` is a ``Path`` for a folder and the URL string for object storage; ``fs`` is the
    fsspec file system of a URL root (None for a folder).
    """

    def __init__(self, root: str | os.PathLike):
        self.fs = None
        if is_url(root):
            try:
                import fsspec

                self.fs, base = fsspec.core.url_to_fs(str(root))
            except (ImportError, ValueError) as exc:
                raise CatalogError(f"cannot open catalog {root}: {exc} (object storage needs its fsspec driver, "
                                   "e.g. `pip install s3fs` for s3://)") from exc
            self._base = base.rstrip("/")
            self.root = self.fs.unstrip_protocol(self._base)
        else:
            self.root = Path(root)

    @property
    def remote(self) -> bool:
        return self.fs is not None

    def location(self, *parts: str):
        """A place under the root: a Path, or a URL on object storage."""
        return "/".join([self.root, *parts]) if self.remote else self.root.joinpath(*parts)

    def _key(self, *parts: str) -> str:
        """The fsspec path (no protocol) of a location under a remote root."""
        return "/".join([self._base, *parts])

    @property
    def parts_dir(self):
        return self.location("parts")

    @property
    def results_dir(self):
        return self.location("results")

    @property
    def artifacts_dir(self):
        return self.location("artifacts")

    def exists(self) -> bool:
        if self.remote:
            return bool(self.fs.exists(self._key("parts")))
        return self.parts_dir.is_dir()

    def require(self) -> "Catalog":
        if not self.exists():
            raise CatalogError(f"no catalog at {self.root} (run `pipeline ingest ZOO_DIR --catalog {self.root}` first)")
        return self

    def clean_incomplete(self) -> int:
        """Remove the temporary folders of writes whose writer is provably gone (graphstore.lease);
        returns how many. Folders of live writers, even stopped or slow ones, are left alone."""
        n = 0
        if self.remote:
            for kind in ("parts", "results", "artifacts"):
                for key in self._uncommitted(kind):
                    if remote_abandoned(self.fs, key):
                        self.fs.rm(key, recursive=True)
                        n += 1
            if n:
                self.fs.invalidate_cache()
            return n
        for base in (self.parts_dir, self.results_dir, self.artifacts_dir):
            if base.is_dir():
                for d in [*base.glob("_tmp-*"), *base.glob(".new-*")]:
                    if local_abandoned(d):
                        shutil.rmtree(d, ignore_errors=True)
                        n += 1
        return n

    def _uncommitted(self, kind: str) -> list[str]:
        """Folders of ``kind`` on object storage without a ``_COMMITTED`` marker. Artifacts written
        before markers existed have none; only those with a lease are uncommitted writes."""
        base = self._key(kind)
        if not self.fs.exists(base):
            return []
        folders = [p for p in self.fs.ls(base, detail=True) if p["type"] == "directory"]
        out = []
        for f in folders:
            names = {p.rsplit("/", 1)[-1] for p in self.fs.ls(f["name"], detail=False)}
            if COMMITTED in names or (kind == "artifacts" and LEASE not in names):
                continue
            out.append(f["name"].rstrip("/"))
        return out

    def new_part_id(self, shard: str = "0") -> str:
        return f"{now_utc():%Y%m%dT%H%M%S}-s{shard}-{uuid.uuid4().hex[:8]}"

    def _commit_files(self, kind: str, name: str, write) -> object:
        """Commit the folder ``kind/name`` at once: ``write(folder)`` fills a leased temporary folder
        (a Path; on object storage the fsspec key of the final folder), which then becomes
        visible as a whole: renamed into place, or marked ``_COMMITTED`` on object storage."""
        if self.remote:
            key = self._key(kind, name)
            self.fs.pipe_file(f"{key}/{LEASE}", remote_lease_bytes())      # first: marks the writer
            write(key)
            self.fs.pipe_file(f"{key}/{COMMITTED}", b"")                    # last: publishes the folder
            self.fs.invalidate_cache()
            return self.location(kind, name)
        base = self.location(kind)
        base.mkdir(parents=True, exist_ok=True)
        final = base / name
        if final.exists():
            raise CatalogError(f"{final} already exists: a catalog folder is written once")
        stage, tmp = base / f".new-{name}", base / f"_tmp-{name}"
        stage.mkdir()
        lease = LocalLease.take(stage)      # every _tmp-* folder of a live writer has its lease
        committed = False
        try:
            os.rename(stage, tmp)
            write(tmp)
            for f in tmp.iterdir():       # make the files durable before the rename publishes them
                if f.name != LEASE:
                    with open(f, "rb") as fh:
                        os.fsync(fh.fileno())
            os.rename(tmp, final)
            committed = True
            _fsync_dir(base)
        finally:
            lease.release(final if committed else None)
            if not committed:
                for d in (stage, tmp):
                    shutil.rmtree(d, ignore_errors=True)
        return final

    def _commit(self, kind: str, name: str, tables: dict[str, pa.Table]):
        tables = {r: t for r, t in tables.items() if t is not None and t.num_rows}

        def write(folder):
            for relation, table in tables.items():
                opts = dict(compression="zstd", row_group_size=ROW_GROUP_ROWS.get(relation, 65_536))
                if self.remote:
                    with self.fs.open(f"{folder}/{relation}.parquet", "wb") as fh:
                        pq.write_table(table, fh, **opts)
                else:
                    pq.write_table(table, folder / f"{relation}.parquet", **opts)

        return self._commit_files(kind, name, write)

    def commit_part(self, tables: dict[str, pa.Table], part_id: str | None = None):
        """Write one part (any subset of the ingest relations) atomically."""
        return self._commit("parts", part_id or self.new_part_id(), tables)

    def commit_results(self, run_id: str, tables: dict[str, pa.Table]):
        """Write the runs / predictions / embeddings of one run atomically (one folder per write)."""
        check_name(run_id, "run id")
        return self._commit("results", f"{run_id}-{uuid.uuid4().hex[:6]}", tables)

    def files(self, relation: str) -> list:
        """The committed Parquet files of ``relation``: Paths, or URLs on object storage."""
        kind = "results" if relation in RESULT_RELATIONS else "parts"
        if self.remote:
            found = self.fs.glob(self._key(kind, "*", f"{relation}.parquet"))
            marked = {p.rsplit("/", 1)[0] for p in self.fs.glob(self._key(kind, "*", COMMITTED))}
            return sorted(self.fs.unstrip_protocol(p) for p in found if p.rsplit("/", 1)[0] in marked)
        base = self.location(kind)
        if not base.is_dir():
            return []
        return sorted(p for p in base.glob(f"*/{relation}.parquet") if not p.parent.name.startswith("_tmp-"))

    def commit_artifacts(self, run_id: str, files: dict[str, bytes]):
        """All files of a run's artifacts (``artifacts/RUN_ID/``), committed at once: a crash leaves
        either every file or no folder (and a temporary one that ``clean_incomplete`` removes)."""

        check_name(run_id, "run id")
        for name in files:
            check_name(name, "artifact name")

        def write(folder):
            for name, data in files.items():
                if self.remote:
                    self.fs.pipe_file(f"{folder}/{name}", data)
                else:
                    (folder / name).write_bytes(data)

        return self._commit_files("artifacts", run_id, write)

    def write_artifact(self, run_id: str, name: str, data: bytes) -> None:
        """One file of a run's artifacts under ``artifacts/RUN_ID/``, replaced atomically (written
        under a temporary name, then renamed over the old one)."""
        check_name(run_id, "run id")
        check_name(name, "artifact name")
        if self.remote:
            self.fs.pipe_file(self._key("artifacts", run_id, name), data)   # an object PUT is atomic
            return
        folder = self.artifacts_dir / run_id
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, folder / name)
        finally:
            tmp.unlink(missing_ok=True)

    def read_artifact(self, run_id: str, name: str) -> bytes | None:
        """A file of a run's artifacts, or None when it is not there (or not committed yet)."""
        check_name(run_id, "run id")
        check_name(name, "artifact name")
        if self.remote:
            key = self._key("artifacts", run_id, name)
            if self.fs.exists(self._key("artifacts", run_id, LEASE)) and \
                    not self.fs.exists(self._key("artifacts", run_id, COMMITTED)):
                return None
            return self.fs.cat_file(key) if self.fs.exists(key) else None
        path = self.artifacts_dir / run_id / name
        return path.read_bytes() if path.exists() else None


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (where the platform allows opening a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
