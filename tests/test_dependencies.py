"""Every third-party package kimik3 imports is declared in pyproject.toml, and the installed uvicorn is one
of the versions its pin allows (the server extends uvicorn's h11 protocol class, an internal API, so an
untested uvicorn must not be installed silently)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# import name -> distribution name, where they differ
DIST_OF = {"PIL": "pillow", "fla": "fla-core"}


def _requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    return {Requirement(r).name.lower().replace("_", "-"): Requirement(r) for r in reqs}


def imported_packages() -> dict[str, str]:
    """Top-level third-party import name -> one file importing it (imports inside functions included)."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "kimik3").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "kimik3" and top not in sys.stdlib_module_names:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def test_every_imported_package_is_declared():
    declared = _requirements()
    missing = {name: where for name, where in imported_packages().items()
               if DIST_OF.get(name, name).lower().replace("_", "-") not in declared}
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_the_scan_sees_imports_inside_functions():
    found = imported_packages()
    assert {"torch", "uvicorn", "regex", "llguidance"} <= set(found)


def test_installed_uvicorn_is_within_the_pin():
    pin = _requirements()["uvicorn"]
    assert pin.specifier and any(s.operator == "<" for s in pin.specifier), "uvicorn needs an upper bound"
    installed = Version(importlib.metadata.version("uvicorn"))
    assert pin.specifier.contains(installed), (
        f"uvicorn {installed} is outside the tested range {pin.specifier}: kimik3.serve.limits extends its "
        f"h11 protocol class; run tests/serve/test_limits.py on it and widen the pin in pyproject.toml")


def test_the_h11_protocol_surface_the_limits_use():
    """What ``LimitedH11Protocol`` overrides and reads is still there (method names and the instance state
    set in ``__init__``)."""
    import inspect

    from uvicorn.protocols.http.h11_impl import H11Protocol
    for method in ("connection_made", "data_received", "on_response_complete", "connection_lost"):
        assert callable(getattr(H11Protocol, method, None)), method
    init = inspect.getsource(H11Protocol.__init__) + inspect.getsource(H11Protocol.connection_made)
    for attr in ("connections", "cycle", "transport", "loop", "app"):
        assert re.search(rf"self\.{attr}\b\s*[:=]", init), attr
