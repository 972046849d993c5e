"""``kvpool up``: a router and N workers on loopback, as separate processes.

The stack is made of the same commands a cluster runs (``kvpool worker serve``,
``kvpool worker sim-fleet``, ``kvpool router serve``), so what works here works there; the
core only starts processes, it imports no component. Ctrl-C (or SIGTERM) stops all of them,
router first, so no request is sent to a worker that is gone.

``--demo`` sends a few chat requests that share a long system prompt, prints for each the
worker chosen, the cached prompt tokens and the time to first token, then the router's
hit ratio, and stops the stack.

The stack is one pool with one secret: a random pool secret is made for each start and
given to the router and every worker through the environment (``KVPOOL_ROUTER_POOL_SECRET``,
``KVPOOL_POOL_SECRET``), never on a command line. It signs prefill/decode hand-offs, keys
the workers' admin token and guards their KV event sockets (see :mod:`kvpool.signing`).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .signing import new_secret

__all__ = [
    "Stack",
    "StackError",
    "free_port",
    "free_port_range",
    "healthy",
    "run_demo",
    "stop_process",
    "wait_healthy",
    "wait_until",
]


class StackError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


#: where :func:`free_port_range` looks first: below Linux's ephemeral range (32768 and up),
#: which every outgoing connection on the machine draws from. A range found free there
#: can be taken by another process's connection before the fleet binds it; below, only
#: an explicit bind can.
RANGE_PORTS = (20000, 32768)


def free_port_range(count: int, tries: int = 100) -> int:
    """The first of ``count`` consecutive free ports (for ``sim-fleet``'s base ports)."""
    rng = random.Random()
    low, high = RANGE_PORTS
    for _ in range(tries):
        base = rng.randrange(low, high - count)
        if all(_bindable(base + i) for i in range(count)):
            return base
    for _ in range(tries):  # that stretch is taken: anywhere the kernel hands out
        base = free_port()
        if base + count < 65536 and all(_bindable(base + i) for i in range(count)):
            return base
    raise StackError(f"found no {count} consecutive free ports")


def _kvpool(*args: str) -> list[str]:
    # PYTHONSAFEPATH (in the env below) keeps a checkout's operator/ off the import path.
    return [
        sys.executable,
        "-c",
        "import sys; from kvpool.cli import main; sys.exit(main())",
        *args,
    ]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONSAFEPATH": "1", **extra}


def stop_process(proc: subprocess.Popen[Any], timeout: float = 30.0) -> None:
    """SIGTERM, ``timeout`` seconds to exit, then SIGKILL; waits until it is gone."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def healthy(url: str) -> bool:
    """Whether the server at ``url`` answers ``/health`` with 200 within a second;
    :class:`StackError` when it answers that its model failed to load (a worker stays up,
    unready, with the reason: waiting longer cannot help)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as resp:
            return resp.status == 200
    except urllib.error.HTTPError as exc:
        try:
            error = json.loads(exc.read())["error"]
        except (OSError, ValueError, KeyError, TypeError):
            return False
        if isinstance(error, dict) and error.get("code") == "load_failed":
            raise StackError(f"{url}: {error.get('message')}") from None
        return False
    except OSError:
        return False


def wait_until(
    check: Callable[[], bool], proc: subprocess.Popen[Any], what: str, timeout: float = 120.0
) -> None:
    """Until ``check()`` holds for the process ``proc`` (``what`` names it in errors);
    :class:`StackError` if the process exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not check():
        if proc.poll() is not None:
            raise StackError(f"{what}: the process exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise StackError(f"{what} was not ready in {timeout:.0f} s")
        time.sleep(0.1)


def wait_healthy(url: str, proc: subprocess.Popen[Any], timeout: float = 120.0) -> None:
    """Until the server ``proc`` runs at ``url`` is healthy (see :func:`wait_until`)."""
    wait_until(lambda: healthy(url), proc, url, timeout)


@dataclass
class Stack:
    model: Path
    workers: int = 2
    engine: str = "kvpool"
    port: int = 8080
    policy: str = "kvpool"
    num_blocks: int = 4096
    verbose: bool = False
    worker_urls: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    #: shared by the router and the workers; a new random one per start when not given
    pool_secret: str | None = field(default=None, repr=False)
    #: the router's tenants file (API keys); None: the router asks for no key
    api_keys_file: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> None:
        if self.workers < 1:
            raise StackError("--workers must be at least 1")
        # Ports below the ephemeral range (free_port_range): one the kernel hands out to any
        # process's connection, or to another stack's free_port(), may be taken before the
        # server binds it, and a stranger then answers this stack's /health.
        block = free_port_range(3 * self.workers + 1)
        if self.port == 0:
            self.port = block + 3 * self.workers
        if not (self.model / "config.json").is_file():
            raise StackError(f"{self.model} is not a model directory (no config.json)")
        quiet = None if self.verbose else subprocess.DEVNULL
        verbose = ["-v"] if self.verbose else []
        secret = self.pool_secret = self.pool_secret or new_secret()
        # The worker's variable (its settings' prefix is KVPOOL_); a file variable from
        # the caller's environment would clash with it.
        worker_env = _env(KVPOOL_POOL_SECRET=secret)
        worker_env.pop("KVPOOL_POOL_SECRET_FILE", None)
        if self.engine == "sim":  # one process hosts the whole simulated fleet
            # one range for the HTTP, event and replay ports, so that none overlaps another
            n = self.workers
            base = block
            ports, events, replay = list(range(base, base + n)), base + n, base + 2 * n
            self.procs.append(
                subprocess.Popen(
                    _kvpool(
                        "worker", *verbose, "sim-fleet", "--model", str(self.model),
                        "--count", str(self.workers), "--base-port", str(base),
                        "--kv-events-base-port", str(events),
                        "--kv-events-replay-base-port", str(replay),
                        "--num-blocks", str(self.num_blocks),
                    ),
                    env=worker_env, stdout=quiet, stderr=None, start_new_session=True,
                )
            )  # fmt: skip
        else:
            n = self.workers
            ports = list(range(block, block + n))
            for i, port in enumerate(ports):
                pub, replay = block + n + i, block + 2 * n + i
                self.procs.append(
                    subprocess.Popen(
                        _kvpool(
                            "worker", *verbose, "serve", "--model", str(self.model),
                            "--port", str(port), "--num-blocks", str(self.num_blocks),
                            "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
                            "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}",
                        ),
                        env=worker_env, stdout=quiet, stderr=None, start_new_session=True,
                    )
                )  # fmt: skip
        self.worker_urls = [f"http://127.0.0.1:{p}" for p in ports]
        self._wait(self.worker_urls, timeout, "workers")
        args = ["router", *verbose, "serve", "--model", str(self.model), "--port", str(self.port)]
        args += ["--policy", self.policy]
        if self.api_keys_file is not None:
            args += ["--api-keys-file", str(self.api_keys_file)]
        for url in self.worker_urls:
            args += ["--worker", url]
        router_env = _env(KVPOOL_ROUTER_POOL_SECRET=secret)
        router = subprocess.Popen(_kvpool(*args), env=router_env, start_new_session=True)
        self.procs.insert(0, router)
        self._wait([self.url], timeout, "router")

    def _wait(self, urls: list[str], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        pending = list(urls)
        while pending:
            if any(p.poll() is not None for p in self.procs):
                self.stop()
                raise StackError(f"a process of the stack exited while the {what} started")
            try:
                pending = [u for u in pending if not healthy(u)]
            except StackError:
                self.stop()
                raise
            if pending and time.monotonic() > deadline:
                self.stop()
                raise StackError(f"the {what} did not become healthy in {timeout:.0f} s")
            if pending:
                time.sleep(0.2)

    def stop(self, timeout: float = 30.0) -> None:
        for proc in self.procs:  # the router first: it stops sending before workers go
            stop_process(proc, timeout)
        self.procs.clear()

    def wait(self) -> None:
        """Until Ctrl-C or a process of the stack exits."""
        while all(p.poll() is None for p in self.procs):
            time.sleep(0.5)
        raise StackError("a process of the stack exited")


DEMO_SYSTEM = (
    "You are the support assistant of a company that runs large language model serving "
    "fleets on Kubernetes. Answer briefly and precisely. The fleet has prefill and decode "
    "workers, a router that sends each request to the worker holding the most of its "
    "prompt's KV cache, and an operator that scales every role to meet its latency targets. "
) * 4
DEMO_QUESTIONS = (
    "What does the router do?",
    "How are workers scaled?",
    "What is a prefix cache hit?",
    "Why split prefill and decode?",
    "How do I watch the fleet?",
    "What happens when a worker dies?",
)


def run_demo(url: str, model: str, out: object = sys.stdout) -> dict[str, float]:
    """Send the demo's chat requests through the router; print one line per request."""
    import httpx

    def say(line: str) -> None:
        print(line, file=out, flush=True)  # type: ignore[arg-type]

    say(f"{'#':>2}  {'worker':<24} {'prompt':>6} {'cached':>6} {'TTFT ms':>8}  question")
    with httpx.Client(base_url=url, timeout=120) as client:
        for i, question in enumerate(DEMO_QUESTIONS, 1):
            body = {
                "model": model,
                "messages": [
                    {"role": "system", "content": DEMO_SYSTEM},
                    {"role": "user", "content": question},
                ],
                "max_tokens": 16,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            start = time.perf_counter()
            ttft = None
            usage: dict[str, object] = {}
            with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise StackError(f"the router answered {resp.status_code}: {resp.text}")
                worker = resp.headers.get("x-kvpool-worker", "?")
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for c in chunk.get("choices") or ():
                        if ttft is None and (c.get("delta") or {}).get("content"):
                            ttft = time.perf_counter() - start
            details = usage.get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens", 0) if isinstance(details, dict) else 0
            ttft_ms = "-" if ttft is None else f"{ttft * 1000:.0f}"
            say(
                f"{i:>2}  {worker:<24} {usage.get('prompt_tokens', 0):>6} {cached:>6} "
                f"{ttft_ms:>8}  {question}"
            )
        metrics = client.get("/metrics").text
    values = _counters(
        metrics,
        ("kvpool_router_cached_prompt_tokens_total", "kvpool_router_reported_prompt_tokens_total"),
    )
    cached, prompt = values
    ratio = cached / prompt if prompt else 0.0
    say(f"router hit ratio: {ratio:.1%} ({cached:.0f} of {prompt:.0f} prompt tokens from cache)")
    return {"hit_ratio": ratio, "cached_tokens": cached, "prompt_tokens": prompt}


def _counters(text: str, names: tuple[str, ...]) -> list[float]:
    values = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in values:
            values[name] = float(value)
    return [values[n] for n in names]
