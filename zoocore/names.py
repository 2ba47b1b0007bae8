"""Names that users give (run ids, zoo names, artifact file names) are checked as names, never
trusted as paths: one shape for all, so a name can be joined under a catalog folder safely."""
from __future__ import annotations

import re

from zoocore.errors import ZooGraphError

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
