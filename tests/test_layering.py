"""The packages form layers and no module imports itself back, directly or through others.

zoocore (errors, configuration, CLI helpers) <- graphstore (catalog, SQL, graph stores)
<- pipeline (conversion, zoos, ingest) <- jobs (metanetworks, training, analytics): a package
imports only from layers below it. Imports inside functions count too: a lazy import hides a
cycle from Python, not from a reader.
"""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["zoocore", "graphstore", "pipeline", "jobs"]


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    mods = {}
    for package in LAYERS:
        for f in (root / package).rglob("*.py"):
            name = ".".join(f.relative_to(root).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = f
    return mods


def import_graph(mods: dict[str, Path]) -> nx.DiGraph:
    """module -> project module it imports (a name resolves to its longest module prefix)."""

    def resolve(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for target in targets:
                dep = resolve(target)
                # a module's own package (its __init__) is not an import of something else
                if dep and dep != name and not name.startswith(dep + "."):
                    g.add_edge(name, dep)
    return g


def test_no_module_imports_itself_back():
    cycles = [c for c in nx.simple_cycles(import_graph(project_modules()))]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c + [c[0]]) for c in cycles[:10])


def test_packages_import_only_from_layers_below():
    rank = {p: i for i, p in enumerate(LAYERS)}
    upward = sorted(f"{a} imports {b}" for a, b in import_graph(project_modules()).edges
                    if rank[b.split(".")[0]] > rank[a.split(".")[0]])
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_the_check_sees_a_cycle(tmp_path):
    """The walker itself: two modules importing each other (one lazily) are found."""
    for package in LAYERS:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "jobs" / "a.py").write_text("from jobs.b import thing\n")
    (tmp_path / "jobs" / "b.py").write_text("def thing():\n    from . import a\n    import graphstore\n")
    (tmp_path / "graphstore" / "c.py").write_text("from jobs import a\n")
    g = import_graph(project_modules(tmp_path))
    assert sorted(map(sorted, nx.simple_cycles(g))) == [["jobs.a", "jobs.b"]]
    assert ("graphstore.c", "jobs.a") in g.edges and ("jobs.b", "graphstore") in g.edges
