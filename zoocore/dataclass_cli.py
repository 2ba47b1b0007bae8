"""Command-line options generated from dataclass fields: a configurable thing owns one dataclass,
and a new hyperparameter is one field.

    @dataclass
    class OptimConfig:
        lr: float = option(1e-3, "Learning rate.")
        calibrate: bool = option(True, "Fit a * p + b on validation.")     # --calibrate/--no-calibrate

    @click.command()
    @click_options(OptimConfig)
    def train(**kwargs):
        cfg = from_options(OptimConfig, kwargs)

A field made with ``option`` carries its help (and any click settings) in its metadata; a field
made without it is not on the command line. Booleans that default to True get an ``--x/--no-x``
pair, those that default to False a flag; a tuple default makes a repeatable option. Click stays
the CLI library: ``click_options`` only writes out the ``click.option`` calls.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import click

HELP = "zoocore.help"
CLICK = "zoocore.click"


def option(default: Any, help: str, **click_settings) -> Any:
    """A dataclass field with ``default`` that is also a command-line option: ``help`` is its help
    text; ``click_settings`` go to ``click.option`` (``type``, ``metavar``, ``flag_name``...)."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("a mutable default needs a default_factory; use a tuple")
    return dataclasses.field(default=default, metadata={HELP: help, CLICK: click_settings})


def cli_fields(*classes: type) -> list[dataclasses.Field]:
    """The fields of ``classes`` that are options, in order, each name once."""
    seen: dict[str, dataclasses.Field] = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            if HELP in f.metadata and f.name not in seen:
                seen[f.name] = f
    return list(seen.values())


def _click_option(f: dataclasses.Field) -> Callable:
    settings = dict(f.metadata[CLICK])
    flag = "--" + settings.pop("flag_name", f.name).replace("_", "-")
    default = f.default
    kwargs: dict[str, Any] = {"default": default, "help": f.metadata[HELP], "show_default": True}
    if isinstance(default, bool) and default:
        decls = [f"{flag}/--no-{flag[2:]}"]
    elif isinstance(default, bool):
        decls = [flag]
        kwargs.update(is_flag=True, show_default=False)
    elif isinstance(default, tuple):
        decls = [flag]
        kwargs.update(multiple=True, show_default=False)
    else:
        decls = [flag]
        if default is not None and "type" not in settings:
            kwargs["type"] = type(default)
    kwargs.update(settings)
    return click.option(*decls, f.name, **kwargs)


def click_options(*classes: type, exclude: tuple[str, ...] = ()) -> Callable:
    """A decorator adding one ``click.option`` per option field of ``classes`` (minus ``exclude``);
    the command receives them as keyword arguments named like the fields."""
    def decorate(fn: Callable) -> Callable:
        for f in reversed(cli_fields(*classes)):
            if f.name not in exclude:
                fn = _click_option(f)(fn)
        return fn

    return decorate


def from_options(cls: type, options: dict[str, Any], **overrides) -> Any:
    """An instance of ``cls`` from a command's keyword arguments (those that are its fields)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{**{k: v for k, v in options.items() if k in names}, **overrides})
