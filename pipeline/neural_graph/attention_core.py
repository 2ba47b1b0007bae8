"""Attention written out as matrix products (Hugging Face BERT, GPT-2, ViT; any module that calls
a softmax or ``scaled_dot_product_attention`` on projections of one input).

The module that calls the softmax is read as one block: its parameter-free inside (head
reshapes, scores, masks, softmax, dropout, the weighted sum) makes no neurons of its own. What
the graph keeps is the projections: query, key and value neuron layers fed by the block's input
(``attn_q`` / ``attn_k`` / ``attn_v`` edges), and an output projection inside the block, if any,
fed by the value neurons (``attn_o``), as for ``nn.MultiheadAttention``. Without one (BERT keeps
its output projection in the next module) the block's output neurons are the value neurons.

Which projection is which is read from the data flow: the query reaches the first operand of the
scores product, the key its second, the value the product with the softmax. A fused projection
(GPT-2's ``c_attn``, split into three) gives row blocks of one parameter. GPT-2's ``Conv1D``
stores its weight as (in, out): such ops are marked ``transposed``.

Windowed attention (Swin, MaxViT): the window layout inside the block (padding, shifts by
``roll``, window partition, shift masks made from constants) moves tokens only and makes no
neurons; each ``roll`` is recorded as a step. A relative-position bias and a logit scale are
learned per-head score terms of the block (position_bias.py). A projection bias with rows zeroed
at call time (Swin V2 ignores its key bias) keeps the parameter, with ``zeroed_bias_rows`` noted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.neural_graph.position_bias import PositionBiasOps

aten = torch.ops.aten

SOFTMAX_OPS = {aten._softmax.default}
SDPA_OPS = {aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default}
if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
    SDPA_OPS.add(aten._scaled_dot_product_flash_attention_for_cpu.default)
MATMUL_OPS = {aten.bmm.default, aten.mm.default}
LINEAR_OPS = {aten.addmm.default, aten.mm.default, aten.linear.default}
SPLIT_OPS = {aten.split.Tensor, aten.split_with_sizes.default}


@dataclass
class AttentionCore:
    path: str
    nodes: list
    names: set
    core: object            # the softmax or scaled_dot_product_attention node


def _paths(node, clean) -> list[str]:
    return [clean(p) for p, _ in (node.meta.get("nn_module_stack") or {}).values()]


def attention_cores(graph, clean) -> dict[str, AttentionCore]:
    """Blocks of functional attention, by node name: every node inside the innermost module that
    calls a softmax / scaled_dot_product_attention (nn.MultiheadAttention is handled elsewhere)."""
    blocks: dict[str, AttentionCore] = {}
    cores = [n for n in graph.nodes if n.op == "call_function" and (n.target in SOFTMAX_OPS or n.target in SDPA_OPS)]
    for core in cores:
        stack = list((core.meta.get("nn_module_stack") or {}).values())
        if not stack or any(isinstance(t, type) and issubclass(t, torch.nn.MultiheadAttention) for _, t in stack):
            continue
        path = clean(stack[-1][0])
        if any(b.path == path for b in blocks.values()):
            continue
        nodes = [n for n in graph.nodes if n.op == "call_function" and path in _paths(n, clean)]
        blk = AttentionCore(path, nodes, {n.name for n in nodes}, core)
        for n in nodes:
            blocks[n.name] = blk
    return blocks


def _ancestors(node, names: set) -> set:
    out, todo = set(), [node]
    while todo:
        n = todo.pop()
        for a in n.all_input_nodes:
            if a.name in names and a.name not in out:
                out.add(a.name)
                todo.append(a)
    return out


class AttentionCoreOps(PositionBiasOps):
    """Tracer handler for AttentionCore blocks (mixed into plan._Tracer)."""

    def _is_projection(self, node) -> bool:
        if node.target not in LINEAR_OPS:
            return False
        w = node.args[1] if node.target in (aten.mm.default, aten.linear.default) else node.args[2]
        return isinstance(w, torch.fx.Node) and (w.name in self.param_of or (
            w.target is aten.t.default and w.args[0].name in self.param_of))

    def _projection(self, node):
        """(weight key, bias key, transposed) of a linear ATen node inside a block."""
        if node.target is aten.addmm.default:
            b, _, wt = node.args[:3]
        elif node.target is aten.mm.default:
            b, (_, wt) = None, node.args
        else:
            _, wt, b = (list(node.args) + [None])[:3]
            return self.key(wt), self._bias_key(b), False
        if isinstance(wt, torch.fx.Node) and wt.target is aten.t.default:
            return self.key(wt.args[0]), self._bias_key(b), False
        return self.key(wt), self._bias_key(b), True

    def _projection_shape(self, node, in_size: int, what: str, mismatch: str):
        """(weight key, bias key, transposed, parameter shape, out features, in features) of a
        projection that must read ``in_size`` neurons (``what`` it is, ``mismatch`` when it does not)."""
        wkey, bkey, transposed = self._projection(node)
        if wkey is None:
            raise self.unsupported(node, f"{what} whose weight is not a parameter")
        shape = [int(s) for s in self.state[wkey].shape]
        out_f, in_f = (shape[1], shape[0]) if transposed else (shape[0], shape[1])
        if in_f != in_size:
            raise self.unsupported(node, f"{what} {mismatch}", f"{in_f} inputs, {in_size} neurons")
        return wkey, bkey, transposed, shape, out_f, in_f

    def _bias_key(self, b) -> str | None:
        """The parameter behind a projection's bias, also when rows of a copy of it are zeroed first
        (``b.clone()[k0:k1].zero_()``: exported as a slice_scatter of zeros into the clone)."""
        if isinstance(b, torch.fx.Node) and b.target is aten.slice_scatter.default:
            base, src = b.args[0], b.args[1]
            while isinstance(src, torch.fx.Node) and src.target not in (aten.zero.default, aten.zeros_like.default):
                src = src.args[0] if src.args and isinstance(src.args[0], torch.fx.Node) else None
            while isinstance(base, torch.fx.Node) and base.target is aten.clone.default:
                base = base.args[0]
            key = self.key(base)
            dim = b.args[2] if len(b.args) > 2 else 0
            if src is None or key is None or dim != 0:
                raise self.unsupported(b, "projection bias computed other than by zeroing rows of a parameter")
            start, end = (list(b.args[3:5]) + [None, None])[:2]
            self._zeroed_rows = [int(start or 0), int(end if end is not None else self.state[key].shape[0])]
            return key
        return self.key(b)

    def attention_core(self, node, blk: AttentionCore) -> None:
        names = blk.names
        outside = {a.name: a for n in blk.nodes for a in n.all_input_nodes if a.name not in names}
        neurons = {k: self.vals[k] for k in outside if isinstance(self.vals.get(k), type(self).Val)}
        if len(neurons) != 1:
            raise self.unsupported(blk.core, "attention other than self-attention on one input",
                                   f"{len(neurons)} neuron inputs")
        (x_name, x), = neurons.items()
        core = blk.core
        pb = self.find_position_bias(blk)
        inner = {n.name for n in pb.mlp} if pb else set()       # a position-bias MLP's products are not scores
        if core.target in SDPA_OPS:
            q_from, k_from, v_from = (_ancestors(core.args[i], names) | {core.args[i].name} for i in range(3))
            after = {core.name}
        else:
            scores = [blk.nodes[i] for i in range(len(blk.nodes)) if blk.nodes[i].target in MATMUL_OPS
                      and blk.nodes[i].name in _ancestors(core, names) and blk.nodes[i].name not in inner]
            users = [n for n in blk.nodes if n.target in MATMUL_OPS and core.name in _ancestors(n, names)]
            if not scores or not users:
                raise self.unsupported(core, "softmax that is not between a scores product and a weighted sum")
            s, ctx = scores[-1], users[0]
            q_from = _ancestors(s.args[0], names) | {s.args[0].name}
            k_from = _ancestors(s.args[1], names) | {s.args[1].name}
            v_from = _ancestors(ctx.args[1], names) | {ctx.args[1].name}
            after = {ctx.name}
        projections = [n for n in blk.nodes if self._is_projection(n) and n.name not in inner]
        late = [n for n in projections if after & (_ancestors(n, names) | {n.name})]
        early = [n for n in projections if n not in late]
        width = self.width(x)
        heads = pb.heads if pb else self._core_heads(blk, width)
        layers = {}
        for p in early:
            self._zeroed_rows = None
            wkey, bkey, transposed, shape, out_f, in_f = self._projection_shape(
                p, width, "attention projection", "whose inputs do not match the neurons")
            roles = [r for r, src in (("q", q_from), ("k", k_from), ("v", v_from)) if p.name in src]
            if len(roles) == 1:
                parts = [(roles[0], None)]
            elif len(roles) == 3 and out_f % 3 == 0:
                parts = [(r, [i * out_f // 3, (i + 1) * out_f // 3]) for i, r in enumerate(self._split_order(
                    p, names, q_from, k_from, v_from))]
            else:
                raise self.unsupported(p, "attention projection of no single role", f"roles {roles}")
            for role, rows in parts:
                size = out_f if rows is None else rows[1] - rows[0]
                dst = self.new_layer(size, "attention")
                op = dict(kind="linear", relation=f"attn_{role}", **self.source(p, x), dst_layer=dst, weight_key=wkey,
                          bias_key=bkey, weight_shape=[size, in_f], kernel=[1, 1], groups=1, heads=heads)
                if rows is not None:
                    op.update(rows=rows, param_shape=shape)
                if transposed:
                    op["transposed"] = True
                if self._zeroed_rows is not None:
                    op["zeroed_bias_rows"] = self._zeroed_rows
                self.add_op(p, **op)
                layers[role] = dst
        if set(layers) != {"q", "k", "v"}:
            raise self.unsupported(core, "attention whose query, key and value projections were not all found")
        out = layers["v"]
        if len(late) > 1:
            raise self.unsupported(late[1], "attention with several output projections")
        for p in late:
            wkey, bkey, transposed, _, out_f, in_f = self._projection_shape(
                p, self.layers[out].size, "attention output projection", "that does not read the values")
            dst = self.new_layer(out_f, "attention_out")
            op = dict(kind="linear", relation="attn_o", src_layer=out, dst_layer=dst, weight_key=wkey, bias_key=bkey,
                      weight_shape=[out_f, in_f], kernel=[1, 1], groups=1, heads=heads)
            if transposed:
                op["transposed"] = True
            self.add_op(p, **op)
            out = dst
        if pb:
            self.position_bias_ops(pb, layers["q"])
        self.logit_scale_ops(blk, layers["q"], heads)
        for n in blk.nodes:
            if n.target is aten.roll.default:
                self.steps.append({"step": "roll", "layer": layers["q"], "shifts": list(n.args[1]),
                                   "dims": list(n.args[2]) if len(n.args) > 2 else []})
        for n in blk.nodes:                     # every parameter or buffer the block reads is accounted for
            for a in n.all_input_nodes:
                if a.name in self.param_of and self.param_of[a.name] not in self.used_keys \
                        and self.param_of[a.name] not in self.constant_keys and self.param_of[a.name] in self.state:
                    raise self.unsupported(n, "attention that reads parameters other than its projections",
                                           self.param_of[a.name])
        result = type(x)(out, True, x.spatial)
        for n in blk.nodes:
            if any(u.name not in names for u in n.users):
                self.vals[n.name] = result

    def _split_order(self, proj, names, q_from, k_from, v_from) -> list[str]:
        """Roles of the chunks of a fused projection, in row order (read from its split's getitems)."""
        for n in proj.users:
            todo = [n]
            while todo:
                m = todo.pop()
                if m.target in SPLIT_OPS:
                    order = {}
                    for g in m.users:
                        for r, src in (("q", q_from), ("k", k_from), ("v", v_from)):
                            if g.name in src:
                                order[int(g.args[1])] = r
                    if sorted(order) == [0, 1, 2]:
                        return [order[i] for i in range(3)]
                if m.name in names or m.target in (aten.view.default, aten._unsafe_view.default):
                    todo.extend(m.users)
        return ["q", "k", "v"]

    @staticmethod
    def _core_heads(blk: AttentionCore, width: int) -> int:
        for n in blk.nodes:
            val = n.meta.get("val")
            shape = tuple(getattr(val, "shape", ()) or ())
            if len(shape) == 4 and n.target in (aten.view.default, aten._unsafe_view.default) \
                    and shape[-2] * shape[-1] == width and shape[-1] < width:
                return int(shape[-2])
        return 1
