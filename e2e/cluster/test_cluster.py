"""kvpool on a real cluster: ``e2e/cluster/run.sh`` (CRD, operator, the tiny CPU pool, Ready,
one chat completion through the router), run when a cluster is reachable.

Without one (no ``kubectl``, no kubeconfig, or an API server that does not answer within a
few seconds) the test is skipped, quickly and saying why, so ``pytest`` stays green and
fast on a machine that has no cluster.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("run.sh")
SKIPPED = 77  # the script's own "no cluster" exit status
PROBE_TIMEOUT_S = 10
# The pool's own wait (KVPOOL_E2E_TIMEOUT_S, 600 s) plus image loading, the chat and the
# namespace's deletion; a build (KVPOOL_E2E_BUILD=1) may need more: KVPOOL_E2E_TEST_TIMEOUT_S.
RUN_TIMEOUT_S = float(os.environ.get("KVPOOL_E2E_TEST_TIMEOUT_S", "1200"))
CLEANUP_GRACE_S = 200  # after SIGTERM, time for the script to stop its processes and clean up


def _kubeconfig_paths() -> list[Path]:
    env = os.environ.get("KUBECONFIG")
    if env:
        return [Path(p).expanduser() for p in env.split(os.pathsep) if p]
    return [Path.home() / ".kube" / "config"]


def cluster_unavailable() -> str | None:
    """Why there is no cluster to test against, or None when there is one."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return "kubectl is not on PATH"
    if not any(p.is_file() for p in _kubeconfig_paths()):
        where = "KUBECONFIG=" + os.environ["KUBECONFIG"] if "KUBECONFIG" in os.environ else ""
        return f"no kubeconfig ({where or 'KUBECONFIG unset and no ~/.kube/config'})"
    try:
        probe = subprocess.run(
            [kubectl, "get", "--raw", "/version", "--request-timeout=5s"],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return f"the cluster did not answer within {PROBE_TIMEOUT_S} s (kubectl get --raw /version)"
    if probe.returncode != 0:
        lines = (probe.stderr or probe.stdout).strip().splitlines()
        return f"no cluster reachable: {lines[-1] if lines else f'kubectl exit {probe.returncode}'}"
    return None


def _run_script(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """run.sh in its own process group; past the deadline it gets SIGTERM (it then stops the
    operator and the port-forward and deletes its namespace), and SIGKILL if that hangs."""
    proc = subprocess.Popen(
        ["bash", str(SCRIPT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=CLEANUP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"run.sh did not finish within {RUN_TIMEOUT_S:g} s:\n{out}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + CLEANUP_GRACE_S + 60)
def test_tiny_pool_serves_a_chat_completion_on_a_real_cluster(tmp_path: Path) -> None:
    reason = cluster_unavailable()
    if reason is not None:
        pytest.skip(f"no Kubernetes cluster: {reason}")

    env = dict(os.environ)
    env["PYTHONSAFEPATH"] = "1"
    env.setdefault("KVPOOL_E2E_PYTHON", sys.executable)  # the one that runs pytest has openai
    kvpool = Path(sys.executable).with_name("kvpool")
    if kvpool.is_file():
        env.setdefault("KVPOOL_E2E_KVPOOL", str(kvpool))
    env.setdefault("KVPOOL_E2E_LOG_DIR", str(tmp_path))

    result = _run_script(env)
    print(result.stdout)
    if result.returncode == SKIPPED:
        pytest.skip(f"run.sh found no cluster: {result.stdout.strip().splitlines()[-1]}")
    assert result.returncode == 0, f"run.sh failed (exit {result.returncode}):\n{result.stdout}"
    assert "[e2e] passed" in result.stdout
