"""``pipeline``: make zoos, convert checkpoints, ingest zoos into the catalog, query it with SQL."""
from __future__ import annotations

import sys

import click

from graphstore.options import optional_store, store_options
from pipeline.formats import FORMATS as ZOO_FORMATS
from pipeline.formats.base import STEPS
from pipeline.zoo import CHECKPOINT_FORMATS, KINDS
from zoocore.cli import FORMATS, catalog_option, echo_err, format_rows, timeout_option, translate_errors


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """Model zoos in, neural graphs out.

    \b
    pipeline zoo make cnn zoos/cnn --n 100   train a real zoo (scikit-learn data, nothing downloaded)
    pipeline ingest zoos/cnn                 convert every checkpoint once into ./catalog (Parquet)
    pipeline convert zoos/cnn/cnn-00000.safetensors   show one checkpoint's neural graph
    pipeline sql "SELECT count(*) FROM models"        SQL over every catalog relation
    """


def _format_lines() -> list[str]:
    import textwrap

    lines = []
    for name, (_, summary) in ZOO_FORMATS.items():
        wrapped = textwrap.wrap(summary, 62)
        lines.append(f"{name:14s} {wrapped[0]}")
        lines += [" " * 15 + w for w in wrapped[1:]]
    return lines


@main.group()
def zoo():
    """Generate model zoos of real trained networks (data from scikit-learn, nothing downloaded)."""


@zoo.command("make", help="Train a zoo of KIND (" + "; ".join(f"{k}: {v}" for k, v in KINDS.items()) + ") into "
             "OUT_DIR. Models already in OUT_DIR are kept, so an interrupted run resumes.")
@click.argument("kind", type=click.Choice(list(KINDS)))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--n", "n", type=click.IntRange(min=1), default=100, show_default=True, help="Number of models.")
@click.option("--seed", type=int, default=0, show_default=True, help="Zoo seed; the same seed gives the same zoo.")
@click.option("--format", "fmt", type=click.Choice(CHECKPOINT_FORMATS), default="safetensors",
              show_default=True, help="Checkpoint format (state dicts come with a JSON spec sidecar).")
@click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True, help="Training processes.")
@click.option("--replicas", type=click.IntRange(min=1), default=1, show_default=True,
              help="Models per recipe: groups of K with one architecture, hyper-parameters and data that "
                   "differ only in initialisation and batch order (pairs for `jobs merge`).")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="Change the kind's training recipe (repeatable). mlp-equivariant: epochs (200), "
                   "weight_decay (1.0), lambda_autoencoder (10), lambda_classifier (1). inr: side (8; 28 fits "
                   "digits upsampled bicubically to 28x28, the size of the MNIST INR benchmarks, from "
                   "scikit-learn's 8x8 digits, the only offline source), width (16 at side 8, else 32), steps "
                   "(300 at side 8, else 1000), w0 (10 at side 8, else 30). A folder holds one recipe: resuming "
                   "with other settings is refused.")
@translate_errors
def zoo_make(kind, out_dir, n, seed, fmt, workers, replicas, settings):
    from pipeline.zoo.kinds import recipe_settings
    from pipeline.zoo.make import make_zoo

    click.echo(str(make_zoo(kind, out_dir, n, seed, fmt, workers, progress=True, replicas=replicas,
                            settings=recipe_settings(kind, settings))))


@main.command(epilog="\b\nZoo formats:\n" + "\n".join(f"  {line}" for line in _format_lines()))
@click.argument("zoo_dir", type=click.Path(exists=True, file_okay=False))
@catalog_option
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Conversion processes.")
@click.option("--zoo-name", default=None, help="Name of the zoo in the catalog (default: the folder name).")
@click.option("--shard", default="0/1", show_default=True,
              help="I/N: ingest only the checkpoints of shard I of N (several machines, one catalog).")
@click.option("--no-graph", is_flag=True, help="Write Parquet only; run `graphstore sync` later.")
@click.option("--on-bad-value", type=click.Choice(["null", "refuse"]), default="null", show_default=True,
              help="A metrics.csv or sidecar value that does not fit its column's type (a word in a column of "
                   "numbers): record it as null with a warning, or refuse the zoo before anything is written.")
@click.option("--format", "fmt", type=click.Choice(list(ZOO_FORMATS)), default=None,
              help="The zoo's format (default: detected from the folder's files, and named in the report).")
@click.option("--steps", type=click.Choice(STEPS), default=None,
              help="Small CNN Zoo and Model Zoos: ingest each training run's final checkpoint (the default) or "
                   "every checkpoint, each its own model (step / epoch columns tell them apart).")
@click.option("--padding", type=click.Choice(["valid", "same"]), default=None,
              help="Small CNN Zoo: the convolutions' TensorFlow padding (default valid, as the published zoo "
                   "was trained; same for zoos of that layout trained with 'SAME').")
@click.option("--input-side", type=click.IntRange(min=1), default=None,
              help="Small CNN Zoo: the input images' side when config.dataset is not mnist, fashion_mnist, "
                   "cifar10 or svhn_cropped.")
@store_options
@translate_errors
def ingest(zoo_dir, catalog, workers, zoo_name, shard, no_graph, on_bad_value, fmt, steps, padding, input_side,
           neo4j_uri, neo4j_user, neo4j_password):
    """Convert every model of the zoo in ZOO_DIR into its neural graph and append it to the catalog.

    The zoo's format is detected from its files (--format overrides; formats listed below).
    Model attributes get one type per column for the whole catalog (a column of numbers stays
    numbers). Models already in the catalog are skipped (content hash), and any of this zoo's
    models missing from the graph store are written to it (a re-run repairs a lost graph write).
    Failures are listed and recorded in ingest_errors. Exit code 1 when any model failed or the
    graph store could not be brought up to date (then run `graphstore sync`).
    """
    from zoocore.config import catalog_dir
    from pipeline.ingest import check_zoo, ingest_zoo

    options = {"steps": steps, "padding": padding, "input_side": input_side}
    try:
        i, n = (int(x) for x in shard.split("/"))
        assert 0 <= i < n
    except (ValueError, AssertionError):
        raise click.BadParameter(f"{shard!r} is not I/N with 0 <= I < N", param_hint="--shard")
    # a zoo refused (empty, unreadable metrics, a bad value under --on-bad-value refuse) is refused
    # before the catalog or its graph store is touched: no empty store is left behind
    check_zoo(zoo_dir, catalog_dir(catalog), (i, n), on_bad_value, fmt, options)
    with optional_store(catalog, neo4j_uri, neo4j_user, neo4j_password, enabled=not no_graph) as (store, warning):
        report = ingest_zoo(zoo_dir, catalog_dir(catalog), workers=workers, zoo_name=zoo_name, store=store,
                            shard=(i, n), on_bad_value=on_bad_value, fmt=fmt, options=options)
    report.store_warning = report.store_warning or warning
    click.echo(report.summary())
    if not report.ok or report.graph_behind:
        sys.exit(1)


@main.command()
@click.argument("checkpoint", type=click.Path(exists=True, dir_okay=False))
@click.option("--spec", "spec_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Architecture spec JSON (default: the checkpoint's sidecar).")
@translate_errors
def convert(checkpoint, spec_file):
    """Show the neural graph of one checkpoint: layers, node and edge counts, relations."""
    import numpy as np

    from pipeline.checkpoints import read_json_object
    from pipeline.ingest import summarize_plan
    from pipeline.neural_graph.convert import convert_checkpoint
    from pipeline.neural_graph.vocabulary import NODE_TYPES, RELATIONS

    spec = read_json_object(spec_file, "spec") if spec_file else None
    conv = convert_checkpoint(checkpoint, spec)
    g = conv.graph
    click.echo(f"architecture {conv.plan.signature}: {summarize_plan(conv.plan)}")
    click.echo(f"{g.num_nodes} nodes, {g.num_edges} edges, {g.num_layers} neuron layers, "
               f"edge features {g.kernel_shape[0]}x{g.kernel_shape[1]}")
    rows = [[NODE_TYPES[t], int(c)] for t, c in zip(*np.unique(g.node_type, return_counts=True))]
    click.echo(format_rows(["node_type", "nodes"], rows))
    rows = [[RELATIONS[r], int(c)] for r, c in zip(*np.unique(g.relation, return_counts=True))]
    click.echo(format_rows(["relation", "edges"], rows))


@main.command()
@click.argument("query")
@catalog_option
@click.option("--format", "fmt", type=click.Choice(FORMATS + ("parquet",)), default="table", show_default=True)
@click.option("--out", "out", type=click.Path(dir_okay=False), default=None,
              help="Write the result to this file (required for --format parquet).")
@click.option("--param", "params", multiple=True, metavar="VALUE",
              help="Positional parameter for ? placeholders, in order (repeatable).")
@timeout_option
@click.option("--memory-limit", default=None, metavar="SIZE",
              help="DuckDB memory limit for the query, e.g. 2GB or 10% (default: 25% of this machine's memory).")
@translate_errors
def sql(query, catalog, fmt, out, params, timeout, memory_limit):
    """Run a read-only SQL QUERY (DuckDB) over the catalog relations: models, architectures,
    layers, nodes, edges, ingest_errors, runs, predictions, embeddings, similarities,
    layer_equivariance. Statements that write, attach, copy, install or load are refused; files
    outside the catalog cannot be read. A query is stopped after --timeout seconds and refused past
    --memory-limit; Ctrl-C stops it too."""
    from graphstore.sql import run_readonly
    from zoocore.config import catalog_dir

    if fmt == "parquet" and not out:
        raise click.BadParameter("--format parquet needs --out FILE", param_hint="--out")
    table = run_readonly(catalog_dir(catalog), query, list(params) or None, timeout=timeout,
                         memory_limit=memory_limit)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, out)
        click.echo(f"wrote {table.num_rows} rows to {out}")
        return
    rows = [list(r) for r in zip(*(col.to_pylist() for col in table.columns))]   # repeated column names kept
    text = format_rows(table.column_names, rows, fmt)
    if out:
        with open(out, "w") as fh:
            fh.write(text + "\n")
        echo_err(f"wrote {table.num_rows} rows to {out}")
    else:
        click.echo(text)


if __name__ == "__main__":  # pragma: no cover
    main()
