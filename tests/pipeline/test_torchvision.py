"""torchvision classification builders: convert with parameter-implied counts and an exact inverse
(unsupported operations are covered by tests/pipeline/test_neural_graph.py's refusal tests)."""
import pytest

from pipeline.neural_graph.coverage import check_builder


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "squeezenet1_1", "shufflenet_v2_x0_5",
                                  "mobilenet_v3_small"])
def test_builders_that_convert(name):
    """Counts checked against the parameters and the inverse bit-exact (inside check_builder):
    plain CNNs, concatenations (SqueezeNet), channel shuffles (ShuffleNet), gates (MobileNetV3)."""
    row = check_builder(name)
    assert row.status == "converts" and row.materialised and row.nodes > 1000



def test_the_inverse_is_checked_in_parts_within_the_memory_budget():
    """A graph larger than the budget is built and inverted in runs of operations (q/k/v row blocks
    of one parameter kept together); one operation larger than the budget alone is not checked."""
    import torch

    from pipeline.neural_graph.build import expected_edges
    from pipeline.neural_graph.coverage import check_plan, op_parts
    from pipeline.neural_graph.plan import plan_from_module
    from tests.pipeline.test_windowed_attention import tiny_swin

    model = tiny_swin().eval()
    plan = plan_from_module(model, torch.randn(2, 3, 8, 8))
    state = dict(model.state_dict())
    whole = check_plan("swin", plan, state)
    assert whole.materialised and whole.parts == 1
    frame = plan.kernel_shape[0] * plan.kernel_shape[1]
    budget = max(expected_edges(plan, op) for op in plan.ops) * frame       # the largest operation
    parts = op_parts(plan, budget)
    fused = [i for i, op in enumerate(plan.ops) if "rows" in op]
    assert len(fused) == 12 and all(any({i, i + 1, i + 2} <= set(p) for p in parts) for i in fused[::3])
    split = check_plan("swin", plan, state, budget=budget)
    assert split.materialised and split.parts == len(parts) > 10
    assert (split.nodes, split.edges) == (whole.nodes, whole.edges)
    assert op_parts(plan, budget - 1) is None
    assert not check_plan("swin", plan, state, budget=budget - 1).materialised


class AuxNet(__import__("torch").nn.Module):
    """A head that runs in training only (GoogLeNet's and Inception's auxiliary classifiers)."""

    def __init__(self):
        super().__init__()
        from torch import nn
        self.body, self.head, self.aux = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x):
        h = self.body(x).relu()
        return self.head(h) + self.aux(h) if self.training else self.head(h)


def test_entries_the_evaluated_network_never_reads_are_named_not_inverted():
    import torch

    from pipeline.neural_graph.coverage import check_module

    row = check_module("aux", AuxNet().eval(), torch.randn(2, 4))
    assert row.status == "converts" and row.materialised
    assert row.unread == ["aux.bias", "aux.weight"]
