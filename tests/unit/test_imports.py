"""The package's import graph: no circle anywhere, and nothing imports the entry points.

Every `import vldist...` and `from vldist... import ...` of every module counts, those inside
functions too (a deferred import is how a circle usually hides), and importing `vldist.a.b` also
imports the package `vldist.a` (unless that is the importer's own package, which Python imports
before it anyway). Read from the source with `ast`: nothing is imported to look.
"""

import ast
from pathlib import Path

import vldist

ROOT = Path(vldist.__file__).parent
ENTRY_POINTS = {"vldist.train", "vldist.evaluate", "vldist.caption", "vldist.export", "vldist.shards.__main__"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def resolve(name: str) -> str | None:
    """The module `name` refers to: itself, or its package when it names an attribute."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """The vldist modules `module` imports, and the packages above them."""
    tree = ast.parse(MODULES[module].read_text())
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for name in names:
            target = resolve(name) if name.startswith("vldist") else None
            if target is None:
                continue
            found.add(target)  # what it names, even its own package (`from vldist.metrics import x`)
            parent = target.rpartition(".")[0]
            while parent and not module.startswith(parent + "."):  # its own packages come first anyway
                found.add(parent)
                parent = parent.rpartition(".")[0]
    found.discard(module)
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def find_cycle() -> list[str] | None:
    """One import circle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(GRAPH):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_reader_sees_the_imports_it_should():
    """The walk is not vacuous: it finds a deferred import and a package's parent."""
    assert "vldist.recipes.jobs" in GRAPH["vldist.recipes.cl_caption"]  # inside CLCaptionRecipe.stages
    assert "vldist.data" in GRAPH["vldist.recipes.vsrn"]  # the package of vldist.data.collate
    assert "vldist.recipes" not in GRAPH["vldist.recipes.vsrn"]  # its own package: imported before it anyway


def test_no_import_circle():
    cycle = find_cycle()
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_module_imports_an_entry_point():
    importers = {m: sorted(GRAPH[m] & ENTRY_POINTS) for m in GRAPH if GRAPH[m] & ENTRY_POINTS}
    assert not importers, importers
