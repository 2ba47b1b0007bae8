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
"""
from __future__ import annotations

import datetime as dt
import os
import shutil
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import CatalogError

ROW_GROUP_ROWS = {"edges": 262_144, "nodes": 262_144, "layers": 65_536}


def now_utc() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class Catalog:
    """A catalog folder; creates its sub-folders on first write."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    @property
    def parts_dir(self) -> Path:
        return self.root / "parts"

    @property
    def results_dir(self) -> Path:
        return self.root / "results"

    @property
    def artifacts_dir(self) -> Path:
        return self.root / "artifacts"

    def exists(self) -> bool:
        return self.parts_dir.is_dir()

    def require(self) -> "Catalog":
        if not self.exists():
            raise CatalogError(f"no catalog at {self.root} (run `pipeline ingest ZOO_DIR --catalog {self.root}` first)")
        return self

    def clean_incomplete(self) -> int:
        """Remove folders of writes that never committed; returns how many."""
        n = 0
        for base in (self.parts_dir, self.results_dir):
            if base.is_dir():
                for d in base.glob("_tmp-*"):
                    shutil.rmtree(d, ignore_errors=True)
                    n += 1
        return n

    def new_part_id(self, shard: str = "0") -> str:
        return f"{now_utc():%Y%m%dT%H%M%S}-s{shard}-{uuid.uuid4().hex[:8]}"

    def _commit(self, base: Path, name: str, tables: dict[str, pa.Table]) -> Path:
        base.mkdir(parents=True, exist_ok=True)
        tmp = base / f"_tmp-{name}"
        tmp.mkdir()
        for relation, table in tables.items():
            if table is None or table.num_rows == 0:
                continue
            pq.write_table(table, tmp / f"{relation}.parquet", compression="zstd",
                           row_group_size=ROW_GROUP_ROWS.get(relation, 65_536))
        for f in tmp.iterdir():           # make the files durable before the rename publishes them
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        final = base / name
        os.rename(tmp, final)
        return final

    def commit_part(self, tables: dict[str, pa.Table], part_id: str | None = None) -> Path:
        """Write one part (any subset of the ingest relations) atomically."""
        return self._commit(self.parts_dir, part_id or self.new_part_id(), tables)

    def commit_results(self, run_id: str, tables: dict[str, pa.Table]) -> Path:
        """Write the runs / predictions / embeddings of one run atomically (one folder per write)."""
        return self._commit(self.results_dir, f"{run_id}-{uuid.uuid4().hex[:6]}", tables)

    def files(self, relation: str) -> list[Path]:
        base = self.results_dir if relation in ("runs", "predictions", "embeddings", "similarities") else self.parts_dir
        if not base.is_dir():
            return []
        return sorted(p for p in base.glob(f"*/{relation}.parquet") if not p.parent.name.startswith("_tmp-"))
