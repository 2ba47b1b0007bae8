"""Operation kinds: one module per kind (or small family), each found here and registered by itself.

A plan's operations (``Plan.ops``) are typed records, ``Op`` subclasses. The plan JSON stores each
as the dict ``Op.to_dict`` gives (``kind`` plus the record's fields), and ``op_from_dict`` reads it
back through the registry; an unknown kind fails with the known ones named. Everything a kind
does lives in its module:

- reading it from a trace: a tracer mixin whose methods take an fx node (``conv.ConvTracing``),
  registered with the ATen ops they handle, or with the module classes whose nodes they read as
  one call (``upsample.UpsampleTracing``: torch.export writes ``nn.Upsample`` out as index
  arithmetic); ``plan._Tracer`` is built from the registered mixins and dispatches on
  ``TRACE_HANDLERS`` and ``MODULE_HANDLERS``. A kind with no edges (``upsample``) registers no
  record, only its tracer, and records a plan step;
- reading it from a spec: a spec-planner mixin (``conv.ConvSpec``), registered with the module
  classes it handles (``SPEC_HANDLERS``); a kind with no spec rule leaves such specs to the tracer;
- its edges and inverse (``build.py``): ``edges``/``expected_edges`` and ``invert``/``invert_bias``,
  usually inherited from ``DenseOp`` (a weight read as (out, in-per-group, kh, kw) blocks) or
  ``DiagonalOp`` / ``ChannelParams`` (channel c -> channel c), with hooks such as
  ``weight_blocks``, ``bias_values`` or ``node_stats`` where the kind's tensors differ;
- the neurons it ties (``symmetry.py``): ``permutation_ties``, ``scaling_ties``, ``rescale``,
  ``incoming``;
- its summary (``summarize_plan``): ``describe``.

Adding a kind
-------------
1. A module here with the record (``@dataclass(kw_only=True)``, ``kind = "name"`` as the plan JSON
   will store it, a base class from ``base.py``, fields for what the plan must remember; fields
   that are only sometimes written are ``optional()``), the tracer mixin (and spec mixin, if specs
   can build it), and the hooks whose defaults do not fit.
2. Registration: a ``register(Record, tracer=..., aten=..., spec=..., modules=..., spec_layers=...)``
   call at the bottom of the module. Every module of this package is imported below, in name order,
   so nothing else names it.
3. A new relation or node type, if the kind needs one, goes in ``vocabulary.py`` (append only).

Stored plans never change: a field's name and the dict ``to_dict`` writes are part of the catalog
format and of the architecture signature (``tests/pipeline/test_plan_pins.py`` pins them).
"""
import importlib
import pkgutil

from pipeline.neural_graph.ops.base import (MODULE_HANDLERS, REGISTRY, SPEC_HANDLERS, SPEC_LAYERS, SPEC_MIXINS,
                                            TRACE_HANDLERS, TRACER_MIXINS, DenseOp, DiagonalOp, Op, make_op,
                                            op_from_dict)

# Importing a kind's module registers it: every module of this package is one (base.py holds the registry).
KIND_MODULES = tuple(importlib.import_module(f"{__name__}.{m.name}")
                     for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name) if m.name != "base")

__all__ = ["KIND_MODULES", "MODULE_HANDLERS", "REGISTRY", "SPEC_HANDLERS", "SPEC_LAYERS", "SPEC_MIXINS",
           "TRACE_HANDLERS", "TRACER_MIXINS", "DenseOp", "DiagonalOp", "Op", "make_op", "op_from_dict"]
