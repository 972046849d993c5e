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
