"""torchvision classification builders: convert with parameter-implied counts, or fail clearly."""
import pytest

from pipeline.neural_graph.coverage import check_builder


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_builders_that_convert(name):
    row = check_builder(name)
    assert row.status == "converts" and row.materialised and row.nodes > 1000


@pytest.mark.parametrize("name,what", [("squeezenet1_1", "cat"), ("efficientnet_b0", "SqueezeExcitation")])
def test_builders_that_fail_clearly(name, what):
    row = check_builder(name)
    assert row.status == "unsupported" and "unsupported module at 'features." in row.reason and what in row.reason
