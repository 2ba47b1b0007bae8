"""Selecting models with SQL, deterministic splits, per-layer statistics, and streaming DGL graphs.

``Selection`` is the set of models a job works on (``--where`` over the ``models`` view) with
their target and split. ``GraphStream`` streams nodes and edges of chunks of models out of
DuckDB as Arrow record batches, turns each model into a normalised DGL heterograph, and
prefetches chunks in background threads so the trainer does not wait; built graphs are kept in
a cache bounded in bytes, so later epochs read memory while the zoo fits and DuckDB when not.
"""
from __future__ import annotations

import dataclasses
import hashlib
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from graphstore.sql import run_readonly
from jobs.training.tasks import task_for_column, task_named
from pipeline.graph_codec import ids_table, read_graphs, read_plans
from pipeline.neural_graph.graph import NeuralGraph
from pipeline.neural_graph.heterograph import CanonicalEtype, build_heterograph, reframe, with_reverses
from pipeline.neural_graph.vocabulary import NODE_TYPES, RELATIONS
from zoocore.errors import JobError, QueryRefused, ZooGraphError

SPLITS = ("train", "val", "test")


def hash_unit(salt: str, model_id: str) -> float:
    """A number in [0, 1) fixed by ``model_id`` (and ``salt``): how every split here is drawn."""
    return int(hashlib.sha256((salt + model_id).encode()).hexdigest()[:12], 16) / float(16 ** 12)


def hash_split(model_id: str, fractions: tuple[float, float] = (0.7, 0.15)) -> str:
    """Deterministic split from the model_id: a model keeps its split across runs."""
    u = hash_unit("split:", model_id)
    return "train" if u < fractions[0] else "val" if u < fractions[0] + fractions[1] else "test"


def fold_split(model_id: str, folds: int, fold: int, val_fraction: float = 0.15) -> str:
    """Split of ``model_id`` in fold ``fold`` of a ``folds``-fold cross-validation: every model is a
    test model in exactly one fold; of the others, a fixed ``val_fraction`` (by another hash, the
    same in every fold) is validation, the rest training. Deterministic, like ``hash_split``."""
    if folds < 2 or not 0 <= fold < folds:
        raise JobError(f"--fold must be in 0..{folds - 1} of --folds {folds} (at least 2 folds)")
    if int(hash_unit("fold:", model_id) * folds) == fold:
        return "test"
    return "val" if hash_unit("val:", model_id) < val_fraction else "train"


@dataclass
class Selection:
    model_ids: list[str]
    targets: np.ndarray                  # float targets (regression) or class indices
    splits: np.ndarray                   # "train" | "val" | "test"
    architectures: list[str]
    task: str                            # regression | classification
    target: str
    classes: list[str] = field(default_factory=list)
    frame: tuple[int, int] = (1, 1)
    etypes: list[CanonicalEtype] = field(default_factory=list)

    def ids(self, split: str) -> list[str]:
        return [m for m, s in zip(self.model_ids, self.splits) if s == split]

    def mask(self, split: str) -> np.ndarray:
        return self.splits == split

    def with_training_models(self, n: int) -> "Selection":
        """The selection with only ``n`` of its training models (validation and test unchanged): the
        first ``n`` in the order of a hash of model_id, so that smaller sizes are subsets of larger
        ones (a learning curve adds models, it does not swap them)."""
        train = list(np.flatnonzero(self.mask("train")))
        if n >= len(train):
            return self
        order = sorted(train, key=lambda i: hashlib.sha256(f"train-size:{self.model_ids[i]}".encode()).digest())
        keep = np.ones(len(self.model_ids), bool)
        keep[order[n:]] = False
        rows = np.flatnonzero(keep)
        return dataclasses.replace(self, model_ids=[self.model_ids[i] for i in rows], targets=self.targets[rows],
                                   splits=self.splits[rows], architectures=[self.architectures[i] for i in rows])


def _columns(con) -> dict[str, str]:
    return {r[0]: r[1] for r in con.execute("DESCRIBE models").fetchall()}


def auxiliary_targets(con, sel: Selection, columns: Sequence[str]) -> np.ndarray:
    """``(models, len(columns))``: each numeric ``models`` column of ``columns`` for the training models
    of ``sel``, mapped through its ranks among them to a standard normal (``Phi^-1((rank - 0.5) / n)``,
    ties averaged), so that a column spread over decades (a learning rate) weighs like any other; NaN
    for every other model and every missing value. Names are checked against the catalog's columns."""
    from scipy.special import ndtri
    from scipy.stats import rankdata

    cols = _columns(con)
    for c in columns:
        if c not in cols:
            raise JobError(f"--aux-targets: models has no column {c!r}; columns: {', '.join(sorted(cols))}")
        if task_for_column(cols[c]) != "regression":
            raise JobError(f"--aux-targets: {c!r} is {cols[c]}, not a number")
        if c == sel.target:
            raise JobError(f"--aux-targets: {c!r} is the target itself")
    out = np.full((len(sel.model_ids), len(columns)), np.nan)
    if not columns:
        return out
    cur = con.cursor()
    ids_table(cur, sel.model_ids)
    picked = ", ".join(f'CAST("{c}" AS DOUBLE)' for c in columns)
    rows = {r[0]: r[1:] for r in cur.execute(f"SELECT model_id, {picked} FROM models JOIN _ids USING (model_id)"
                                             ).fetchall()}
    cur.close()
    train = np.flatnonzero(sel.mask("train"))
    for j in range(len(columns)):
        values = np.array([rows[sel.model_ids[i]][j] for i in train], dtype=float)
        ok = np.isfinite(values)
        if ok.sum() >= 2:
            out[train[ok], j] = ndtri((rankdata(values[ok]) - 0.5) / ok.sum())
    return out


def select_models(con, target: str | None, where: str | None = None, task: str = "auto",
                  split_column: str | None = None, classes: Sequence[str] | None = None,
                  require_target: bool = True, catalog=None, folds: tuple[int, int] | None = None) -> Selection:
    """Models matching ``where`` (a SQL condition over ``models``), with target and split.

    The ``where`` condition is the user's SQL: it runs under the sandbox of ``pipeline sql``
    (graphstore.sql: read-only, nothing outside ``catalog`` readable, time and memory limits),
    on a connection of its own; ``con`` (the job's connection) never sees it.

    Args:
        target: a models column; numeric -> regression, text/bool -> classification (``task=auto``).
        split_column: a column holding train/val/test; default: hash of model_id.
        classes: fixed class list (when applying a trained classifier); default: sorted values.
        require_target: drop models whose target is NULL (training); keep them (prediction).
        catalog: the catalog of ``con``; needed with ``where``.
        folds: ``(K, i)``: the split of fold i of a K-fold cross-validation (``fold_split``)
            instead of the default hash split; not with ``split_column``.
    """
    if folds is not None and split_column:
        raise JobError("choose either a split column or folds, not both")
    cols = _columns(con)
    if target is not None and target not in cols:
        raise JobError(f"models has no column {target!r}; columns: {', '.join(sorted(cols))}")
    if split_column and split_column not in cols:
        raise JobError(f"models has no split column {split_column!r}")
    conds = [f"({where})"] if where else []
    if target is not None and require_target:
        conds.append(f'"{target}" IS NOT NULL')
    tsel = f', "{target}" AS y' if target is not None else ", NULL AS y"
    ssel = f', "{split_column}" AS split' if split_column else ", NULL AS split"
    query = (f"SELECT model_id, architecture_id, kernel_h, kernel_w{tsel}{ssel} FROM models"
             + (" WHERE " + " AND ".join(conds) if conds else "") + " ORDER BY model_id")
    rows = _run_where(catalog, query, where) if where else con.execute(query).fetchall()
    if not rows:
        raise JobError(f"no models match --where {where!r}" + (f" with {target} set" if target else ""))
    ids = [r[0] for r in rows]
    if task == "auto":
        task = task_for_column(cols.get(target, "VARCHAR") if target else "DOUBLE")
    targets, class_list = task_named(task).read_targets([r[4] for r in rows], classes, target)
    if split_column:
        splits = np.array([str(r[5]) if r[5] is not None else hash_split(r[0]) for r in rows])
        bad = set(splits) - set(SPLITS)
        if bad:
            raise JobError(f"split column {split_column!r} has values {sorted(bad)}; use train/val/test")
    elif folds is not None:
        splits = np.array([fold_split(m, *folds) for m in ids])
    else:
        splits = np.array([hash_split(m) for m in ids])
    frame = (max(int(r[2]) for r in rows), max(int(r[3]) for r in rows))
    sel = Selection(ids, targets, splits, [r[1] for r in rows], task, target or "", class_list, frame)
    sel.etypes = edge_types(con, ids)
    return sel


def _run_where(catalog, query: str, where: str) -> list[tuple]:
    """The selection query with the user's condition, on a sandboxed connection."""
    if catalog is None:
        raise JobError("a --where condition runs sandboxed on the catalog: pass catalog= to select_models")
    try:
        table = run_readonly(catalog, query)
    except QueryRefused as exc:
        raise JobError(f"--where {where!r} is refused: {exc} (a condition may read the catalog's relations "
                       "only, like `pipeline sql`)") from exc
    except ZooGraphError as exc:
        raise JobError(f"cannot select models with --where {where!r}: {exc}") from exc
    return list(zip(*(col.to_pylist() for col in table.columns)))


def edge_types(con, ids: Sequence[str]) -> list[CanonicalEtype]:
    """Canonical edge types of the selected models, from layers x per-layer node types (cheap)."""
    cur = con.cursor()
    ids_table(cur, ids)
    rows = cur.execute(
        "WITH lt AS (SELECT DISTINCT n.model_id, n.layer, CAST(n.node_type AS VARCHAR) AS t FROM nodes n "
        "JOIN _ids USING (model_id)) "
        "SELECT DISTINCT s.t, l.relation, d.t FROM layers l JOIN _ids USING (model_id) "
        "JOIN lt s ON s.model_id = l.model_id AND s.layer = l.src_layer "
        "JOIN lt d ON d.model_id = l.model_id AND d.layer = l.dst_layer").fetchall()
    cur.close()
    return with_reverses((s, r, d) for s, r, d in rows)


@dataclass
class LayerStats:
    """One mean/std per layer, training split only: biases by neuron layer; weights by operation
    and relation (op 3 is batch norm in one architecture and a conv in another: two layers)."""

    bias_mean: np.ndarray            # (L,)
    bias_std: np.ndarray
    weight_mean: np.ndarray          # (ops, relations)
    weight_std: np.ndarray

    def to_dict(self) -> dict:
        return {k: getattr(self, k).tolist() for k in ("bias_mean", "bias_std", "weight_mean", "weight_std")}

    @classmethod
    def from_dict(cls, d: dict) -> "LayerStats":
        return cls(**{k: np.asarray(v, dtype=np.float64) for k, v in d.items()})

    def bias(self, layer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        i = np.minimum(layer, len(self.bias_mean) - 1)
        return self.bias_mean[i], self.bias_std[i]

    def weight(self, op: np.ndarray, relation: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        i = np.minimum(op, self.weight_mean.shape[0] - 1)
        return self.weight_mean[i, relation], self.weight_std[i, relation]


def _fill(rows, shape) -> tuple[np.ndarray, np.ndarray]:
    mean, std = np.zeros(shape), np.ones(shape)
    for *key, m, s in rows:
        mean[tuple(key)] = m or 0.0
        std[tuple(key)] = s if s and s > 1e-8 else 1.0
    return mean, std


def layer_stats(con, train_ids: Sequence[str]) -> LayerStats:
    """Zeros in edge vectors are the kernel frame's padding and are left out (a trained weight of
    exactly 0.0 is vanishingly rare)."""
    cur = con.cursor()
    ids_table(cur, train_ids)
    b = cur.execute("SELECT layer, avg(bias), stddev_pop(bias) FROM nodes JOIN _ids USING (model_id) "
                    "WHERE CAST(node_type AS VARCHAR) <> 'input' GROUP BY layer ORDER BY layer").fetchall()
    w = cur.execute("SELECT layer, CAST(relation AS VARCHAR), avg(x), stddev_pop(x) FROM (SELECT layer, relation, "
                    "unnest(weight) AS x FROM edges JOIN _ids USING (model_id)) WHERE x <> 0 "
                    "GROUP BY ALL ORDER BY 1, 2").fetchall()
    cur.close()
    bm, bs = _fill(b, (max([r[0] for r in b], default=0) + 1,))
    w = [(layer, RELATIONS.index(rel), m, sd) for layer, rel, m, sd in w]
    wm, ws = _fill(w, (max([r[0] for r in w], default=0) + 1, len(RELATIONS)))
    return LayerStats(bm, bs, wm, ws)


def layer_stats_of_graphs(graphs: Sequence[NeuralGraph]) -> LayerStats:
    """``layer_stats`` computed from in-memory graphs (e.g. canonicalised ones) instead of the catalog:
    the same groups (biases by neuron layer without input nodes, non-zero weight values by operation
    and relation), the same population standard deviations."""
    bias: dict[int, list] = {}
    weight: dict[tuple[int, int], list] = {}
    inp = NODE_TYPES.index("input")
    for g in graphs:
        keep = g.node_type != inp
        for layer in np.unique(g.node_layer[keep]):
            bias.setdefault(int(layer), []).append(g.bias[keep & (g.node_layer == layer)].astype(np.float64))
        for op, rel in {(int(o), int(r)) for o, r in zip(g.edge_op, g.relation)}:
            x = g.weight[(g.edge_op == op) & (g.relation == rel)].astype(np.float64).ravel()
            weight.setdefault((op, rel), []).append(x[x != 0])
    b = [(k, float(np.mean(v)), float(np.std(v))) for k, v in ((k, np.concatenate(v)) for k, v in bias.items())
         if len(v)]
    w = [(op, rel, float(np.mean(v)), float(np.std(v))) for (op, rel), v in
         ((k, np.concatenate(v)) for k, v in weight.items()) if len(v)]
    bm, bs = _fill(b, (max([r[0] for r in b], default=0) + 1,))
    wm, ws = _fill(w, (max([r[0] for r in w], default=0) + 1, len(RELATIONS)))
    return LayerStats(bm, bs, wm, ws)


def normalised_graph(graph: NeuralGraph, stats: LayerStats, frame: tuple[int, int],
                     etypes: Sequence[CanonicalEtype], raw: bool = False, model_id: str = "?",
                     probe: np.ndarray | None = None):
    """The metanetwork's input: ``graph`` as a DGL heterograph with per-layer normalised features
    (biases by neuron layer, weights by operation and relation, kernels reframed to ``frame``);
    ``raw`` also keeps the raw scalar weights and biases that probe features need (1x1 edges only);
    ``probe``: (N, P) per-node values on fixed probes (jobs.analysis.probing), node data ``probe``.
    A graph with a NaN or infinite value (a diverged checkpoint) is refused by name: one would turn
    every prediction of the run into NaN."""
    if not (np.isfinite(graph.weight).all() and np.isfinite(graph.bias).all()):
        raise JobError(f"model {model_id} has NaN or infinite weights (a diverged checkpoint?): leave it out, "
                       f"e.g. --where \"model_id <> '{model_id}'\"")
    bm, bs = stats.bias(graph.node_layer)
    bias = (graph.bias.astype(np.float64) - bm) / bs
    bias[graph.node_type == NODE_TYPES.index("input")] = 0.0
    w = reframe(graph.weight, graph.kernel_shape, frame)
    pad = w == 0
    wm, ws = stats.weight(graph.edge_op, graph.relation.astype(np.int64))
    w = (w - wm[:, None]) / ws[:, None]
    w[pad] = 0.0
    extra = {}
    if raw:
        if tuple(graph.kernel_shape) != (1, 1):
            raise JobError(f"model {model_id}: probe features need 1x1 edges (MLP / INR zoos), "
                           f"this graph has {graph.kernel_shape[0]}x{graph.kernel_shape[1]} kernels")
        extra = {"raw_bias": graph.bias.astype(np.float64), "raw_weight": graph.weight[:, 0]}
    return build_heterograph(graph.node_type, graph.node_layer.astype(np.int64),
                             graph.node_position.astype(np.int64), bias.astype(np.float32),
                             graph.node_activation_codes(), graph.src, graph.dst, graph.relation,
                             w.astype(np.float32), etypes, node_probe=probe, **extra)


# A cached DGL heterograph holds about 2.2x its tensors' bytes in resident memory (per-relation
# index structures, tensor objects, allocator rounding): measured as RSS growth over the tensor
# estimate for 1,936 graphs of a Small CNN Zoo catalog. The cache budget counts this, so that a
# 2 GB budget holds about 2 GB (it held 4.3 GB when only the tensors were counted).
CACHE_OVERHEAD = 2.2


def cache_size(graph: NeuralGraph) -> int:
    """Bytes a cached graph is expected to hold in memory (its tensors, times CACHE_OVERHEAD)."""
    return int((graph.weight.nbytes * 2 + graph.src.nbytes * 4 + graph.bias.nbytes * 16) * CACHE_OVERHEAD)


class GraphStream:
    """Batches of (model indices, DGL graphs) for a list of selected models.

    Args:
        con: DuckDB connection over the catalog (each worker uses its own cursor).
        selection, stats: what to load and how to normalise it.
        chunk: models per DuckDB query; workers: prefetching threads; cache_bytes: graph cache budget.
        prepare: a deterministic change of every graph made once, on reading (e.g. the scale
            canonicalisation): ``prepare(graph, steps)`` with the plan's traced steps.
        augment: a random function-preserving change made anew every time a graph is served
            (e.g. random rescalings): ``augment(graph, steps, rng)``; the model's n-th serving uses
            the generator seeded by (``seed``, model index, n), so runs repeat whatever the thread
            order. With ``augment`` the cache holds the raw graphs and normalises on every serving.
        probe: each graph's per-node values on fixed probes, ``probe(model_id, graph)`` (N, P), read
            from the graph as served (after preparation and augmentation), node data ``probe``.
    """

    def __init__(self, con, selection: Selection, stats: LayerStats, chunk: int = 1024, workers: int = 2,
                 prefetch: int = 4, cache_bytes: int = 2 << 30, raw: bool = False,
                 prepare: Callable[[NeuralGraph, list], NeuralGraph] | None = None,
                 augment: Callable[[NeuralGraph, list, np.random.Generator], NeuralGraph] | None = None,
                 seed: int = 0, probe: Callable[[str, NeuralGraph], np.ndarray] | None = None):
        self.con, self.sel, self.stats, self.raw, self.probe = con, selection, stats, raw, probe
        self.chunk, self.workers, self.prefetch = chunk, workers, prefetch
        self.cache_bytes = cache_bytes
        self.prepare, self.augment, self.seed = prepare, augment, seed
        self.side: np.ndarray | None = None     # per-model inputs beside the graph, by selection index (head statistics)
        self._cache: dict[int, object] = {}
        self._cached_bytes = 0
        self._served: dict[int, int] = {}
        self._lock = threading.Lock()
        self._plans: dict = {}
        self._arch: dict[str, str] = {}
        if prepare is not None or augment is not None:
            self._arch, plans = read_plans(con, selection.model_ids)
            self._plans.update(plans)

    def _steps(self, model_id: str) -> list:
        return self._plans[self._arch[model_id]].steps

    def _normalise(self, i: int, graph: NeuralGraph):
        mid = self.sel.model_ids[i]
        if self.augment is not None:
            with self._lock:
                n = self._served.get(i, 0)
                self._served[i] = n + 1
            graph = self.augment(graph, self._steps(mid), np.random.default_rng([self.seed, i, n]))
        return normalised_graph(graph, self.stats, self.sel.frame, self.sel.etypes, raw=self.raw, model_id=mid,
                                probe=None if self.probe is None else self.probe(mid, graph))

    def _build(self, indices: Sequence[int]) -> list:
        missing = [i for i in indices if i not in self._cache]
        built = {}
        if missing:
            ids = [self.sel.model_ids[i] for i in missing]
            for i, mid, graph in zip(missing, ids, read_graphs(self.con, ids, plans=self._plans)):
                if self.prepare is not None:
                    graph = self.prepare(graph, self._steps(mid))
                item = graph if self.augment is not None else self._normalise(i, graph)
                built[i] = item
                size = cache_size(graph)
                with self._lock:
                    if self._cached_bytes + size <= self.cache_bytes:
                        self._cache[i] = item
                        self._cached_bytes += size
        items = [self._cache[i] if i in self._cache else built[i] for i in indices]
        if self.augment is None:
            return items
        return [self._normalise(i, g) for i, g in zip(indices, items)]

    def batches(self, indices: Sequence[int], batch_size: int) -> Iterator[tuple[np.ndarray, list]]:
        """Yield (indices, graphs) batches in the order given (training shuffles and shards with
        ``jobs.training.distributed.shard``). Worker threads read ahead a chunk of consecutive
        batches (at least ``chunk`` models) per DuckDB query: a query's cost grows with the catalog
        (a batch's models are spread over every part), so one query per batch made a 30,000-model
        catalog stream at half the speed of a 3,000-model one."""
        idx = np.array(indices, dtype=np.int64)
        groups = [idx[i:i + batch_size] for i in range(0, len(idx), batch_size)]
        if not groups:
            return
        per_chunk = max(1, self.chunk // max(batch_size, 1))
        out: "queue.Queue" = queue.Queue(maxsize=max(self.prefetch, per_chunk))
        todo: "queue.Queue" = queue.Queue()
        for k in range(0, len(groups), per_chunk):
            todo.put(list(range(k, min(k + per_chunk, len(groups)))))
        results: dict[int, tuple] = {}
        stop = threading.Event()

        def put(item) -> bool:
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.2)
                    return True
                except queue.Full:
                    continue
            return False

        def work():
            while not stop.is_set():
                try:
                    ks = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    members = np.concatenate([groups[k] for k in ks]).tolist()
                    graphs = self._build(members)
                    items, at = [], 0
                    for k in ks:
                        items.append((k, groups[k], graphs[at:at + len(groups[k])], None))
                        at += len(groups[k])
                except Exception as exc:  # surfaced in the consumer
                    items = [(ks[0], groups[ks[0]], None, exc)]
                for item in items:
                    if not put(item):
                        return

        threads = [threading.Thread(target=work, daemon=True) for _ in range(max(1, self.workers))]
        for t in threads:
            t.start()
        try:
            for k in range(len(groups)):
                while k not in results:
                    kk, grp, graphs, exc = out.get()
                    if exc is not None:
                        raise exc
                    results[kk] = (grp, graphs)
                yield results.pop(k)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=5)


class GraphList:
    """In-memory graphs served like a GraphStream (``batches(indices, batch_size)``): for graphs that
    are not in the catalog, e.g. function-preserving rescalings of test models."""

    def __init__(self, graphs: Sequence[NeuralGraph], selection: Selection, stats: LayerStats, raw: bool = False,
                 probe: Callable[[str, NeuralGraph], np.ndarray] | None = None,
                 model_ids: Sequence[str] | None = None):
        self.graphs, self.sel, self.stats, self.raw, self.probe = list(graphs), selection, stats, raw, probe
        self.ids = list(selection.model_ids if model_ids is None else model_ids)   # whose graph each one is
        self.side: np.ndarray | None = None     # per-graph inputs beside the graph, by list index (head statistics)

    def batches(self, indices: Sequence[int], batch_size: int) -> Iterator[tuple[np.ndarray, list]]:
        idx = np.array(indices, dtype=np.int64)
        for start in range(0, len(idx), batch_size):
            grp = idx[start:start + batch_size]
            yield grp, [normalised_graph(self.graphs[i], self.stats, self.sel.frame, self.sel.etypes, raw=self.raw,
                                         probe=None if self.probe is None else
                                         self.probe(self.ids[i], self.graphs[i]))
                        for i in grp]

