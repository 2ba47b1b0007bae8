"""``pipeline ingest ZOO_DIR``: convert every checkpoint of a zoo once and append it to the catalog.

Rules kept here:
- ``model_id`` is a content hash of architecture and weights, so re-ingesting a zoo or a copied
  checkpoint adds nothing;
- models are committed in parts (one atomic rename each): a crash leaves no partial model, and a
  re-run finishes the job;
- a checkpoint that cannot be read or converted is recorded in ``ingest_errors`` with its reason
  and the rest of the zoo goes on;
- model attributes (metrics.csv, sidecars) keep one type per column for the whole catalog; a value
  that does not fit is recorded as null with a warning, or refuses the zoo before anything is
  written (pipeline.zoo_metadata);
- the graph store is reconciled with Parquet for every model of the zoo, so a re-run repairs a graph
  write that a crash or a held lock lost; when it cannot be, the report says what is missing;
- memory is bounded by the part size, not by the zoo size;
- converting one member has a time budget stated before it starts, from the bytes it stores
  (``member_budget``): a member that takes longer is recorded as failed and the zoo goes on.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import torch
from tqdm import tqdm

from graphstore import duck
from graphstore.catalog import Catalog, now_utc
from graphstore.column_types import established_types
from graphstore.schema import ARCHITECTURES, INGEST_ERRORS, LAYERS, MODEL_CORE
from pipeline.graph_codec import graph_tables
from pipeline.neural_graph.concat import in_size
from pipeline.formats import Member, ZooFormat, open_zoo
from pipeline.formats.base import stray_entries
from pipeline.formats.checkpoint_folder import CheckpointFolder
from pipeline.neural_graph.convert import PlanCache
from pipeline.neural_graph.graph import NeuralGraph
from pipeline.neural_graph.plan import Plan
from pipeline.workers import process_pool
from pipeline.zoo_metadata import ZooMetadata
from zoocore.errors import CheckpointError, ZooGraphError

# One member's conversion may take this long plus this much per stored megabyte: ResNet-50 (100 MB)
# converts in under a minute on this project's 2-core machine, so the budget is generous for real
# checkpoints and still ends a hostile one (an expression that never finishes evaluating) in minutes.
MEMBER_SECONDS, SECONDS_PER_MB = 120.0, 2.0


def member_budget(stored_bytes: int) -> float:
    """The seconds converting a member that stores ``stored_bytes`` may take."""
    return MEMBER_SECONDS + SECONDS_PER_MB * stored_bytes / 2 ** 20


@contextlib.contextmanager
def time_budget(seconds: float, what: str):
    """Raise CheckpointError in this thread when the block runs past ``seconds`` (SIGALRM: the main
    thread of a process only, which is where every conversion runs; elsewhere no budget)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def over(signum, frame):
        raise CheckpointError(f"{what}: converting it took more than its budget of {seconds:.0f} s; stopped")

    previous = signal.signal(signal.SIGALRM, over)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class ModelRecord:
    model_id: str
    source_path: str
    checkpoint: str
    plan: Plan
    spec: dict | None
    graph: NeuralGraph
    num_params: int
    metadata: dict[str, Any]                                    # verbatim (metadata_json)
    columns: dict[str, Any] = field(default_factory=dict)       # typed, by column name
    program: tuple[str | None, bytes | None] = (None, None)     # kept once per architecture and worker


@dataclass
class ErrorRecord:
    source_path: str
    error_type: str
    message: str


@dataclass
class IngestReport:
    zoo: str
    catalog: Path
    fmt: str = "checkpoints"
    seen: int = 0
    added: int = 0
    duplicates: int = 0
    errors: list[ErrorRecord] = field(default_factory=list)
    parts: int = 0
    seconds: float = 0.0
    store_warning: str | None = None
    warnings: list[str] = field(default_factory=list)
    model_ids: list[str] = field(default_factory=list)       # every model of the zoo in the catalog
    graph_repaired: int = 0                                  # models the graph store lacked and got

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def graph_behind(self) -> bool:
        """The graph store could not be brought up to date with Parquet for this zoo."""
        return self.store_warning is not None

    def summary(self) -> str:
        rate = self.seen / self.seconds if self.seconds else 0.0
        lines = [f"ingested zoo {self.zoo!r} ({self.fmt}) into {self.catalog}: {self.added} new models, "
                 f"{self.duplicates} already in the catalog, {len(self.errors)} failed "
                 f"({self.seen} checkpoints, {rate:.1f} models/s)"]
        for w in self.warnings[:20]:
            lines.append(f"  WARNING {w}")
        if len(self.warnings) > 20:
            lines.append(f"  ... and {len(self.warnings) - 20} more warnings")
        for err in self.errors[:20]:
            lines.append(f"  FAILED {err.source_path}: {err.error_type}: {err.message}")
        if len(self.errors) > 20:
            lines.append(f"  ... and {len(self.errors) - 20} more (see the ingest_errors relation)")
        if self.graph_repaired:
            lines.append(f"  graph store repaired: wrote {self.graph_repaired} models of this zoo that were in "
                         "Parquet but missing from the graph")
        if self.store_warning:
            lines.append(f"  graph store not updated: {self.store_warning}")
            lines.append(f"  the graph store may lack up to {len(self.model_ids)} models of zoo {self.zoo!r} that "
                         "are in the catalog: run `graphstore sync` (or this ingest again) once the store is "
                         "available")
        return "\n".join(lines)


# --------------------------------------------------------------------------- members
def shard_of(path: str | Path, shards: int) -> int:
    """The shard of a member, by the hash of its last path component (a checkpoint's file name)."""
    return int(hashlib.sha1(Path(str(path)).name.encode()).hexdigest(), 16) % shards


# --------------------------------------------------------------------------- conversion
def content_id(plan: Plan, state: dict[str, torch.Tensor], identity: str = "") -> str:
    """sha256 over the architecture signature and every state entry (name, dtype, shape, bytes),
    and the member's ``identity`` where its format gives one (pipeline.formats.base.Member)."""
    h = hashlib.sha256(plan.signature.encode())
    for key in sorted(state):
        t = state[key].detach().cpu().contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.float().numpy().tobytes())
    if identity:
        h.update(b"|identity|" + identity.encode())
    return h.hexdigest()[:32]


_CACHE: PlanCache | None = None
_OPEN: dict[tuple, ZooFormat] = {}       # a conversion worker's open zoos (open files, parsed layouts)
_KEPT: set[str] = set()                  # architectures whose program this process has returned


def convert_one(fmt: ZooFormat, member: Member, metadata: dict[str, Any] | None) -> ModelRecord | ErrorRecord:
    """Convert one member of a zoo; never raises for a bad member (returns an ErrorRecord).
    ``metadata``: its attributes, verbatim (pipeline.zoo_metadata)."""
    global _CACHE
    if _CACHE is None:
        _CACHE = PlanCache()
    try:
        with time_budget(member_budget(fmt.stored_bytes(member)), member.key):
            conv = fmt.convert(member, metadata or {}, _CACHE)
        params = sum(int(conv.state[k].numel()) for op in conv.plan.ops
                     for k in (op.get("weight_key"), op.get("bias_key")) if k)
        program = (None, None)
        if conv.program is not None and conv.plan.signature not in _KEPT:
            program = conv.program()
            _KEPT.add(conv.plan.signature)
        return ModelRecord(content_id(conv.plan, conv.state, member.identity), member.key, member.checkpoint,
                           conv.plan, conv.spec, conv.graph, params, dict(metadata or {}), program=program)
    except ZooGraphError as exc:
        return ErrorRecord(member.key, type(exc).__name__, str(exc))
    except Exception as exc:  # a checkpoint must never stop the zoo: record and go on
        return ErrorRecord(member.key, type(exc).__name__, (str(exc).splitlines() or [""])[0][:500])


def _convert_star(args):
    """In a worker of one ingest's pool: every job arrives with its own unpickled copy of the format,
    so the first copy is kept and reused (the pool, and so this cache, ends with the ingest)."""
    torch.set_num_threads(1)
    fmt, member, metadata = args
    return convert_one(_OPEN.setdefault(fmt.cache_key(), fmt), member, metadata)


# --------------------------------------------------------------------------- tables
def summarize_plan(plan: Plan) -> str:
    parts = []
    sizes = [layer.size for layer in plan.layers]
    for op in plan.ops:
        act = plan.layers[op.dst_layer].activation
        parts.append(op.describe(sizes) + ("" if act == "identity" else f" {act}"))
    return " | ".join(parts)


def models_schema(records: list[ModelRecord], types: dict[str, pa.DataType]) -> pa.Schema:
    """MODEL_CORE plus the metadata columns these records have, typed as decided for the catalog."""
    names = sorted({k for r in records for k in r.columns})
    return pa.schema(list(MODEL_CORE) + [pa.field(n, types.get(n, pa.string())) for n in names])


def tables_for(records: list[ModelRecord], zoo: str, types: dict[str, pa.DataType] | None = None
               ) -> dict[str, pa.Table]:
    """The Arrow tables of one part (a non-empty batch): models, architectures, layers, nodes, edges.
    ``types``: the metadata columns' types (pipeline.zoo_metadata); ``r.columns`` are typed by them."""
    ids = [r.model_id for r in records]
    at = now_utc()
    schema = models_schema(records, types or {})
    cols: dict[str, list] = {name: [] for name in schema.names}
    for r in records:
        g = r.graph
        core = {"model_id": r.model_id, "zoo": zoo, "source_path": r.source_path, "checkpoint": r.checkpoint,
                "architecture_id": r.plan.signature, "num_params": r.num_params, "num_nodes": g.num_nodes,
                "num_edges": g.num_edges, "kernel_h": g.kernel_shape[0], "kernel_w": g.kernel_shape[1],
                "buffers_json": json.dumps(g.buffers), "metadata_json": json.dumps(r.metadata, sort_keys=True,
                                                                                  default=str),
                "ingested_at": at}
        for f in schema:
            cols[f.name].append(core[f.name] if f.name in core else r.columns.get(f.name))
    models = pa.table(cols, schema=schema)

    archs: dict[str, ModelRecord] = {}
    for r in records:
        if r.plan.signature not in archs or (archs[r.plan.signature].program[0] is None and r.program[0]):
            archs[r.plan.signature] = r
    architectures = pa.table({
        "architecture_id": list(archs), "num_layers": [len(r.plan.layers) for r in archs.values()],
        "num_ops": [len(r.plan.ops) for r in archs.values()],
        "num_nodes": [r.graph.num_nodes for r in archs.values()],
        "num_edges": [r.graph.num_edges for r in archs.values()],
        "num_params": [r.num_params for r in archs.values()],
        "kernel_h": [r.plan.kernel_shape[0] for r in archs.values()],
        "kernel_w": [r.plan.kernel_shape[1] for r in archs.values()],
        "input_shape": [r.plan.input_shape for r in archs.values()],
        "summary": [summarize_plan(r.plan) for r in archs.values()],
        "plan_json": [r.plan.to_json() for r in archs.values()],
        "spec_json": [json.dumps(r.spec) if r.spec else None for r in archs.values()],
        "program_json": [r.program[0] for r in archs.values()],
        "program_tensors": [r.program[1] for r in archs.values()],
    }, schema=ARCHITECTURES)

    lrows: dict[str, list] = {name: [] for name in LAYERS.names}
    for r in records:
        sizes = [layer.size for layer in r.plan.layers]
        for i, op in enumerate(r.plan.ops):
            for k, v in (("model_id", r.model_id), ("layer", i), ("kind", op["kind"]), ("relation", op["relation"]),
                         ("src_layer", op["src_layer"]), ("dst_layer", op["dst_layer"]),
                         ("in_size", in_size(op, sizes)), ("out_size", sizes[op["dst_layer"]]),
                         ("weight_shape", op.get("weight_shape")), ("kernel_h", op["kernel"][0]),
                         ("kernel_w", op["kernel"][1]), ("groups", op.get("groups", 1)),
                         ("activation", r.plan.layers[op["dst_layer"]].activation), ("path", op.get("path")),
                         ("weight_key", op.get("weight_key"))):
                lrows[k].append(v)
    layers = pa.table(lrows, schema=LAYERS)

    return {"models": models, "architectures": architectures, "layers": layers,
            **graph_tables(ids, [r.graph for r in records])}


def error_table(errors: list[ErrorRecord], zoo: str) -> pa.Table:
    at = now_utc()
    return pa.table({"source_path": [e.source_path for e in errors], "zoo": [zoo] * len(errors),
                     "error_type": [e.error_type for e in errors], "message": [e.message for e in errors],
                     "failed_at": [at] * len(errors)}, schema=INGEST_ERRORS)


# --------------------------------------------------------------------------- the job
def _results(jobs: list[tuple], workers: int) -> Iterator[ModelRecord | ErrorRecord]:
    _KEPT.clear()           # each ingest keeps its architectures' programs (workers start from this copy)
    if workers <= 1:
        yield from (convert_one(*j) for j in jobs)
        return
    with process_pool(workers) as pool:
        yield from pool.map(_convert_star, jobs, chunksize=8)


def _read_zoo(zoo: ZooFormat, catalog: Catalog, shard: tuple[int, int], on_bad_value: str
              ) -> tuple[list[Member], list[Member], ZooMetadata]:
    """The zoo's members, this shard's, their metadata typed against the catalog, and the stray
    entries (formats.base.stray_entries) no member covers; raises ZooGraphError for everything a
    zoo is refused for before anything is written."""
    strays = stray_entries(zoo.zoo_dir) if getattr(zoo, "files", None) is None else []
    every = zoo.members()
    members = [m for m in every if shard_of(m.key, shard[1]) == shard[0]]
    meta = zoo.metadata(members, every, established_types(catalog), on_bad_value)
    return every, members, meta, [s for s in strays if not _covered(s[0], every) and shard_of(s[0], shard[1]) == shard[0]]


def _covered(key: str, members: list[Member]) -> bool:
    """Whether a stray entry is a member, in one, or holds one (that member's conversion refuses it)."""
    return any(key == m.key or key.startswith(m.key + "/") or m.key.startswith(key + "/") for m in members)


def _zoo(zoo_dir, fmt: str | None, files, options: dict[str, Any] | None) -> ZooFormat:
    given = {k: v for k, v in (options or {}).items() if v is not None}
    if files is not None:
        return CheckpointFolder(zoo_dir, files=files, **given)
    return open_zoo(zoo_dir, fmt, **given)


def check_zoo(zoo_dir: str | Path, catalog: str | Path | Catalog, shard: tuple[int, int] = (0, 1),
              on_bad_value: str = "null", fmt: str | None = None, options: dict[str, Any] | None = None) -> str:
    """Refuse (ZooGraphError) a zoo that ``ingest_zoo`` would refuse, touching nothing: the CLI
    checks before it opens the graph store, so a refused zoo leaves no empty store behind.
    Returns the zoo's format name."""
    zoo = _zoo(zoo_dir, fmt, None, options)
    _read_zoo(zoo, catalog if isinstance(catalog, Catalog) else Catalog(catalog), shard, on_bad_value)
    return zoo.name


def ingest_zoo(zoo_dir: str | Path, catalog: str | Path | Catalog = "catalog", *, workers: int = 1,
               zoo_name: str | None = None, store=None, shard: tuple[int, int] = (0, 1),
               part_edges: int = 2_000_000, part_models: int = 512, progress: bool = True,
               files: list[Path] | None = None, on_bad_value: str = "null", fmt: str | None = None,
               options: dict[str, Any] | None = None) -> IngestReport:
    """Ingest every checkpoint under ``zoo_dir`` into ``catalog``; see the module docstring.

    Args:
        store: an optional graph store (graphstore.metadata); architecture metadata is written to
            it after every committed part, and at the end every model of this run that the store
            lacks is written from Parquet. A store failure does not stop the Parquet work; it is
            reported in ``report.store_warning`` (``report.graph_behind``).
        shard: (i, n) ingests only the members whose file name (or key) hashes to shard i of n.
        files: ingest these checkpoints of ``zoo_dir`` only (default: every member of the zoo).
        fmt: the zoo's format (pipeline.formats; default: detected from the folder's files).
        options: the format's own options (e.g. ``{"steps": "all"}`` for the Small CNN Zoo).
        on_bad_value: ``"null"`` records a value that does not fit its column as null, with a
            warning; ``"refuse"`` raises ZooGraphError before anything is written.

    Raises ZooGraphError for a missing or empty zoo folder, an unreadable metrics.csv, or (with
    ``on_bad_value="refuse"``) a bad value, always before anything is written.
    """
    zoo_dir = Path(zoo_dir)
    catalog = catalog if isinstance(catalog, Catalog) else Catalog(catalog)
    source = _zoo(zoo_dir, fmt, files, options)
    every, members, meta, strays = _read_zoo(source, catalog, shard, on_bad_value)
    zoo = zoo_name or zoo_dir.resolve().name
    report = IngestReport(zoo, catalog.root, fmt=source.name)
    report.warnings.extend(meta.warnings)
    if not members:
        report.warnings.append(f"shard {shard[0]}/{shard[1]} holds none of the {len(every)} members")
    types = {name: d.type for name, d in meta.types.items()}
    catalog.clean_incomplete()
    started = time.perf_counter()
    con = duck.connect(catalog, ["models"])
    known = duck.model_ids(con)
    con.close()
    jobs = [(source, m, meta.raw.get(m.key)) for m in members]
    pending: list[ModelRecord] = []
    pending_errors: list[ErrorRecord] = []
    pending_edges = 0

    def write_graph(tables: dict[str, pa.Table]) -> None:
        if store is None or report.store_warning is not None:
            return
        try:
            store.write_models(tables["models"].to_pylist(), tables["architectures"].to_pylist(),
                               tables["layers"].to_pylist())
        except Exception as exc:  # the graph is rebuildable from Parquet: report, finish the Parquet work
            report.store_warning = _first_line(exc)

    def flush() -> None:
        nonlocal pending, pending_errors, pending_edges
        if not pending and not pending_errors:
            return
        tables = tables_for(pending, zoo, types) if pending else {}
        if pending_errors:
            tables["ingest_errors"] = error_table(pending_errors, zoo)
        catalog.commit_part(tables, catalog.new_part_id(f"{shard[0]}of{shard[1]}"))
        report.parts += 1
        if pending:
            write_graph(tables)
        pending, pending_errors, pending_edges = [], [], 0

    for key, message in strays:          # entries no format reads (a link out of the zoo): failures, not silence
        error = ErrorRecord(key, "CheckpointError", message)
        report.errors.append(error)
        pending_errors.append(error)
    bar = tqdm(total=len(jobs), desc=f"ingest {zoo}", unit="model", disable=not progress)
    for job, result in zip(jobs, _results(jobs, workers)):     # results come in job order
        report.seen += 1
        bar.update(1)
        if isinstance(result, ErrorRecord):
            report.errors.append(result)
            pending_errors.append(result)
            continue
        report.model_ids.append(result.model_id)
        if result.model_id in known:
            report.duplicates += 1
            continue
        known.add(result.model_id)
        result.columns = meta.columns.get(job[1].key, {})
        pending.append(result)
        report.added += 1
        pending_edges += result.graph.num_edges
        if pending_edges >= part_edges or len(pending) >= part_models:
            flush()
    flush()
    bar.close()
    if store is not None and report.model_ids:
        from graphstore.sync import reconcile_models

        try:      # models committed to Parquet whose graph write was lost (a crash, a held lock) are written now
            report.graph_repaired = reconcile_models(catalog, store, report.model_ids)
            report.store_warning = None
        except Exception as exc:
            report.store_warning = report.store_warning or _first_line(exc)
    report.seconds = time.perf_counter() - started
    return report


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
