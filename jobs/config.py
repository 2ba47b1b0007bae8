"""A run's configuration (``jobs train-heterognn``): the data, optimisation and model parts, each
field with its default and its help. The command's options are generated from these fields
(zoocore.dataclass_cli), so a new hyperparameter is one field here. Importing this module costs
neither torch nor DGL (the CLI reads it to build its options).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import click

from jobs.predictors import PREDICTORS, help_text
from zoocore.cli import FiniteRange
from zoocore.dataclass_cli import option

ATTENTION_GROUPS = ("all", "direction", "relation")       # what one NG-T attention softmax runs over (jobs.metanets.ngt)


class TaskNames(Sequence):
    """Names a module defines (by default jobs.training.tasks: ``TASKS`` with ``auto`` first, or
    ``CALIBRATIONS``; or ``module``'s ``what``), read when click first asks, so that importing the
    CLI stays free of torch."""

    def __init__(self, what: str = "TASKS", module: str = "jobs.training.tasks"):
        self.what, self.module = what, module

    def _names(self) -> list[str]:
        import importlib

        names = list(getattr(importlib.import_module(self.module), self.what))
        return ["auto", *names] if (self.module, self.what) == ("jobs.training.tasks", "TASKS") else names

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())


@dataclass
class DataConfig:
    """Which models, which target, which split, and how graphs reach the metanetwork."""
    target: str = option("test_accuracy", "models column to predict: numeric -> regression (Kendall tau, R^2), "
                         "text -> classification (accuracy, macro-F1); e.g. optimizer, dataset, label.")
    where: str | None = option(None, "SQL condition over the models view selecting the models.")
    task: str = option("auto", "auto: the first task that takes the target column's type (numbers: regression).",
                       type=click.Choice(TaskNames()))
    split_column: str | None = option(None, "models column with train/val/test (default: a hash of model_id, "
                                      "stable across runs).")
    folds: int = option(0, "K-fold cross-validation by hash of model_id (every model a test model in exactly one "
                        "fold; 15% of the rest validation). 0 = the default hash split. Run once per --fold.",
                        type=click.IntRange(min=0), metavar="K")
    fold: int = option(0, "Which fold (0..K-1) is the test set, with --folds K.", type=click.IntRange(min=0),
                       metavar="I")
    train_size: int | None = option(None, "Train on at most N of the training models (the first N by a hash of "
                                    "model_id, so smaller sizes are subsets of larger ones: a learning curve); "
                                    "validation and test models are unchanged. Default: all.",
                                    type=click.IntRange(min=2), metavar="N")
    loader_workers: int = option(2, "Threads that stream graphs from DuckDB ahead of the trainer.",
                                 type=click.IntRange(min=0))
    chunk: int = option(1024, "Graphs read from DuckDB per query (consecutive batches are read together: a "
                               "query's cost grows with the catalog, so few large queries stream a large zoo "
                               "faster).", type=click.IntRange(min=1))
    canonical: bool = option(False, "Feed the metanetwork scale-canonicalised graphs: every rescalable hidden neuron "
                             "gets unit-norm incoming weights (and a positive sum where signs may flip), the factor "
                             "pushed forward; one graph per function-preserving rescaling orbit.")
    balanced: bool = option(True, "Feed the balanced representative of each rescaling orbit: from the canonical "
                            "graph, every rescalable hidden neuron's incoming and outgoing weights brought to equal "
                            "norms (the balance weight decay drives training to), so predictions do not change when "
                            "a network is rewritten with other neuron scales or signs, and inputs stay close to the "
                            "trained networks. --no-balanced: the checkpoints' own weights; --canonical overrides.")
    compress: bool = option(False, "Feed every weight and bias w as sign(w) log(1 + |w|): with --canonical the "
                            "factors pushed forward pile up in the last layers, and the compressed values keep "
                            "their order without the heavy tails (applied last, after every other preparation).")
    bn_stats: bool = option(True, "Feed batch norms as the affine maps they compute at evaluation (gamma / sqrt(var "
                            "+ eps) on the edge, beta - gamma * mean / sqrt(var + eps) as the bias), so the running "
                            "statistics reach the metanetwork.")
    scale_augment: float = option(0.0, "Train on a new random function-preserving rescaling of every model each "
                                  "time it is served: per hidden neuron a factor U[1, MAX] (and a sign flip where "
                                  "the activation allows). 0 = off.", metavar="MAX")
    weight_noise: float = option(0.0, "Train on weights plus Gaussian noise of X times each operation's weight "
                                 "spread (biases: per neuron layer), drawn anew every time a model is served.",
                                 type=FiniteRange(min=0.0), metavar="X")
    weight_dropout: float = option(0.0, "Train with each edge's weights zeroed with probability P.",
                                   type=FiniteRange(min=0.0, max=1.0, max_open=True), metavar="P")
    rescale_test: tuple[float, ...] = option((), "Also score the metanetwork and StatNN on function-preserving "
                                             "random rescalings U[1, MAX] of the test models (rows "
                                             "'<method>@xMAX'). Repeat for several MAX.", type=float, metavar="MAX")


DEFAULT_EPOCHS = 10     # per member, where the zoo is large enough (OptimConfig.schedule_for)


@dataclass
class OptimConfig:
    """How the metanetwork is fitted and selected, and what it is compared with."""
    epochs: int | None = option(None, "Epochs per ensemble member (cosine schedule over them). Default: 10, or more "
                                "on a zoo too small for 10 epochs to take --min-steps batches.",
                                type=click.IntRange(min=1))
    batch_size: int = option(32, "Models per batch.", type=click.IntRange(min=1))
    lr: float = option(1e-3, "AdamW learning rate.")
    weight_decay: float = option(1e-4, "AdamW weight decay.", type=FiniteRange(min=0.0))
    patience: int = option(5, "Early stopping: epochs without a better validation score.",
                           type=click.IntRange(min=1))
    min_steps: int = option(400, "Without --epochs: at least N optimiser steps per member. On a zoo too small "
                            "for 10 epochs to take N batches, the epochs (and --patience with them) grow until "
                            "they do. 0 = always 10.", type=click.IntRange(min=0), metavar="N")
    ensemble: int = option(3, "Train K metanetworks (seeds SEED..SEED+K-1) and average their predictions (K times "
                           "the training time; 1 for a single model).", type=click.IntRange(min=1))
    rank_weight: float = option(3.0, "Regression: add W times a pairwise ranking loss (RankNet's, over the pairs of "
                                "each batch) to the squared error; 0 = squared error alone.",
                                type=FiniteRange(min=0.0), metavar="W")
    aux_targets: tuple[str, ...] = option((), "Regression: also train the metanetwork to predict this numeric "
                                          "models column of its training models (e.g. train_accuracy, lr), "
                                          "rank-transformed to a standard normal; only the target is predicted "
                                          "and scored. More supervision per model for small zoos; measured level "
                                          "with the recipe on the development fixed CNN zoo, so off by default "
                                          "(docs/metanetworks.md). Repeat for several.", type=str,
                                          metavar="COLUMN")
    aux_weight: float = option(0.5, "With --aux-targets: weight of their squared error beside the target's loss.",
                               type=FiniteRange(min=0.0), metavar="W")
    calibrate: bool = option(True, "Regression: map the predictions through a * p + b fitted on the validation "
                             "split (a > 0: Kendall tau is unchanged; R^2 and MAE improve); saved with the run.")
    calibration: str = option("monotone", "With --calibrate: linear (a * p + b) or monotone (that line, then an "
                              "isotonic map fitted on validation, blended with the identity so it stays strictly "
                              "increasing).", type=click.Choice(TaskNames("CALIBRATIONS")))
    seed: int = option(0, "Seed of the split-independent randomness (initialisation, batches, learners).")
    device: str = option("cpu", "torch device: cpu, cuda, cuda:1 ... (no code change between them).")
    max_train_batches: int | None = None   # cap per epoch (smoke runs); None = all
    baselines: bool = option(True, "Fit the tabular predictors (StatNN, the flat-weights MLP) beside the run's own.")
    init_from: str | None = option(None, "Fine-tune: start every ensemble member from run RUN_ID's trained "
                                   "metanetwork (member k from its member k mod n; e.g. one trained on a large "
                                   "generated zoo) instead of a random one. Its hyperparameters, edge types, kernel "
                                   "frame and statistics map (--head-statistics) are kept (the metanetwork options "
                                   "here are then ignored); the selected models must fit them.", metavar="RUN_ID")
    init_catalog: str | None = option(None, "The catalog holding --init-from's run (default: the one trained on).",
                                      metavar="PATH")
    stack: bool = option(True, "Regression with a metanetwork: the run's answer is w * metanetwork + (1 - w) * the "
                         "mean of the blend partners (StatNN's two learners, StatNN with spectral descriptors, and the probing "
                         "predictors probe and probegen; those more than 0.05 behind the best on validation left out), w in 0, "
                         "0.1, ..., 1 chosen on validation, then recalibrated by a line a * answer + b fitted on validation (the row "
                         "'ngnn+statnn+...+probegen'); needs the baselines.")
    plain_statistics: bool = option(True, "With balanced (or canonical) inputs, the blend's statistics read the "
                                    "checkpoints' own weights for inputs whose weight scales lie within the training "
                                    "models' (what the weights' scales say about training is kept), and the balanced "
                                    "graphs for any other input (a rescaled copy gets an answer as invariant as the "
                                    "metanetwork's). --no-plain-statistics: balanced graphs for every input.")
    residual: bool = option(False, "Regression with --stack: train the metanetwork on what statistics miss. Its "
                            "targets are the models' targets minus the blend's statistics (the mean of the statistics "
                            "predictors; out-of-fold on the training models, so that it never learns their fit to its "
                            "own targets), and the answer is statistics + w * its prediction, w in 0, 0.1, ..., 1 "
                            "chosen on validation (w = 0: statistics alone). Off: measured behind the recipe's blend "
                            "on the development zoos (docs/metanetworks.md).")

    def schedule_for(self, train_models: int) -> tuple[int, int]:
        """(epochs, patience) of one member trained on ``train_models`` models: --epochs and --patience
        as given; without --epochs, 10 and --patience, both scaled up by the same factor where 10
        epochs would take fewer batches than --min-steps (a metanetwork on 100 models would
        otherwise stop after 40 optimiser steps, still learning)."""
        if self.epochs is not None:
            return self.epochs, self.patience
        batches = -(-max(train_models, 1) // self.batch_size)
        if self.max_train_batches is not None:
            batches = min(batches, self.max_train_batches)
        factor = max(1.0, self.min_steps / (batches * DEFAULT_EPOCHS))
        return math.ceil(DEFAULT_EPOCHS * factor), math.ceil(self.patience * factor)


@dataclass(kw_only=True)
class MetanetConfig:
    """A metanetwork's own hyperparameters, as the CLI offers them and as runs save them;
    jobs.metanets.ngnn.NGGNNConfig adds what the selected models fix (edge types, kernel frame, outputs).
    A field added here is an option of ``jobs train-heterognn`` and reaches the metanetwork; give
    ``LEGACY`` the value that reproduces runs saved before it existed."""
    hidden: int = option(64, "Node embedding width.", type=click.IntRange(min=4))
    edge_hidden: int = option(32, "Edge embedding width.", type=click.IntRange(min=1))
    layers: int = option(3, "Message-passing (or attention) layers.", type=click.IntRange(min=1))
    dropout: float = option(0.0, "Dropout in the node updates.", type=FiniteRange(min=0.0, max=1.0,
                                                                                         max_open=True))
    probes: int = option(0, "Learned probe inputs whose per-neuron activations join the node features (MLP / INR "
                         "zoos: graphs of linear and residual edges).", type=click.IntRange(min=0))
    fixed_probes: int = option(0, "Fixed probe inputs (N(0, 1) values, or uniform token ids) run through every "
                               "model's own checked program, any architecture: each neuron node's value on each "
                               "probe (a conv channel's map pooled by mean and by max) joins its node features "
                               "(jobs.analysis.probing). 0 = off.", type=click.IntRange(min=0), metavar="N")
    probe_inputs: str = option("noise", "What --fixed-probes feeds: 'noise' (seeded, data-free: the prediction is from "
                               "the network alone) or 'data' (unlabelled training inputs of each model's data set, "
                               "where it is recorded and held here; the prediction then depends on that data too).",
                               type=click.Choice(["noise", "data"]))
    quasi: bool = option(False, "Add the quasi-equivariant scaling layer (Quasi-Equivariant Metanetworks, ICLR "
                         "2026): a learned per-neuron factor 1 + eps*sin(.) from per-neuron and per-layer weight "
                         "statistics; its parameter overhead is printed.")
    quasi_eps: float = option(0.1, "eps of the quasi-equivariant factors 1 + eps*sin(.).",
                              type=FiniteRange(min=0.0, max=0.99))
    readout_outputs: int = option(10, "Also read the embeddings of output neurons 0..K-1, in order, beside the "
                                  "mean/max readout (invariant: output neurons are never permuted). 0 = off.",
                                  type=click.IntRange(min=0), metavar="K")
    fourier: int = option(32, "Add random Fourier features (F frequencies) of every edge's weights and every bias "
                          "to their encodings. 0 = off.", type=click.IntRange(min=0), metavar="F")
    head_statistics: bool = option(True, "Also give the head each model's StatNN features beside its graph "
                                   "embedding (per-layer weight and bias statistics, shape descriptors on mixed zoos; "
                                   "read after the symmetry preparation, as normal scores of the training models' "
                                   "quantiles): the graph adds to what statistics know.")
    head_spectral: bool = option(False, "With --head-statistics: also give the head each weight matrix's spectral "
                                 "descriptors (top singular value, norm, stable and effective rank, how far the top "
                                 "stands out of the bulk), which statistics of the weight values cannot see. Off: measured "
                                 "level with the recipe on the development zoos (docs/metanetworks.md).")
    heads: int = option(4, "NG-T: attention heads (they split --hidden).", type=click.IntRange(min=1))
    attention_groups: str = option("all", "NG-T: what one attention softmax runs over: all of a neuron's edges, its "
                                   "in-edges and reverse edges apart (direction), or each edge type apart "
                                   "(relation).", type=click.Choice(ATTENTION_GROUPS))
    attention_std: bool = option(True, "NG-T: read the attention-weighted standard deviation of the values beside "
                                 "their weighted mean.")
    relation_values: bool = option(True, "NG-T: one value map per edge type (as NG-GNN's per-relation messages) "
                                   "instead of one map shared by every edge.")
    attention_dropout: float = option(0.0, "NG-T: dropout on the attention weights while training.",
                                      type=FiniteRange(min=0.0, max=1.0, max_open=True))


# what runs saved before a field existed computed (jobs.metanets.ngnn.NGGNNConfig.from_dict fills them in)
LEGACY = {"readout_outputs": 0, "fourier": 0, "attention_std": False, "relation_values": False,
          "head_statistics": False, "head_spectral": False}


@dataclass
class ModelConfig(MetanetConfig):
    """The predictor (jobs.predictors) and, for a metanetwork, its hyperparameters."""
    model: str = option("ngnn", "The predictor whose answer the run gives (`jobs predict` rebuilds it from the "
                        "run): " + help_text() + ".", type=click.Choice(list(PREDICTORS)))


@dataclass
class TrainConfig(ModelConfig, OptimConfig, DataConfig):
    """A run's whole configuration: the data, optimisation and model parts in one flat record (as
    the CLI options and the run manifest hold it); ``part(DataConfig)`` etc. give one part."""

    def part(self, cls):
        return cls(**{f.name: getattr(self, f.name) for f in fields(cls)})


@dataclass
class EditConfig:
    """A run of ``jobs train-editor`` (jobs.editing): which INRs, which edit, and the editors'
    training; its options are generated from these fields."""
    edit: str = option("dilate", "The image transformation the edited INR should compute: 3x3 grey dilation, "
                       "Gaussian blur (sigma 1 pixel) or contrast x2, of the digit the INR was fitted to, on its "
                       "pixel grid (8x8, or the side its zoo was made at).",
                       type=click.Choice(TaskNames("EDITS", "jobs.editing.targets")))
    where: str | None = option(None, "SQL condition over models selecting the INRs (default: all INRs with an "
                               "image_index that are not themselves edits).")
    model: str = option("ngnn", "The metanetwork under the equivariant edge / node heads.",
                        type=click.Choice([n for n, e in PREDICTORS.items() if e.family == "metanetwork"]))
    oce: int = option(4, "Output Capacity Expansion: the heads predict K weight sets and the edited INR is their "
                      "average, written as one network with K times wider hidden layers. 1 = off.",
                      type=click.IntRange(min=1), metavar="K")
    steps: int = option(400, "Optimiser steps per editor (60 with --quick).", type=click.IntRange(min=1))
    batch_size: int = option(32, "INRs per batch.", type=click.IntRange(min=1))
    lr: float = option(2e-3, "AdamW learning rate.")
    weight_decay: float = 1e-5
    hidden: int = option(32, "Node embedding width.", type=click.IntRange(min=4))
    edge_hidden: int = 16
    layers: int = option(2, "Metanetwork layers.", type=click.IntRange(min=1))
    nfn_channels: int = 32
    eval_every: int = 50                # validation MSE every N steps; the best checkpoint is kept
    seed: int = option(0, "Seed of the initialisation and the batches.")
    device: str = option("cpu", "torch device: cpu, cuda, cuda:1 ... (no code change between them).")
    baselines: bool = option(True, "Also train NFN (NP layers) and the metanetwork with K=1 (the identity is "
                             "always scored); --no-baselines scores only the identity and the chosen editor.")
    write: str = option("all", "Which edited INRs to write as a zoo and ingest.",
                        type=click.Choice(["all", "test", "none"]))
    out_dir: str | None = option(None, "Folder of the edited zoo (default: ./edited-EDIT-RUN_ID).",
                                 type=click.Path(file_okay=False), flag_name="out")
