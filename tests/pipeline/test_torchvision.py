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

