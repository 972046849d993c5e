"""``kvpool up``: the local stack, as a user starts it (a real command, real processes)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.timeout(180)

KVPOOL = [sys.executable, "-c", "import sys; from kvpool.cli import main; sys.exit(main())"]
ENV = {**os.environ, "PYTHONSAFEPATH": "1"}


def test_demo_routes_a_shared_system_prompt_to_its_cache(llama_dir: Path) -> None:
    done = subprocess.run(
        [*up_argv(llama_dir), "--demo"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if re.match(r"\s*\d+\s+127", line)]
    assert len(rows) == 6
    # The first request computes the system prompt; every later one finds it cached.
    assert int(rows[0][3]) == 0
    assert all(int(row[3]) > 0 for row in rows[1:])
    ratio = re.search(r"router hit ratio: ([\d.]+)%", done.stdout)
    assert ratio and float(ratio.group(1)) > 50


def up_argv(llama_dir: Path) -> list[str]:
    """``kvpool up`` of simulated workers, the router on a free port."""
    return [*KVPOOL, "up", "--model", str(llama_dir), "--engine", "sim", "--port", "0"]


def start_up(argv: list[str]) -> tuple[subprocess.Popen[str], list[str]]:
    """The stack running, and the URLs its first line names (the router's first)."""
    proc = subprocess.Popen(
        argv, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert proc.stdout is not None
    return proc, re.findall(r"http://127\.0\.0\.1:\d+", proc.stdout.readline())


def test_sigterm_stops_every_process_of_the_stack(llama_dir: Path) -> None:
    proc, urls = start_up(up_argv(llama_dir))
    try:
        assert len(urls) >= 3, urls  # the router (twice: its API too) and two workers
        assert httpx.get(urls[0] + "/health", timeout=5).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 10
    for url in set(urls):
        while True:
            try:
                httpx.get(url + "/health", timeout=1)
            except httpx.HTTPError:
                break  # nothing listens there any more
            assert time.monotonic() < deadline, f"{url} still answers after the stack stopped"
            time.sleep(0.1)


def test_up_asks_for_keys_only_when_given_a_tenants_file(llama_dir: Path, tmp_path: Path) -> None:
    key = "sk-local-0123456789abcdef"
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"tenants:\n  - name: me\n    keys: [{key}]\n")
    argv = up_argv(llama_dir)
    proc, urls = start_up([*argv, "--api-keys-file", str(tenants)])
    try:
        router = urls[0]
        assert httpx.get(router + "/v1/models", timeout=5).status_code == 401
        with_key = httpx.get(router + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert with_key.status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    bad = subprocess.run(
        [*argv, "--api-keys-file", str(tmp_path / "missing.yaml")],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "--api-keys-file" in bad.stderr


def test_up_stops_at_once_with_the_reason_when_a_worker_cannot_load(
    llama_dir: Path, tmp_path: Path
) -> None:
    """A worker that failed to load stays up, unready, with the reason in /health; ``up``
    says it and stops instead of waiting for its timeout (three minutes)."""
    broken = tmp_path / "no-tokenizer"
    shutil.copytree(llama_dir, broken)
    (broken / "tokenizer.json").unlink()
    # (the stack's own timeout is 180 s: on a wait that long this run times out)
    done = subprocess.run(up_argv(broken), env=ENV, capture_output=True, text=True, timeout=90)
    assert done.returncode == 1
    assert "failed to load" in done.stderr and "http://127.0.0.1:" in done.stderr, done.stderr
