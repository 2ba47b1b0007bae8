"""Learned per-head score terms of windowed attention: relative-position bias and logit scale.

Swin and MaxViT add a relative-position bias to each head's scores,
``scores[h, i, j] += B[index[i, j], h]``, with ``index`` a fixed map from a pair of window
positions to one of R relative offsets. ``B`` is a learned parameter of the attention block and
is stored the way positional embeddings are (tokens.py): a layer of R relative-position neurons
(inputs) joined by ``embedding`` edges of weight ``B[r, h]`` to a layer of H bias neurons, one per
head; each bias neuron joins the query neurons of its head by an ``attn_bias`` edge (weight 1, no
parameter: the bias is added to that head's scores).

Swin V2 computes ``B`` instead with a small MLP (its continuous position bias, ``cpb_mlp``) from
a fixed table of R log-spaced relative coordinates, and applies ``16 * sigmoid`` to it: the MLP is
written out as neurons, from 2 coordinate inputs through its hidden layer to the H bias neurons
(activation ``sigmoid``; the factor 16 is kept in the ``attn_bias`` op). V2 also scales each
head's cosine scores by ``exp(min(s_h, log 100))``: the learned ``s`` is stored like a class token,
``embedding`` edges from one input neuron to H scale neurons, each joined to its head's queries by
an ``attn_scale`` edge.

The index and the coordinate table are architecture (made from the window size): they are kept in
the op that reads them (``buffers``, or ``constants`` when they are not state-dict entries), and
the inverse gives the state-dict ones back bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeline.neural_graph.vocabulary import aten_activations

aten = torch.ops.aten

INDEX_OPS = {aten.index.Tensor}
_VIEW_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default,
             aten.flatten.using_ints, aten.permute.default, aten.unsqueeze.default, aten.expand.default,
             aten.contiguous.default}
_ACTIVATION_OPS = aten_activations()


@dataclass
class PositionBias:
    index: object                       # the aten.index node that gathers the table
    table_key: str | None               # a learned (R, heads) table, or None when an MLP computes it
    index_key: str
    heads: int
    mlp: list = field(default_factory=list)       # nodes of the table's MLP, in graph order
    coords_key: str | None = None


def _through_views(node):
    while isinstance(node, torch.fx.Node) and node.target in _VIEW_OPS:
        node = node.args[0]
    return node


def _ancestors(node, names: set) -> list:
    out, todo = {}, [node]
    while todo:
        n = todo.pop()
        if n.name in names and n.name not in out:
            out[n.name] = n
            todo.extend(n.all_input_nodes)
    return list(out.values())


class PositionBiasOps:
    """Relative-position bias and logit scale of an attention core (mixed into AttentionCoreOps)."""

    def _buffer_entry(self, key: str) -> tuple[str, dict]:
        t = self.state[key]
        entry = {"values": t.reshape(-1).tolist(), "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
        return ("constants" if key in self.constant_keys else "buffers"), {key: entry}

    def find_position_bias(self, blk) -> PositionBias | None:
        """The block's relative-position bias (a learned table, or an MLP of fixed coordinates)."""
        found = None
        for n in blk.nodes:
            if n.target not in INDEX_OPS or not isinstance(n.args[0], torch.fx.Node):
                continue
            idx = n.args[1]
            src = _through_views(idx[0]) if len(idx) == 1 else None
            ikey = self.param_of.get(src.name) if isinstance(src, torch.fx.Node) else None
            if ikey is None or self.state[ikey].is_floating_point():
                raise self.unsupported(n, "indexing other than a relative-position index",
                                       f"index {getattr(src, 'name', src)}")
            if found is not None:
                raise self.unsupported(n, "attention with several relative-position bias tables")
            heads = int(n.meta["val"].shape[-1])
            tkey = self.param_of.get(n.args[0].name)
            if tkey is not None:
                if tkey not in self.state or tkey in self.constant_keys or self.state[tkey].ndim != 2:
                    raise self.unsupported(n, "relative-position bias that is not a learned (offsets, heads) table",
                                           tkey)
                found = PositionBias(n, tkey, ikey, heads)
                continue
            mlp = _ancestors(n.args[0], blk.names)
            mlp.sort(key=lambda m: blk.nodes.index(m))
            coords = [self.param_of[a.name] for m in mlp for a in m.all_input_nodes
                      if a.name in self.param_of and self.param_of[a.name] in self.state
                      and self.state[self.param_of[a.name]].is_floating_point() and m.target in _VIEW_OPS]
            if len(coords) != 1:
                raise self.unsupported(n, "relative-position bias computed from other than one coordinate table")
            found = PositionBias(n, None, ikey, heads, mlp, coords[0])
        return found

    def position_bias_ops(self, pb: PositionBias, q_layer: int) -> None:
        """Relative-position neurons (or the MLP's coordinate inputs) -> H bias neurons -> the queries."""
        self.used_keys.add(pb.index_key)
        where, entry = self._buffer_entry(pb.index_key)
        if pb.table_key is not None:
            self.used_keys.add(pb.table_key)
            r = int(self.state[pb.table_key].shape[0])
            pos = self.new_layer(r, "input")
            bias = self.new_layer(pb.heads, "attention_bias")
            self.add_op(pb.index, kind="relative_position", relation="embedding", src_layer=pos, dst_layer=bias,
                        weight_key=pb.table_key, bias_key=None, weight_shape=[r, pb.heads],
                        param_shape=[r, pb.heads], kernel=[1, 1], **{where: entry})
        else:
            bias = self._bias_mlp(pb, where, entry)
        fn = self._bias_transform(pb.index, bias)
        self._per_head_edges(pb.index, bias, q_layer, pb.heads, "attention_bias", "attn_bias", **fn)

    def _bias_mlp(self, pb: PositionBias, where: str, entry: dict) -> int:
        """Swin V2's continuous position bias: coordinates -> linear layers -> H bias neurons."""
        self.used_keys.add(pb.coords_key)
        cwhere, centry = self._buffer_entry(pb.coords_key)
        layer = self.new_layer(int(self.state[pb.coords_key].shape[-1]), "input")
        first = True
        for n in pb.mlp:
            if self._is_projection(n):
                wkey, bkey, transposed, _, out_f, in_f = self._projection_shape(
                    n, self.layers[layer].size, "position-bias MLP layer", "that does not read the layer before it")
                dst = self.new_layer(out_f, "linear")
                op = dict(kind="linear", relation="linear", src_layer=layer, dst_layer=dst, weight_key=wkey,
                          bias_key=bkey, weight_shape=[out_f, in_f], kernel=[1, 1], groups=1)
                if transposed:
                    op["transposed"] = True
                if first:
                    op[cwhere] = centry
                    first = False
                self.add_op(n, **op)
                layer = dst
            elif n.target in _ACTIVATION_OPS:
                if self.layers[layer].activation != "identity":
                    raise self.unsupported(n, "two activations on one position-bias layer")
                self.layers[layer].activation = _ACTIVATION_OPS[n.target]
            elif n.target not in _VIEW_OPS and not (n.op == "call_function" and n.target is aten.t.default):
                raise self.unsupported(n, "position-bias MLP step other than linear layers and activations")
        if first or self.layers[layer].size != pb.heads:
            raise self.unsupported(pb.index, "position-bias MLP whose output is not one value per head")
        self.layers[layer].kind = "attention_bias"
        last = self.ops[-1]
        last[where] = {**(last.get(where) or {}), **entry}
        return layer

    def _bias_transform(self, index, bias: int) -> dict:
        """What happens to the gathered bias before it meets the scores: views, then (V2) ``c * sigmoid``."""
        n, scale = index, None
        while len(n.users) == 1:
            (u,) = n.users
            if u.target in _VIEW_OPS:
                pass
            elif u.target is aten.sigmoid.default and self.layers[bias].activation == "identity":
                self.layers[bias].activation = "sigmoid"
            elif u.target is aten.mul.Tensor and isinstance(u.args[1], (int, float)) and scale is None:
                scale = float(u.args[1])
            else:
                break
            n = u
        return {} if scale is None else {"scale": scale}

    def logit_scale_ops(self, blk, q_layer: int, heads: int) -> None:
        """Swin V2's learned per-head temperature ``exp(min(s, c))`` of the cosine scores."""
        for n in blk.nodes:
            if n.target is not aten.clamp.default or not isinstance(n.args[0], torch.fx.Node):
                continue
            key = self.param_of.get(n.args[0].name)
            if key is None or key not in self.state or key in self.used_keys:
                continue
            shape = [int(s) for s in self.state[key].shape]
            users = list(n.users)
            if self.state[key].numel() != heads or len(users) != 1 or users[0].target is not aten.exp.default:
                raise self.unsupported(n, "clamped parameter other than a per-head logit scale", key)
            self.used_keys.add(key)
            one = self.new_layer(1, "input")
            scale = self.new_layer(heads, "attention_scale")
            self.add_op(n, kind="logit_scale", relation="embedding", src_layer=one, dst_layer=scale, weight_key=key,
                        bias_key=None, weight_shape=[1, heads], param_shape=shape, kernel=[1, 1],
                        clamp=[n.args[1], n.args[2] if len(n.args) > 2 else None], fn="exp")
            self._per_head_edges(n, scale, q_layer, heads, "attention_scale", "attn_scale")

    def _per_head_edges(self, node, src: int, q_layer: int, heads: int, kind: str, relation: str, **info) -> None:
        q_size = self.layers[q_layer].size
        if q_size % heads:
            raise self.unsupported(node, f"{kind} whose heads do not divide the queries",
                                   f"{heads} heads, {q_size} query neurons")
        d = q_size // heads
        self.add_op(node, kind=kind, relation=relation, src_layer=src,
                    src_segments=[[src, h, d, 0] for h in range(heads)], dst_layer=q_layer, kernel=[1, 1], **info)
