"""Names that users give (run ids, zoo names, artifact file names) are checked as names, never
trusted as paths: one shape for all, so a name can be joined under a catalog folder safely. A path
found inside a zoo is checked to resolve inside it (``inside_folder``): a link never leads out."""
from __future__ import annotations

import re
from pathlib import Path

from zoocore.errors import CheckpointError, ZooGraphError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]{0,199}")


class InvalidName(ZooGraphError):
    """A name that is not of the allowed shape."""


def check_name(value: object, what: str = "name") -> str:
    """``value`` when it is a plain name: letters, digits and ``. _ + = -``, starting with a letter
    or digit, at most 200 characters, never ``..`` (so no path separator or parent step)."""
    if not isinstance(value, str) or not _NAME.fullmatch(value) or ".." in value:
        shown = repr(value)[:80]
        raise InvalidName(f"invalid {what} {shown}: a {what} is a plain name (letters, digits and . _ + = -, "
                          "no path separators), not a path")
    return value


def inside_folder(folder: str | Path, path: str | Path, what: str = "the zoo folder") -> Path:
    """``path`` when it resolves (links followed) inside ``folder``; otherwise CheckpointError naming
    ``path`` as given, raised before anything is read from it."""
    path = Path(path)
    root = Path(folder).resolve()
    real = path.resolve()
    if real != root and root not in real.parents:
        raise CheckpointError(f"{path}: resolves outside {what} {folder} (a link out of it); it was not read")
    return path
