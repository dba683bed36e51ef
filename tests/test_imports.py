"""The package's import graph, read from the source with ``ast`` (module-level imports and the ones
inside functions alike): no cycle between kimik3's modules or between its packages, and no lower
layer importing a higher one.

A unit is a top-level module or package of kimik3 (``kimik3.config``, ``kimik3.engine``, ...);
``kimik3`` itself (its ``__init__``) is the public facade above everything. An import of a
submodule (``from kimik3.model.batch import X``) is an edge to that module only, not to the
parents' ``__init__`` files Python runs first.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kimik3"

# Lowest first. A unit may import units of its own layer or below, never above.
LAYERS: list[tuple[str, ...]] = [
    ("config", "distributed", "kernels"),  # config.json parsing; the collectives context; built CUDA libraries
    ("ops", "chat", "vision"),            # numerics; prompt formats (text only); image preprocessing
    ("tokenizer", "tokenizer_build"),     # the tiktoken tokenizer (renders chats through chat/)
    ("model",),
    ("loader", "testing"),                # checkpoints; tiny checkpoints for tests and benchmarks
    ("parallel",),                        # starting a TP/EP group, the workers' loop (loader + model)
    ("engine",),                          # scheduler, cache, runners (rank 0's ParallelRunner), LLM
    ("inspect", "sizing", "layouts"),     # checkpoint summaries, per-GPU sizing (read engine defaults), layouts
    ("serve", "bench"),
    ("cli",),
    ("",),                                # kimik3/__init__.py: the public names
]
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = ("kimik3", *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit(module: str) -> str:
    """``kimik3.engine.run.runner`` -> ``engine``; ``kimik3`` -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports_of(path: Path, modules: set[str], root: Path = ROOT) -> set[str]:
    """The kimik3 modules ``path`` imports, anywhere in the file."""
    here = module_name(path, root)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:            # `from kimik3.model import batch` imports the module batch
                sub = f"{target}.{a.name}"
                found.add(sub if sub in modules else target)
    return {m for m in found if m == "kimik3" or m.startswith("kimik3.")}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = sorted(root.rglob("*.py"))
    modules = {module_name(p, root) for p in files}
    graph = {}
    for p in files:
        here = module_name(p, root)
        targets = imports_of(p, modules, root)
        unknown = targets - modules
        assert not unknown, f"{p} imports {sorted(unknown)}, which are not modules of kimik3"
        graph[here] = targets - {here}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for a, targets in graph.items():
        units.setdefault(unit(a), set()).update(unit(b) for b in targets if unit(b) != unit(a))
    return units


def part_graphs(graph: dict[str, set[str]]) -> dict[str, dict[str, set[str]]]:
    """For every package P, the graph between its parts (its direct submodules and subpackages, each
    subpackage standing for everything below it): ``{P: {part: parts it imports}}``."""
    packages = {m for m in graph if any(o.startswith(m + ".") for o in graph)}
    out: dict[str, dict[str, set[str]]] = {}
    for pkg in packages:
        prefix = pkg + "."

        def part(m: str) -> str:
            return prefix + m[len(prefix):].split(".")[0]

        parts = out.setdefault(pkg, {})
        for a, targets in graph.items():
            if a.startswith(prefix):
                parts.setdefault(part(a), set()).update(
                    part(b) for b in targets if b.startswith(prefix) and part(b) != part(a))
    return out


def imports_from_own_init(path: Path, modules: set[str], root: Path = ROOT) -> list[str]:
    """The names ``path`` imports from the ``__init__`` of a package it lies in (``from kimik3.engine import
    LLM`` inside kimik3/engine/...), rather than from the submodule that defines them; submodules are fine."""
    here = module_name(path, root)
    if path.name == "__init__.py":
        return []
    package = here.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == package or package.startswith(target + "."):
                found += [f"{here} imports {a.name} from {target}" for a in node.names
                          if f"{target}.{a.name}" not in modules]
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} ({unit(a) or 'kimik3'}, layer {LAYER_OF[unit(a)]}) imports {b} "
            f"({unit(b) or 'kimik3'}, layer {LAYER_OF[unit(b)]})"
            for a, targets in sorted(graph.items()) for b in sorted(targets)
            if LAYER_OF[unit(b)] > LAYER_OF[unit(a)]]


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_every_unit_has_a_layer(graph):
    missing = sorted({unit(m) for m in graph} - set(LAYER_OF))
    assert not missing, f"kimik3 units {missing} are in no layer of tests/test_imports.py LAYERS; place them"


def test_no_module_import_cycle(graph):
    assert cycles(graph) == []


def test_no_package_import_cycle(graph):
    assert cycles(unit_graph(graph)) == []


def test_no_import_cycle_between_the_parts_of_any_package(graph):
    """Inside every package too (kimik3.engine: core, spec, sample, run, images, ...), the parts import one way."""
    found = {pkg: c for pkg, parts in part_graphs(graph).items() if (c := cycles(parts))}
    assert found == {}


def test_no_module_imports_from_its_own_package_init():
    """A module takes a name from the submodule that defines it, never from the __init__ of a package it lies in
    (whose imports it would run first, the start of a cycle)."""
    files = sorted(ROOT.rglob("*.py"))
    modules = {module_name(p) for p in files}
    assert [line for p in files for line in imports_from_own_init(p, modules)] == []


def test_no_lower_layer_imports_a_higher_one(graph):
    assert upward_imports(graph) == []


def test_the_checks_see_cycles_and_upward_imports(tmp_path):
    """The walker on a small tree: a function-level import closing a cycle, a relative import and an
    upward import are all found."""
    pkg = tmp_path / "kimik3"
    (pkg / "model").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("def f():\n    from kimik3.model.layers import Dense\n")
    (pkg / "model" / "__init__.py").write_text("from .layers import Dense\n")
    (pkg / "model" / "layers.py").write_text("from kimik3 import config\nDense = 1\n")
    g = import_graph(pkg)
    assert g["kimik3.model"] == {"kimik3.model.layers"}
    assert g["kimik3.model.layers"] == {"kimik3.config"}
    assert cycles(g) == [["kimik3.config", "kimik3.model.layers"]]
    assert cycles(unit_graph(g)) == [["config", "model"]]
    assert upward_imports(g) == ["kimik3.config (config, layer 0) imports kimik3.model.layers (model, layer 3)"]


def test_the_checks_see_cycles_inside_a_package_and_imports_from_its_init(tmp_path):
    """Two subpackages of one package that import each other form a cycle of its parts; a module taking a
    name from its own package's __init__ is found, a sibling submodule is not."""
    pkg = tmp_path / "kimik3"
    for d in ("engine/core", "engine/spec"):
        (pkg / d).mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("from kimik3.engine.core.a import A\n")
    (pkg / "engine" / "core" / "__init__.py").write_text("")
    (pkg / "engine" / "spec" / "__init__.py").write_text("")
    (pkg / "engine" / "core" / "a.py").write_text("from kimik3.engine.spec.b import B\nA = 1\n")
    (pkg / "engine" / "spec" / "b.py").write_text("from kimik3.engine.core import a\nfrom kimik3.engine import A\nB = 2\n")
    g = import_graph(pkg)
    assert cycles(g) == [["kimik3.engine", "kimik3.engine.core.a", "kimik3.engine.spec.b"]]
    assert cycles(part_graphs(g)["kimik3.engine"]) == [["kimik3.engine.core", "kimik3.engine.spec"]]
    modules = set(g)
    assert imports_from_own_init(pkg / "engine" / "spec" / "b.py", modules, pkg) == [
        "kimik3.engine.spec.b imports A from kimik3.engine"]
    assert imports_from_own_init(pkg / "engine" / "core" / "a.py", modules, pkg) == []
