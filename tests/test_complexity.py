"""Every function in the package stays within cyclomatic complexity 25 (GUIDE "How we write code"), counted
as radon counts it (the measure the project's issues quote): 1, plus 1 for each if / elif / conditional
expression, loop (and its else), except handler (and a try's else), comprehension clause and its ifs,
match case other than the wildcard, and each extra operand of ``and`` / ``or``. A nested function or class
counts on its own."""

from __future__ import annotations

import ast
from pathlib import Path

import kimik3

LIMIT = 25
ROOT = Path(kimik3.__file__).resolve().parent


def _decisions(node: ast.AST) -> int:
    if isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
        return len(node.handlers) + bool(node.orelse)
    if isinstance(node, ast.BoolOp):
        return len(node.values) - 1
    if isinstance(node, (ast.If, ast.IfExp)):
        return 1
    if isinstance(node, ast.Match):
        wildcard = any(getattr(c.pattern, "pattern", False) is None for c in node.cases)
        return max(0, len(node.cases) - wildcard)
    if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
        return 1 + bool(node.orelse)
    if isinstance(node, ast.comprehension):
        return 1 + len(node.ifs)
    return 0


def complexity(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    total, todo = 1, list(ast.iter_child_nodes(fn))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue                                   # counted on its own
        total += _decisions(node)
        todo.extend(ast.iter_child_nodes(node))
    return total


def functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from functions(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, prefix + node.name + ".")
        else:
            yield from functions(node, prefix)


def test_the_counter_counts_what_radon_counts():
    src = ("def f(a, b):\n"
           "    if a and b or a:\n"              # if 1, boolop 2
           "        return [x for x in a if x]\n"  # comprehension 1 + if 1
           "    for i in b:\n"                    # for 1
           "        pass\n"
           "    else:\n"                          # for-else 1
           "        pass\n"
           "    try:\n"
           "        pass\n"
           "    except ValueError:\n"             # handler 1
           "        pass\n"
           "    def g():\n"                       # nested: not counted in f
           "        if a: pass\n"
           "    return 1 if a else 2\n")          # ifexp 1
    (name, f), (_, g) = list(functions(ast.parse(src)))
    assert name == "f" and complexity(f) == 10 and complexity(g) == 2


def test_no_function_over_the_limit():
    over = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for name, fn in functions(ast.parse(path.read_text(encoding="utf-8"))):
            c = complexity(fn)
            if c > LIMIT:
                over[f"{rel}::{name}"] = c
    assert not over, f"functions over complexity {LIMIT} (split them into parts named by the decision they make): {over}"


ENGINE_FILE_LINES = 350


def test_no_engine_file_is_over_350_lines():
    """A file of ``kimik3/engine/`` that grows past 350 lines holds two concerns: split it by concern."""
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "engine").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > ENGINE_FILE_LINES}
    assert not long, f"engine files over {ENGINE_FILE_LINES} lines: {long}"


def _reads_environment(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb") \
                and isinstance(node.value, ast.Name) and node.value.id == "os":
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "os" \
                and any(a.name in ("environ", "getenv", "environb") for a in node.names):
            return True
    return False


def test_the_ops_and_the_model_read_no_environment_variable():
    """Options reach the ops and the model through KernelOptions / the configs (engine/args.py reads the
    environment, once); an op that reads ``os.environ`` hides an option from the config and the tests."""
    readers = [str(p.relative_to(ROOT)) for d in ("ops", "model") for p in sorted((ROOT / d).rglob("*.py"))
               if _reads_environment(ast.parse(p.read_text()))]
    assert not readers, f"environment read in {readers}: pass the option through kimik3/ops/options.py"
