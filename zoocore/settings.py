"""``KEY=VALUE`` settings from the command line, typed by a ``{key: type}`` map.

One parser for every option of this kind (``pipeline zoo make --set``, the benchmarks' ``--set``):
keys may be written with dashes, values become int, float, bool or str by the key's type (a type
or its name, as dataclass fields annotate them). Callers add their own range checks and turn the
ValueError into their own kind of error.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def typed_pairs(pairs: Sequence[str], types: Mapping[str, type | str], what: str = "") -> dict[str, Any]:
    """``["epochs=600", "weight-decay=0.1"]`` -> ``{"epochs": 600, "weight_decay": 0.1}``; a missing
    ``=``, an unknown key or a value of the wrong type raises ValueError naming the pair (and
    ``what`` takes which keys, e.g. "mlp-equivariant")."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in types:
            choices = ", ".join(sorted(types)) or "none"
            raise ValueError(f"{pair!r}: {what + ' takes ' if what else ''}KEY=VALUE with KEY one of: {choices}")
        out[key] = _typed(pair, key, value.strip(), _name(types[key]))
    return out


def _name(t: type | str) -> str:
    return (t if isinstance(t, str) else t.__name__).split("|")[0].strip()


def _typed(pair: str, key: str, value: str, kind: str) -> Any:
    if kind.startswith("tuple["):        # tuple[float, ...]: comma-separated items of the first type
        inner = kind[len("tuple["):].split(",")[0].strip()
        return tuple(_typed(pair, key, v.strip(), inner) for v in value.split(",") if v.strip())
    try:
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
    except ValueError:
        raise ValueError(f"{pair!r}: {key} must be {'an integer' if kind == 'int' else 'a number'}") from None
    if kind == "bool":
        if value.lower() not in TRUE + FALSE:
            raise ValueError(f"{pair!r}: {key} must be true or false")
        return value.lower() in TRUE
    return value
