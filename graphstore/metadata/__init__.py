"""Cypher metadata stores: Neo4j when configured, else the embedded Ladybug database."""
from __future__ import annotations

from pathlib import Path

from graphstore.metadata.base import MetadataStore, QueryResult
from zoocore.config import Neo4jSettings, embedded_store_dir, neo4j_settings

EMBEDDED_NAME = "graph.lbug"


def open_store(catalog_dir: str | Path, settings: Neo4jSettings | None = None, *,
               use_env: bool = True, read_only: bool = False) -> MetadataStore:
    """Neo4j when ``settings`` (or NEO4J_URI, with ``use_env``) is given, else Ladybug in
    ``CATALOG/graph.lbug`` (a local cache folder for a catalog on object storage).

    ``read_only``: the store runs single read-only statements only (graphstore.metadata.read_only):
    a read-only Ladybug database, read access mode on Neo4j, and a clause check before either."""
    if settings is None and use_env:
        settings = neo4j_settings()
    if settings is not None:
        from graphstore.metadata.neo4j_store import Neo4jStore

        return Neo4jStore(settings, read_only=read_only)
    from graphstore.metadata.ladybug_store import LadybugStore

    return LadybugStore(embedded_store_dir(catalog_dir) / EMBEDDED_NAME, read_only=read_only)


__all__ = ["MetadataStore", "QueryResult", "open_store", "EMBEDDED_NAME"]
