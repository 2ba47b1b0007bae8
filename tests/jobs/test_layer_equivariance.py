"""Layerwise equivariance: a first layer built to be exactly mirror-equivariant is found to be so
(error ~ 0, A = the signed permutation it was built with); random layers are not; the
layer_equivariance relation round-trips through the catalog, SQL, the graph store and
`graphstore sync`; the CLI runs end to end on a tiny mlp-equivariant zoo."""
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from graphstore.metadata import open_store
from graphstore.sql import run_readonly
from graphstore.sync import sync_store
from jobs.cli import main as jobs_cli
from jobs.analysis.layer_equivariance import (analyse_catalog, best_group_map, fit_layers, matched_row_share,
                                     nearest_permutation_distance, nearest_signed_permutation, neuron_roles,
                                     ridge_fit)
from pipeline.cli import main as pipeline_cli
from pipeline.ingest import ingest_zoo
from pipeline.spec import build_module
from pipeline.zoo import equivariant
from pipeline.zoo.kinds import recipe_settings
from pipeline.zoo.make import make_zoo
from pipeline.zoo.transforms import transform_index
from zoocore.errors import JobError, ZooGraphError


def equivariant_first_layer(activation: str, kinds=("pair", "antisymmetric", "symmetric"), seed: int = 0):
    """A depth-4 MLP whose first layer satisfies W Q = S W and S b = b for the mirror-lr pixel
    permutation Q and a known signed permutation S: mirror pairs (w, w[index]) are swapped,
    antisymmetric filters u - u[index] (bias 0) are negated, symmetric filters u + u[index] stay."""
    rng = np.random.default_rng(seed)
    index = transform_index("mirror-lr", 64)
    rows, bias, perm, signs = [], [], [], []
    while len(rows) < 64:
        for kind in kinds:
            u = rng.normal(0, 0.6, 64)
            k = len(rows)
            if len(rows) == 64:
                break
            if kind == "pair" and k + 2 <= 64:
                b = rng.normal(0, 0.5)
                rows += [u, u[index]]
                bias += [b, b]
                perm += [k + 1, k]
                signs += [1, 1]
            elif kind == "antisymmetric" or (kind == "pair" and "symmetric" not in kinds):
                rows.append(u - u[index])
                bias.append(0.0)
                perm.append(k)
                signs.append(-1)
            else:
                rows.append(u + u[index])
                bias.append(rng.normal(0, 0.5))
                perm.append(k)
                signs.append(1)
    net = build_module(equivariant.equivariant_spec(activation, "autoencoder", width=64))
    with torch.no_grad():
        net.layers[0].weight.copy_(torch.tensor(np.array(rows[:64]), dtype=torch.float32))
        net.layers[0].bias.copy_(torch.tensor(bias[:64], dtype=torch.float32))
    return net, np.array(perm[:64]), np.array(signs[:64])


def test_exactly_equivariant_tanh_layer_is_found_with_its_signed_permutation():
    net, perm, signs = equivariant_first_layer("tanh")
    spec = equivariant.equivariant_spec("tanh", "autoencoder", width=64)
    fit = fit_layers(net, spec, "mirror-lr", samples=4000)[0]
    assert fit.layer == 1 and fit.activation == "tanh" and fit.width == 64
    assert fit.error < 1e-6
    assert fit.identity_error > 0.3                 # the mirror does move the layer
    assert np.array_equal(fit.signed_perm, perm) and np.array_equal(fit.signs, signs)
    expected = np.zeros((64, 64))
    expected[np.arange(64), perm] = signs
    assert np.abs(fit.matrix - expected).max() < 1e-5
    assert fit.signed_perm_error < 1e-6 and fit.signed_perm_rel_dist < 1e-5 and fit.signed_perm_share > 1 - 1e-9
    assert fit.signed_perm_neurons == 1.0 and fit.perm_neurons < 1.0
    assert fit.match_corr > 1 - 1e-9
    assert fit.match_negations == int((signs < 0).sum()) > 0
    assert fit.perm_rel_dist > 0.3 and fit.perm_error > 0.1     # the negated neurons are no plain permutation
    roles = neuron_roles(fit)
    assert {"mirror", "negation", "itself"} == set(roles) and "negated mirror" not in roles


def test_gelu_needs_a_plain_permutation():
    """GELU is not odd: antisymmetric filters break equivariance; pairs and symmetric ones keep it."""
    spec = equivariant.equivariant_spec("gelu", "autoencoder", width=64)
    net, perm, _ = equivariant_first_layer("gelu", kinds=("pair", "symmetric"))
    fit = fit_layers(net, spec, "mirror-lr", samples=4000)[0]
    assert fit.error < 1e-6 and fit.perm_rel_dist < 1e-5 and fit.perm_error < 1e-6 and fit.perm_neurons == 1.0
    assert np.array_equal(fit.signed_perm, perm)
    assert fit.match_negations == 0
    net, _, _ = equivariant_first_layer("gelu")
    assert fit_layers(net, spec, "mirror-lr", samples=4000)[0].error > 0.05


def test_random_mlp_is_not_layerwise_equivariant():
    torch.manual_seed(0)
    spec = equivariant.equivariant_spec("tanh", "autoencoder", width=64)
    net = build_module(spec)
    with torch.no_grad():
        net.layers[0].weight.normal_(0, 0.5)
    fits = fit_layers(net, spec, "mirror-lr", samples=4000)
    assert fits[0].error > 0.1 and fits[0].match_corr < 0.9
    assert fits[0].signed_perm_error > 0.5 and fits[0].signed_perm_rel_dist > 0.5 and fits[0].signed_perm_share < 0.5
    assert fits[0].signed_perm_neurons < 0.1
    assert [f.layer for f in fits] == [1, 2, 3, 4] and fits[-1].activation is None


def _signed_perms(n):
    import itertools

    for p in itertools.permutations(range(n)):
        for signs in itertools.product((1, -1), repeat=n):
            m = np.zeros((n, n))
            m[np.arange(n), p] = signs
            yield m


def test_nearest_permutations_are_exact_minimisers_up_to_scale():
    rng = np.random.default_rng(1)
    a = rng.normal(size=(4, 4))

    def rel(m):                                   # min over c of ||a - c m|| / ||a||
        c = (a * m).sum() / (m * m).sum()
        return np.linalg.norm(a - c * m) / np.linalg.norm(a)

    perms = list(_signed_perms(4))
    assert nearest_signed_permutation(a)[2] == pytest.approx(min(rel(m) for m in perms))
    assert nearest_permutation_distance(a) == pytest.approx(min(rel(m) for m in perms if (m >= 0).all()))


def test_relative_distance_is_scale_free_and_large_for_a_random_matrix():
    rng = np.random.default_rng(0)
    cols, signs = rng.permutation(64), rng.choice([-1, 1], 64)
    p = np.zeros((64, 64))
    p[np.arange(64), cols] = signs
    for scale in (1e-3, 1.0, 1e3):
        got_cols, got_signs, dist = nearest_signed_permutation(scale * p)
        assert dist < 1e-12 and np.array_equal(got_cols, cols) and np.array_equal(got_signs, signs)
        assert matched_row_share(scale * p, got_cols) == 1.0
    noisy = p + 0.1 * rng.normal(size=(64, 64))
    assert 0.4 < nearest_signed_permutation(noisy)[2] < 0.7         # sqrt(1 - 1 / (1 + 64 * 0.01)) = 0.62
    g = rng.normal(size=(64, 64))
    g_cols, _, g_dist = nearest_signed_permutation(g)
    assert g_dist > 0.9 and matched_row_share(g, g_cols) < 0.15
    assert nearest_signed_permutation(np.zeros((3, 3)))[2] == 1.0


def test_best_group_map_minimises_the_squared_residual():
    rng = np.random.default_rng(2)
    f = rng.normal(size=(200, 4))
    fg = f @ rng.normal(size=(4, 4)).T
    cols, signs = best_group_map(f, fg)
    best = min(_signed_perms(4), key=lambda m: ((fg - f @ m.T) ** 2).sum())
    got = np.zeros((4, 4))
    got[np.arange(4), cols] = signs
    assert np.array_equal(got, best)
    cols, signs = best_group_map(f, fg, signed=False)
    best = min((m for m in _signed_perms(4) if (m >= 0).all()), key=lambda m: ((fg - f @ m.T) ** 2).sum())
    assert (signs == 1).all() and np.array_equal(np.eye(4)[cols], best)


def test_ridge_tames_collinear_neurons():
    """Two nearly identical neurons: plain least squares puts huge opposite weights on their
    difference (fitting noise); the ridge chosen on held-out samples does not, and A stays near P."""
    rng = np.random.default_rng(3)
    n, width = 4000, 6
    f = rng.normal(size=(n, width))
    f[:, 1] = f[:, 0] + 1e-5 * rng.normal(size=n)
    p = np.eye(width)[[1, 0, 3, 2, 5, 4]]
    fg = f @ p.T + 0.05 * rng.normal(size=(n, width))
    plain = np.linalg.lstsq(f[:2000], fg[:2000], rcond=None)[0].T
    a, lam = ridge_fit(f[:2000], fg[:2000], f[2000:3000], fg[2000:3000])
    assert np.abs(plain).max() > 10 and lam > 0 and np.abs(a).max() < 1.5
    assert nearest_signed_permutation(a)[2] < nearest_signed_permutation(plain)[2]


def test_transforms():
    lr, ud = transform_index("mirror-lr", 64), transform_index("mirror-ud", 64)
    img = np.arange(64).reshape(8, 8)
    assert np.array_equal(img.reshape(-1)[lr].reshape(8, 8), img[:, ::-1])
    assert np.array_equal(img.reshape(-1)[ud].reshape(8, 8), img[::-1])
    p3 = transform_index("perm-input:3", 10)
    assert sorted(p3) == list(range(10)) and np.array_equal(p3, transform_index("perm-input:3", 10))
    with pytest.raises(ZooGraphError, match="not a flattened square"):
        transform_index("mirror-lr", 10)
    with pytest.raises(ZooGraphError, match="unknown transform"):
        transform_index("rotate", 64)


# ------------------------------------------------------------------ over a real catalog

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """8 mlp-equivariant models (one per grid cell, 6 epochs each) and a CNN, ingested with the
    embedded graph store."""
    root = tmp_path_factory.mktemp("leq")
    make_zoo("mlp-equivariant", root / "zoo", n=8, seed=0, workers=1, progress=False, settings={"epochs": 6})
    make_zoo("cnn", root / "cnn", n=1, seed=0, workers=1, progress=False)
    catalog = root / "catalog"
    with open_store(catalog, use_env=False) as store:
        assert ingest_zoo(root / "zoo", catalog, zoo_name="eq", store=store, progress=False).ok
        assert ingest_zoo(root / "cnn", catalog, zoo_name="cnn", store=store, progress=False).ok
    return {"root": root, "catalog": catalog}


def test_zoo_records_the_grid(tiny):
    rows = run_readonly(tiny["catalog"], "SELECT activation, task, equivariance, equivariance_lambda, width, "
                                         "equivariance_error FROM models WHERE zoo = 'eq'").to_pylist()
    cells = {(r["activation"], r["task"], r["equivariance"]) for r in rows}
    assert cells == set(equivariant.CELLS)
    assert all((r["equivariance_lambda"] > 0) == (r["equivariance"] != "none") for r in rows)
    assert all(r["width"] == 64 and r["equivariance_error"] >= 0 for r in rows)
    epochs = run_readonly(tiny["catalog"], "SELECT DISTINCT epochs, equivariance_from_epoch FROM models "
                                           "WHERE zoo = 'eq'").to_pylist()
    assert epochs == [{"epochs": 6, "equivariance_from_epoch": 3}]     # the --set epochs=6 recipe, not 200


def test_recipe_settings_are_typed_and_refused_when_unknown():
    assert recipe_settings("mlp-equivariant", ["epochs=600", "weight-decay=0.5"]) == {"epochs": 600,
                                                                                      "weight_decay": 0.5}
    assert recipe_settings("cnn", []) == {}
    for kind, pair, match in [("mlp-equivariant", "epochs=many", "must be an integer"),
                              ("mlp-equivariant", "epochs=0", "at least 1"),
                              ("mlp-equivariant", "weight_decay=-1", "non-negative"),
                              ("mlp-equivariant", "width=3", "one of: epochs, lambda_autoencoder"),
                              ("mlp-equivariant", "epochs", "KEY=VALUE"),
                              ("cnn", "epochs=3", "one of: none")]:
        with pytest.raises(ZooGraphError, match=match):
            recipe_settings(kind, [pair])


def test_resuming_a_zoo_with_other_settings_is_refused(tiny, tmp_path):
    import shutil

    zoo = tmp_path / "zoo"
    shutil.copytree(tiny["root"] / "zoo", zoo)
    with pytest.raises(ZooGraphError, match="recipe settings"):
        make_zoo("mlp-equivariant", zoo, n=9, seed=0, workers=1, progress=False, settings={"epochs": 7})
    assert len(list(zoo.glob("*.safetensors"))) == 8            # nothing made, nothing overwritten
    res = CliRunner().invoke(pipeline_cli, ["zoo", "make", "mlp-equivariant", str(zoo), "--n", "8",
                                            "--set", "epochs=6"])
    assert res.exit_code == 0, res.output                        # the same recipe resumes (all 8 kept)
    res = CliRunner().invoke(pipeline_cli, ["zoo", "make", "mlp-equivariant", str(zoo), "--n", "8"])
    assert res.exit_code != 0 and "recipe settings" in res.output


def test_relation_round_trips_through_catalog_sql_and_graph_store(tiny):
    catalog = tiny["catalog"]
    with open_store(catalog, use_env=False) as store:
        report = analyse_catalog(catalog, "zoo = 'eq' AND task = 'autoencoder'", ["mirror-lr"], samples=2000,
                                 store=store)
    assert report.store_warning is None and len(report.rows) == 4 * 4
    got = run_readonly(catalog, "SELECT l.model_id, l.layer, l.error, l.width, len(l.matrix) AS n, m.activation "
                                "FROM layer_equivariance l JOIN models m USING (model_id) "
                                "WHERE l.analysis_id = ? ORDER BY l.model_id, l.layer",
                       [report.analysis_id]).to_pylist()
    expected = sorted((r["model_id"], r["layer"], r["error"]) for r in report.rows)
    assert [(g["model_id"], g["layer"], g["error"]) for g in got] == expected
    assert all(g["n"] == g["width"] ** 2 for g in got) and {g["activation"] for g in got} == {"tanh", "gelu"}
    first = {r["model_id"]: r["error"] for r in report.rows if r["layer"] == 1}

    def stored(store):
        res = store.run("MATCH (m:Model) WHERE m.equivariance_mirror_lr_f1 IS NOT NULL "
                        "RETURN m.model_id, m.equivariance_mirror_lr_f1, m.equivariance_mirror_lr_f1_run")
        return {r[0]: (r[1], r[2]) for r in res.rows}

    with open_store(catalog, use_env=False) as store:
        assert stored(store) == {m: (e, report.analysis_id) for m, e in first.items()}
        store.clear()
        assert stored(store) == {}
        sync = sync_store(catalog, store)
        assert sync.layer_equivariance == 16 and "layer-equivariance" in str(sync)
        assert stored(store) == {m: (e, report.analysis_id) for m, e in first.items()}


def mirror_cnn(equivariant: bool, seed: int = 0) -> torch.nn.Module:
    """conv(1->6, 3x3, padding 1) tanh | max pool | conv(6->5) relu | pool | linear. With
    ``equivariant`` the first conv's filters are mirror pairs (u, u mirrored: swapped by mirror-lr),
    a symmetric filter (kept) and an antisymmetric one with bias 0 (negated: tanh is odd), so layer
    1 is exactly mirror-lr-equivariant with a known signed permutation of its channels."""
    from torch import nn

    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2), nn.Conv2d(6, 5, 3, padding=1),
                        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(5, 3)).eval()
    if equivariant:
        u, v, w = torch.randn(3, 3, 3)
        filters = [u, u.flip(-1), w, w.flip(-1), v + v.flip(-1), v - v.flip(-1)]
        b = torch.randn(3)
        with torch.no_grad():
            net[0].weight.copy_(torch.stack(filters)[:, None])
            net[0].bias.copy_(torch.tensor([b[0], b[0], b[1], b[1], b[2], 0.0]))
    return net


def test_convolutional_archives_are_analysed_per_channel(tmp_path):
    """torch.export archives (no JSON spec) are rebuilt from the catalog and analysed; a conv layer's
    map acts on channels at each position, so the built-in mirror pairs are found exactly."""
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    for name, eq in (("eq", True), ("random", False)):
        ep = torch.export.export(mirror_cnn(eq), (torch.zeros(2, 1, 8, 8),))
        torch.export.save(ep, str(zoo / f"{name}.pt2"))
    assert ingest_zoo(zoo, tmp_path / "catalog", zoo_name="pt2", progress=False).added == 2
    report = analyse_catalog(tmp_path / "catalog", None, ["mirror-lr", "mirror-ud"], samples=2000)
    rows = {(r["checkpoint"], r["transform"], r["layer"]): r for r in report.rows}
    assert sorted({k[2] for k in rows}) == [1, 2, 3]            # conv, conv, linear
    first = rows[("eq.pt2", "mirror-lr", 1)]
    assert first["width"] == 6 and first["activation"] == "tanh"
    assert first["error"] < 1e-6 and first["signed_perm_error"] < 1e-6 and first["signed_perm_neurons"] == 1.0
    assert first["fit"].signed_perm.tolist() == [1, 0, 3, 2, 4, 5]
    assert first["fit"].signs.tolist() == [1, 1, 1, 1, 1, -1]
    assert rows[("eq.pt2", "mirror-lr", 1)]["identity_error"] > 0.1        # the mirror does move the layer
    assert rows[("random.pt2", "mirror-lr", 1)]["signed_perm_error"] > 0.1
    assert rows[("eq.pt2", "mirror-ud", 1)]["signed_perm_error"] > 0.1      # built for left-right only
    with pytest.raises(JobError, match="perm-input:3 has no counterpart on its feature maps"):
        analyse_catalog(tmp_path / "catalog", None, ["perm-input:3"], samples=100)


def test_cnns_with_a_spec_are_analysed(tiny):
    report = analyse_catalog(tiny["catalog"], "zoo = 'cnn'", ["mirror-lr"], samples=400)
    layers = [r["layer"] for r in report.rows]
    assert layers == sorted(set(layers)) and len(layers) >= 2
    assert all(np.isfinite(r["error"]) and r["width"] > 0 for r in report.rows)


def test_cli_end_to_end(tiny):
    catalog = str(tiny["catalog"])
    res = CliRunner().invoke(jobs_cli, ["layer-equivariance", "--catalog", catalog, "--where", "zoo = 'eq'",
                                        "--transform", "mirror-lr", "--transform", "perm-input:2",
                                        "--samples", "1000"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert "(64 rows)" in res.output                     # 8 models x 2 transforms x 4 layers
    assert any(line.startswith("summary: median over models") for line in lines)
    assert any(line.startswith("tanh") and "mirror-lr" in line for line in lines)
    res = CliRunner().invoke(pipeline_cli, ["sql", "--catalog", catalog, "--format", "csv",
                                            "SELECT transform, count(*) AS n FROM layer_equivariance "
                                            "JOIN models USING (model_id) GROUP BY 1 ORDER BY 1"])
    assert res.exit_code == 0 and "mirror-lr" in res.output and "perm-input:2" in res.output
    bad = CliRunner().invoke(jobs_cli, ["layer-equivariance", "--catalog", catalog, "--transform", "rotate"])
    assert bad.exit_code == 1 and "unknown transform 'rotate'" in bad.output and "Traceback" not in bad.output
    bad = CliRunner().invoke(jobs_cli, ["layer-equivariance", "--catalog", catalog, "--where", "zoo = 'cnn'",
                                        "--transform", "perm-input", "--samples", "100"])
    assert bad.exit_code == 1 and "has no counterpart on its feature maps" in bad.output
    assert "Traceback" not in bad.output


def test_sync_shows_the_newest_errors_on_both_backends(tiny, store_factory):
    catalog = tiny["catalog"]
    report = analyse_catalog(catalog, "zoo = 'eq' AND activation = 'tanh'", ["perm-input:5"], samples=1000)
    store = store_factory(catalog=tiny["root"] / f"store-{store_factory.backend}")
    try:
        sync_store(catalog, store)
        res = store.run("MATCH (m:Model) WHERE m.equivariance_perm_input_5_f4 IS NOT NULL "
                        "RETURN m.model_id, m.equivariance_perm_input_5_f4, m.equivariance_perm_input_5_f4_run")
    finally:
        store.close()
    assert {r[0]: (r[1], r[2]) for r in res.rows} == {
        r["model_id"]: (pytest.approx(r["error"]), report.analysis_id) for r in report.rows if r["layer"] == 4}
