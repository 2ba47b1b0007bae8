"""Hidden-neuron permutations that leave a network's function unchanged.

Neurons of a hidden layer can be reordered freely, but some layers move together: a norm layer,
a residual edge or a depthwise conv connects neuron ``c`` to neuron ``c`` of another layer, so
both layers take the same permutation. Input and output layers never move; neither do the two
sides of a grouped (non-depthwise) conv, whose group structure a free permutation would break,
nor the query / key / value neurons of attention (their head structure is left alone). A gate
(``x * g``) ties its gate, gated and output layers like a residual does. An operation reading a
concatenation ties its destination channel by channel to parts of several layers; such diagonal
operations fix every layer they touch (a conservative choice: no free permutation is offered
where one would have to be shared across a slice of a layer).
"""
from __future__ import annotations

import numpy as np

from pipeline.neural_graph.graph import NeuralGraph
from pipeline.neural_graph.ops.base import Op
from pipeline.neural_graph.scaled_edges import BalanceSums, ScaledGraph, op_edge_rows
from pipeline.neural_graph.vocabulary import NODE_TYPES, SCALE, SIGN, VOCABULARY


def layer_classes(num_layers: int, ties) -> list[int]:
    """Union-find over neuron layers: the representative of each layer once the pairs ``ties``
    (layer a, layer b) are joined."""
    parent = list(range(num_layers))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for s, d in ties:
        parent[find(s)] = find(d)
    return [find(i) for i in range(num_layers)]


def boundary_layers(graph: NeuralGraph) -> set[int]:
    """Layers holding input or output neurons: no symmetry moves them."""
    return set(np.unique(graph.node_layer[graph.node_type != NODE_TYPES.index("hidden")]).tolist())


def tied_layer_classes(graph: NeuralGraph) -> tuple[list[int], set[int]]:
    """Layers whose neurons must be permuted together, and those never permuted: (representative per
    layer, set of fixed representatives)."""
    fixed: set[int] = set()
    sizes = graph.layer_sizes()
    ties = []
    for op in graph.ops:
        pairs, fix = op.permutation_ties(sizes)
        ties += pairs
        fixed.update(fix)
    fixed |= boundary_layers(graph)
    reps = layer_classes(graph.num_layers, ties)
    return reps, {reps[i] for i in fixed}


def random_hidden_permutation(graph: NeuralGraph, rng: np.random.Generator) -> np.ndarray:
    """A node permutation ``perm`` (node i -> perm[i]) that is a symmetry of the network."""
    reps, fixed = tied_layer_classes(graph)
    sizes = graph.layer_sizes()
    offsets = graph.layer_offsets()
    perm = np.arange(graph.num_nodes)
    drawn: dict[int, np.ndarray] = {}
    for layer, rep in enumerate(reps):
        if rep in fixed:
            continue
        if rep not in drawn:
            drawn[rep] = rng.permutation(int(sizes[layer]))
        perm[offsets[layer]:offsets[layer] + sizes[layer]] = offsets[layer] + drawn[rep]
    return perm


# --------------------------------------------------------------------------- scaling and sign symmetries
#
# Beyond permutations, a hidden neuron n of neuron layer l can be multiplied by a factor s_n when its
# activation commutes with it: act(s z) = s act(z). Multiplying the neuron's incoming weights and bias
# by s_n and dividing its outgoing weights by s_n then leaves the function unchanged. Which factors:
#   relu, leaky_relu          s > 0       (positive homogeneity)
#   tanh, sin                 s = +-1     (odd)
#   identity                  s != 0      (linear)
#   anything else             s = 1
# A max pool on a layer does not commute with a sign flip, so there only s > 0 (or nothing) remains.
# Residual (identity) edges tie their two layers to one factor per channel. A batch norm absorbs any
# factor of its input (running mean times s, variance times s^2, gamma corrected for eps exactly) and
# gives its output a factor of its own; a layer norm does not commute with per-neuron factors of its
# input, so that input layer is fixed. Input, output and attention layers are fixed. A gate x * g
# passes x's factor on (x and the product are tied like a residual); the gate's own layer is fixed.
# A residual or layer norm reading a concatenation fixes the layers it reads.

_ACTIVATION_GROUPS = {a.name: set(a.symmetries) for a in VOCABULARY if a.symmetries}
_MAX_POOLS = {"max_pool", "adaptive_max_pool"}


def max_pooled_layers(steps: list[dict] | None) -> set[int]:
    """Neuron layers whose values pass through a max pool (from a plan's ``steps``)."""
    return {int(s["layer"]) for s in (steps or []) if s.get("step") in _MAX_POOLS}


def scale_classes(graph: NeuralGraph, steps: list[dict] | None = None) -> tuple[list[int], dict[int, set[str]]]:
    """Layers that must share one factor per neuron (tied by residual edges), and the factors each class
    allows: (representative per layer, {representative: subset of {"scale", "sign"}}).

    ``steps`` (a plan's traced steps) tells where max pools are; without it every layer with spatial
    maps (a conv output) is assumed max-pooled, which only ever forbids sign flips.
    """
    allowed = [set(_ACTIVATION_GROUPS.get(act, set())) for act in graph.layer_activation]
    pooled = max_pooled_layers(steps) if steps is not None else {
        op["dst_layer"] for op in graph.ops if op["relation"] == "conv"}
    for layer in pooled:
        allowed[layer].discard(SIGN)
    for layer in boundary_layers(graph):
        allowed[layer] = set()
    ties = []
    for op in graph.ops:
        pairs, cleared = op.scaling_ties()
        ties += pairs
        for layer in cleared:
            allowed[layer] = set()
    reps = layer_classes(graph.num_layers, ties)
    groups: dict[int, set[str]] = {}
    for layer, rep in enumerate(reps):
        groups[rep] = groups.get(rep, {SCALE, SIGN}) & allowed[layer]
    return reps, groups


def apply_neuron_factors(graph: NeuralGraph, factors: np.ndarray) -> NeuralGraph:
    """The graph of the network whose neuron ``n`` outputs ``factors[n]`` times the original's.

    Incoming weights and biases are multiplied by the factor of their destination, outgoing ones divided
    by the factor of their source, batch-norm statistics and gamma follow exactly. The caller chooses
    factors the activations allow (see ``scale_classes``; ``random_rescaling`` does); this function checks
    that residual edges join equal factors and that fixed layers keep factor 1 where it must.

    Args:
        factors: (N,) non-zero floats, 1 on input and output neurons.
    """
    s = np.asarray(factors, dtype=np.float64)
    if s.shape != (graph.num_nodes,) or not np.isfinite(s).all() or (s == 0).any():
        raise ValueError(f"factors must be {graph.num_nodes} finite non-zero numbers")
    hidden = graph.node_type == NODE_TYPES.index("hidden")
    if not np.allclose(s[~hidden], 1.0):
        raise ValueError("input and output neurons cannot be rescaled")
    weight = np.empty_like(graph.weight)
    bias = graph.bias.astype(np.float64) * s
    extra = graph.extra.astype(np.float64)
    for i, (op, e) in enumerate(zip(graph.ops, op_edge_rows(graph))):
        src, dst = graph.src[e], graph.dst[e]
        if type(op).rescale is Op.rescale:       # the default hook, fused with the rounding to float32
            fac = (s[dst] / s[src])[:, None]
            if isinstance(e, slice):
                np.multiply(graph.weight[e], fac, out=weight[e], dtype=np.float64, casting="unsafe")
            else:
                weight[e] = np.multiply(graph.weight[e], fac, dtype=np.float64)
            continue
        w = graph.weight[e].astype(np.float64)     # the operation's rows, as the hook's ``weight[e]``
        op.rescale(i, s, src, dst, np.arange(len(w)), w, extra)
        weight[e] = w
    return NeuralGraph(
        node_type=graph.node_type, node_layer=graph.node_layer, node_position=graph.node_position,
        bias=bias.astype(np.float32), extra=extra.astype(np.float32), layer_activation=list(graph.layer_activation),
        src=graph.src, dst=graph.dst, relation=graph.relation, edge_op=graph.edge_op,
        weight=weight, kernel_shape=graph.kernel_shape, ops=graph.ops, buffers=dict(graph.buffers))


def random_factors(graph: NeuralGraph, rng: np.random.Generator, max_scale: float = 10.0,
                   steps: list[dict] | None = None, signs: bool = True) -> np.ndarray:
    """Per-neuron factors of a random function-preserving transformation: U[1, max_scale] magnitudes
    where scaling is allowed, random signs where sign flips are (``signs``), 1 elsewhere."""
    reps, groups = scale_classes(graph, steps)
    sizes, offsets = graph.layer_sizes(), graph.layer_offsets()
    s = np.ones(graph.num_nodes)
    drawn: dict[int, np.ndarray] = {}
    for layer, rep in enumerate(reps):
        group = groups[rep]
        if not group:
            continue
        if rep not in drawn:
            n = int(sizes[layer])
            f = rng.uniform(1.0, max_scale, n) if SCALE in group else np.ones(n)
            if signs and SIGN in group:
                f *= rng.choice([-1.0, 1.0], n)
            drawn[rep] = f
        s[offsets[layer]:offsets[layer] + sizes[layer]] = drawn[rep]
    return s


def random_rescaling(graph: NeuralGraph, rng: np.random.Generator, max_scale: float = 10.0,
                     steps: list[dict] | None = None, signs: bool = True) -> NeuralGraph:
    """A random function-preserving rescaling (and sign flip) of ``graph``'s hidden neurons."""
    return apply_neuron_factors(graph, random_factors(graph, rng, max_scale, steps, signs))


def _incoming_norms(graph: NeuralGraph, weight: np.ndarray, bias: np.ndarray, extra: np.ndarray,
                    layers: set[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per node of ``layers``: the norm and the sum of its effective incoming coefficients (weights,
    batch norm's gamma / sqrt(var + eps) and its effective bias, the node bias)."""
    sq = np.zeros(graph.num_nodes)
    total = np.zeros(graph.num_nodes)
    for op, e in zip(graph.ops, op_edge_rows(graph)):
        if op.dst_layer not in layers:
            continue
        dst = graph.dst[e]
        parts = op.incoming(weight[e], dst, extra)
        if parts is None:                       # residual and gate edges carry no weight of the network
            continue
        np.add.at(sq, dst, parts[0])
        np.add.at(total, dst, parts[1])
    return np.sqrt(sq + bias ** 2), total + bias


# Incoming (or outgoing) coefficient norms at or below this are a dead neuron's: float32 noise, not a
# direction. Canonical and balanced scaling leave such a neuron's scale alone; dividing by its norm
# (one collapsed model of a development zoo had norms of 1e-27) overflows float32 downstream.
DEAD = 1e-10


def canonical_scaling(graph: NeuralGraph, steps: list[dict] | None = None) -> tuple[NeuralGraph, np.ndarray]:
    """One representative per scaling (and sign) orbit: every rescalable hidden neuron gets unit-norm
    incoming coefficients (weights and bias), and, where signs may flip, a positive sum of them; the
    factor is pushed forward into its outgoing weights. Returns the canonical graph and the factors used.

    Two networks that differ by a function-preserving rescaling (``random_rescaling``) have the same
    canonical graph up to float rounding. Layers are processed in order; a class of layers tied by
    residual edges takes its factors from its first layer's incoming coefficients.

    Time linear in the graph: each class's factors touch only the operations next to its layers,
    on the graph held operation by operation (``scaled_edges.ScaledGraph``), which gives the same
    arrays, bit for bit, as applying ``apply_neuron_factors`` once per class.
    """
    state, s = _canonical_state(graph, steps)
    return state.graph(), s


def _canonical_state(graph: NeuralGraph, steps: list[dict] | None) -> tuple[ScaledGraph, np.ndarray]:
    """``canonical_scaling`` on a ScaledGraph, whose applications touch only the operations next to
    the layers they rescale, and the factors used."""
    reps, groups = scale_classes(graph, steps)
    state = ScaledGraph(graph)
    s = np.ones(graph.num_nodes)
    step = np.ones(graph.num_nodes)
    done: set[int] = set()
    for layer, rep in enumerate(reps):
        group = groups[rep]
        if not group or rep in done:
            continue
        done.add(rep)
        sl = state.slices[layer]
        sq, total = state.incoming_sums(layer, SIGN in group)
        bias = state.bias[sl].astype(np.float64)
        norm = np.sqrt(sq + bias ** 2)
        f = np.ones(sl.stop - sl.start)
        if SCALE in group:      # a dead neuron (no incoming coefficient above DEAD) keeps its scale
            live = norm > DEAD
            f = np.where(live, 1.0 / np.where(live, norm, 1.0), 1.0)
        if SIGN in group:
            f = f * np.where(total + bias < 0, -1.0, 1.0)
        members = [other for other, r in enumerate(reps) if r == rep]
        for other in members:
            step[state.slices[other]] = f
        state.apply(step, members)
        for other in members:
            s[state.slices[other]] *= f
            step[state.slices[other]] = 1.0
    return state, s


def _outgoing_norms(graph: NeuralGraph, weight: np.ndarray, extra: np.ndarray, layers: set[int]) -> np.ndarray:
    """Per node of ``layers``: the norm of its effective outgoing coefficients (the same per-edge
    coefficients ``_incoming_norms`` counts at the destination, counted here at the source)."""
    sq = np.zeros(graph.num_nodes)
    for op, e in zip(graph.ops, op_edge_rows(graph)):
        if op.src_layer not in layers and not op.get("src_segments"):
            continue
        src, dst = graph.src[e], graph.dst[e]
        parts = op.incoming(weight[e], dst, extra)
        if parts is None:
            continue
        keep = np.isin(graph.node_layer[src], list(layers))
        np.add.at(sq, src[keep], parts[0][keep])
    return np.sqrt(sq)


def balanced_scaling(graph: NeuralGraph, steps: list[dict] | None = None, sweeps: int = 30,
                     tolerance: float = 1e-7) -> NeuralGraph:
    """The balanced representative of a graph's rescaling orbit: from the canonical graph
    (``canonical_scaling``, so every member of an orbit starts from the same point), each rescalable
    neuron's factor is set so that its incoming and outgoing coefficients have equal norms, all
    classes at once, up to ``sweeps`` times or until no factor moves by more than ``tolerance``
    (every sweep is one pass over the graph, whatever its depth; the fixed point minimises the total
    squared norm, which is convex in the log-factors). Weight decay drives training towards this
    balance, so a trained network's balanced form is close to the network itself, unlike the
    unit-norm canonical form, whose pushed-forward factors pile up in the last layer; and, being a
    deterministic function of the canonical graph, it is exactly as invariant.

    A sweep is one pass over the kept weights (``scaled_edges``): the factors applied, rounded to
    float32 as the graph stores them, and the next sweep's squared sums taken in the same pass; the
    result is the same, bit for bit, as applying ``apply_neuron_factors`` once per sweep."""
    state, _ = _canonical_state(graph, steps)
    reps, groups = scale_classes(graph, steps)
    sizes, offsets = graph.layer_sizes(), graph.layer_offsets()
    classes: dict[int, list[int]] = {}
    for layer, rep in enumerate(reps):
        if SCALE in groups[rep]:
            classes.setdefault(rep, []).append(layer)
    layers = {layer for members in classes.values() for layer in members}
    sums = BalanceSums(state, layers) if classes else None
    for sweep in range(sweeps if classes else 0):
        sq_in, sq_out = sums()
        inn = np.sqrt(sq_in + state.bias.astype(np.float64) ** 2)
        out = np.sqrt(sq_out)
        step = np.ones(graph.num_nodes)
        for rep, members in classes.items():
            n = int(sizes[rep])
            si, so = np.zeros(n), np.zeros(n)
            for layer in members:
                sl = slice(offsets[layer], offsets[layer] + sizes[layer])
                si += inn[sl] ** 2
                so += out[sl] ** 2
            ok = (si > DEAD ** 2) & (so > DEAD ** 2)
            f = np.where(ok, (np.where(ok, so, 1.0) / np.where(ok, si, 1.0)) ** 0.25, 1.0)
            for layer in members:
                step[offsets[layer]:offsets[layer] + sizes[layer]] = f
        converged = np.abs(step - 1.0).max() < tolerance
        # the last application also computes the next sweep's squared sums, block by block
        state.apply(step, layers, squares=not converged and sweep + 1 < sweeps)
        if converged:
            break
    return state.graph()
