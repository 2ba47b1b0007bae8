"""The neural graph of one network: neurons as nodes, weights as edges (Kofinas et al., ICLR 2024).

Nodes are grouped into *neuron layers*: layer 0 holds the input neurons (input channels or
features), every later layer the outputs of one operation (a linear or conv layer, a norm layer,
a residual sum...). Edges carry a weight vector: a conv kernel zero-padded to the largest kernel
of the model and flattened, or a single value padded the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.neural_graph.vocabulary import ACTIVATIONS, NODE_TYPES, RELATIONS
from zoocore.errors import GraphValidationError



@dataclass
class NeuralGraph:
    """Arrays of one neural graph.

    Args:
        node_type: (N,) int8 code into NODE_TYPES.
        node_layer: (N,) int32 neuron-layer index, 0 for inputs.
        node_position: (N,) int32 index of the neuron inside its layer.
        bias: (N,) float32 node bias (0 where the layer has none).
        extra: (N, 2) float32 running mean / variance for batch-norm neurons, NaN elsewhere.
        layer_activation: activation name per neuron layer (len = number of neuron layers).
        src, dst: (E,) int64 node indices.
        relation: (E,) int8 code into RELATIONS.
        edge_op: (E,) int32 index of the operation in `ops` that produced the edge.
        weight: (E, Kh*Kw) float32 edge features, kernels centred in a Kh x Kw frame.
        kernel_shape: (Kh, Kw), the largest kernel of the model (1, 1) for MLPs.
        ops: one record per operation (``pipeline.neural_graph.ops``: kind, relation, src/dst
            neuron layer, parameter keys, shapes, hyper-parameters): what the exact inverse needs.
        buffers: state-dict entries that are neither weights nor node values
            (e.g. ``num_batches_tracked``), kept so the inverse is complete.
    """

    node_type: np.ndarray
    node_layer: np.ndarray
    node_position: np.ndarray
    bias: np.ndarray
    extra: np.ndarray
    layer_activation: list[str]
    src: np.ndarray
    dst: np.ndarray
    relation: np.ndarray
    edge_op: np.ndarray
    weight: np.ndarray
    kernel_shape: tuple[int, int]
    ops: list[dict[str, Any]]
    buffers: dict[str, Any] = field(default_factory=dict)

    @property
    def num_nodes(self) -> int:
        return int(self.node_type.shape[0])

    @property
    def num_edges(self) -> int:
        return int(self.src.shape[0])

    @property
    def num_layers(self) -> int:
        return len(self.layer_activation)

    def layer_sizes(self) -> np.ndarray:
        return np.bincount(self.node_layer, minlength=self.num_layers)

    def layer_offsets(self) -> np.ndarray:
        """First node index of every neuron layer (nodes are stored layer by layer)."""
        sizes = self.layer_sizes()
        return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)

    def validate(self) -> "NeuralGraph":
        """Check shapes, codes and index ranges; raise GraphValidationError naming what is wrong."""
        n, e = self.num_nodes, self.num_edges
        for name in ("node_layer", "node_position", "bias"):
            if getattr(self, name).shape != (n,):
                raise GraphValidationError(f"{name} has shape {getattr(self, name).shape}, expected ({n},)")
        if self.extra.shape != (n, 2):
            raise GraphValidationError(f"extra has shape {self.extra.shape}, expected ({n}, 2)")
        for name in ("dst", "relation", "edge_op"):
            if getattr(self, name).shape != (e,):
                raise GraphValidationError(f"{name} has shape {getattr(self, name).shape}, expected ({e},)")
        k = self.kernel_shape[0] * self.kernel_shape[1]
        if self.weight.shape != (e, k):
            raise GraphValidationError(f"weight has shape {self.weight.shape}, expected ({e}, {k})")
        if e and (self.src.min() < 0 or self.src.max() >= n or self.dst.min() < 0 or self.dst.max() >= n):
            bad = int(np.max(np.concatenate([self.src, self.dst])))
            raise GraphValidationError(f"edge endpoint {bad} out of range for {n} nodes")
        if n and (self.node_type.min() < 0 or self.node_type.max() >= len(NODE_TYPES)):
            raise GraphValidationError(f"node_type code {int(self.node_type.max())} unknown")
        if e and (self.relation.min() < 0 or self.relation.max() >= len(RELATIONS)):
            raise GraphValidationError(f"relation code {int(self.relation.max())} unknown")
        if n and (np.diff(self.node_layer) < 0).any():
            raise GraphValidationError("nodes are not stored layer by layer")
        if len(self.layer_activation) != (int(self.node_layer.max()) + 1 if n else 0):
            raise GraphValidationError(
                f"{len(self.layer_activation)} layer activations for {int(self.node_layer.max()) + 1} layers")
        unknown = set(self.layer_activation) - set(ACTIVATIONS)
        if unknown:
            raise GraphValidationError(f"unknown activation(s) {sorted(unknown)}")
        if e and (self.edge_op.min() < 0 or self.edge_op.max() >= len(self.ops)):
            raise GraphValidationError(f"edge_op {int(self.edge_op.max())} out of range for {len(self.ops)} ops")
        if not np.isfinite(self.weight).all() or not np.isfinite(self.bias).all():
            raise GraphValidationError("non-finite weight or bias")
        return self

    # ------------------------------------------------------------------ conversions
    def node_activation_codes(self) -> np.ndarray:
        codes = np.array([ACTIVATIONS.index(a) for a in self.layer_activation], dtype=np.int64)
        return codes[self.node_layer]

    def to_networkx(self):
        """A networkx MultiDiGraph with node attributes and edge ``relation`` / ``weight`` lists."""
        import networkx as nx

        g = nx.MultiDiGraph()
        for i in range(self.num_nodes):
            g.add_node(i, node_type=NODE_TYPES[self.node_type[i]], layer=int(self.node_layer[i]),
                       position=int(self.node_position[i]), bias=float(self.bias[i]),
                       activation=self.layer_activation[self.node_layer[i]])
        for s, d, r, w in zip(self.src.tolist(), self.dst.tolist(), self.relation.tolist(), self.weight):
            g.add_edge(s, d, relation=RELATIONS[r], weight=w.tolist())
        return g

    def permuted(self, perm: np.ndarray) -> "NeuralGraph":
        """The same graph with node ``i`` renamed ``perm[i]``, re-sorted by (layer, position).

        ``perm`` must map each neuron layer onto itself; positions follow the new order.
        """
        perm = np.asarray(perm, dtype=np.int64)
        if (self.node_layer[np.argsort(perm)] != self.node_layer).any():
            raise GraphValidationError("a permutation must keep every neuron inside its layer")
        inv = np.argsort(perm)  # new index -> old index
        out = NeuralGraph(
            node_type=self.node_type[inv], node_layer=self.node_layer[inv],
            node_position=self.node_position.copy(), bias=self.bias[inv], extra=self.extra[inv],
            layer_activation=list(self.layer_activation), src=perm[self.src], dst=perm[self.dst],
            relation=self.relation.copy(), edge_op=self.edge_op.copy(), weight=self.weight.copy(),
            kernel_shape=self.kernel_shape, ops=self.ops, buffers=dict(self.buffers))
        order = np.lexsort((out.src, out.dst, out.edge_op))
        for name in ("src", "dst", "relation", "edge_op", "weight"):
            setattr(out, name, getattr(out, name)[order])
        return out

    def edge_key_order(self) -> np.ndarray:
        """Edge order by (op, dst, src): a canonical order to compare two graphs."""
        return np.lexsort((self.src, self.dst, self.edge_op))
