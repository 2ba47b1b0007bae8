"""INR editing (jobs.editing): targets, the exact widening of OCE, equivariance of the edit, and the
``jobs train-editor`` command end to end on a small real SIREN zoo, catalog and Ladybug store."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from graphstore import duck
from graphstore.catalog import Catalog
from jobs.cli import main as jobs_cli
from jobs.editing.siren import MLPLayout, mlp_forward, permute_params, pixel_grid, widen, widened_spec
from jobs.editing.targets import digit_images, transform_images
from jobs.config import EditConfig
from jobs.editing.data import EditData, load_edit_data
from jobs.editing.train import average_function, edited_members, edited_state_dict, graph_editor, load_editor
from pipeline.checkpoints import load_state_dict, read_sidecar
from pipeline.neural_graph.convert import convert_checkpoint
from pipeline.spec import build_module
from pipeline.zoo.kinds import INR_SPEC
from zoocore.errors import JobError

INR_ZOO_SIZE = 24
SIZES = (2, 16, 16, 1)
ACTS = ("sin", "sin", "identity")


@pytest.fixture(scope="module")
def inr_zoo(tmp_path_factory):
    from pipeline.zoo.make import make_zoo

    out = tmp_path_factory.mktemp("zoo") / "inr"
    make_zoo("inr", out, n=INR_ZOO_SIZE, seed=11, workers=2, progress=False)
    return out


@pytest.fixture(scope="module")
def inr_graphs(inr_zoo):
    paths = sorted(inr_zoo.glob("*.safetensors"))
    meta = [read_sidecar(p)["metadata"] for p in paths]
    return [p.stem for p in paths], [convert_checkpoint(p).graph for p in paths], [m["image_index"] for m in meta]


def _members(k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(k, SIZES[i + 1], SIZES[i], generator=g), torch.randn(k, SIZES[i + 1], generator=g))
            for i in range(len(SIZES) - 1)]


@pytest.mark.parametrize("k", [1, 2, 5])
def test_widened_network_is_the_average_of_its_members(k):
    members = _members(k, seed=k)
    coords = torch.rand(50, 2) * 2 - 1
    avg = average_function([(w.unsqueeze(0), b.unsqueeze(0)) for w, b in members], coords, ACTS)[0]
    wide = widen(members)
    assert [w.shape for w, _ in wide] == [(16 * k, 2), (16 * k, 16 * k), (1, 16 * k)]
    direct = mlp_forward([(w.unsqueeze(0), b.unsqueeze(0)) for w, b in wide], coords, ACTS)[0, :, 0]
    assert torch.allclose(direct, avg, atol=1e-5)
    net = build_module(widened_spec(INR_SPEC, k))        # the written architecture runs it too
    net.load_state_dict({f"layers.{2 * i}.{n}": t for i, (w, b) in enumerate(wide) for n, t in (("weight", w), ("bias", b))})
    with torch.no_grad():
        assert torch.allclose(net(coords)[:, 0], avg, atol=1e-5)
    one = mlp_forward([(w[:1], b[:1]) for w, b in members], coords, ACTS)[0, :, 0]
    assert not torch.allclose(one, avg, atol=1e-3) or k == 1   # the average is not just member 0


def test_targets_transform_the_digit():
    dot = np.zeros((1, 8, 8), np.float32)
    dot[0, 4, 4] = 1.0
    dilated = transform_images(dot, "dilate")[0]
    assert dilated.sum() == 9 and dilated[3:6, 3:6].min() == 1.0
    digits = digit_images([0, 5, 17])
    assert (transform_images(digits, "dilate") >= digits).all()
    blurred = transform_images(digits, "blur")
    assert blurred.max() < digits.max() and abs(blurred.mean() - digits.mean()) < 0.02
    contrast = transform_images(digits, "contrast")
    assert contrast.min() >= 0 and contrast.max() <= 1 and contrast.std() > digits.std()
    with pytest.raises(JobError, match="unknown edit"):
        transform_images(digits, "rotate")


def test_pixel_grid_is_the_grid_the_zoo_fitted(inr_zoo, inr_graphs):
    """The functional forward on ``pixel_grid`` against the original digit gives the zoo's own MSE:
    grid order, image order and weights agree with ``pipeline zoo make inr``."""
    names, graphs, images = inr_graphs
    data = EditData.from_graphs(names, graphs, ["train"] * len(names), images, "dilate")
    pred = mlp_forward(data.params, pixel_grid(), data.layout.activations)[..., 0]
    orig = torch.from_numpy(digit_images(images).reshape(len(images), -1))
    mse = ((pred - orig) ** 2).mean(-1)
    with open(inr_zoo / "metrics.csv") as fh:
        recorded = {r["checkpoint"]: float(r["mse"]) for r in csv.DictReader(fh)}
    assert np.allclose(mse.numpy(), [recorded[n + ".safetensors"] for n in names], rtol=1e-4, atol=1e-6)


def _hidden_perm(graph, rng):
    perm = np.arange(graph.num_nodes)
    for layer in (1, 2):
        idx = np.nonzero(graph.node_layer == layer)[0]
        perm[idx] = rng.permutation(idx)
    return perm


@pytest.mark.parametrize("model,k", [("ngnn", 1), ("ngnn", 3), ("ngt", 3)])
def test_editing_a_permuted_inr_gives_the_permuted_edit(inr_graphs, model, k):
    names, graphs, images = inr_graphs
    names, graphs, images = names[:6], graphs[:6], images[:6]
    rng = np.random.default_rng(0)
    perms = [_hidden_perm(g, rng) for g in graphs]
    splits = ["train"] * len(names)
    data = EditData.from_graphs(names, graphs, splits, images, "dilate")
    moved = EditData.from_graphs(names, [g.permuted(p) for g, p in zip(graphs, perms)], splits, images, "dilate",
                                 stats=data.stats, etypes=data.etypes)
    torch.manual_seed(0)
    editor = graph_editor(data, EditConfig(model=model, hidden=16, edge_hidden=8), k).eval()
    with torch.no_grad():                              # heads at full scale: an edit far from zero
        editor.edge_head[-1].weight.mul_(10.0)
        editor.node_head[-1].weight.mul_(10.0)
    idx = np.arange(len(names))
    with torch.no_grad():
        a = edited_members(editor, data, idx, torch.device("cpu"))
        b = edited_members(editor, moved, idx, torch.device("cpu"))
    for i, perm in enumerate(perms):
        offsets = graphs[i].layer_offsets()
        layer_perms = [perm[offsets[layer]:offsets[layer] + 16] - offsets[layer] for layer in (1, 2)]
        for j in range(k):
            mine = [(w[i:i + 1, j], bb[i:i + 1, j]) for w, bb in a]
            theirs = [(w[i:i + 1, j], bb[i:i + 1, j]) for w, bb in b]
            expected = permute_params(mine, layer_perms)
            for (we, be), (wt, bt), (w0, _) in zip(expected, theirs, mine):
                scale = float(w0.abs().max())
                assert torch.allclose(we, wt, atol=1e-5 * scale, rtol=1e-4)
                assert torch.allclose(be, bt, atol=1e-5 * scale, rtol=1e-4)
        changed = [float((w[i] - data.params[li][0][i]).abs().max()) for li, (w, _) in enumerate(a)]
        assert max(changed) > 1e-3                     # a real edit, not the identity


def test_editor_refuses_models_that_are_not_plain_mlps(catalog_dir):
    from pipeline.graph_codec import read_graphs, read_plans

    con = duck.connect(catalog_dir)
    mid = con.execute("SELECT model_id FROM models WHERE zoo = 'cnn' LIMIT 1").fetchone()[0]
    _, plans = read_plans(con, [mid])
    graph, = read_graphs(con, [mid], plans=plans)
    con.close()
    with pytest.raises(JobError, match="plain MLPs"):
        MLPLayout.of_graph(graph)


@pytest.fixture(scope="module")
def inr_catalog(tmp_path_factory, inr_zoo):
    from graphstore.metadata import open_store
    from pipeline.ingest import ingest_zoo

    root = tmp_path_factory.mktemp("catalog") / "catalog"
    store = open_store(root, use_env=False)
    try:
        report = ingest_zoo(inr_zoo, root, store=store, progress=False)
    finally:
        store.close()
    assert report.ok and report.added == INR_ZOO_SIZE
    return root


@pytest.mark.slow
def test_train_editor_compares_methods_and_writes_reloadable_edits(inr_catalog, tmp_path, monkeypatch):
    from graphstore.metadata import open_store

    monkeypatch.delenv("NEO4J_URI", raising=False)
    out = tmp_path / "edited"
    res = CliRunner().invoke(jobs_cli, ["train-editor", "--catalog", str(inr_catalog), "--edit", "dilate",
                                        "--oce", "2", "--steps", "40", "--hidden", "16", "--out", str(out)])
    assert res.exit_code == 0, res.output
    rows = {line.split()[0]: line.split() for line in res.output.splitlines() if line.startswith("  ")}
    assert {"identity", "nfn", "ngnn", "ngnn-oce2"} <= set(rows), res.output
    assert "OCE vs K=1" in res.output
    mse = {m: float(rows[m][1]) for m in ("identity", "ngnn", "ngnn-oce2")}
    assert mse["ngnn"] < mse["identity"] and mse["ngnn-oce2"] < mse["identity"], res.output

    con = duck.connect(inr_catalog)
    edited = con.execute("SELECT model_id, edited_from, edit, edit_run, checkpoint, mse FROM models "
                         "WHERE edited_from IS NOT NULL ORDER BY model_id").fetchall()
    run_id, task, metrics = con.execute("SELECT run_id, task, metrics_json FROM runs").fetchone()
    originals = con.execute("SELECT count(*) FROM models WHERE edited_from IS NULL").fetchone()[0]
    con.close()
    assert len(edited) == INR_ZOO_SIZE == originals
    assert {r[2] for r in edited} == {"dilate"} and {r[3] for r in edited} == {run_id} and task == "edit"
    assert set(json.loads(metrics)) == {"identity", "nfn", "ngnn", "ngnn-oce2"}

    store = open_store(inr_catalog, use_env=False, read_only=True)
    try:
        found = store.run("MATCH (m:Model) WHERE m.edited_from IS NOT NULL RETURN m.edited_from, m.edit_run").rows
    finally:
        store.close()
    assert sorted(r[0] for r in found) == sorted(r[1] for r in edited) and {r[1] for r in found} == {run_id}

    # the written checkpoints are the editor's output, and reload to the same function
    editor, meta = load_editor(inr_catalog, run_id)
    assert meta["members"] == 2
    data = load_edit_data(Catalog(inr_catalog), EditConfig(edit="dilate"))
    coords = pixel_grid()
    by_original = {r[1]: r for r in edited}
    with torch.no_grad():          # the batch the command wrote (all models, in order): the same sums
        members = edited_members(editor, data, np.arange(len(data.model_ids)), torch.device("cpu"))
        functions = average_function(members, coords, data.layout.activations)
    for i in range(0, len(data.model_ids), 7):
        _, _, _, _, checkpoint, recorded_mse = by_original[data.model_ids[i]]
        path = out / checkpoint
        side = read_sidecar(path)
        assert side["metadata"]["edited_from"] == data.model_ids[i] and side["metadata"]["oce"] == 2
        state = load_state_dict(path)
        expected = edited_state_dict(data.graphs[i], data.layout, [(w[i], b[i]) for w, b in members])
        want = functions[i]
        with torch.no_grad():
            net = build_module(side["architecture"])
            net.load_state_dict(state)
            got = net(coords)[:, 0]
        assert all(torch.equal(state[key], expected[key]) for key in expected)
        assert torch.allclose(got, want, atol=1e-5)
        target = data.targets[i]
        assert abs(float(((got - target) ** 2).mean()) - recorded_mse) < 1e-5


def test_digits_upsampled_to_28_are_the_8x8_digits_made_finer():
    """The 28x28 grid (the MNIST INR benchmarks' size) is made from scikit-learn's 8x8 digits by
    bicubic upsampling: same range, the same digit at the same place, sharper than a block copy."""
    from pipeline.datasets import digit_images as all_digits

    small, big = all_digits(8), all_digits(28)
    assert big.shape == (len(small), 28, 28) and big.min() >= 0 and big.max() <= 1
    # averaged back over 3.5-pixel cells (7x7 blocks of 2x2 cells), the big digits are the small ones, roughly
    back = big.reshape(len(big), 14, 2, 14, 2).mean((2, 4))[:, ::7 // 4 + 1][:, :, ::2][:, :7, :7]
    assert np.corrcoef(back[:200].ravel(), small[:200, :7, :7].ravel())[0, 1] > 0.7
    assert np.abs(np.diff(big, axis=2)).max() < np.abs(np.diff(small, axis=2)).max()
    with pytest.raises(ValueError, match="8 to 128 pixels"):
        all_digits(4)
    assert digit_images([3], side=28).shape == (1, 28, 28)


def test_an_inr_zoo_at_side_28_is_fitted_edited_and_written_back_with_its_lineage(tmp_path, monkeypatch):
    """`pipeline zoo make inr --set side=28`: 2x32 SIRENs on upsampled digits, the grid recorded per
    model; `jobs train-editor` reads it, edits on the 28x28 grid, and its edited INRs invert exactly and
    ingest with their lineage."""
    from pipeline.cli import main as pipeline_cli
    from pipeline.ingest import ingest_zoo
    from pipeline.neural_graph.build import state_dict_from_graph
    from pipeline.zoo.kinds import recipe_settings

    monkeypatch.delenv("NEO4J_URI", raising=False)
    zoo, n = tmp_path / "inr28", 24     # the split is by a hash of the weights: 10 INRs left none for validation once
    res = CliRunner().invoke(pipeline_cli, ["zoo", "make", "inr", str(zoo), "--n", str(n), "--seed", "4",
                                            "--workers", "1", "--set", "side=28", "--set", "steps=150"])
    assert res.exit_code == 0, res.output
    paths = sorted(zoo.glob("*.safetensors"))
    meta = [read_sidecar(p)["metadata"] for p in paths]
    assert {m["side"] for m in meta} == {28} and {m["width"] for m in meta} == {32}
    graph = convert_checkpoint(paths[0]).graph
    assert MLPLayout.of_graph(graph).sizes == (2, 32, 32, 1)
    assert ingest_zoo(zoo, tmp_path / "cat", progress=False).ok
    data = load_edit_data(Catalog(tmp_path / "cat"), EditConfig(edit="dilate"))
    assert data.side == 28 and data.targets.shape == (n, 784)
    # the functional forward on the 28x28 grid against the upsampled digit gives the zoo's own MSE
    pred = mlp_forward(data.params, pixel_grid(28), data.layout.activations)[..., 0]
    orig = torch.from_numpy(digit_images(data.image_index, side=28).reshape(n, -1).copy())
    with open(zoo / "metrics.csv") as fh:
        recorded = {r["model_id"] if "model_id" in r else r["checkpoint"]: float(r["mse"]) for r in csv.DictReader(fh)}
    con = duck.connect(tmp_path / "cat")
    ckpt = dict(con.execute("SELECT model_id, checkpoint FROM models").fetchall())
    con.close()
    np.testing.assert_allclose(((pred - orig) ** 2).mean(-1).numpy(), [recorded[ckpt[m]] for m in data.model_ids],
                               rtol=1e-4, atol=1e-6)
    out = tmp_path / "edited"
    res = CliRunner().invoke(jobs_cli, ["train-editor", "--catalog", str(tmp_path / "cat"), "--edit", "blur",
                                        "--no-baselines", "--oce", "2", "--steps", "5", "--hidden", "8",
                                        "--out", str(out)])
    assert res.exit_code == 0, res.output
    con = duck.connect(tmp_path / "cat")
    edited = con.execute("SELECT edited_from, side, checkpoint FROM models WHERE edited_from IS NOT NULL").fetchall()
    con.close()
    assert len(edited) == n and {r[1] for r in edited} == {28}
    state = load_state_dict(out / edited[0][2])
    again = convert_checkpoint(out / edited[0][2]).graph        # OCE K=2: written twice as wide, and exact
    assert MLPLayout.of_graph(again).sizes == (2, 64, 64, 1)
    back = state_dict_from_graph(again)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    with pytest.raises(Exception, match="side=4"):
        recipe_settings("inr", ["side=4"])
