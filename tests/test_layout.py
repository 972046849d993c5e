"""The package layout the architecture asks for, checked on the installed distribution."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys


def test_components_import_under_the_kvpool_namespace() -> None:
    for name in ("kvpool.router", "kvpool.worker", "kvpool.operator"):
        module = importlib.import_module(name)
        assert module.__name__ == name
    import operator

    assert hasattr(operator, "itemgetter")  # the standard library's module is untouched


def test_the_core_imports_no_torch_and_no_web_framework() -> None:
    code = (
        "import sys, kvpool, kvpool.hashing, kvpool.kv_events, kvpool.cli;"
        "bad = {'torch', 'fastapi', 'kopf', 'kvpool.router', 'kvpool.worker', 'kvpool.operator'}"
        " & set(sys.modules); print(sorted(bad))"
    )
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == "[]"


def test_kvpool_console_script_is_installed() -> None:
    exe = shutil.which("kvpool") or str(
        __import__("pathlib").Path(sys.executable).with_name("kvpool")
    )
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("kvpool ")


# --- no import cycles ---------------------------------------------------------------------------

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
# the installed packages and their folders (pyproject's package-dir)
PACKAGES = {
    "kvpool": ROOT / "kvpool",
    "kvpool.router": ROOT / "router",
    "kvpool.worker": ROOT / "worker",
    "kvpool.operator": ROOT / "operator",
}


def project_modules() -> dict[str, __import__("pathlib").Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if package == "kvpool" and parts[0] in ("router", "worker", "operator"):
                continue  # not there: kept out by the package-dir mapping
            modules[".".join([package, *(p for p in parts if p != "__init__")])] = path
    return modules


def imports_of(module: str, path: __import__("pathlib").Path, known: set[str]) -> set[str]:
    """Every project module ``module`` imports anywhere: at the top, in a function, or for
    type checking only (a cycle of those is still two modules that need each other)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level]
                if path.name == "__init__.py":
                    base = module.split(".")[: len(module.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            names = [target, *(f"{target}.{a.name}" for a in node.names)]
        else:
            continue
        found.update(n for n in names if n in known and n != module)
    return found


def test_no_import_cycle_anywhere_in_the_project() -> None:
    """Components import the core and never each other, and within each, no two modules
    need each other (even lazily, or for a type): the data path reads in one direction."""
    import graphlib

    modules = project_modules()
    assert "kvpool.router.server" in modules and "kvpool.api.crd" in modules
    graph = {m: imports_of(m, p, set(modules)) for m, p in modules.items()}
    try:
        list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        raise AssertionError(f"an import cycle: {' -> '.join(exc.args[1])}") from None
    for module, needs in graph.items():  # and the architecture's direction
        component = ".".join(module.split(".")[:2])
        for other in needs:
            other_component = ".".join(other.split(".")[:2])
            if other_component in ("kvpool.router", "kvpool.worker", "kvpool.operator"):
                assert other_component == component, f"{module} imports {other}"


def test_no_router_module_is_over_500_lines() -> None:
    """The router is laid out by concern (proxy, routing, admission, state, admin), each
    module small enough to read whole."""
    long = {
        str(path.relative_to(ROOT)): n
        for path in (ROOT / "router").rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 500
    }
    assert not long, f"over 500 lines: {long}"
    subpackages = {p.parent.name for p in (ROOT / "router").glob("*/__init__.py")}
    assert subpackages == {"proxy", "routing", "admission", "state", "admin"}
