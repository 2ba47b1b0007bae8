"""The project's one exception hierarchy; the CLIs turn these into messages and exit codes."""


def first_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's first line (its type where it has no text), cut to ``limit`` characters: how
    a third-party error (torch, safetensors, zipfile) is quoted inside one of ours."""
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:limit]


class ZooGraphError(Exception):
    """Base class of every error this project raises on purpose."""


class UnsupportedModuleError(ZooGraphError):
    """A module or operation the neural-graph converter does not cover."""

    def __init__(self, path: str, what: str, detail: str = ""):
        self.path = path or "<root>"
        self.what = what
        msg = f"unsupported module at {self.path!r}: {what}"
        super().__init__(msg + (f" ({detail})" if detail else ""))


class CheckpointError(ZooGraphError):
    """A checkpoint that cannot be read: corrupt, truncated, unsafe or of an unknown format."""


class SpecError(ZooGraphError):
    """An architecture spec (JSON) that is malformed or does not match its state dict."""


class GraphValidationError(ZooGraphError):
    """A neural graph whose arrays are inconsistent (caught before anything is written)."""


class CatalogError(ZooGraphError):
    """The Parquet catalog is missing, malformed, or a query over it failed."""


class QueryRefused(CatalogError):
    """A SQL statement that the read-only query surface does not allow."""


class QueryTimeout(ZooGraphError):
    """A user's query ran past its time limit and was stopped."""


class StoreError(ZooGraphError):
    """The graph store (Neo4j or Ladybug) is unreachable or rejected a query."""


class JobError(ZooGraphError):
    """A training, prediction or analytics job cannot run as asked."""
