"""What the three CLIs share: error translation at the edge, output formats, the --catalog option."""
from __future__ import annotations

import csv
import functools
import io
import json
import math
import sys
from typing import Any, Callable, Sequence

import click

from zoocore.errors import ZooGraphError

FORMATS = ("table", "json", "csv")


INTERRUPTED_EXIT = 130       # the shell's code for a command stopped by Ctrl-C (128 + SIGINT)


def translate_errors(fn: Callable) -> Callable:
    """Run a command body; a ZooGraphError becomes ``Error: <message>`` and exit code 1, Ctrl-C
    one line and exit code 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ZooGraphError as exc:
            raise click.ClickException(short_message(str(exc))) from exc
        except OSError as exc:           # a path that is a file, a full disk, a permission: one line
            where = f": {exc.filename}" if getattr(exc, "filename", None) else ""
            raise click.ClickException(f"{exc.strerror or exc}{where}") from exc
        except RecursionError as exc:
            raise click.ClickException("the input is nested too deeply to process") from exc
        except MemoryError as exc:
            raise click.ClickException("out of memory") from exc
        except KeyboardInterrupt:
            click.echo("\nInterrupted (Ctrl-C); nothing half-written is left visible in the catalog.", err=True)
            raise click.exceptions.Exit(INTERRUPTED_EXIT)

    return wrapper


MAX_MESSAGE = 2000


def short_message(text: str, limit: int = MAX_MESSAGE) -> str:
    """An error message cut to ``limit`` characters (a hostile input can make one of megabytes)."""
    return text if len(text) <= limit else text[:limit] + f" ... ({len(text) - limit} more characters)"


class FiniteRange(click.FloatRange):
    """``click.FloatRange`` that also refuses ``nan`` and ``inf`` (which compare false with any bound)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


class Seconds(click.ParamType):
    """A finite, non-negative number of seconds (``nan`` and ``inf`` are refused as usage errors)."""

    name = "seconds"

    def convert(self, value, param, ctx):
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not math.isfinite(seconds) or seconds < 0:
            self.fail(f"{value!r} is not a finite number of seconds >= 0 (0: no limit)", param, ctx)
        return seconds


def timeout_option(fn: Callable) -> Callable:
    return click.option("--timeout", type=Seconds(), default=60.0, show_default=True,
                        metavar="SECONDS", help="Stop the query after this many seconds (0: no limit).")(fn)


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.6g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, default=str)
    return str(v)


def format_rows(columns: Sequence[str], rows: Sequence[Sequence[Any]], fmt: str = "table",
                max_width: int = 48) -> str:
    """Render a result as an aligned table, JSON records or CSV."""
    if fmt == "json":
        return json.dumps([dict(zip(columns, r)) for r in rows], indent=1, default=str)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(columns)
        w.writerows([[_cell(v) for v in r] for r in rows])
        return buf.getvalue().rstrip("\n")
    cells = [[_cell(v)[:max_width] for v in r] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(out)


def catalog_option(fn: Callable) -> Callable:
    return click.option("--catalog", "catalog", type=click.Path(file_okay=False), default=None, metavar="DIR|URL",
                        help="Catalog folder, or object storage URL such as s3://bucket/catalog (credentials "
                             "and endpoint from AWS_* variables) (default: $ZOOGRAPH_CATALOG or ./catalog).")(fn)


def parse_params(pairs: Sequence[str]) -> dict[str, Any]:
    """``k=v`` pairs; values parsed as JSON when they are JSON (numbers, true, lists), else strings."""
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise click.BadParameter(f"{pair!r} is not of the form key=value", param_hint="--param")
        k, v = pair.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def echo_err(msg: str) -> None:
    click.echo(msg, err=True)


def is_tty() -> bool:
    return sys.stderr.isatty()
