"""``jobs``: train NG-GNN on the catalog, predict, and run the end-to-end demo."""
from __future__ import annotations

import os
import sys

import click

from graphstore.options import existing_catalog, open_store_from_options, optional_store, store_options
from jobs.config import EditConfig, TrainConfig
from zoocore.dataclass_cli import click_options, from_options
from zoocore.cli import FiniteRange, catalog_option, format_rows, translate_errors


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """Learning on neural graphs (NG-GNN, Kofinas et al. 2024) over the catalog.

    \b
    jobs demo                                   zoo -> ingest -> train -> predicted vs true accuracy
    jobs train-heterognn --target test_accuracy --where "zoo = 'cnn'"
    jobs predict --run RUN_ID --where "test_accuracy IS NULL"
    jobs retrieve MODEL_ID -k 10 --write-back   similar models by embedding
    jobs classify --run RUN_ID --target dataset  linear probe on frozen embeddings
    jobs merge MODEL_A MODEL_B --out merged.safetensors --ingest
    jobs layer-equivariance --where "zoo = 'eq'" --transform mirror-lr --transform mirror-ud
    jobs train-editor --edit dilate --oce 4     metanetworks that edit INRs, vs identity and NFN
    """


def _device_option(fn):
    return click.option("--device", default="cpu", show_default=True,
                        help="torch device: cpu, cuda, cuda:1 ... (no code change between them).")(fn)


@main.command("train-heterognn")
@catalog_option
@click_options(TrainConfig)
@store_options
@translate_errors
def train_heterognn_cmd(catalog, neo4j_uri, neo4j_user, neo4j_password, **options):
    """Train a predictor (default NG-GNN) of TARGET on the selected models, report test metrics
    beside StatNN and a flat-weights MLP (and, for regression, the blend of the metanetwork with
    StatNN, which is the run's answer), and write runs / predictions / embeddings.

    \b
    Every option is a field of jobs.config.TrainConfig.
    Data-parallel on several processes, GPUs or machines (gloo on CPU, NCCL with --device cuda):
      torchrun --standalone --nproc-per-node 2 -m jobs.cli train-heterognn ...
    Each rank streams its own shard of the models; rank 0 writes the results."""
    from jobs.training.train import train_heterognn

    root = existing_catalog(catalog)
    cfg = from_options(TrainConfig, options)
    main_rank = int(os.environ.get("RANK", "0")) == 0      # under torchrun, rank 0 writes and reports
    with optional_store(catalog, neo4j_uri, neo4j_user, neo4j_password, enabled=main_rank) as (store, warning):
        report = train_heterognn(root, cfg, store=store)
    report.store_warning = report.store_warning or warning
    if main_rank:
        click.echo(report.summary())
        if report.store_warning:        # the run is in Parquet; the graph store is behind: not a success
            sys.exit(1)


@main.command()
@catalog_option
@click.option("--run", "run_id", required=True, help="The run whose predictor to apply (any of --model's).")
@click.option("--where", default=None, help="SQL condition over models (default: all models).")
@_device_option
@store_options
@translate_errors
def predict(catalog, run_id, where, device, neo4j_uri, neo4j_user, neo4j_password):
    """Apply a run's trained predictor to (newly ingested) models and write their predictions.

    Each prediction says whether the model's per-layer weight scales lie within the training
    models' (predictions.in_distribution; a warning line names how many do not): a rescaled copy
    computes the same function, but the predictor never saw its like."""
    from graphstore.catalog import Catalog
    from jobs.training.run_weights import require_run
    from jobs.training.predict import predict as run_predict

    root = existing_catalog(catalog)
    require_run(Catalog(root), run_id)              # a name the catalog lists, before anything is opened
    with open_store_from_options(catalog, neo4j_uri, neo4j_user, neo4j_password) as store:
        report = run_predict(root, run_id, where, device, store)
    click.echo(report.summary())
    if report.warning:
        click.echo(report.warning, err=True)


@main.command()
@click.argument("model_id")
@click.option("-k", "k", type=click.IntRange(min=1), default=10, show_default=True, help="Neighbours to return.")
@click.option("--run", "run_id", default=None, help="Run whose embeddings to use (default: the newest with this model).")
@click.option("--write-back", is_flag=True,
              help="Store SIMILAR_TO edges in the graph store and the catalog's `similarities` relation.")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table", show_default=True)
@catalog_option
@store_options
@translate_errors
def retrieve(model_id, k, run_id, write_back, fmt, catalog, neo4j_uri, neo4j_user, neo4j_password):
    """The K models whose NG-GNN embeddings are most similar (cosine) to MODEL_ID, with their
    architecture, accuracy and similarity."""
    from jobs.analysis.analytics import retrieve as run_retrieve

    root = existing_catalog(catalog)
    store = open_store_from_options(catalog, neo4j_uri, neo4j_user, neo4j_password) if write_back else None
    try:
        res = run_retrieve(root, model_id, k, run_id, store)
    finally:
        if store is not None:
            store.close()
    click.echo(f"nearest to {model_id} (run {res.run_id}):", err=True)
    if res.warning:
        click.echo(f"warning: {res.warning}", err=True)
    click.echo(format_rows(res.columns, res.rows, fmt))


@main.command()
@click.option("--run", "run_id", required=True, help="Run whose (frozen) embeddings to probe.")
@click.option("--target", required=True, help="Categorical models column: dataset, optimizer, activation, label ...")
@click.option("--png", "png", type=click.Path(dir_okay=False), default=None,
              help="Save the confusion matrix here (default: confusion-<target>.png).")
@catalog_option
@translate_errors
def classify(run_id, target, png, catalog):
    """Linear probe (logistic regression) on a run's frozen embeddings for any categorical
    column: accuracy, macro-F1 and a confusion matrix, i.e. how well an embedding trained for
    one task transfers to another."""
    from jobs.analysis.analytics import classify as run_classify
    from zoocore.config import catalog_dir

    res = run_classify(catalog_dir(catalog), run_id, target, png or f"confusion-{target}.png")
    click.echo(res.summary())


@main.command()
@click.argument("model_a")
@click.argument("model_b")
@click.option("--method", type=click.Choice(["embeddings", "activations", "weights"]), default="embeddings",
              show_default=True,
              help="Alignment whose merge is written: NG-GNN node embeddings of a trained run, activation "
                   "matching on training inputs, or weight matching (Git Re-Basin). All are reported.")
@click.option("--alpha", type=FiniteRange(0.0, 1.0), default=0.5, show_default=True,
              help="Weight of B in the interpolation (1 - alpha) A + alpha B.")
@click.option("--run", "run_id", default=None,
              help="NG-GNN run whose node embeddings align the neurons (default: the newest run).")
@click.option("--points", type=click.IntRange(min=2), default=11, show_default=True,
              help="Points on the interpolation path for the loss barrier.")
@click.option("--no-reset-bn", is_flag=True,
              help="Keep interpolated batch-norm statistics instead of recomputing them on training data.")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Write the merged checkpoint here (.safetensors with a JSON sidecar; .pt2 for models "
                   "ingested from torch.export archives).")
@click.option("--ingest", is_flag=True, help="Ingest the merged checkpoint into the catalog (needs --out).")
@_device_option
@catalog_option
@store_options
@translate_errors
def merge(model_a, model_b, method, alpha, run_id, points, no_reset_bn, out, ingest, device, catalog, neo4j_uri,
          neo4j_user, neo4j_password):
    """Merge two models of one architecture (MODEL_A, MODEL_B: model ids): align B's hidden
    neurons to A's, permute B through the exact graph inverse, interpolate the weights. Prints
    test accuracy, test loss and the loss barrier of both parents, naive averaging and each
    alignment method."""
    from jobs.analysis.merge import MergeConfig, merge_models

    if ingest and not out:
        raise click.UsageError("--ingest needs --out FILE")
    root = existing_catalog(catalog)
    cfg = MergeConfig(method=method, alpha=alpha, run_id=run_id, points=points, reset_bn=not no_reset_bn,
                      device=device)
    with optional_store(catalog, neo4j_uri, neo4j_user, neo4j_password, enabled=ingest) as (store, warning):
        report = merge_models(root, model_a, model_b, cfg, out=out, ingest=ingest, store=store)
    click.echo(report.summary())
    if warning:
        click.echo(f"graph store not updated: {warning} (run `graphstore sync` later)", err=True)


@main.command("layer-equivariance")
@catalog_option
@click.option("--where", default=None, help="SQL condition over the models view selecting the models (default: all).")
@click.option("--transform", "transforms", multiple=True, required=True, metavar="NAME",
              help="Input transform g: mirror-lr, mirror-ud (of the square image grid of a flat input, or "
                   "of an image input's feature maps) or perm-input[:SEED] (a random permutation of a flat "
                   "input). Repeatable.")
@click.option("--samples", type=click.IntRange(min=8), default=100_000, show_default=True,
              help="Noise inputs per model: half fit A_i, a quarter picks the ridge, a quarter measures the errors.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the noise inputs.")
@click.option("--noise-std", type=float, default=1.0, show_default=True,
              help="Noise inputs y have i.i.d. N(0, STD^2) entries.")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table", show_default=True)
@click.option("--summary-only", is_flag=True, help="Print only the summary, not one row per model and layer.")
@store_options
@translate_errors
def layer_equivariance(catalog, where, transforms, samples, seed, noise_std, fmt, summary_only, neo4j_uri,
                       neo4j_user, neo4j_password):
    """Which layers of the selected models are equivariant to an input transform g, and to what.

    Per model and neuron layer i (after its activation; the output last), on Gaussian noise inputs
    y (half fit, a quarter validates, a quarter tests). Any converted model runs from the catalog
    (MLPs, CNNs with batch norm and residual blocks, .pt2 archives); a convolutional layer is read
    at one random position p per input, f_i(g y)[p] against f_i(y)[g p], so A_i acts on channels:

    \b
      error           median |f_i(g y) - A_i f_i(y)| / |f_i(y)|, A_i a ridge fit of
                      A_i f_i(y) ~ f_i(g y) (ridge picked on the validation quarter)
      identity_error  the same with A = I (how much g moves the layer)
      sperm_error     the same with A = the best signed permutation (tanh's group)
      perm_error      the same with A = the best permutation (GELU's group)
      sperm_neurons   share of neurons that signed permutation maps onto their image
                      within 10% (relative residual); perm_neurons: the same for perm_error's
      sperm_dist      min over scales c and signed permutations P of ||A - cP|| / ||A||
                      (0: A is a scaled signed permutation; ~0.95 for a random matrix)
      sperm_share     median share of each row's squared mass of A on P's entry
      match_corr      median |corr| of each neuron's image with its best signed match

    sperm_error is the robust answer to "is A_i near a signed permutation"; the distances on A
    mean little where the layer's outputs are nearly collinear (the condition number is stored).
    Prints a row per model and layer and a summary (medians) by activation, task, trained and
    analysed transform; writes the rows (with A_i) to the catalog's layer_equivariance relation,
    e.g.

    \b
      pipeline sql "SELECT activation, layer, median(error) FROM layer_equivariance
                    JOIN models m USING (model_id) GROUP BY ALL"

    and the errors to the graph store as model properties equivariance_<transform>_f<i>."""
    from jobs.analysis.layer_equivariance import analyse_catalog
    from zoocore.config import catalog_dir

    with optional_store(catalog, neo4j_uri, neo4j_user, neo4j_password) as (store, warning):
        report = analyse_catalog(catalog_dir(catalog), where, transforms, samples, seed, store=store, progress=True,
                                 noise_std=noise_std)
    if not summary_only:
        click.echo(format_rows(*report.table(), fmt))
    click.echo(f"summary: median over models (analysis {report.analysis_id}, {samples} noise samples)")
    click.echo(format_rows(*report.summary_table(), fmt))
    warning = report.store_warning or warning
    if warning:
        click.echo(f"graph store not updated: {warning} (run `graphstore sync` later)", err=True)
        sys.exit(1)                     # the rows are in Parquet; the graph store is behind: not a success


@main.command()
@click.option("--workdir", type=click.Path(file_okay=False), default="demo", show_default=True,
              help="Folder for the zoo and the catalog.")
@click.option("--n", "n", type=click.IntRange(min=20), default=160, show_default=True, help="Models in the zoo.")
@click.option("--epochs", type=click.IntRange(min=1), default=10, show_default=True,
              help="Epochs per ensemble member (the recipe of `jobs train-heterognn`).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True)
@_device_option
@translate_errors
def demo(workdir, n, epochs, seed, workers, device):
    """End to end on the embedded defaults (no server, no GPU): train a CNN zoo on digits, ingest
    it, train NG-GNN, print predicted vs true test accuracy and Kendall tau."""
    from jobs.demo import run_demo

    report = run_demo(workdir, n=n, epochs=epochs, seed=seed, workers=workers, device=device)
    click.echo(str(report.zoo))
    click.echo(report.ingest.summary())
    click.echo(format_rows(["checkpoint", "true_accuracy", "predicted"], report.rows))
    click.echo(report.run.summary())


@main.command("train-editor")
@catalog_option
@click_options(EditConfig)
@click.option("--quick", is_flag=True, help="A smoke run: 60 steps per editor (unless --steps is given).")
@store_options
@translate_errors
@click.pass_context
def train_editor_cmd(ctx, catalog, quick, neo4j_uri, neo4j_user, neo4j_password, **options):
    """Train metanetworks whose equivariant heads edit the weights of INRs (edited = original +
    predicted change) so that each SIREN computes a transformed image, trained on the function-space
    MSE; print the test MSE of identity, NFN (NP layers), the metanetwork with K=1 and with OCE K on
    one split; write the edited INRs as a zoo and ingest them with their lineage (edited_from, edit,
    edit_run). Every option but --quick is a field of jobs.config.EditConfig."""
    from jobs.editing.train import train_editor

    root = existing_catalog(catalog)
    quick = quick and ctx.get_parameter_source("steps") is click.core.ParameterSource.DEFAULT
    cfg = from_options(EditConfig, options, **({"steps": 60} if quick else {}))
    with optional_store(catalog, neo4j_uri, neo4j_user, neo4j_password, enabled=cfg.write != "none") as (store, warning):
        report = train_editor(root, cfg, store=store)
    report.store_warning = report.store_warning or warning
    click.echo(report.summary())
    if report.store_warning:
        sys.exit(1)


if __name__ == "__main__":  # pragma: no cover
    main()
