"""Operation kinds: one module per kind (or small family), each registered under ``OpKind``.

A plan's operations are typed records (``Op`` subclasses); the plan JSON stores each as the dict
``Op.to_dict`` gives, and ``op_from_dict`` reads it back by its ``kind``.
"""
from pipeline.neural_graph.ops.base import (REGISTRY, SPEC_HANDLERS, SPEC_MIXINS, TRACE_HANDLERS, TRACER_MIXINS,
                                            DenseOp, DiagonalOp, Op, OpKind, make_op, op_from_dict)
from pipeline.neural_graph.ops import attention, conv, embedding, gate, linear, norm, residual, tokens

# Importing a kind's module registers it; this is the list of them.
KIND_MODULES = (conv, linear, attention, norm, residual, embedding, tokens, gate)

__all__ = ["KIND_MODULES", "REGISTRY", "SPEC_HANDLERS", "SPEC_MIXINS", "TRACE_HANDLERS", "TRACER_MIXINS", "DenseOp", "DiagonalOp",
           "Op", "OpKind", "make_op", "op_from_dict"]
