"""``KEY=VALUE`` settings typed by a map of keys to types: the one parser behind every --set."""
import pytest

from zoocore.settings import typed_pairs

TYPES = {"epochs": int, "lr": "float", "bn_stats": "bool", "model": "str", "where": "str | None",
         "columns": "tuple[str, ...]", "scales": "tuple[float, ...]"}


def test_pairs_are_typed_by_their_key():
    got = typed_pairs(["epochs=600", "lr=1e-3", "bn-stats=no", "model=ngt", "where=zoo = 'a'"], TYPES)
    assert got == {"epochs": 600, "lr": 1e-3, "bn_stats": False, "model": "ngt", "where": "zoo = 'a'"}
    assert typed_pairs(["bn_stats=True"], TYPES) == {"bn_stats": True} and typed_pairs([], TYPES) == {}
    # a tuple takes comma-separated items of its type
    assert typed_pairs(["columns=train_accuracy, lr", "scales=10,1e3"], TYPES) == {
        "columns": ("train_accuracy", "lr"), "scales": (10.0, 1000.0)}


@pytest.mark.parametrize("pair, match", [("epochs=many", "epochs must be an integer"), ("lr=fast", "must be a number"),
                                         ("bn_stats=maybe", "true or false"), ("width=3", "one of: bn_stats, columns, epochs"),
                                         ("scales=10,big", "scales must be a number"),
                                         ("epochs", "KEY=VALUE")])
def test_bad_pairs_are_refused_by_name(pair, match):
    with pytest.raises(ValueError, match=match) as err:
        typed_pairs([pair], TYPES, "mlp")
    assert repr(pair) in str(err.value)
