"""A kept torch.export program holds only what the conversion needs, and each model runs its own.

Real models are exported and saved with ``torch.export.save``; the hostile archives are those
archives with their serialized graph rewritten (dead nodes that read only constants, a sparse
tensor whose index is 1e9 made dense: an out-of-bounds heap write when run). The reader refuses
them by name at ingest and again before a stored program runs; legitimate archives and the
programs kept from ordinary modules still ingest and run; and one zoo's program never becomes
another zoo's network.
"""
from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import zipfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn
from torch._export.serde.schema import Argument

from graphstore import duck
from jobs.analysis.catalog_models import load_model
from pipeline.checkpoints import load_exported
from pipeline.ingest import ingest_zoo
from pipeline.neural_graph.plan import exported_plan
from pipeline.neural_graph.program_policy import allowed_target, check_serialized
from pipeline.neural_graph.runnable import CONSTANT, Network, keep_program, program_from_catalog
from zoocore.errors import CheckpointError, JobError

PROGRAM = "serialized_exported_program.json"
ATEN = "torch.ops.aten."
SPARSE = ATEN + "_sparse_coo_tensor_with_dims_and_tensors.default"


# ------------------------------------------------------------------ real models and their archives
def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()


def cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Flatten(), nn.Linear(64, 3)).eval()
    net[1].running_mean.normal_()
    net[1].running_var.uniform_(0.5, 2.0)
    return net


SHAPES = {"mlp": (2, 4), "cnn": (2, 1, 8, 8)}
MAKERS = {"mlp": mlp, "cnn": cnn}


def save(net: nn.Module, shape, path: Path) -> Path:
    torch.export.save(torch.export.export(net, (torch.zeros(*shape),)), str(path))
    return path


def rewrite(src: Path, dst: Path, edit) -> Path:
    """``src`` with its serialized graph passed through ``edit`` (every other member as it was)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for name in zin.namelist():
            data = zin.read(name)
            if name == PROGRAM:
                program = json.loads(data)
                edit(program)
                data = json.dumps(program).encode()
            zout.writestr(name, data)
    return dst


# The serialized graph's format (torch._export.serde.schema): a node is {target, inputs: [{name,
# arg}], outputs: [arg], metadata}; an argument is a union with every field present, one not null.
FIELDS = [f.name for f in dataclasses.fields(Argument)]


def arg(**value) -> dict:
    return {f: value.get(f) for f in FIELDS}


def node(target: str, inputs: dict, output: str) -> dict:
    return {"target": ATEN + target, "inputs": [{"name": k, "arg": arg(**v)} for k, v in inputs.items()],
            "outputs": [arg(as_tensor={"name": output})], "metadata": {}}


def meta(sizes, dtype: int = 7, layout: int = 7) -> dict:
    strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
    return {"dtype": dtype, "sizes": [{"as_expr": None, "as_int": s} for s in sizes], "requires_grad": False,
            "device": {"type": "cpu", "index": None}, "strides": [{"as_expr": None, "as_int": s} for s in strides],
            "storage_offset": 0, "layout": layout}


def add_sparse_write(program: dict, index: int = 10**9) -> None:
    """Dead nodes reading only constants: full -> a sparse tensor of 4 elements whose one index is
    ``index`` (unchecked by this constructor) -> _to_dense, which writes element ``index``."""
    graph = program["graph_module"]["graph"]
    graph["nodes"] += [
        node("full.default", {"size": {"as_ints": [1, 1]}, "fill_value": {"as_int": index},
                              "dtype": {"as_scalar_type": 5}}, "evil_index"),
        node("full.default", {"size": {"as_ints": [1]}, "fill_value": {"as_float": 1.0}}, "evil_value"),
        node("_sparse_coo_tensor_with_dims_and_tensors.default",
             {"sparse_dim": {"as_int": 1}, "dense_dim": {"as_int": 0}, "size": {"as_ints": [4]},
              "indices": {"as_tensor": {"name": "evil_index"}}, "values": {"as_tensor": {"name": "evil_value"}},
              "layout": {"as_layout": 1}}, "evil_sparse"),
        node("_to_dense.default", {"self": {"as_tensor": {"name": "evil_sparse"}}}, "evil_dense")]
    graph["tensor_values"] |= {"evil_index": meta([1, 1], dtype=5), "evil_value": meta([1]),
                               "evil_sparse": meta([4], layout=1), "evil_dense": meta([4])}


def add_dead_chain(program: dict) -> None:
    """Dead nodes of allowed kinds only: full -> add, read by nothing."""
    graph = program["graph_module"]["graph"]
    graph["nodes"] += [node("full.default", {"size": {"as_ints": [2, 2]}, "fill_value": {"as_float": 1.0}}, "spare"),
                       node("add.Tensor", {"self": {"as_tensor": {"name": "spare"}},
                                           "other": {"as_tensor": {"name": "spare"}}}, "spare_sum")]
    graph["tensor_values"] |= {"spare": meta([2, 2]), "spare_sum": meta([2, 2])}


@pytest.fixture(scope="module")
def archives(tmp_path_factory):
    root = tmp_path_factory.mktemp("archives")
    return {kind: save(MAKERS[kind](), SHAPES[kind], root / f"{kind}.pt2") for kind in MAKERS}


# ------------------------------------------------------------------ (a) the reader refuses by name
@pytest.mark.slow          # a child process that crashes
def test_the_payload_is_live_when_torch_runs_the_graph(archives, tmp_path):
    """Without the reader's checks, running the archive's graph (as jobs run a kept program)
    kills the process: the refusals below guard a real write."""
    bad = rewrite(archives["mlp"], tmp_path / "bad.pt2", lambda p: add_sparse_write(p, index=2**45))
    child = ("import io, json, sys, zipfile, torch\n"
             "z = zipfile.ZipFile(sys.argv[1]); p = json.loads(z.read('serialized_exported_program.json'))\n"
             "for n in p['graph_module']['graph']['nodes']: n['metadata'] = {}   # torch 2.2 cannot read its own\n"
             "buf = io.BytesIO(); out = zipfile.ZipFile(buf, 'w')\n"
             "[out.writestr(n, json.dumps(p) if n.endswith('program.json') else z.read(n)) for n in z.namelist()]\n"
             "out.close(); ep = torch.export.load(io.BytesIO(buf.getvalue()))\n"
             "args = [torch.zeros(2, 4) if s.kind.name == 'USER_INPUT' else ep.state_dict[s.target]\n"
             "        for s in ep.graph_signature.input_specs]\n"
             "ep.graph_module(*args); print('survived')\n")
    run = subprocess.run([sys.executable, "-c", child, str(bad)], capture_output=True, text=True, timeout=120)
    assert run.returncode < 0 and "survived" not in run.stdout, (run.returncode, run.stderr[-400:])


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_dead_sparse_nodes_are_refused_by_name(archives, tmp_path, kind):
    bad = rewrite(archives[kind], tmp_path / "bad.pt2", add_sparse_write)
    with pytest.raises(CheckpointError) as refused:
        load_exported(bad)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{bad}: ")
    assert f"refused the graph call target {SPARSE!r}" in message


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_dead_nodes_of_allowed_kinds_are_refused_by_name(archives, tmp_path, kind):
    bad = rewrite(archives[kind], tmp_path / "dead.pt2", add_dead_chain)
    with pytest.raises(CheckpointError, match=rf"^{bad}: refused the graph node 'spare' "
                                              r"\(torch\.ops\.aten\.full\.default\): it is on no path"):
        load_exported(bad)


def test_ingest_refuses_the_archive_and_keeps_the_zoo(archives, tmp_path):
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    (zoo / "good.pt2").write_bytes(archives["cnn"].read_bytes())
    rewrite(archives["cnn"], zoo / "evil.pt2", add_sparse_write)
    report = ingest_zoo(zoo, tmp_path / "catalog", progress=False)
    assert report.added == 1
    [error] = report.errors
    assert error.source_path == "evil.pt2" and "_sparse_coo_tensor_with_dims_and_tensors" in error.message
    con = duck.connect(tmp_path / "catalog")
    assert con.execute("SELECT checkpoint FROM models").fetchall() == [("good.pt2",)]
    con.close()


class Padded(nn.Module):
    """A linear layer plus a table made in the graph: ``table`` elements from a factory, or a lifted
    constant of ``table`` elements."""

    def __init__(self, table: int, constant: bool):
        super().__init__()
        self.lin, self.table, self.constant = nn.Linear(4, 3), table, constant

    def forward(self, x):
        extra = torch.tensor([0.0] * self.table) if self.constant else torch.zeros(self.table)
        return self.lin(x) + extra.sum()


@pytest.mark.parametrize("constant, refusal", [
    (False, r"refused the graph node 'zeros' \(torch\.ops\.aten\.zeros\.default\): it makes 1000 elements, "
            r"more than the state's 15"),
    (True, r"refused a program whose tensor constants hold 1000 elements, more than its state's 15")])
def test_factories_and_constants_larger_than_the_state_are_refused(tmp_path, constant, refusal):
    path = save(Padded(1000, constant).eval(), (2, 4), tmp_path / "padded.pt2")
    with pytest.raises(CheckpointError, match=refusal):
        load_exported(path)
    small = save(Padded(3, constant).eval(), (2, 4), tmp_path / "small.pt2")
    assert load_exported(small) is not None            # a table no larger than the state is read


@pytest.mark.parametrize("target", [
    SPARSE, ATEN + "_to_dense.default", ATEN + "_to_sparse.default", ATEN + "sparse_coo_tensor.indices",
    ATEN + "_sparse_csr_tensor_unsafe.default", ATEN + "empty.memory_format", ATEN + "empty_strided.default",
    ATEN + "rand.default", ATEN + "randn.default", ATEN + "bernoulli.p", ATEN + "index_put.default",
    ATEN + "_unsafe_index_put.default", ATEN + "resize_.default", ATEN + "set_.source_Storage",
    ATEN + "add.out", ATEN + "add_.Tensor", ATEN + "from_file.default", ATEN + "save.default",
    "torch.ops.higher_order.cond", "builtins.eval"])
def test_operator_kinds_outside_the_conversion_are_refused(target):
    assert not allowed_target(target)


def test_every_operator_the_tracer_reads_is_allowed():
    from pipeline.neural_graph import attention_core, plan
    from pipeline.neural_graph.ops import TRACE_HANDLERS

    ops = (set(plan.STEP_HANDLERS) | set(TRACE_HANDLERS) | plan._PASSTHROUGH_OPS | attention_core.SDPA_OPS
           | attention_core.SOFTMAX_OPS | attention_core.MATMUL_OPS | attention_core.LINEAR_OPS)
    names = {ATEN + f"{op._schema.name.split('::')[1]}.{op._overloadname}" for op in ops}
    assert {n for n in names if not allowed_target(n)} == set()


# ------------------------------------------------------------------ (b) legitimate archives still ingest and run
@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_legitimate_archives_ingest_and_run(archives, tmp_path, kind):
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    (zoo / f"{kind}.pt2").write_bytes(archives[kind].read_bytes())
    assert ingest_zoo(zoo, tmp_path / "catalog", progress=False).added == 1
    con = duck.connect(tmp_path / "catalog")
    model = load_model(con, con.execute("SELECT model_id FROM models").fetchone()[0])
    con.close()
    x = torch.randn(5, *SHAPES[kind][1:])
    with torch.no_grad():
        torch.testing.assert_close(model.network()(x), MAKERS[kind]()(x), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ (c) programs kept from ordinary modules
class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.norm = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        return torch.relu(x + self.norm(self.conv(x)))


MODULES = {
    "mlp": (mlp, (2, 4)),
    "cnn_batch_norm": (cnn, (2, 1, 8, 8)),
    "residual": (lambda: nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), Residual(),
                                       nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)), (2, 1, 8, 8)),
    "group_norm_upsample": (lambda: nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.SiLU(),
                                                  nn.Upsample(scale_factor=2), nn.AvgPool2d(2), nn.Flatten(),
                                                  nn.Linear(256, 3)), (2, 1, 8, 8)),
    "layer_norm": (lambda: nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 3)), (2, 4)),
    "conv1d": (lambda: nn.Sequential(nn.Conv1d(2, 4, 3), nn.Tanh(), nn.MaxPool1d(2), nn.Flatten(),
                                     nn.Linear(12, 3)), (2, 2, 8)),
    "transformer_encoder": (lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), (2, 5, 8)),
}


def _kept_and_run(net: nn.Module, program: tuple, state: dict, x: torch.Tensor, want: torch.Tensor) -> None:
    check_serialized(json.loads(program[0]), "kept")                 # the ingest check passes
    exported = program_from_catalog(*program, state, "kept")          # and the one before running
    with torch.no_grad():
        torch.testing.assert_close(Network(exported, state)(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_programs_kept_from_ordinary_modules_hold_to_the_policy(name):
    make, shape = MODULES[name]
    torch.manual_seed(0)
    net = make().eval()
    x = torch.randn(*shape)
    plan, exported = exported_plan(net, x)
    with torch.no_grad():
        _kept_and_run(net, keep_program(exported, plan.state_keys), net.state_dict(), x, net(x))


@pytest.mark.slow          # builds and exports transformers models
@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_programs_kept_from_transformers_hold_to_the_policy(name):
    """Masks and position tables (arange, full, where, ...) are live and no larger than the state."""
    transformers = pytest.importorskip("transformers")
    from pipeline.formats.hf_folders import ModelOutput, example_input, traced_plan

    torch.manual_seed(0)
    if name == "bert":
        model = transformers.BertModel(transformers.BertConfig(
            vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=16, attn_implementation="eager"), add_pooling_layer=False)
    else:
        model = transformers.GPT2Model(transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2,
                                                               n_positions=16, use_cache=False))
    model.eval()
    index, _, program = traced_plan(model)
    x = example_input(model)
    with torch.no_grad():
        want = model(x, return_dict=False)[index]
    _kept_and_run(model, program, ModelOutput(model, index).state_dict(), x, want)


# ------------------------------------------------------------------ the check again before a stored program runs
def test_network_refuses_a_program_with_a_dead_node():
    net = mlp()
    exported = torch.export.export(net, (torch.zeros(2, 4),))
    output = next(n for n in exported.graph.nodes if n.op == "output")
    with exported.graph.inserting_before(output):
        exported.graph.call_function(torch.ops.aten.full.default, ([3], 1.0))
    with pytest.raises(CheckpointError, match=r"^mine: refused the graph node 'full_default' \(torch\.ops\.aten\.full\."
                                              r"default\): it is on no path"):
        Network(exported, net.state_dict(), "mine")


def test_stored_constants_are_checked_as_they_are_not_as_declared():
    """The catalog's program tensors hold a constant larger than its graph declares: refused from
    the tensors themselves before it runs."""
    from safetensors.torch import load, save as save_tensors

    net = Padded(3, constant=True).eval()
    exported = torch.export.export(net, (torch.zeros(2, 4),))
    program_json, tensors = keep_program(exported, net.state_dict())
    [key] = load(tensors)
    assert key.startswith(CONSTANT)
    assert program_from_catalog(program_json, tensors, net.state_dict(), "catalog") is not None
    swollen = save_tensors({key: torch.zeros(100_000)})
    with pytest.raises(CheckpointError, match=r"^catalog: refused a program whose tensor constants hold 100000"):
        program_from_catalog(program_json, swollen, net.state_dict(), "catalog")


# ------------------------------------------------------------------ one zoo's program never another model's network
def ingest_one(tmp_path: Path, zoo: str, name: str, net: nn.Module) -> str:
    folder = tmp_path / "zoos" / zoo / name
    folder.mkdir(parents=True)
    save(net, (2, 4), folder / f"{name}.pt2")
    assert ingest_zoo(folder, tmp_path / "catalog", zoo_name=zoo, progress=False).added == 1
    con = duck.connect(tmp_path / "catalog")
    (model_id,) = con.execute("SELECT model_id FROM models WHERE checkpoint = ?", [f"{name}.pt2"]).fetchone()
    con.close()
    return model_id


def rewrite_rows(catalog: Path, model_id: str, **values) -> None:
    """Set columns of the architectures rows in ``model_id``'s part, as an older version (or a
    later part of one ingest, which keeps no program) would have written them."""
    for models in (catalog / "parts").glob("*/models.parquet"):
        if model_id not in pq.read_table(models, columns=["model_id"])["model_id"].to_pylist():
            continue
        path = models.with_name("architectures.parquet")
        table = pq.read_table(path)
        for name, value in values.items():
            f = table.schema.field(name)
            table = table.set_column(table.schema.get_field_index(name), f, pa.array([value] * len(table), f.type))
        pq.write_table(table, path)


def program_of(catalog: Path, model_id: str) -> tuple:
    con = duck.connect(catalog)
    try:
        return load_model(con, model_id)
    finally:
        con.close()


def hostile(program_json: str) -> str:
    program = json.loads(program_json)
    add_sparse_write(program)
    return json.dumps(program)


def test_a_hostile_program_in_one_zoo_is_not_another_zoos_network(tmp_path):
    catalog = tmp_path / "catalog"
    good = ingest_one(tmp_path, "good", "a", mlp(1))
    evil = ingest_one(tmp_path, "evil", "b", mlp(2))
    own = program_of(catalog, good).program
    rewrite_rows(catalog, evil, program_json=hostile(own[0]))          # an older catalog kept it
    x = torch.randn(5, 4)
    with torch.no_grad():
        model = program_of(catalog, good)
        assert model.program == own
        torch.testing.assert_close(model.network()(x), mlp(1)(x))
    with pytest.raises(CheckpointError, match=r"^model [0-9a-f]+: refused the graph call target "
                                              r"'torch\.ops\.aten\._sparse_coo_tensor_with_dims_and_tensors"):
        program_of(catalog, evil).network()


def test_a_zoo_without_a_program_never_borrows_another_zoos(tmp_path):
    catalog = tmp_path / "catalog"
    old = ingest_one(tmp_path, "old", "a", mlp(1))
    ingest_one(tmp_path, "other", "b", mlp(2))
    rewrite_rows(catalog, old, program_json=None, program_tensors=None)   # ingested before programs were kept
    model = program_of(catalog, old)
    assert model.program == (None, None)
    with pytest.raises(JobError, match="its zoo kept no program of its architecture"):
        model.network()


def test_a_part_without_a_program_takes_its_own_zoos_when_they_agree(tmp_path):
    catalog = tmp_path / "catalog"
    first = ingest_one(tmp_path, "zoo", "a", mlp(1))
    second = ingest_one(tmp_path, "zoo", "b", mlp(2))
    kept = program_of(catalog, first).program
    rewrite_rows(catalog, second, program_json=None, program_tensors=None)
    x = torch.randn(5, 4)
    with torch.no_grad():
        model = program_of(catalog, second)
        assert model.program == kept
        torch.testing.assert_close(model.network()(x), mlp(2)(x))
    third = ingest_one(tmp_path, "zoo", "c", mlp(3))
    rewrite_rows(catalog, third, program_json=json.dumps(json.loads(kept[0]), indent=1))   # another program
    with pytest.raises(JobError, match=r"its zoo 'zoo' keeps 2 different programs of architecture"):
        program_of(catalog, second)
    assert program_of(catalog, third).program[0] != kept[0]            # a part with its own keeps it
