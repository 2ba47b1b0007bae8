"""Opening the catalog and its graph store from command-line options (shared by the three CLIs)."""
from __future__ import annotations

import contextlib
from typing import Callable

import click

from graphstore.catalog import Catalog
from graphstore.metadata import EMBEDDED_NAME, open_store
from zoocore.config import catalog_dir, embedded_store_dir, neo4j_settings
from zoocore.errors import ZooGraphError


def store_options(fn: Callable) -> Callable:
    """--neo4j-uri / --neo4j-user / --neo4j-password (else NEO4J_* variables, else embedded Ladybug)."""
    fn = click.option("--neo4j-password", default=None, help="Neo4j password (default: $NEO4J_PASSWORD).")(fn)
    fn = click.option("--neo4j-user", default=None, help="Neo4j user (default: $NEO4J_USER, or neo4j).")(fn)
    fn = click.option("--neo4j-uri", default=None,
                      help="Neo4j Bolt URI (default: $NEO4J_URI); without one the embedded Ladybug "
                           "store in CATALOG/graph.lbug is used.")(fn)
    return fn


def existing_catalog(catalog):
    """The --catalog of a command that reads it, refused with a clear message when there is no
    catalog there (only `pipeline ingest` creates one: a mistyped path must not make a folder)."""

    root = catalog_dir(catalog)
    Catalog(root).require()
    return root


def open_store_from_options(catalog, neo4j_uri, neo4j_user, neo4j_password, read_only: bool = False,
                            must_exist: bool = False):
    """The graph store the options name (``read_only``: opened for reading only); with ``must_exist``,
    the embedded store of a catalog that is not there is refused instead of created."""

    root, settings = catalog_dir(catalog), neo4j_settings(neo4j_uri, neo4j_user, neo4j_password)
    if must_exist and settings is None and not (embedded_store_dir(root) / EMBEDDED_NAME).exists():
        Catalog(root).require()
    return open_store(root, settings, read_only=read_only)


@contextlib.contextmanager
def optional_store(catalog, neo4j_uri, neo4j_user, neo4j_password, enabled: bool = True):
    """``(store, None)``, or ``(None, reason)`` when the graph store cannot be opened: the Parquet
    work goes on and `graphstore sync` catches the graph up later. Closes the store on exit."""
    store, warning = None, None
    if enabled:
        try:
            store = open_store_from_options(catalog, neo4j_uri, neo4j_user, neo4j_password)
        except ZooGraphError as exc:
            warning = str(exc)
    try:
        yield store, warning
    finally:
        if store is not None:
            store.close()
