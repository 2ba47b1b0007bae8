"""Hidden-neuron permutations that leave a network's function unchanged.

Neurons of a hidden layer can be reordered freely, but some layers move together: a norm layer,
a residual edge or a depthwise conv connects neuron ``c`` to neuron ``c`` of another layer, so
both layers take the same permutation. Input and output layers never move; neither do the two
sides of a grouped (non-depthwise) conv, whose group structure a free permutation would break,
nor the query / key / value neurons of attention (their head structure is left alone).
"""
from __future__ import annotations

import numpy as np

from pipeline.neural_graph.graph import NODE_TYPES, NeuralGraph


def tied_layer_classes(graph: NeuralGraph) -> tuple[list[int], set[int]]:
    """Union-find over neuron layers: (representative per layer, set of fixed representatives)."""
    parent = list(range(graph.num_layers))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    fixed: set[int] = set()
    for op in graph.ops:
        s, d = op["src_layer"], op["dst_layer"]
        if op["relation"] in ("norm", "residual"):
            parent[find(s)] = find(d)
        elif op["relation"] in ("attn_q", "attn_k", "attn_v"):
            fixed.add(d)                            # head structure: q/k/v neurons stay put
        elif op["kind"] == "conv" and op.get("groups", 1) > 1:
            if op["weight_shape"][1] == 1 and op["weight_shape"][0] == graph.layer_sizes()[s]:
                parent[find(s)] = find(d)          # depthwise: channel c -> channel c
            else:
                fixed.update((s, d))
    for layer in range(graph.num_layers):
        types = set(graph.node_type[graph.node_layer == layer].tolist())
        if types - {NODE_TYPES.index("hidden")}:
            fixed.add(layer)
    reps = [find(i) for i in range(graph.num_layers)]
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
