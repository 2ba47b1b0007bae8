"""The project's own zoo format: a folder of checkpoints plus ``metrics.csv`` and JSON sidecars.

Checkpoints are ``.pt2`` (torch.export) archives, or ``.pt``/``.pth``/``.safetensors`` state
dicts whose sidecar (``model.json`` beside ``model.safetensors``) holds the architecture spec;
``metrics.csv`` (first column the checkpoint's path relative to the zoo) and the sidecars'
``metadata``/``metrics`` give the attributes (pipeline.zoo_metadata).
"""
from __future__ import annotations

from pathlib import Path

from pipeline import checkpoints
from pipeline.formats.base import Member, ZooFormat
from pipeline.neural_graph.convert import Converted, PlanCache, convert_checkpoint
from pipeline.zoo_metadata import ZooMetadata, zoo_metadata
from zoocore.errors import ZooGraphError


def list_checkpoints(zoo_dir: Path) -> list[Path]:
    files = [p for p in zoo_dir.rglob("*") if p.is_file() and p.suffix in checkpoints.CHECKPOINT_SUFFIXES
             and not p.name.startswith(".")]
    return sorted(files)


def zoo_checkpoints(zoo_dir: Path, files: list[Path] | None = None) -> list[Path]:
    """The checkpoints to ingest (``files``, else every one under ``zoo_dir``); raises ZooGraphError
    for a missing folder or a zoo without checkpoints."""
    zoo_dir = Path(zoo_dir)
    if not zoo_dir.is_dir():
        raise ZooGraphError(f"zoo folder {zoo_dir} does not exist")
    found = list_checkpoints(zoo_dir) if files is None else [Path(f) for f in files]
    if not found:
        raise ZooGraphError(f"no checkpoints in {zoo_dir} (looked for "
                            f"{', '.join('*' + s for s in sorted(checkpoints.CHECKPOINT_SUFFIXES))} in it and its "
                            "sub-folders); nothing was ingested")
    return found


class CheckpointFolder(ZooFormat):
    name = "checkpoints"

    def __init__(self, zoo_dir, files: list[Path] | None = None, **options):
        super().__init__(zoo_dir, **options)
        self.files = None if files is None else [Path(f) for f in files]

    @classmethod
    def detect(cls, zoo_dir: Path) -> bool:
        return bool(list_checkpoints(zoo_dir))

    def _path(self, member: Member) -> Path:
        path = Path(member.key)
        return path if path.is_absolute() else self.zoo_dir / path

    def members(self) -> list[Member]:
        found = zoo_checkpoints(self.zoo_dir, self.files)
        root = self.zoo_dir.resolve()
        out = []
        for p in found:
            try:                # the key names the member as found in the zoo, a link by its own name
                key = p.relative_to(self.zoo_dir).as_posix()
            except ValueError:
                try:
                    key = p.resolve().relative_to(root).as_posix()
                except ValueError:      # a file given outside the zoo folder (jobs merge's output)
                    key = str(p)
            out.append(Member(key, p.name))
        return out

    def metadata(self, members, all_members, established, on_bad_value) -> ZooMetadata:
        paths = [self._path(m) for m in members]
        every = [self._path(m) for m in all_members] if len(all_members) > len(members) else None
        meta = zoo_metadata(self.zoo_dir, paths, established, on_bad_value, zoo_files=every)
        by_path = {str(p): m.key for p, m in zip(paths, members)}
        return ZooMetadata({by_path[p]: v for p, v in meta.raw.items()},
                           {by_path[p]: v for p, v in meta.columns.items()}, meta.types, meta.warnings)

    def convert(self, member: Member, metadata, cache: PlanCache) -> Converted:
        path = self._path(member)
        if self.files is None:          # a member found in the zoo (not a file the caller named)
            self.inside(path)
            self.inside(checkpoints.sidecar_path(path))
        side = checkpoints.read_sidecar(path)
        return convert_checkpoint(path, side.get("architecture"), cache)
