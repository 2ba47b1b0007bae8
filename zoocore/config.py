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


def is_url(root: str | os.PathLike) -> bool:
    """Whether a catalog root names object storage (``scheme://...``) rather than a folder."""
    return "://" in str(root) and not str(root).startswith("file://")


def catalog_dir(path: str | os.PathLike | None = None) -> Path | str:
    """The catalog: the flag, else ZOOGRAPH_CATALOG, else ./catalog. A folder is a Path; an
    object-storage URL (``s3://bucket/prefix``) stays a string."""
    root = path or os.environ.get("ZOOGRAPH_CATALOG") or DEFAULT_CATALOG
    return str(root) if is_url(root) else Path(root)


def embedded_store_dir(catalog: str | os.PathLike) -> Path:
    """Where the embedded graph store of a catalog lives: inside a catalog folder; for a catalog
    on object storage, in a local cache keyed by its URL (rebuildable with `graphstore sync`)."""
    if is_url(catalog):
        import hashlib

        key = hashlib.sha256(str(catalog).rstrip("/").encode()).hexdigest()[:16]
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        return cache / "zoograph" / "graphs" / key
    return Path(catalog)
