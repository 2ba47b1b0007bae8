"""The read-only Cypher surface: which statements ``graphstore cypher`` runs without ``--write``.

The database enforces read-only access where it can (a read-only Ladybug database; a read access
mode transaction on Neo4j). On top of that, a statement is refused before it reaches the database
when, outside string literals, comments and back-quoted names, it:

- uses a clause that writes or reaches the file system, the network or the server's
  administration (CREATE, MERGE, DELETE, SET, REMOVE, DROP, LOAD, COPY, INSTALL, ATTACH, ...);
- calls a procedure other than the schema ones listed in ``READ_PROCEDURES``, or sets an option
  (Ladybug's ``CALL threads = 4``);
- holds more than one statement.
"""
from __future__ import annotations

import re

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


_LEXEME = re.compile(r"""
    (?P<comment>//[^\n]*|/\*.*?(?:\*/|\Z))
  | (?P<string>'(?:[^'\\]|\\.|'')*(?:'|\Z)|"(?:[^"\\]|\\.|"")*(?:"|\Z))
  | (?P<name>`(?:[^`]|``)*(?:`|\Z))
""", re.S | re.X)
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CALL = re.compile(r"\bCALL\s+([A-Za-z_][A-Za-z0-9_.]*)\s*(=)?", re.I)


def code_only(query: str) -> str:
    """``query`` with comments removed and string literals and back-quoted names blanked."""
    def blank(m: re.Match) -> str:
        if m.group("comment"):
            return " "
        return "''" if m.group("string") else "`x`"
    return _LEXEME.sub(blank, query)


def check_read_only(query: str) -> None:
    """Raise CypherRefused when ``query`` is not a single read-only statement (see the module)."""
    code = code_only(query)
    hint = " (graphstore cypher is read-only; an administrator can add --write)"
    if ";" in code.rstrip().rstrip(";"):
        raise CypherRefused("one statement at a time: the query holds several (separated by ;)" + hint)
    for m in _WORD.finditer(code):
        word = m.group().upper()
        if word not in REFUSED_CLAUSES:
            continue
        before = code[:m.start()].rstrip()[-1:]
        after = code[m.end():].lstrip()[:1]
        if before in (".", ":", "$") or after == ":":      # a property, label, parameter or map key
            continue
        raise CypherRefused(f"{word} is not allowed: it writes, or reads or writes files or server state" + hint)
    for m in _CALL.finditer(code):
        name = m.group(1).lower()
        if m.group(2):
            raise CypherRefused(f"CALL {m.group(1)} = ... changes a setting" + hint)
        if name not in READ_PROCEDURES:
            raise CypherRefused(f"CALL {m.group(1)} is not allowed; the schema procedures are "
                                f"{', '.join(sorted(READ_PROCEDURES))}" + hint)
