"""``graphstore``: the Cypher side of the catalog (Neo4j or the embedded Ladybug store)."""
from __future__ import annotations

import click

from graphstore.options import existing_catalog, open_store_from_options, store_options
from zoocore.cli import FORMATS, catalog_option, echo_err, format_rows, parse_params, timeout_option, translate_errors


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """Architecture metadata as a property graph, queried with Cypher.

    \b
    Neo4j when NEO4J_URI (or --neo4j-uri) is set, else the embedded Ladybug store in
    CATALOG/graph.lbug. The graph can always be rebuilt from Parquet: `graphstore sync`.
    Schema: (:Zoo)-[:CONTAINS]->(:Model)-[:HAS_ARCHITECTURE]->(:Architecture)
            -[:HAS_LAYER {position}]->(:Layer), (:Layer)-[:FEEDS]->(:Layer),
            (:Model)-[:TRAINED_ON]->(:Dataset), (:Model)-[:SIMILAR_TO {score, run_id}]->(:Model)
    """


@main.command()
@catalog_option
@store_options
@click.option("--keep", is_flag=True, help="Merge into the existing graph instead of clearing it first.")
@translate_errors
def sync(catalog, neo4j_uri, neo4j_user, neo4j_password, keep):
    """Rebuild the graph store from the Parquet catalog (the source of truth)."""
    from graphstore.sync import sync_store

    root = existing_catalog(catalog)
    with open_store_from_options(catalog, neo4j_uri, neo4j_user, neo4j_password) as store:
        click.echo(str(sync_store(root, store, clear=not keep)))


@main.command()
@click.argument("query", required=False)
@click.option("--named", default=None, help="Run one of the named example queries (see `graphstore queries`).")
@click.option("--param", "params", multiple=True, metavar="KEY=VALUE",
              help="Query parameter $KEY (JSON values are parsed: numbers, true, lists). Repeatable.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True)
@click.option("--write", is_flag=True,
              help="For administrators: allow statements that change the graph or touch files (CREATE, MERGE, "
                   "DELETE, SET, DROP, LOAD, COPY, ...) and several statements at once. The graph is rebuilt "
                   "from Parquet by `graphstore sync`, which undoes such changes.")
@catalog_option
@store_options
@timeout_option
@click.option("--memory-limit", default=None, metavar="SIZE",
              help="Memory limit for a query on the embedded store, e.g. 2GB or 10% (default: 25% of this "
                   "machine's memory).")
@translate_errors
def cypher(query, named, params, fmt, write, catalog, neo4j_uri, neo4j_user, neo4j_password, timeout, memory_limit):
    """Run a read-only Cypher QUERY with parameters and print the result.

    \b
    Read-only unless --write: the embedded store is opened read-only, Neo4j runs the query in a
    read transaction, and statements that write, read or write files (LOAD FROM, LOAD CSV, COPY),
    change settings, call procedures other than the schema ones, or hold several statements are
    refused before they run. Queries stop after --timeout seconds and, on the embedded store, past
    --memory-limit.

    Example: graphstore cypher "MATCH (m:Model) WHERE m.test_accuracy > $t RETURN count(m)" --param t=0.9
    """
    from graphstore.metadata.queries import SUITE

    if named:
        if named not in SUITE:
            raise click.BadParameter(f"unknown query {named!r}; known: {', '.join(sorted(SUITE))}",
                                     param_hint="--named")
        query = SUITE[named]
    if not query:
        raise click.UsageError("give a QUERY or --named NAME")
    if not write:       # refused before the store is even opened
        from graphstore.metadata.read_only import check_read_only

        check_read_only(query)
    with open_store_from_options(catalog, neo4j_uri, neo4j_user, neo4j_password, read_only=not write,
                                 must_exist=True) as store:
        store.query_timeout = timeout or None
        store.memory_limit = memory_limit
        store.isolated = True           # the embedded store: a crash or a long expression stays in a child
        result = store.run(query, parse_params(params))
    for notice in result.notices:
        echo_err(f"notice: {notice}")
    click.echo(format_rows(result.columns, result.rows, fmt))


@main.command()
def queries():
    """List the named example queries (the README's Cypher suite)."""
    from graphstore.metadata.queries import SUITE

    for name, q in SUITE.items():
        click.echo(f"{name}:\n  {q}\n")


if __name__ == "__main__":  # pragma: no cover
    main()
