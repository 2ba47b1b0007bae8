"""The read-only Cypher surface: which statements ``graphstore cypher`` runs without ``--write``.

The database enforces read-only access where it can (a read-only Ladybug database; a read access
mode transaction on Neo4j). On top of that, a statement is refused before it reaches the database
when, outside string literals, comments and back-quoted names, it:

- uses a clause that writes or reaches the file system, the network or the server's
  administration (CREATE, MERGE, DELETE, SET, REMOVE, DROP, LOAD, COPY, INSTALL, ATTACH, ...);
- calls a procedure other than the schema ones listed in ``READ_PROCEDURES``, or sets an option
  (Ladybug's ``CALL threads = 4``);
- holds more than one statement.

A word glued to a number (``LIMIT 1LOAD FROM ...``) is read as the engine reads it, a number and then
a word: the letters inside a token that starts with a digit are checked as words too.
"""
from __future__ import annotations

import re
import unicodedata

from zoocore.errors import StoreError

REFUSED_CLAUSES = frozenset({
    "CREATE", "MERGE", "DELETE", "DETACH", "SET", "REMOVE", "DROP", "ALTER", "FOREACH", "LOAD", "COPY",
    "INSTALL", "UNINSTALL", "ATTACH", "USE", "IMPORT", "EXPORT", "BEGIN", "COMMIT", "ROLLBACK", "CHECKPOINT",
    "GRANT", "DENY", "REVOKE", "START", "STOP", "TERMINATE", "RENAME", "ENABLE", "DISABLE",
})
READ_PROCEDURES = frozenset({
    # Neo4j
    "db.labels", "db.relationshiptypes", "db.propertykeys", "db.schema.visualization",
    "db.schema.nodetypeproperties", "db.schema.reltypeproperties", "db.indexes", "db.constraints",
    "dbms.components",
    # Ladybug
    "table_info", "show_tables", "show_connection", "show_functions", "db_version", "current_setting",
})


class CypherRefused(StoreError):
    """A statement that the read-only Cypher surface does not run."""


_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<comment>//[^\n]*|/\*.*?(?:\*/|\Z))
  | (?P<string>'(?:[^'\\]|\\.|'')*(?:'|\Z)|"(?:[^"\\]|\\.|"")*(?:"|\Z))
  | (?P<quoted>`(?:[^`]|``)*(?:`|\Z))
  | (?P<word>[^\W\d]\w*)
  | (?P<number>\d[\w.]*)
  | (?P<punct>.)
""", re.S | re.X)


_GLUED = re.compile(r"[^\W\d_]+")        # the letter runs of a token that starts with a digit


def tokens(query: str) -> list[tuple[str, str]]:
    """``query`` as (kind, text) tokens: word, quoted (a back-quoted name, unquoted), string,
    number, punct; spaces and comments dropped. Unicode letters make words, as in Cypher."""
    out = []
    for m in _TOKEN.finditer(query):
        kind = m.lastgroup
        if kind in ("space", "comment"):
            continue
        text = m.group()
        if kind == "quoted":
            text = text[1:-1].replace("``", "`") if text.endswith("`") and len(text) > 1 else text[1:]
        out.append((kind, text))
    return out


def code_only(query: str) -> str:
    """``query`` with comments removed and string literals and back-quoted names blanked."""
    return " ".join("''" if k == "string" else "`x`" if k == "quoted" else t for k, t in tokens(query))


def _procedure(toks: list[tuple[str, str]], i: int) -> tuple[str | None, int]:
    """The dotted procedure name starting at token ``i`` (back-quoted parts unquoted), and the
    index after it; None when no name starts there."""
    parts = []
    while i < len(toks) and toks[i][0] in ("word", "quoted"):
        parts.append(toks[i][1])
        i += 1
        if i < len(toks) and toks[i] == ("punct", "."):
            i += 1
            continue
        break
    return (".".join(parts) if parts else None), i


def check_read_only(query: str) -> None:
    """Raise CypherRefused when ``query`` is not a single read-only statement (see the module)."""
    hint = " (graphstore cypher is read-only; an administrator can add --write)"
    toks = tokens(query)
    while toks and toks[-1] == ("punct", ";"):
        toks.pop()
    if ("punct", ";") in toks:
        raise CypherRefused("one statement at a time: the query holds several (separated by ;)" + hint)
    if not toks:
        raise CypherRefused("empty query" + hint)
    for i, (kind, text) in enumerate(toks):
        if kind == "number":
            for glued in _GLUED.findall(text):
                word = unicodedata.normalize("NFKC", glued).upper()
                if word in REFUSED_CLAUSES or word == "CALL":
                    raise CypherRefused(f"{word} is not allowed: it writes, or reads or writes files or server state "
                                        f"(here glued to a number, {text[:40]!r})" + hint)
            continue
        if kind != "word":
            continue
        word = unicodedata.normalize("NFKC", text).upper()
        before = toks[i - 1][1] if i else ""
        after = toks[i + 1][1] if i + 1 < len(toks) else ""
        if word in REFUSED_CLAUSES:
            if before in (".", ":", "$") or after == ":":      # a property, label, parameter or map key
                continue
            raise CypherRefused(f"{word} is not allowed: it writes, or reads or writes files or server state" + hint)
        if word == "CALL" and before not in (".", ":", "$") and after != ":":
            if after == "{":                                   # a subquery: its clauses are checked as words
                continue
            name, j = _procedure(toks, i + 1)
            if name is None:
                raise CypherRefused(f"CALL {after} is not allowed: CALL takes a procedure name or a subquery" + hint)
            if j < len(toks) and toks[j] == ("punct", "="):
                raise CypherRefused(f"CALL {name} = ... changes a setting" + hint)
            if name.lower() not in READ_PROCEDURES:
                raise CypherRefused(f"CALL {name} is not allowed; the schema procedures are "
                                    f"{', '.join(sorted(READ_PROCEDURES))}" + hint)
