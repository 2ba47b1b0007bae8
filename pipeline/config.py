"""Connection settings and defaults, read from the environment in one place."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CATALOG = Path("catalog")


@dataclass(frozen=True)
class Neo4jSettings:
    uri: str
    user: str | None
    password: str | None
    database: str | None = None


def neo4j_settings(uri: str | None = None, user: str | None = None,
                   password: str | None = None) -> Neo4jSettings | None:
    """Neo4j settings from flags, falling back to NEO4J_URI / NEO4J_USER / NEO4J_PASSWORD.

    Returns None when no URI is configured, which selects the embedded Ladybug store.
    """
    uri = uri or os.environ.get("NEO4J_URI")
    if not uri:
        return None
    return Neo4jSettings(
        uri=uri,
        user=user or os.environ.get("NEO4J_USER"),
        password=password or os.environ.get("NEO4J_PASSWORD"),
        database=os.environ.get("NEO4J_DATABASE") or None,
    )


def catalog_dir(path: str | os.PathLike | None = None) -> Path:
    """The catalog folder: the flag, else ZOOGRAPH_CATALOG, else ./catalog."""
    return Path(path or os.environ.get("ZOOGRAPH_CATALOG") or DEFAULT_CATALOG)
