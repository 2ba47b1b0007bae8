"""What every zoo format gives ``pipeline ingest``: the zoo's members, their attributes, and each
member converted to its neural graph.

A format object is made in the main process from the zoo folder and the user's options, and is
sent to the conversion workers: it holds names and paths only (open files and memory maps are
made lazily in each process and never pickled).
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from zoocore.errors import ZooGraphError
from zoocore.names import inside_folder

if TYPE_CHECKING:       # the registry is read by the CLI, which must not import torch to list formats
    from pipeline.neural_graph.convert import Converted, PlanCache
    from pipeline.zoo_metadata import ZooMetadata

STEPS = ("final", "all")     # --steps of the formats whose training runs hold several checkpoints


@dataclass(frozen=True)
class Member:
    """One model of a zoo.

    key: the model's ``source_path``, unique in the zoo (a path relative to the zoo folder, or a
        row of a matrix: ``weights.npy#17``);
    checkpoint: the ``checkpoint`` column (a file name, ``step 86``);
    identity: mixed into the model id besides architecture and weights, for formats whose
        distinct checkpoints can hold equal weights (two training runs from one initialisation).
    """
    key: str
    checkpoint: str
    identity: str = ""


class ZooFormat:
    """A zoo format: subclasses set ``name`` and implement the four methods (their one-line
    summary is in the registry, pipeline.formats.FORMATS)."""

    name: ClassVar[str]
    options: ClassVar[tuple[str, ...]] = ()     # the format options it takes (pipeline ingest's flags)

    def __init__(self, zoo_dir: str | Path, **options: Any):
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            flag = "--" + unknown[0].replace("_", "-")
            takes = ", ".join("--" + o.replace("_", "-") for o in sorted(self.options))
            raise ZooGraphError(f"{flag} does not apply to a zoo of format {self.name!r}"
                                + (f" (it takes {takes})" if takes else " (it takes no format options)"))
        self.zoo_dir = Path(zoo_dir)
        self.settings = options

    def stored_bytes(self, member: Member) -> int:
        """The bytes a member stores (its file, or the files of its folder): what its conversion's
        time budget is derived from (pipeline.ingest.member_budget). 0 when it is a row of a file."""
        path = self.zoo_dir / member.key
        try:
            if path.is_file():
                return _on_disk(path)
            if path.is_dir():
                return sum(_on_disk(f) for f in path.iterdir() if f.is_file())
        except OSError:
            pass
        return 0

    def inside(self, path: str | Path) -> Path:
        """``path`` (a file or folder of the zoo), checked to resolve inside the zoo folder: a link
        out of the zoo is refused by the path as given (CheckpointError), before anything is read."""
        return inside_folder(self.zoo_dir, path, "the zoo folder")

    @staticmethod
    def choice(option: str, value: Any, choices: tuple[str, ...]) -> Any:
        """``value`` if it is one of ``choices``, else ZooGraphError naming the flag."""
        if value not in choices:
            raise ZooGraphError(f"--{option} must be one of {', '.join(choices)}, not {value!r}")
        return value

    def cache_key(self) -> tuple:
        """Equal for equal formats: a worker keeps one open object per key (its open files,
        parsed layouts) across the members it converts."""
        return (type(self).__name__, str(self.zoo_dir.resolve()), tuple(sorted(self.settings.items())))

    @classmethod
    def detect(cls, zoo_dir: Path) -> bool:
        """Whether ``zoo_dir`` looks like a zoo of this format (cheap: file names only)."""
        raise NotImplementedError

    def members(self) -> list[Member]:
        """Every model of the zoo, in a stable order; raises ZooGraphError for a zoo that is
        refused as a whole, before anything is written."""
        raise NotImplementedError

    def metadata(self, members: list[Member], all_members: list[Member], established: dict,
                 on_bad_value: str) -> "ZooMetadata":
        """Attributes of ``members`` keyed by ``Member.key``, typed against the catalog
        (``all_members``: the whole zoo, which decides new columns' types alike in every shard)."""
        raise NotImplementedError

    def convert(self, member: Member, metadata: dict[str, Any], cache: "PlanCache") -> "Converted":
        """One member's neural graph (in a worker; ``metadata``: its raw attributes); raises for a
        member that cannot be read."""
        raise NotImplementedError



def _on_disk(path: Path) -> int:
    """The bytes a file really stores: a sparse file's holes are not bytes."""
    st = path.stat()
    return min(st.st_size, getattr(st, "st_blocks", st.st_size // 512 + 1) * 512)


def stray_entries(zoo_dir: str | Path) -> list[tuple[str, str]]:
    """Entries of the zoo folder no format may read, as (path relative to the zoo, why): links that
    resolve outside the zoo and links to nothing. Formats list members by name and can pass such an
    entry over silently; ingest records each one the members do not cover as a failure, so a user
    learns of it. A FIFO, device or socket (reading one blocks or never ends) refuses the zoo here
    (ZooGraphError), before any reader opens it."""
    root = Path(zoo_dir)
    real_root = root.resolve()
    out = []
    for folder, dirs, files in os.walk(root, followlinks=False):
        for name in sorted(dirs + files):
            path = Path(folder) / name
            key = path.relative_to(root).as_posix()
            try:
                mode = os.stat(path).st_mode            # the link's target, where it is a link
            except OSError:
                out.append((key, f"{path}: a link to nothing (or unreadable); it was not read"))
                continue
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise ZooGraphError(f"{path}: not a regular file (a FIFO, device or socket), which no zoo holds; "
                                    "nothing was ingested")
            if path.is_symlink():
                real = path.resolve()
                if real != real_root and real_root not in real.parents:
                    out.append((key, f"{path}: resolves outside the zoo folder {zoo_dir} (a link out of it); it "
                                     "was not read"))
    return out
