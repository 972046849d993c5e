"""Several router processes on one port, so that every core serves requests.

``kvpool router serve --processes N`` starts N copies of the router. The supervisor binds
the port and listens; every process accepts from that one socket, as gunicorn's and
uvicorn's own workers do. A process busy with requests is slower to accept, so an idle
one takes the next connection. Each process is the router whole: its own HTTP server,
tokenizer, index, pool and planner.

Why one shared socket rather than ``SO_REUSEPORT`` (a socket per process): on this
project's two-core benchmark both sustained the same rate (1,519 req/s, against 827 for
one process on the same two cores). But the kernel hashes each connection to one
``SO_REUSEPORT`` socket whatever that process's load, and the connections waiting in a
process's queue are reset when the process dies. A shared queue loses none of them.

**One writer per fact.**

* What a worker holds has one owner, the worker. Every process subscribes to the worker's
  KV events and keeps an exact copy of the index. A process never writes what another
  process owns.
* The load a process sends each worker (in flight, queued prompt tokens) and its
  speculative entries are its own facts. It shares them with its siblings over the peer
  link (:mod:`.peers`), as router replicas in other pods do. On one host the link runs
  over ``ipc://`` sockets; with ``--peer-bind tcp://HOST:PORT``, process *i* binds
  ``PORT + i``, and each peer endpoint given (or discovered) stands for ``PORT`` to
  ``PORT + N - 1``. So every replica must run the same ``--processes``.

The processes share the runtime directory made here. ``prometheus_client``'s multiprocess
mode keeps each process's counters and histograms there, and ``/metrics``, whichever
process answers, adds them up. Each process also writes its own gauges and decision
counts there every second (:class:`.metrics.Siblings`).

**The supervisor** is this process, and it serves no request.
* It forwards SIGTERM/SIGINT: the first drains, a second stops at once. It closes its copy
  of the listening socket at the first, so that nothing queues where nobody will accept.
* It restarts a process that dies, with a growing backoff while the new one keeps dying
  before it has started. One that dies before any process of its slot has started (a
  model it cannot load, say) stops them all, with its exit code.
* It blocks signals while it starts a process, so that none falls between the fork and
  its list of processes. A process whose supervisor is gone drains and exits.

Why processes and not threads: Python runs one thread at a time, and the router's work
per request is Python. Why not one process owning the routing state, with others asking
it: every decision would then cost two socket hops, and a slow decision would hold up
the other processes' requests.

The cost is memory and scraping per process. Every process holds the whole index and
scrapes every worker. :mod:`bench.index`'s bytes per entry, times N, gives the memory.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .settings import RouterSettings

__all__ = ["ProcessSlot", "expand_peer", "listening_socket", "supervise"]

log = logging.getLogger(__name__)

#: where prometheus_client keeps the processes' counters, under the runtime directory
PROMETHEUS_DIR = "prometheus"
#: a process that dies again before it has started waits this long, doubled each time,
#: before it is started again (a crash loop costs little)
RESTART_BACKOFF_S = 0.5
MAX_RESTART_BACKOFF_S = 30.0


@dataclass(frozen=True)
class ProcessSlot:
    """One router process's place among its siblings."""

    index: int = 0
    count: int = 1
    runtime_dir: str | None = None  # shared by the siblings; None when alone

    def started(self) -> None:
        """Tell the supervisor this process is up (it restarts a process that dies after
        this, and stops them all when one dies before)."""
        if self.runtime_dir is not None:
            self._started_file().touch()

    def has_started(self) -> bool:
        return self.runtime_dir is not None and self._started_file().exists()

    def _started_file(self) -> Path:
        assert self.runtime_dir is not None
        return Path(self.runtime_dir, f"started-{self.index}")

    def peering(self, bind: str | None, peers: list[str]) -> tuple[str | None, list[str]]:
        """Where this process's peer link binds, and the endpoints it subscribes to:
        its siblings' and every given peer's (expanded to that replica's processes)."""
        if self.count == 1:
            return bind, peers
        others = [j for j in range(self.count) if j != self.index]
        if bind is None:
            assert self.runtime_dir is not None
            ipc = [f"ipc://{self.runtime_dir}/peer-{j}" for j in range(self.count)]
            return ipc[self.index], [ipc[j] for j in others]
        host, port = _split(bind)
        wildcard = host in ("tcp://*", "tcp://0.0.0.0", "tcp://[::]", "tcp://::")
        near = "tcp://127.0.0.1" if wildcard else host
        local = [f"{near}:{port + j}" for j in others]
        remote = [e for peer in peers for e in expand_peer(peer, self.count)]
        return f"{host}:{port + self.index}", local + remote


def expand_peer(endpoint: str, processes: int) -> list[str]:
    """A replica's peer endpoint ``tcp://HOST:PORT`` as the endpoints of its
    ``processes`` processes (``PORT`` to ``PORT + processes - 1``)."""
    if processes == 1:
        return [endpoint]
    host, port = _split(endpoint)
    return [f"{host}:{port + j}" for j in range(processes)]


def _split(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not endpoint.startswith("tcp://"):
        raise ValueError(f"peer endpoint {endpoint!r}: with --processes, peers are tcp://HOST:PORT")
    return host, int(port)


def listening_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A TCP socket listening on ``host:port`` (port 0: one the kernel picks)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


#: what a router process runs: (settings, its slot, log level, the listening socket)
Target = Callable[[RouterSettings, "ProcessSlot", str, socket.socket], None]


def supervise(settings: RouterSettings, target: Target, log_level: str = "info") -> int:
    """Run ``settings.processes`` router processes (each ``target``, a module-level
    function: the processes are spawned) until SIGTERM/SIGINT; returns the exit code."""
    n = settings.processes
    sock = listening_socket(settings.host, settings.port)  # a bad port fails here, once
    settings = settings.model_copy(update={"port": sock.getsockname()[1]})
    runtime = tempfile.mkdtemp(prefix="kvpool-router-")
    prom = Path(runtime, PROMETHEUS_DIR)
    prom.mkdir()
    # Before any child imports prometheus_client: its values then live in files here.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(prom)
    ctx = multiprocessing.get_context("spawn")
    children: list[Any] = [None] * n
    ever_started = [False] * n  # a process in this slot has served: a later one may fail
    restarts = [0] * n  # quick deaths in a row, for the backoff
    not_before = [0.0] * n
    stopping = 0
    code = 0
    signals = (signal.SIGTERM, signal.SIGINT)

    def start(i: int) -> None:
        # No signal between the fork and ``children[i]``: one then would miss this child.
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        try:
            if stopping:
                return
            child = ctx.Process(
                target=target,
                args=(settings, ProcessSlot(i, n, runtime), log_level, sock),
                name=f"kvpool-router-{i}",
                daemon=False,
            )
            child.start()
            children[i] = child
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)

    def on_signal(sig: int, frame: Any) -> None:
        nonlocal stopping
        stopping += 1
        if stopping == 1:
            # No process is started again from now on: new connections are refused at
            # once, rather than queued where nobody will take them (the processes close
            # their own copies of the socket as they drain).
            sock.close()
        log.info("signal %s: passing it to %d router processes", sig, n)
        for child in children:
            if child is not None and child.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, sig)

    for sig in signals:
        signal.signal(sig, on_signal)
    log.info("%d router processes on %s:%d", n, settings.host, settings.port)
    try:
        for i in range(n):
            start(i)
        while True:
            alive = [c for c in children if c is not None and c.is_alive()]
            if stopping and not alive:
                break
            now = time.monotonic()
            for i, child in enumerate(children):
                if stopping or (child is not None and child.is_alive()):
                    continue
                if child is not None:  # it died: what it did is kept, its load goes
                    child.join()
                    _forget(prom, runtime, child.pid)
                    slot = ProcessSlot(i, n, runtime)
                    quick = not slot.has_started()  # it died before it served
                    if quick and not ever_started[i]:
                        code = child.exitcode if child.exitcode and child.exitcode > 0 else 1
                        log.error("router process %d failed to start (exit %s)", i, child.exitcode)
                        on_signal(signal.SIGTERM, None)
                        on_signal(signal.SIGTERM, None)  # at once: nothing is served yet
                        break
                    ever_started[i] = True
                    with contextlib.suppress(FileNotFoundError):
                        slot._started_file().unlink()
                    restarts[i] = restarts[i] + 1 if quick else 0
                    delay = min(RESTART_BACKOFF_S * 2 ** restarts[i], MAX_RESTART_BACKOFF_S)
                    not_before[i] = now + (delay if quick else 0.0)
                    children[i] = None
                    log.error(
                        "router process %d exited (%s): starting it again%s",
                        i,
                        child.exitcode,
                        f" in {delay:g} s" if quick else "",
                    )
                if now >= not_before[i]:
                    start(i)
            time.sleep(0.2)
    finally:
        for child in children:
            if child is not None:
                child.join(timeout=5)
                if child.is_alive():
                    child.kill()
        sock.close()
        shutil.rmtree(runtime, ignore_errors=True)
    return code


def _forget(prom: Path, runtime: str, pid: int | None) -> None:
    """A dead process: its load goes, what it counted stays (a counter that went back
    would read as a reset)."""
    if pid is None:
        return
    from prometheus_client import multiprocess

    from .admin.siblings import Siblings

    multiprocess.mark_process_dead(pid, str(prom))
    Siblings.retire(os.path.join(runtime, f"rows-{pid}.msgpack"))
