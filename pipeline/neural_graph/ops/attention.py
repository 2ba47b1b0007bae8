"""Attention projections: ``nn.MultiheadAttention`` (traced into many ATen ops, read as one block)
and ``TransformerEncoderLayer``'s fused fast path. Q, K, V and O are linear operations
(``ops.linear.Linear``) whose relations (``attn_q`` ...) say their role; hand-written attention
(``F.scaled_dot_product_attention``, softmax between products) is ``attention_core.py``'s.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.neural_graph.ops.base import module_groups, node_shape, register

aten = torch.ops.aten


@dataclass
class AttentionBlock:
    path: str
    heads: int
    nodes: list
    names: set
    outputs: list


def attention_blocks(graph, clean) -> dict[str, AttentionBlock]:
    """Nodes that belong to an nn.MultiheadAttention call, by node name."""
    blocks: dict[str, AttentionBlock] = {}
    match = lambda typ: True if isinstance(typ, type) and issubclass(typ, torch.nn.MultiheadAttention) else None  # noqa: E731
    for path, (_, nodes) in module_groups(graph, clean, match).items():
        names = {n.name for n in nodes}
        blk = AttentionBlock(path, 0, nodes, names, [n for n in nodes if any(u.name not in names for u in n.users)])
        blocks.update((n.name, blk) for n in nodes)
    return blocks


def block_heads(block: AttentionBlock, embed: int) -> int:
    """Heads of an attention block, read from the q/k/v reshape to (L, B * heads, head_dim)."""
    for n in block.nodes:
        if n.target is aten.div.Tensor:          # q / sqrt(head_dim) once per call
            shape = node_shape(n)
            if len(shape) == 3 and 0 < shape[-1] < embed and embed % shape[-1] == 0:
                return embed // shape[-1]
    return 1



class AttentionTracing:
    """Tracer handlers for attention blocks and fused encoder layers (mixed into plan._Tracer)."""

    def _attention(self, node, v, embed: int, in_w: str, in_b: str | None, out_w: str,
                   out_b: str | None, heads: int):
        """Q, K, V neuron layers from the input and an O layer from V: four typed edge blocks."""
        if v.layer is None or not v.channels_last or self.layers[v.layer].size != embed:
            raise self.unsupported(node, "attention whose input is not a layer of embed_dim neurons")
        qkv = []
        for i, rel in enumerate(("attn_q", "attn_k", "attn_v")):
            dst = self.new_layer(embed, "attention")
            self.add_op(node, kind="linear", relation=rel, src_layer=v.layer, dst_layer=dst, weight_key=in_w,
                        bias_key=in_b, rows=[i * embed, (i + 1) * embed], param_shape=[3 * embed, embed],
                        weight_shape=[embed, embed], kernel=[1, 1], groups=1, heads=heads)
            qkv.append(dst)
        out = self.new_layer(embed, "attention_out")
        self.add_op(node, kind="linear", relation="attn_o", src_layer=qkv[2], dst_layer=out, weight_key=out_w,
                    bias_key=out_b, weight_shape=[embed, embed], kernel=[1, 1], groups=1, heads=heads)
        for k in (in_w, in_b, out_w, out_b):
            if k:
                self.used_keys.add(k)
        return self.Val(out, True, v.spatial)

    def attention_block(self, node, block: "AttentionBlock") -> None:
        """An nn.MultiheadAttention traced into many ATen ops: handled as one block."""
        inputs = {a.name for n in block.nodes for a in n.all_input_nodes
                  if a.name not in block.names and a.name not in self.param_of}
        neuron_vals = [self.vals[i] for i in inputs if isinstance(self.vals.get(i), self.Val)]
        if len(inputs) != 1 or len(neuron_vals) != 1:
            raise self.unsupported(node, "attention other than self-attention on one input")
        p = block.path + "."
        keys = {k: p + k for k in ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")}
        if keys["in_proj_weight"] not in self.state:
            raise self.unsupported(node, "attention with separate q/k/v projection weights")
        embed = int(self.state[keys["out_proj.weight"]].shape[0])
        out = self._attention(node, neuron_vals[0], embed, keys["in_proj_weight"],
                              keys["in_proj_bias"] if keys["in_proj_bias"] in self.state else None,
                              keys["out_proj.weight"],
                              keys["out_proj.bias"] if keys["out_proj.bias"] in self.state else None,
                              block_heads(block, embed))
        for n in block.outputs:
            self.vals[n.name] = out

    def encoder_layer(self, node) -> None:
        """``TransformerEncoderLayer``'s fused fast path, decomposed into its parts."""
        (src, embed, heads, qkv_w, qkv_b, proj_w, proj_b, use_gelu, norm_first, eps,
         n1w, n1b, n2w, n2b, f1w, f1b, f2w, f2b) = node.args[:18]
        if len(node.args) > 18 and node.args[18] is not None:
            raise self.unsupported(node, "encoder layer with an attention mask")
        x = self.val(node, src)
        if x.layer is None:
            raise self.unsupported(node, "encoder layer on concatenated neurons")
        k = self.key
        act = "gelu" if use_gelu else "relu"

        def norm(v, w, b):
            dst = self.new_layer(self.layers[v.layer].size, "norm")
            self.add_op(node, kind="layer_norm", relation="norm", src_layer=v.layer, dst_layer=dst,
                        weight_key=k(w), bias_key=k(b), eps=float(eps), kernel=[1, 1])
            return self.Val(dst, True, v.spatial)

        def linear(v, w, b, activation="identity"):
            wk = k(w)
            out_f, in_f = (int(s) for s in self.state[wk].shape)
            dst = self.new_layer(out_f, "linear")
            self.add_op(node, kind="linear", relation="linear", src_layer=v.layer, dst_layer=dst, weight_key=wk,
                        bias_key=k(b), weight_shape=[out_f, in_f], kernel=[1, 1], groups=1)
            self.layers[dst].activation = activation
            return self.Val(dst, True, v.spatial)

        def residual(skip, target):
            self.add_op(node, kind="residual", relation="residual", src_layer=skip.layer, dst_layer=target.layer,
                        kernel=[1, 1])
            return target

        def attention(v):
            return self._attention(node, v, int(embed), k(qkv_w), k(qkv_b), k(proj_w), k(proj_b), int(heads))

        if norm_first:
            h = residual(x, attention(norm(x, n1w, n1b)))
            out = residual(h, linear(linear(norm(h, n2w, n2b), f1w, f1b, act), f2w, f2b))
        else:
            h = norm(residual(x, attention(x)), n1w, n1b)
            out = norm(residual(h, linear(linear(h, f1w, f1b, act), f2w, f2b)), n2w, n2b)
        self.vals[node.name] = out


register(tracer=AttentionTracing, aten={aten._transformer_encoder_layer_fwd.default: "encoder_layer"})
