"""The Parquet catalog: a folder of immutable *parts*, each committed by one atomic rename.

Layout::

    CATALOG/
      parts/<part_id>/{models,architectures,layers,nodes,edges,ingest_errors}.parquet
      results/<run_id>/{runs,predictions,embeddings,similarities}.parquet
      artifacts/<run_id>/...            (trained metanetworks)
      graph.lbug                        (the embedded graph store, rebuildable from Parquet)

A part is written under ``_tmp-<part_id>`` and renamed into place when every file is complete, so
a crash or kill at any moment leaves either the whole part or nothing visible; leftovers of an
interrupted write are removed by ``Catalog.clean_incomplete``. Part ids carry a shard label and a
random suffix, so several writers (shards, machines) never collide.

A catalog can also live on object storage: a URL root such as ``s3://bucket/catalog`` is read and
written through fsspec (``s3fs`` for ``s3://``; credentials and endpoint from the usual
``AWS_*`` environment variables), and DuckDB reads its Parquet through the same file system.
Object stores have no directory rename, so there a part's files are written in place and a
``_COMMITTED`` marker is written last; readers list only marked parts, so the visibility rule is
the same: the whole part or nothing.
"""
from __future__ import annotations

import datetime as dt
import os
import shutil
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from graphstore.schema import RESULT_RELATIONS
from pipeline.config import is_url
from pipeline.errors import CatalogError

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
        """Remove folders of writes that never committed; returns how many. (On object storage an
        unmarked part is invisible and left alone: its writer may still be running.)"""
        if self.remote:
            return 0
        n = 0
        for base in (self.parts_dir, self.results_dir):
            if base.is_dir():
                for d in base.glob("_tmp-*"):
                    shutil.rmtree(d, ignore_errors=True)
                    n += 1
        return n

    def new_part_id(self, shard: str = "0") -> str:
        return f"{now_utc():%Y%m%dT%H%M%S}-s{shard}-{uuid.uuid4().hex[:8]}"

    def _commit(self, kind: str, name: str, tables: dict[str, pa.Table]):
        tables = {r: t for r, t in tables.items() if t is not None and t.num_rows}
        if self.remote:
            for relation, table in tables.items():
                with self.fs.open(self._key(kind, name, f"{relation}.parquet"), "wb") as fh:
                    pq.write_table(table, fh, compression="zstd", row_group_size=ROW_GROUP_ROWS.get(relation, 65_536))
            with self.fs.open(self._key(kind, name, COMMITTED), "wb") as fh:     # last: publishes the part
                fh.write(b"")
            self.fs.invalidate_cache()
            return self.location(kind, name)
        base = self.location(kind)
        base.mkdir(parents=True, exist_ok=True)
        tmp = base / f"_tmp-{name}"
        tmp.mkdir()
        for relation, table in tables.items():
            pq.write_table(table, tmp / f"{relation}.parquet", compression="zstd",
                           row_group_size=ROW_GROUP_ROWS.get(relation, 65_536))
        for f in tmp.iterdir():           # make the files durable before the rename publishes them
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        final = base / name
        os.rename(tmp, final)
        return final

    def commit_part(self, tables: dict[str, pa.Table], part_id: str | None = None):
        """Write one part (any subset of the ingest relations) atomically."""
        return self._commit("parts", part_id or self.new_part_id(), tables)

    def commit_results(self, run_id: str, tables: dict[str, pa.Table]):
        """Write the runs / predictions / embeddings of one run atomically (one folder per write)."""
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

    def write_artifact(self, run_id: str, name: str, data: bytes) -> None:
        """One file of a run's trained metanetwork under ``artifacts/RUN_ID/``."""
        if self.remote:
            with self.fs.open(self._key("artifacts", run_id, name), "wb") as fh:
                fh.write(data)
            return
        folder = self.artifacts_dir / run_id
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)

    def read_artifact(self, run_id: str, name: str) -> bytes | None:
        """A file of a run's artifacts, or None when it is not there."""
        if self.remote:
            key = self._key("artifacts", run_id, name)
            return self.fs.cat_file(key) if self.fs.exists(key) else None
        path = self.artifacts_dir / run_id / name
        return path.read_bytes() if path.exists() else None
