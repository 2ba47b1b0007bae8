"""One entry point per input kind: in-memory module, torch.export archive, state dict + spec."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from pipeline import checkpoints
from pipeline.neural_graph.build import graph_from_plan
from pipeline.neural_graph.graph import NeuralGraph
from pipeline.neural_graph.plan import Plan, plan_from_exported, plan_from_module
from pipeline.neural_graph.spec_plan import plan_from_spec
from pipeline.spec import build_module, example_input, spec_hash, validate_spec
from pipeline.spec_check import check_spec_shapes
from zoocore.errors import CheckpointError, SpecError


@dataclass
class Converted:
    plan: Plan
    graph: NeuralGraph
    state: dict[str, torch.Tensor]
    spec: dict | None = None
    # (program JSON, its non-state tensors) to rebuild the network without a spec: called once per
    # architecture by the ingest (pipeline.neural_graph.runnable.keep_program), None with a spec
    program: Callable[[], tuple[str | None, bytes | None]] | None = None


def convert_module(model: torch.nn.Module, example: torch.Tensor) -> Converted:
    """Trace ``model`` on ``example`` and build its neural graph."""
    plan = plan_from_module(model, example)
    state = {k: v for k, v in model.state_dict().items()}
    return Converted(plan, graph_from_plan(plan, state), state)


def convert_exported(exported) -> Converted:
    """Neural graph of a ``torch.export.ExportedProgram``."""
    from pipeline.neural_graph.runnable import keep_program

    plan = plan_from_exported(exported)
    state = dict(exported.state_dict)
    return Converted(plan, graph_from_plan(plan, state), state,
                     program=lambda: keep_program(exported, plan.state_keys))


class PlanCache:
    """Plans by spec hash: a zoo of one architecture is planned once. A plan is read straight
    from the spec where it can be (pipeline.neural_graph.spec_plan, about a millisecond), and
    traced with torch.export otherwise; ``from_spec`` / ``exported`` count the two."""

    def __init__(self):
        self._plans: dict[str, Plan] = {}
        self.from_spec = 0
        self.exported = 0

    def for_spec(self, spec: dict) -> Plan:
        key = spec_hash(spec)
        if key not in self._plans:
            net = build_module(spec)
            plan = plan_from_spec(net, spec)
            if plan is None:
                plan = plan_from_module(net, example_input(spec))
                self.exported += 1
            else:
                self.from_spec += 1
            self._plans[key] = plan
        return self._plans[key]

    def traced(self, key: str, make):
        """What ``make()`` traces (a plan, with whatever the format keeps beside it), cached under
        the format's own architecture key (a Hugging Face config's hash): made the first time."""
        key = "traced:" + key
        if key not in self._plans:
            self._plans[key] = make()
            self.exported += 1
        return self._plans[key]


def convert_state_dict(state: dict[str, torch.Tensor], spec: dict, cache: PlanCache | None = None,
                       source: str = "state dict") -> Converted:
    """Neural graph of a state dict whose architecture a JSON spec describes (the spec's shapes are
    checked against the tensors before its network is built)."""
    validate_spec(spec)
    check_spec_shapes(spec, {k: tuple(v.shape) for k, v in state.items()}, source)
    plan = (cache or PlanCache()).for_spec(spec)
    extra = sorted(set(state) - set(plan.state_keys))
    if extra:
        raise SpecError(f"state dict has entries the spec does not describe, e.g. {extra[:3]}")
    for key in plan.state_keys:
        if key in state and key not in plan.buffer_keys:
            expected = _expected_shape(plan, key)
            if expected is not None and list(state[key].shape) != expected:
                raise SpecError(f"{key}: shape {list(state[key].shape)} does not match the spec's {expected}")
    return Converted(plan, graph_from_plan(plan, state), state, spec)


def _expected_shape(plan: Plan, key: str) -> list[int] | None:
    for op in plan.ops:
        if op.get("weight_key") == key and "weight_shape" in op:
            return list(op["weight_shape"])
    return None


def convert_checkpoint(path: str | Path, spec: dict | None = None, cache: PlanCache | None = None) -> Converted:
    """Read one checkpoint file safely and convert it.

    ``.pt2`` archives carry their own graph; ``.pt``/``.pth``/``.safetensors`` state dicts need a
    spec: the argument, else the ``architecture`` entry of the JSON sidecar.
    """
    path = Path(path)
    if path.suffix == ".pt2":
        return convert_exported(checkpoints.load_exported(path))
    if path.suffix not in checkpoints.CHECKPOINT_SUFFIXES:
        raise CheckpointError(f"{path}: unknown checkpoint format {path.suffix!r} "
                              f"(expected one of {', '.join(checkpoints.CHECKPOINT_SUFFIXES)})")
    if spec is None:
        spec = checkpoints.read_sidecar(path).get("architecture")
        if spec is None:
            raise SpecError(f"{path}: a state dict needs an architecture spec ('architecture' in "
                            f"{checkpoints.sidecar_path(path).name})")
    validate_spec(spec)
    check_spec_shapes(spec, checkpoints.tensor_shapes(path), str(path))      # before loading or building
    return convert_state_dict(checkpoints.load_state_dict(path), spec, cache, str(path))
