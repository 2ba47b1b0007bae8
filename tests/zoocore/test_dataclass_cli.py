"""Options generated from dataclass fields: one field is one option, with its default, type and help."""
from dataclasses import dataclass

import click
import pytest
from click.testing import CliRunner

from zoocore.dataclass_cli import click_options, from_options, option


@dataclass
class Part:
    width: int = option(8, "How wide.", type=click.IntRange(min=1))
    rate: float = option(0.5, "How fast.")
    on: bool = option(True, "A switch that is on.")
    off: bool = option(False, "A switch that is off.")
    kind: str = option("a", "Which.", type=click.Choice(["a", "b"]))
    scales: tuple[float, ...] = option((), "Repeatable.", type=float)
    name: str | None = option(None, "Optional text.")
    hidden: int = 3                           # not an option


@dataclass
class Whole(Part):
    extra: int = option(1, "A field of the subclass.")


def _run(args):
    seen = {}

    @click.command()
    @click_options(Whole)
    def cmd(**options):
        seen["cfg"] = from_options(Whole, options)

    res = CliRunner().invoke(cmd, args)
    return res, seen.get("cfg")


def test_no_options_give_the_dataclass_defaults():
    res, cfg = _run([])
    assert res.exit_code == 0, res.output
    assert cfg == Whole()


def test_each_kind_of_field_parses_to_its_type():
    res, cfg = _run(["--width", "3", "--rate", "2", "--no-on", "--off", "--kind", "b", "--scales", "10",
                     "--scales", "100", "--name", "x", "--extra", "7"])
    assert res.exit_code == 0, res.output
    assert cfg == Whole(width=3, rate=2.0, on=False, off=True, kind="b", scales=(10.0, 100.0), name="x", extra=7,
                        hidden=3)


@pytest.mark.parametrize("args, says", [(["--width", "0"], "x>=1"), (["--kind", "c"], "'c' is not one of"),
                                        (["--hidden", "4"], "No such option"), (["--rate", "x"], "not a valid float")])
def test_bad_values_and_fields_that_are_not_options_are_refused(args, says):
    res, cfg = _run(args)
    assert res.exit_code == 2 and says in res.output and cfg is None


def test_help_comes_from_the_fields():
    res = CliRunner().invoke(click.command()(click_options(Whole)(lambda **o: None)), ["--help"])
    for text in ("--width", "How wide.", "--on / --no-on", "--off", "Repeatable.", "A field of the subclass."):
        assert text in res.output
    assert "--hidden" not in res.output


def test_a_mutable_default_is_refused():
    with pytest.raises(TypeError, match="use a tuple"):
        option([], "a list")
