"""The trust signal: a model rescaled in a function-preserving way lies outside the training
models' weight scales, and `jobs predict` says so per prediction and in one warning line."""
import json

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.torch import save_file

from graphstore import duck
from jobs.training.data import select_models
from jobs.training.trust import FEATURES, TrustProfile, profiles_of, scale_profile, scale_profiles
from pipeline.graph_codec import read_graphs, read_plans
from pipeline.neural_graph.build import state_dict_from_graph
from pipeline.neural_graph.symmetry import random_hidden_permutation, random_rescaling


def _rescaled(con, ids, max_scale, seed=0):
    arch, plans = read_plans(con, ids)
    return [random_rescaling(g, np.random.default_rng([seed, k]), max_scale, steps=plans[arch[m]].steps)
            for k, (m, g) in enumerate(zip(ids, read_graphs(con, ids, plans=plans)))]


def test_the_profile_ignores_permutations_and_moves_under_rescaling(catalog_dir):
    con = duck.connect(catalog_dir)
    mid = con.execute("SELECT model_id FROM models WHERE zoo = 'cnn' AND activation = 'relu' LIMIT 1").fetchone()[0]
    graph, = read_graphs(con, [mid])
    before = scale_profile(graph)
    assert before.shape == (len(FEATURES),) and np.isfinite(before[:2]).all()
    permuted = graph.permuted(random_hidden_permutation(graph, np.random.default_rng(0)))
    np.testing.assert_allclose(scale_profile(permuted), before, rtol=1e-6, atol=1e-9)
    # without a residual block (whose skip ties a layer's factors to another's), the first hidden layer's
    # log ratio moves by ~2 log10(a) - log10 rms(a'): about +2.4 for U[1, 10^3]; on average over models,
    # since a narrow layer draws few factors (which model LIMIT 1 returns is not fixed either)
    plain = [m for m, in con.execute("SELECT model_id FROM models WHERE zoo = 'cnn' AND activation = 'relu' "
                                     "AND NOT residual ORDER BY model_id").fetchall()]
    shifts = [scale_profile(moved)[0] - scale_profile(g)[0]
              for g, moved in zip(read_graphs(con, plain), _rescaled(con, plain, 1000.0))]
    assert len(plain) >= 3 and np.mean(shifts) > 1.0


def test_rescaled_copies_are_flagged_and_clean_models_are_not(catalog_dir):
    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", "zoo = 'cnn'", catalog=catalog_dir, folds=(3, 0))
    trust = TrustProfile.fit(profiles_of(con, sel.ids("train")))
    assert trust.in_distribution(profiles_of(con, sel.ids("train"))).all()
    others = sel.ids("val") + sel.ids("test")
    clean = profiles_of(con, others)
    assert len(others) >= 10 and trust.in_distribution(clean).mean() >= 0.9
    moved = scale_profiles(_rescaled(con, others, 1000.0))
    changed = np.abs(np.nan_to_num(moved) - np.nan_to_num(clean)).max(1) > 1e-6      # ReLU-like models only
    assert changed.sum() >= 4 and (~trust.in_distribution(moved[changed])).mean() >= 0.8
    assert TrustProfile.from_dict(json.loads(json.dumps(trust.to_dict()))) == trust


def _ingest_rescaled_copies(con, catalog, cnn_zoo, tmp_path, n=6) -> list[tuple[str, str]]:
    """Rescaled copies U[1, 1000] of ``n`` ReLU models of the cnn zoo, ingested as the zoo
    'rescaled' (file stems: the first 12 characters of the original's model_id); closes ``con``."""
    from pipeline.ingest import ingest_zoo

    rows = con.execute("SELECT model_id, source_path FROM models WHERE zoo = 'cnn' AND activation = 'relu' "
                       f"ORDER BY model_id LIMIT {n}").fetchall()
    zoo = tmp_path / "rescaled"
    zoo.mkdir()
    for (mid, source), graph in zip(rows, _rescaled(con, [r[0] for r in rows], 1000.0)):
        state = {k: v.contiguous() for k, v in state_dict_from_graph(graph).items()}
        save_file(state, str(zoo / f"{mid[:12]}.safetensors"))
        (zoo / f"{mid[:12]}.json").write_text((cnn_zoo / source).with_suffix(".json").read_text())
    con.close()
    assert ingest_zoo(zoo, catalog, zoo_name="rescaled", progress=False).ok
    return rows


def test_predict_flags_rescaled_models_in_its_rows_and_one_warning(catalog_copy, cnn_zoo, tmp_path):
    """Rescaled copies of trained models ingested as a new zoo: `jobs predict` writes
    in_distribution = false for them and prints one warning line; clean models stay true."""
    from jobs.cli import main

    res = CliRunner().invoke(main, ["train-heterognn", "--catalog", str(catalog_copy), "--where", "zoo = 'cnn'",
                                    "--ensemble", "1", "--epochs", "1", "--hidden", "8", "--edge-hidden", "4",
                                    "--layers", "1", "--batch-size", "16", "--no-baselines", "--no-balanced"])
    assert res.exit_code == 0, res.output
    con = duck.connect(catalog_copy)
    run_id, = con.execute("SELECT run_id FROM runs").fetchone()
    _ingest_rescaled_copies(con, catalog_copy, cnn_zoo, tmp_path)
    res = CliRunner().invoke(main, ["predict", "--catalog", str(catalog_copy), "--run", run_id,
                                    "--where", "zoo IN ('rescaled', 'cnn')"])
    assert res.exit_code == 0, res.output
    warning, = res.stderr.strip().splitlines()
    con = duck.connect(catalog_copy)
    flags = dict(con.execute("SELECT m.zoo, list(p.in_distribution) FROM predictions p JOIN models m USING "
                             "(model_id) WHERE p.split = 'predict' GROUP BY m.zoo").fetchall())
    assert sum(not f for f in flags["rescaled"]) >= 5 and all(f is not None for f in flags["cnn"])
    n_out = sum(not f for f in flags["rescaled"] + flags["cnn"])
    assert warning.startswith(f"warning: {n_out} of {len(flags['rescaled']) + len(flags['cnn'])} models lie outside")
    assert sum(not f for f in flags["cnn"]) <= len(flags["cnn"]) // 10


def test_a_balanced_run_trusts_rescaled_copies_and_flags_larger_weights(catalog_dir):
    """Read after balancing (the run's own inputs), a rescaled copy is the same network and is not
    flagged; weights made a hundred times larger (another function) are."""
    import dataclasses

    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", "zoo = 'cnn'", catalog=catalog_dir, folds=(3, 0))
    trust = TrustProfile.of_catalog(con, sel.ids("train"), {"balanced": True})
    others = sel.ids("val") + sel.ids("test")
    clean = trust.judge_catalog(con, others)
    assert clean.mean() >= 0.9
    np.testing.assert_array_equal(trust.judge_graphs(con, others, _rescaled(con, others, 1000.0)), clean)
    larger = [dataclasses.replace(g, weight=g.weight * 100) for g in read_graphs(con, others)]
    assert (~trust.judge_graphs(con, others, larger)).mean() >= 0.8
    again = TrustProfile.from_dict(json.loads(json.dumps(trust.to_dict())))
    assert again == trust and again.prepare == {"balanced": True}


def test_a_profile_saved_before_the_norm_features_judges_by_its_own(catalog_dir):
    con = duck.connect(catalog_dir)
    sel = select_models(con, "test_accuracy", "zoo = 'cnn'", catalog=catalog_dir, folds=(3, 0))
    new = TrustProfile.of_catalog(con, sel.ids("train"))
    ratios = [f for f in FEATURES if "log_ratio" in f]
    old = TrustProfile.from_dict({"features": ratios, "low": new.low[:6], "high": new.high[:6]})
    others = sel.ids("val") + sel.ids("test")
    moved = scale_profiles(_rescaled(con, others, 1000.0))
    profiles = profiles_of(con, others)
    assert old.features == ratios and old.prepare is None
    masked = moved.copy()
    masked[:, len(ratios):] = np.nan                  # NaN is no evidence: the new profile on the old features
    np.testing.assert_array_equal(old.in_distribution(moved), new.in_distribution(masked))
    assert (~old.in_distribution(moved)).sum() >= 4 and old.in_distribution(profiles).mean() >= 0.9


def test_by_default_a_rescaled_copy_gets_its_originals_prediction_and_is_trusted(catalog_copy, cnn_zoo, tmp_path):
    """The default run reads balanced graphs: rescaled copies of trained models, ingested as a new
    zoo, get the same metanetwork predictions as the models they copy, and no flag their originals lack. The answer's
    statistics read the checkpoints' own weights only within the training models' weight scales:
    the copies lie outside, and get the blend with statistics of their balanced graphs, which are
    their originals' balanced graphs."""
    from graphstore.catalog import Catalog
    from jobs.cli import main
    from jobs.predictors.stacking import read_stack

    res = CliRunner().invoke(main, ["train-heterognn", "--catalog", str(catalog_copy), "--where", "zoo = 'cnn'",
                                    "--ensemble", "1", "--epochs", "1", "--hidden", "8", "--edge-hidden", "4",
                                    "--layers", "1", "--batch-size", "16"])
    assert res.exit_code == 0, res.output
    # the answer says what it blends
    assert "outside the training models' weight scales: " in res.output and "of balanced graphs)" in res.output
    con = duck.connect(catalog_copy)
    run_id, = con.execute("SELECT run_id FROM runs").fetchone()
    rows = _ingest_rescaled_copies(con, catalog_copy, cnn_zoo, tmp_path)
    res = CliRunner().invoke(main, ["predict", "--catalog", str(catalog_copy), "--run", run_id,
                                    "--where", "zoo IN ('rescaled', 'cnn')"])
    assert res.exit_code == 0, res.output
    con = duck.connect(catalog_copy)
    got = {(m, z, method): (v, ok) for m, z, method, v, ok in con.execute(
        "SELECT m.model_id, m.zoo, p.method, p.predicted, p.in_distribution FROM predictions p JOIN models m "
        "USING (model_id) WHERE p.split = 'predict'").fetchall()}
    copies = {m: src for m, src in con.execute(
        "SELECT model_id, source_path FROM models WHERE zoo = 'rescaled'").fetchall()}
    stack = read_stack(Catalog(catalog_copy), run_id)
    originals = [mid for mid, _ in rows]
    balanced = [p.predict(con, originals)[0] for p in stack.fallback.predictors]
    assert {k[2] for k in got} >= {"ngnn", stack.name}
    # a clean model may lie outside the training models' scales (about 1% do); a copy adds no flag of its own
    flagged = sum(not ok for (_, _, method), (_, ok) in got.items() if method == "ngnn")
    assert flagged <= 3 and (f"warning: {flagged} of" in res.stderr if flagged else "outside" not in res.stderr)
    for k, mid in enumerate(originals):
        copy = next(c for c, src in copies.items() if src.startswith(mid[:12]))
        (orig, ok_orig), (moved, ok_moved) = got[(mid, "cnn", "ngnn")], got[(copy, "rescaled", "ngnn")]
        assert moved == pytest.approx(orig, abs=2e-3) and ok_moved == ok_orig
        answer, _ = got[(copy, "rescaled", stack.name)]
        expected = stack.fallback.apply(np.array([orig]), [np.array([b[k]]) for b in balanced])[0]
        assert answer == pytest.approx(expected, abs=2e-3)
    assert (~stack.gate.judge_catalog(con, list(copies))).all()
