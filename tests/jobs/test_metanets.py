"""The metanetwork registry: every entry builds a metanetwork of its kind, the CLI offers exactly
the registered kinds, and an unknown kind is refused naming the known ones."""
import pytest

from jobs.metanets import METANETWORKS, build_metanetwork, metanetwork_class
from jobs.metanets.ngnn import NGGNN, NGGNNConfig

ETYPES = [("input", "linear", "hidden"), ("hidden", "linear", "output"),
          ("hidden", "rev_linear", "input"), ("output", "rev_linear", "hidden")]


@pytest.mark.parametrize("kind", sorted(METANETWORKS))
def test_every_registered_kind_builds_a_metanetwork_of_that_kind(kind):
    model = build_metanetwork(NGGNNConfig(etypes=ETYPES, edge_in=1, out_dim=1, hidden=8, edge_hidden=4, kind=kind))
    assert isinstance(model, NGGNN) and type(model) is metanetwork_class(kind)
    assert model.cfg.kind == kind


def test_the_cli_offers_every_registered_predictor():
    from jobs.cli import train_heterognn_cmd
    from jobs.predictors import PREDICTORS

    choice = next(p for p in train_heterognn_cmd.params if p.name == "model").type
    assert list(choice.choices) == list(PREDICTORS)
    assert set(METANETWORKS) == {n for n, e in PREDICTORS.items() if e.family == "metanetwork"} == {"ngnn", "ngt"}


def test_an_unknown_kind_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="known: ngnn, ngt"):
        build_metanetwork(NGGNNConfig(etypes=ETYPES, edge_in=1, out_dim=1, kind="gat"))


def test_the_cli_defaults_are_the_library_recipe():
    """`jobs train-heterognn` with no options trains what TrainConfig() trains (one recipe, two doors)."""
    from dataclasses import fields

    import click

    from jobs.cli import train_heterognn_cmd
    from jobs.config import TrainConfig

    recipe = {f.name: getattr(TrainConfig(), f.name) for f in fields(TrainConfig)}
    checked, ctx = set(), click.Context(train_heterognn_cmd)
    for p in train_heterognn_cmd.params:
        field, default = p.name, p.get_default(ctx)
        if field not in recipe or default is None:
            continue
        if p.multiple:          # a repeatable option given no times is the empty tuple
            default = tuple(default) if isinstance(default, (list, tuple)) else ()
        assert default == recipe[field], f"--{p.name}: CLI {p.default!r}, TrainConfig {recipe[field]!r}"
        checked.add(field)
    # no --epochs means the recipe's schedule (TrainConfig.schedule_for), through either door
    assert next(p for p in train_heterognn_cmd.params if p.name == "epochs").get_default(ctx) is None
    assert recipe["epochs"] is None
    assert {"min_steps", "ensemble", "patience", "calibrate", "calibration", "rank_weight", "attention_groups",
            "attention_std", "relation_values", "fourier", "bn_stats", "hidden", "layers", "lr", "model"} <= checked
    from jobs.training.tasks import CALIBRATIONS

    choice = next(p for p in train_heterognn_cmd.params if p.name == "calibration").type.choices
    assert tuple(choice) == CALIBRATIONS


@pytest.mark.parametrize("kind", sorted(METANETWORKS))
def test_a_run_saved_before_an_activation_kind_was_added_still_loads(kind):
    """Activation kinds are appended to the vocabulary (elu was): a saved activation embedding with
    fewer rows loads, the old rows unchanged and the new kinds at zero."""
    import torch

    cfg = NGGNNConfig(etypes=ETYPES, edge_in=1, out_dim=1, hidden=8, edge_hidden=4, kind=kind)
    old = build_metanetwork(cfg).state_dict()
    old["act_emb.weight"] = old["act_emb.weight"][:-1].clone()
    fresh = build_metanetwork(cfg)
    fresh.load_state_dict(old)
    assert torch.equal(fresh.act_emb.weight[:-1], old["act_emb.weight"])
    assert torch.count_nonzero(fresh.act_emb.weight[-1]) == 0


def test_an_added_activation_kind_leaves_a_seeds_network_unchanged():
    """Kinds added to the vocabulary later (elu) start at zero, so every other parameter a seed
    draws is what it drew before the kind existed."""
    import torch

    from pipeline.neural_graph.vocabulary import ACTIVATIONS, SEEDED_ACTIVATIONS

    from pipeline.neural_graph.vocabulary import NODE_TYPES

    cfg = NGGNNConfig(etypes=ETYPES, edge_in=1, out_dim=1, hidden=8, edge_hidden=4)
    torch.manual_seed(0)
    model = build_metanetwork(cfg)
    torch.manual_seed(0)                     # the draws of the modules built before and after, as they were
    torch.nn.Linear(1 + cfg.probes, 8)
    before = torch.nn.Embedding(SEEDED_ACTIVATIONS, 8).weight
    after = torch.nn.Embedding(len(NODE_TYPES), 8).weight
    assert SEEDED_ACTIVATIONS < len(ACTIVATIONS)
    assert torch.equal(model.act_emb.weight[:SEEDED_ACTIVATIONS], before)
    assert torch.equal(model.type_emb.weight, after)
    assert torch.count_nonzero(model.act_emb.weight[SEEDED_ACTIVATIONS:]) == 0
