"""bench_accuracy's table: every method ranked on the same test models, paired against the stronger
StatNN; a method that scored only a sliver of a fold (the flat-weights MLP on a zoo of many
shapes) is left out with a line saying so, not ranked on its own tiny test set."""
import argparse
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_accuracy  # noqa: E402


def _fold(rng, n, noise):
    y = rng.uniform(0.1, 0.9, n)
    ids = [f"m{rng.integers(1 << 30)}-{i}" for i in range(n)]
    return {name: {i: (t, t + rng.normal(0, s)) for i, t in zip(ids, y)} for name, s in noise.items()}, ids


def test_the_table_pairs_methods_and_leaves_out_slivers():
    rng = np.random.default_rng(0)
    per_fold = []
    for _ in range(3):
        fold, ids = _fold(rng, 300, {"ngnn": 0.02, "statnn": 0.2, "statnn_mlp": 0.4, "flat_mlp": 0.01})
        fold["flat_mlp"] = {i: fold["flat_mlp"][i] for i in ids[:3]}       # one shape's 3 test models
        per_fold.append(fold)
    lines = bench_accuracy.summarise("cnn", per_fold, resamples=200)
    assert lines[0].startswith("cnn: 3 folds, test models per fold [300, 300, 300]; paired difference to statnn ")
    rows = {line.split()[0]: line for line in lines[2:] if not line.strip().startswith("(")}
    assert set(rows) == {"ngnn", "statnn", "statnn_mlp"}
    assert rows["ngnn"].rstrip().endswith("*") and rows["statnn"].rstrip().endswith("-")
    assert rows["statnn_mlp"].rstrip().endswith("*") and "-0." in rows["statnn_mlp"].split("[")[0][-10:]
    assert lines[-1] == "  (flat_mlp: left out, it scored only [3, 3, 3] of [300, 300, 300] test models)"


def test_levers_are_trainconfig_fields_typed_or_refused():
    assert bench_accuracy.overrides(["scale_augment=2", "ensemble=1", "bn_stats=false", "model=ngt"]) == {
        "scale_augment": 2.0, "ensemble": 1, "bn_stats": False, "model": "ngt"}
    try:
        bench_accuracy.overrides(["layer=5"])
    except SystemExit as exc:
        assert "one of:" in str(exc) and "layers" in str(exc)
    else:
        raise AssertionError("an unknown field was taken")


def test_the_statistics_mean_joins_each_fold_on_the_models_both_learners_scored():
    fold = {"statnn": {"a": (0.5, 0.2), "b": (0.7, 0.4)}, "statnn_mlp": {"a": (0.5, 0.4), "c": (0.1, 0.1)},
            "ngnn": {"a": (0.5, 0.9)}}
    out = bench_accuracy.with_statistics_mean(fold)
    assert out["statnn_avg"] == {"a": (0.5, 0.30000000000000004)} and out["ngnn"] == fold["ngnn"]


def test_the_learning_curve_gives_each_size_its_own_margin():
    rng = np.random.default_rng(1)
    curves = []
    for size, noise in ((100, 0.3), (500, 0.02)):          # the metanetwork catches up with more models
        folds = [_fold(rng, 200, {"ngnn": noise, "statnn": 0.1, "statnn_mlp": 0.1})[0] for _ in range(2)]
        curves.append(("cnn", size, [bench_accuracy.with_statistics_mean(f) for f in folds]))
    lines = bench_accuracy.curve_table(curves)
    assert lines[1].split() == ["cnn:", "100", "500"]
    row = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert set(row) == {"ngnn", "statnn", "statnn_mlp", "statnn_avg"}
    small, large = float(row["ngnn"][1].strip("()")), float(row["ngnn"][3].strip("()"))
    assert small < 0 < large


def test_a_lever_is_paired_against_the_same_method_without_it():
    rng = np.random.default_rng(2)
    tag = "[head_statistics=true]"
    per_fold = []
    for _ in range(3):
        y = rng.uniform(0.1, 0.9, 300)
        ids = [f"m{k}" for k in range(300)]
        noisy = {"ngnn": 0.3, "ngnn" + tag: 0.05, "ngnn+statnn": 0.1, "ngnn+statnn" + tag: 0.1}
        per_fold.append({m: {i: (t, t + rng.normal(0, s)) for i, t in zip(ids, y)} for m, s in noisy.items()})
    lines = bench_accuracy.versus_lines(per_fold, tag, resamples=200)
    assert lines[0] == f"  the lever {tag} against the recipe, paired on the same test models:"
    rows = {line.split(":")[0].strip(): line.split(":", 1)[1] for line in lines[1:]}
    assert set(rows) == {f"ngnn{tag} - ngnn", f"ngnn+statnn{tag} - ngnn+statnn"}
    assert rows[f"ngnn{tag} - ngnn"].rstrip().endswith("*") and rows[f"ngnn{tag} - ngnn"].split()[0].startswith("+")
    assert not rows[f"ngnn+statnn{tag} - ngnn+statnn"].rstrip().endswith("*")     # the same noise: level


def test_levers_print_one_way_wherever_the_bench_shows_them():
    assert bench_accuracy.shown(bench_accuracy.overrides(["head_spectral=true", "layers=5"])) == \
        "head_spectral=true,layers=5"
    assert bench_accuracy.shown(bench_accuracy.overrides(["rescale_test=10,1000", "residual=false"])) == \
        "rescale_test=10.0+1000.0,residual=false"


def test_a_named_variant_keeps_its_rows_narrow_and_spells_its_levers_out_once():
    levers = bench_accuracy.overrides(["init_from=run-1", "init_catalog=/tmp/a/long/catalog/path"])
    tag = bench_accuracy.variant_tag("PRE", levers)
    assert tag == "[PRE]" and bench_accuracy.variant_tag(None, levers) == f"[{bench_accuracy.shown(levers)}]"
    rng = np.random.default_rng(1)
    per_fold = []
    for _ in range(2):
        fold, _ids = _fold(rng, 60, {"ngnn": 0.1, "ngnn" + tag: 0.1})
        per_fold.append(fold)
    lines = bench_accuracy.versus_lines(per_fold, tag, resamples=50, levers=bench_accuracy.shown(levers))
    assert lines[0] == ("  the lever [PRE] = init_from=run-1,init_catalog=/tmp/a/long/catalog/path against the "
                        "recipe, paired on the same test models:")
    assert [line.split(":")[0].strip() for line in lines[1:]] == ["ngnn[PRE] - ngnn"]
    # an unnamed variant's tag already is its levers: not spelled out twice
    plain = bench_accuracy.variant_tag(None, {"layers": 5})
    assert bench_accuracy.versus_lines([{k.replace(tag, plain): v for k, v in f.items()} for f in per_fold], plain,
                                       resamples=50, levers="layers=5")[0].startswith("  the lever [layers=5] against")
    for bad in ("", "a b", "x" * 25, "../p"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_accuracy.tag_name(bad)
