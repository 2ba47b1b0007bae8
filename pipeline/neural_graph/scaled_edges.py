"""A neural graph held operation by operation while per-neuron factors are applied to it: the working
state of the scale canonicalisation and the balancing (``symmetry.canonical_scaling`` and
``symmetry.balanced_scaling``).

Those apply factors many times (once per class of tied layers, then once per sweep) and read
per-neuron norms in between. Done on a NeuralGraph, every application copies the whole graph and
every norm re-reads it. Here each operation's edges are found once (one stable grouping of
``edge_op``), and only the entries of their weight rows that can be non-zero are kept, as float32
columns: a 3x3 kernel in a ResNet's 7x7 frame keeps 9 of 49 entries. An application touches only
the operations next to the layers it rescales; the graph is written back once, at the end.

The results are bit for bit those of applying the factors to the whole graph each time (the
reference kept in tests/pipeline/test_symmetry.py):

- weights, biases and batch-norm statistics are rounded to float32 after every application, as the
  graph stores them, and multiplied in float64 by the same per-edge factors (an operation's own
  ``rescale`` hook computes them, or, for the default hook, the same ``s[dst] / s[src]`` fused with
  the rounding);
- an edge's coefficient sums are numpy's pairwise sums over the full padded row (``w.sum(1)``):
  ``row_sum_tree`` makes the same additions on the kept entries (the padding zeros are exact
  identities); each (frame, kept entries) pattern is checked once against numpy's own sum, and an
  operation whose pattern does not match keeps its full rows;
- per-neuron sums add the edges in the order ``np.add.at`` did (operations in order, edges in
  stored order within each), with ``np.bincount``, which also adds in input order from zero;
- the padding of a row is zeros whose sign flips with every negative factor: restored at the end
  from the sign changes of a kept entry (every ``rescale`` hook trusted with kept entries multiplies
  a row by one factor; an operation with another hook keeps its full rows).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from pipeline.neural_graph.graph import NeuralGraph
from pipeline.neural_graph.ops.base import Op, frame_offset
from pipeline.neural_graph.ops.gate import Gate
from pipeline.neural_graph.ops.norm import BatchNorm, LayerNorm
from pipeline.neural_graph.ops.residual import Residual

# floats of one column block worked on at once (squares and partial sums stay in cache)
BLOCK = 1 << 17

# ``rescale`` hooks that multiply each edge's row by one factor, or leave it alone
_ROW_FACTOR_HOOKS = {Op.rescale, BatchNorm.rescale, LayerNorm.rescale, Residual.rescale, Gate.rescale}


def op_edge_rows(graph: NeuralGraph) -> list[slice | np.ndarray]:
    """Each operation's edges in stored order (what ``np.flatnonzero(graph.edge_op == i)`` gives),
    from one stable sort of ``edge_op``: slices when the edges are stored operation by operation."""
    counts = np.bincount(graph.edge_op, minlength=len(graph.ops))
    ends = np.cumsum(counts)
    starts = ends - counts
    if (np.diff(graph.edge_op) >= 0).all():
        return [slice(int(a), int(b)) for a, b in zip(starts, ends)]
    order = np.argsort(graph.edge_op, kind="stable")
    return [order[a:b] for a, b in zip(starts, ends)]


# --------------------------------------------------------------------------- numpy's row sums, on kept entries

def _add(a, b):
    return b if a is None else a if b is None else (a, b)


def _pairwise(lo: int, n: int):
    """numpy's pairwise summation of positions ``lo .. lo + n - 1`` (``pairwise_sum`` in numpy's
    umath loops: below 8 terms in order, up to 128 in eight interleaved partial sums, beyond that
    halves) as a tree: an int is a position, a pair an addition, None nothing."""
    if n < 8:
        res = None
        for i in range(lo, lo + n):
            res = _add(res, i)
        return res
    if n <= 128:
        r = list(range(lo, lo + 8))
        i = 8
        while i < n - n % 8:
            r = [_add(r[j], lo + i + j) for j in range(8)]
            i += 8
        res = _add(_add(_add(r[0], r[1]), _add(r[2], r[3])), _add(_add(r[4], r[5]), _add(r[6], r[7])))
        for k in range(lo + i, lo + n):
            res = _add(res, k)
        return res
    half = n // 2
    half -= half % 8
    return _add(_pairwise(lo, half), _pairwise(lo + half, n - half))


def _restrict(tree, index: dict[int, int]):
    """The tree with positions outside ``index`` dropped (adding zero is exact) and the others renamed."""
    if tree is None:
        return None
    if isinstance(tree, int):
        return index.get(tree)
    return _add(_restrict(tree[0], index), _restrict(tree[1], index))


def evaluate(tree, leaves):
    """The sum ``tree`` describes over ``leaves`` (indexable by the tree's ints: arrays of one shape)."""
    if isinstance(tree, int):
        return leaves[tree]
    return np.add(evaluate(tree[0], leaves), evaluate(tree[1], leaves))


@lru_cache(maxsize=None)
def row_sum_tree(width: int, cols: tuple[int, ...]):
    """The additions numpy's ``w.sum(1)`` makes on C-contiguous float64 rows of ``width`` entries that
    are zero outside ``cols``, as a tree over indices into ``cols`` (equal results, signed zeros
    aside); None when numpy, checked on random rows, does not sum that way.

    Example: a 3x3 kernel centred in a 7x7 frame, ``row_sum_tree(49, (16, 17, 18, 23, 24, 25, 30,
    31, 32))`` is ``((((0, 4), 8), (1, 5)), 2), (6, (3, 7))``: numpy's eight partial sums take
    positions 16 + 24 + 32, 17 + 25, 18, 30 and 23 + 31, then add them pairwise.
    """
    tree = _restrict(_pairwise(0, width), {c: k for k, c in enumerate(cols)})
    rng = np.random.default_rng(0)
    kept = rng.standard_normal((len(cols), 256)) * 10.0 ** rng.uniform(-6, 6, (len(cols), 256))
    rows = np.zeros((256, width))
    rows[:, list(cols)] = kept.T
    return tree if tree is not None and np.array_equal(evaluate(tree, kept), rows.sum(1)) else None


def tree_program(tree) -> tuple[list[tuple[int, int]], int]:
    """``tree`` as in-place additions ``row[i] += row[j]`` over its leaves' rows (each leaf is used
    once, so a sum can live in its leftmost leaf's row), and the row that ends with the sum."""
    steps: list[tuple[int, int]] = []

    def walk(node) -> int:
        if isinstance(node, int):
            return node
        i, j = walk(node[0]), walk(node[1])
        steps.append((i, j))
        return i
    return steps, walk(tree)


def _kernel_columns(op, frame: tuple[int, int]) -> np.ndarray | None:
    """The frame entries an operation's kernel fills (centred, ``frame_offset``), if it fits."""
    kernel = list(getattr(op, "kernel", None) or [])
    if len(kernel) != 2 or kernel[0] > frame[0] or kernel[1] > frame[1]:
        return None
    top, left = frame_offset(kernel, frame)
    return ((top + np.arange(kernel[0]))[:, None] * frame[1] + left + np.arange(kernel[1])).ravel()


def _set_bits(rows: np.ndarray) -> np.ndarray:
    """Per column of float32 ``rows`` (E, width), the OR of its entries' bits (64 rows at a time)."""
    bits = rows.view(np.uint32)
    whole = len(bits) // 64 * 64
    out = np.bitwise_or.reduce(bits[whole:], axis=0)
    if whole:
        out |= np.bitwise_or.reduce(np.bitwise_or.reduce(bits[:whole].reshape(-1, 64 * rows.shape[1]), axis=0)
                                    .reshape(64, rows.shape[1]), axis=0)
    return out


def _kept_entries(full: np.ndarray, guess: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The columns of ``full`` (E, width) outside which every entry is zero, and those columns as a
    float32 (k, E) array; one pass over ``full``, block by block, when the columns are ``guess``."""
    width = full.shape[1]
    step = max(64, (BLOCK * 4) // width // 64 * 64)
    bits = np.zeros(width, np.uint32)
    if guess is not None:
        w = np.empty((len(guess), full.shape[0]), np.float32)
        for a in range(0, full.shape[0], step):
            chunk = full[a:a + step]
            bits |= _set_bits(chunk)
            for k, c in enumerate(guess):
                w[k, a:a + step] = chunk[:, c]
        outside = np.ones(width, bool)
        outside[guess] = False
        if not (bits[outside] & 0x7FFFFFFF).any():      # zeros of either sign outside the guess
            return guess, w
    else:
        for a in range(0, full.shape[0], step):
            bits |= _set_bits(full[a:a + step])
    cols = np.flatnonzero(bits & 0x7FFFFFFF)
    cols = cols if len(cols) else np.zeros(1, np.int64)
    return cols, np.ascontiguousarray(full[:, cols].T)


def _dense_layout(src: np.ndarray, dst: np.ndarray) -> tuple[int, np.ndarray] | None:
    """(first destination, source rows (G, F)) when the edges run destination by destination
    (consecutive destinations, F edges each) and each of G equal runs of destinations reads the same
    sources in the same order, as a dense or grouped layer's edges do; else None."""
    if len(dst) == 0:
        return None
    first = int(dst[0])
    other = np.flatnonzero(dst != first)
    fan = int(other[0]) if len(other) else len(dst)
    rows = len(dst) // fan
    if rows * fan != len(dst) or not np.array_equal(dst, np.repeat(np.arange(first, first + rows), fan)):
        return None
    src = src.reshape(rows, fan)
    starts = np.concatenate([[0], np.flatnonzero((src[1:] != src[:-1]).any(axis=1)) + 1])
    per = rows // len(starts)
    if per * len(starts) != rows or not np.array_equal(starts, np.arange(0, rows, per)):
        return None
    return first, src[starts]


# --------------------------------------------------------------------------- one operation's edges

class OpEdges:
    """One operation's edges: endpoints, and the kept entries of their weight rows as float32
    columns ``w`` (k, E). ``program`` (additions of numpy's row sum on the kept entries) is set when
    the operation's ``incoming`` is the default; otherwise the hook itself is called on the rows
    it would have seen. ``scratch``: a float64 buffer of at least BLOCK entries, shared."""

    def __init__(self, i: int, op, rows, graph: NeuralGraph, extra: np.ndarray, scratch: np.ndarray):
        self.i, self.op, self.rows, self.scratch = i, op, rows, scratch
        self.src, self.dst = graph.src[rows], graph.dst[rows]
        full = graph.weight[rows]
        width = full.shape[1]
        cols, w = _kept_entries(full, _kernel_columns(op, tuple(graph.kernel_shape)))
        default_incoming = type(op).incoming is Op.incoming
        tree = row_sum_tree(width, tuple(cols.tolist())) if default_incoming else None
        if (type(op).rescale not in _ROW_FACTOR_HOOKS or (default_incoming and tree is None)
                or (not default_incoming and len(cols) > 1)):
            cols = np.arange(width)                # the hooks see full rows, as they always did
            w = np.ascontiguousarray(full.T)
            tree = row_sum_tree(width, tuple(cols.tolist())) if default_incoming else None
        self.cols, self.w = cols, w
        self.padded = len(cols) < width
        self.sign = np.signbit(w[0]) if self.padded else None     # of a kept entry, as read
        self.program = tree_program(tree) if tree is not None else None
        self.default_rescale = type(op).rescale is Op.rescale
        self.dense = _dense_layout(self.src, self.dst) if self.default_rescale else None
        counts = np.bincount(graph.node_layer[self.src], minlength=graph.num_layers)
        counts += np.bincount(graph.node_layer[self.dst], minlength=graph.num_layers)
        self.layers = np.flatnonzero(counts).tolist()
        self.sq: np.ndarray | None = None          # where squared sums go (a BalanceSums segment), if set
        self.sq_valid = False                      # whether ``sq`` holds those of the current weights
        self.weighted = self.program is not None or self.sums(extra) is not None
        self.scaled = False

    @property
    def num_edges(self) -> int:
        return self.w.shape[1]

    def _blocks(self):
        step = max(1, BLOCK // self.w.shape[0])
        return ((a, min(a + step, self.num_edges)) for a in range(0, self.num_edges, step))

    def _row_sums(self, buf: np.ndarray, out: np.ndarray) -> None:
        """Into ``out``: numpy's row sums of the rows whose kept entries are ``buf``'s columns
        (``buf`` is overwritten)."""
        steps, root = self.program
        for i, j in steps[:-1]:
            np.add(buf[i], buf[j], out=buf[i])
        if steps:
            np.add(buf[steps[-1][0]], buf[steps[-1][1]], out=out)
        else:
            np.copyto(out, buf[root])

    def sums(self, extra: np.ndarray, total: bool = False):
        """Per edge, the squared (and, with ``total``, plain) sums of its effective incoming
        coefficients, as ``op.incoming`` gives them; None for an operation without weights."""
        if self.program is None:
            parts = self.op.incoming(np.ascontiguousarray(self.w.T, dtype=np.float64), self.dst, extra)
            if parts is not None and self.sq is not None:
                self.sq[:] = parts[0]
            return parts
        sq = self.sq if self.sq is not None else np.empty(self.num_edges)
        plain = np.empty(self.num_edges) if total else None
        k = self.w.shape[0]
        for a, b in self._blocks():
            buf = self.scratch[:k * (b - a)].reshape(k, b - a)
            if total:
                np.copyto(buf, self.w[:, a:b])
                self._row_sums(buf, plain[a:b])
            np.copyto(buf, self.w[:, a:b])
            np.square(buf, out=buf)
            self._row_sums(buf, sq[a:b])
        self.sq_valid = self.sq is not None
        return sq, plain

    def update_squares(self, extra: np.ndarray) -> None:
        """Fill ``sq`` with the squared sums of the current weights, unless the last application did."""
        if not self.sq_valid:
            self.sums(extra)

    def scale(self, s: np.ndarray, extra: np.ndarray, factors: np.ndarray, squares: bool = False) -> None:
        """Apply the per-neuron factors ``s`` as ``op.rescale`` does on float64 rows, rounded back
        to float32; with ``squares`` (the default hook only) also keep the new squared sums, computed
        while each block is in cache. ``factors``: a float64 buffer of at least E entries."""
        self.scaled = True
        self.sq_valid = False
        if not self.default_rescale:
            w = self.w.T.astype(np.float64)
            self.op.rescale(self.i, s, self.src, self.dst, np.arange(self.num_edges), w, extra)
            self.w[...] = w.T
            return
        keep = squares and self.program is not None and self.sq is not None
        sq = self.sq
        k = self.w.shape[0]
        whole = None
        if self.dense is not None:             # s[dst] / s[src] for all edges, by broadcasting
            first, src = self.dense
            groups, fan = src.shape
            whole = np.divide(s[first:first + self.num_edges // fan].reshape(groups, -1, 1), s[src][:, None, :],
                              out=factors[:self.num_edges].reshape(groups, -1, fan)).reshape(-1)
        up, down = np.empty(BLOCK // k), np.empty(BLOCK // k)
        for a, b in self._blocks():
            w = self.w[:, a:b]
            buf = self.scratch[:k * (b - a)].reshape(k, b - a)
            if whole is not None:
                fac = whole[a:b]
            else:
                fac = np.take(s, self.dst[a:b], out=up[:b - a])
                np.divide(fac, np.take(s, self.src[a:b], out=down[:b - a]), out=fac)     # s[dst] / s[src]
            np.copyto(buf, w)
            np.multiply(buf, fac, out=buf)
            np.copyto(w, buf, casting="unsafe")          # float32, as the graph stores weights
            if keep:
                np.copyto(buf, w)
                np.square(buf, out=buf)
                self._row_sums(buf, sq[a:b])
        self.sq_valid = keep

    def write(self, weight: np.ndarray, original: np.ndarray, flips: bool) -> None:
        """Copy the operation's rows of ``original`` into ``weight`` with the kept entries replaced;
        with ``flips`` (a negative factor was applied), the padding zeros of rows whose factors
        multiplied to a negative number change sign (as a kept entry's sign did)."""
        sign = None
        if self.padded and flips:
            sign = np.where(np.signbit(self.w[0]) != self.sign, np.float32(-1), np.float32(1))[:, None]
        rows = self.rows
        if not isinstance(rows, slice):
            block = original[rows] if sign is None else original[rows] * sign
            for k, c in enumerate(self.cols):
                block[:, c] = self.w[k]
            weight[rows] = block
            return
        step = max(1, (BLOCK * 2) // weight.shape[1])
        for a in range(0, self.num_edges, step):
            b = min(a + step, self.num_edges)
            block = weight[rows.start + a:rows.start + b]
            if sign is None:
                np.copyto(block, original[rows.start + a:rows.start + b])
            else:                     # the padding is zeros: times -1 flips their sign, nothing else
                np.multiply(original[rows.start + a:rows.start + b], sign[a:b], out=block)
            for k, c in enumerate(self.cols):
                block[:, c] = self.w[k, a:b]


# --------------------------------------------------------------------------- the whole graph

class ScaledGraph:
    """A graph whose hidden neurons are being rescaled: weights as ``OpEdges``, biases float32 and
    batch-norm statistics float64 (both always float32 values), written back by ``graph()``."""

    def __init__(self, graph: NeuralGraph):
        self.source = graph
        self.extra = graph.extra.astype(np.float64)
        self.bias = graph.bias.copy()
        scratch = np.empty(max(BLOCK, graph.weight.shape[1]))
        self.factors = np.empty(int(np.bincount(graph.edge_op, minlength=len(graph.ops)).max(initial=0)))
        self.op_edges = [OpEdges(i, op, rows, graph, self.extra, scratch)
                         for i, (op, rows) in enumerate(zip(graph.ops, op_edge_rows(graph)))]
        sizes, offsets = graph.layer_sizes(), graph.layer_offsets()
        self.slices = [slice(int(o), int(o + n)) for o, n in zip(offsets, sizes)]
        self.touching: dict[int, list[OpEdges]] = {}
        self.into: dict[int, list[OpEdges]] = {}
        for e in self.op_edges:
            self.into.setdefault(e.op.dst_layer, []).append(e)
            for layer in e.layers:
                self.touching.setdefault(layer, []).append(e)
        self.applied = False
        self.negative = False          # whether a negative factor was applied (padding zeros may flip)

    def ops_touching(self, layers) -> list[OpEdges]:
        """Operations with an edge into or out of ``layers``, in order."""
        found = {e.i: e for layer in layers for e in self.touching.get(layer, [])}
        return [found[i] for i in sorted(found)]

    def apply(self, s: np.ndarray, layers, squares: bool = False) -> None:
        """Multiply neuron ``n`` by ``s[n]`` (1 outside ``layers``), as ``apply_neuron_factors`` does."""
        for layer in layers:
            f = s[self.slices[layer]]
            if not np.isfinite(f).all() or (f == 0).any():
                raise ValueError(f"factors must be {len(s)} finite non-zero numbers")
            self.negative = self.negative or bool((f < 0).any())
        self.applied = True
        touched = self.ops_touching(layers)
        for e in touched:
            e.scale(s, self.extra, self.factors, squares)
        for layer in {layer for e in touched if not e.default_rescale for layer in e.layers}:
            sl = self.slices[layer]          # statistics a hook may have changed, stored as float32
            self.extra[sl] = self.extra[sl].astype(np.float32)
        for layer in layers:
            sl = self.slices[layer]
            self.bias[sl] = self.bias[sl].astype(np.float64) * s[sl]

    def incoming_sums(self, layer: int, total: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        """Per neuron of ``layer``: the sums of squared (and, with ``total``, plain) effective incoming
        coefficients, added edge by edge as ``np.add.at`` did over the operations in order."""
        sl = self.slices[layer]
        n = sl.stop - sl.start
        ops = [e for e in self.into.get(layer, []) if e.weighted]
        if not ops:
            return np.zeros(n), np.zeros(n) if total else None
        parts = [e.sums(self.extra, total) for e in ops]
        idx = np.concatenate([e.dst for e in ops])
        lo, bins = sl.start, n
        if idx.min(initial=lo) < lo or idx.max(initial=lo) >= sl.stop:     # not the layer's own edges: all nodes
            lo, bins = 0, len(self.bias)
        keep = slice(sl.start - lo, sl.start - lo + n)
        sq = np.bincount(idx - lo, np.concatenate([p[0] for p in parts]), minlength=bins)[keep].astype(np.float64)
        if not total:
            return sq, None
        return sq, np.bincount(idx - lo, np.concatenate([p[1] for p in parts]), minlength=bins)[keep].astype(np.float64)

    def graph(self) -> NeuralGraph:
        """The rescaled NeuralGraph (the source graph itself when nothing was applied)."""
        g = self.source
        if not self.applied:
            return g
        weight = np.empty_like(g.weight)
        for e in self.op_edges:
            if e.scaled:
                e.write(weight, g.weight, self.negative)
            else:
                weight[e.rows] = g.weight[e.rows]
        return NeuralGraph(
            node_type=g.node_type, node_layer=g.node_layer, node_position=g.node_position, bias=self.bias.copy(),
            extra=self.extra.astype(np.float32), layer_activation=list(g.layer_activation), src=g.src, dst=g.dst,
            relation=g.relation, edge_op=g.edge_op, weight=weight, kernel_shape=g.kernel_shape, ops=g.ops,
            buffers=dict(g.buffers))


class BalanceSums:
    """The per-neuron sums one balancing sweep reads, for a fixed set of rescaled ``layers``: squared
    incoming coefficients (operations into the layers) and squared outgoing ones (edges out of them),
    each added in the order ``np.add.at`` did. The operations write their per-edge squared sums into
    one buffer, in operation order; edges a sum leaves out count towards a spare last bin."""

    def __init__(self, state: ScaledGraph, layers: set[int]):
        g = state.source
        self.state, self.n = state, g.num_nodes
        into, keep = set(), {}
        self.members = []
        for e in state.op_edges:
            if not e.weighted:
                continue
            if e.op.dst_layer in layers:
                into.add(e.i)
            if e.op.src_layer in layers or e.op.get("src_segments"):
                keep[e.i] = np.isin(g.node_layer[e.src], list(layers))
            if e.i in into or e.i in keep:
                self.members.append(e)
        self.values = np.zeros(sum(e.num_edges for e in self.members))
        self.into_idx = np.full(len(self.values), self.n, np.int64)
        self.out_idx = np.full(len(self.values), self.n, np.int64)
        spans = {"into": [], "out": []}
        a = 0
        for e in self.members:
            b = a + e.num_edges
            e.sq, e.sq_valid = self.values[a:b], False
            if e.i in into:
                self.into_idx[a:b] = e.dst
                spans["into"] += [a, b]
            if e.i in keep:
                self.out_idx[a:b] = np.where(keep[e.i], e.src, self.n)
                spans["out"] += [a, b]
            a = b
        # the stretch of ``values`` each sum reads (a run of spare-bin entries costs time)
        self.into = slice(min(spans["into"], default=0), max(spans["into"], default=0))
        self.out = slice(min(spans["out"], default=0), max(spans["out"], default=0))

    def __call__(self) -> tuple[np.ndarray, np.ndarray]:
        """(incoming, outgoing) sums of squares per node (zero outside the layers)."""
        for e in self.members:
            e.update_squares(self.state.extra)
        into = np.bincount(self.into_idx[self.into], self.values[self.into], minlength=self.n + 1)
        out = np.bincount(self.out_idx[self.out], self.values[self.out], minlength=self.n + 1)
        return into[:self.n].astype(np.float64), out[:self.n].astype(np.float64)
