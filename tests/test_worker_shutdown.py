"""Graceful shutdown of a real ``kvpool worker serve`` process: on SIGTERM it stops taking
requests, finishes the streams it has started, and exits 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

KVPOOL = Path(sys.executable).parent / "kvpool"
MAX_TOKENS = 200
STARTUP_S = 60.0  # importing torch and loading the model on a busy 2-core machine
DEADLINE_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.05)


def healthy(proc: subprocess.Popen[bytes], url: str) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"the worker exited with {proc.returncode} before it was healthy")
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def refused_or_503(url: str) -> bool:
    """A new connection after SIGTERM: nothing listens any more, or a 503."""
    try:
        with httpx.Client(timeout=5) as fresh:  # a new connection, not a pooled one
            r = fresh.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 1})
    except httpx.TransportError:
        return True
    return r.status_code == 503


@pytest.fixture
def worker_process(llama_dir: Path, tmp_path: Path) -> Any:
    port = free_port()
    argv = [
        str(KVPOOL),
        "worker",
        "serve",
        "--model",
        str(llama_dir),
        "--port",
        str(port),
        "--num-blocks",
        "128",
        "--device",
        "cpu",
        "--drain-timeout-s",
        "20",
    ]
    log = (tmp_path / "worker.log").open("wb")
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(proc, url), STARTUP_S, "the worker answering /health")
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        log.close()
        sys.stderr.write((tmp_path / "worker.log").read_text(errors="replace")[-4000:])


def test_sigterm_lets_the_running_stream_finish_and_refuses_new_connections(
    worker_process: Any,
) -> None:
    proc, url = worker_process
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    first_chunk, resume = threading.Event(), threading.Event()
    chunks: list[Any] = []
    failure: list[BaseException] = []

    def consume() -> None:
        try:
            stream = client.completions.create(
                model=None,
                prompt="A router in front of a pool of inference workers",
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                chunks.append(chunk)
                if not first_chunk.is_set():
                    first_chunk.set()
                    # Read no further until the worker has stopped listening, so the
                    # stream is still open on this side when shutdown begins.
                    resume.wait(DEADLINE_S)
        except BaseException as exc:
            failure.append(exc)
        finally:
            first_chunk.set()

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    try:
        assert first_chunk.wait(DEADLINE_S), "no first chunk"
        assert not failure, failure
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: refused_or_503(url), DEADLINE_S, "new work refused after SIGTERM")
    finally:
        resume.set()

    reader.join(DEADLINE_S)
    assert not reader.is_alive(), "the stream did not end"
    assert not failure, failure
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == MAX_TOKENS
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length"
    assert all(f is None for f in finishes[:-1])
    proc.wait(DEADLINE_S)  # and then it exits (with what status: the next test)


def test_sigterm_exits_0_once_drained(worker_process: Any) -> None:
    proc, _ = worker_process
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(DEADLINE_S) == 0
