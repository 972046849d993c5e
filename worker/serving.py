"""Running workers: one per process (``serve``), or a simulated fleet in one event loop
(``serve_many``), under a uvicorn server that drains its worker on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator
from typing import Any

import uvicorn

from kvpool.httpguard import HttpLimits, server_config

from .server import WorkerServer
from .settings import WorkerSettings

log = logging.getLogger("kvpool.worker.server")


class _Uvicorn(uvicorn.Server):
    """A uvicorn server that starts draining its worker on SIGTERM/SIGINT; with
    ``own_signals=False`` (several servers in one process) signals are left to the caller."""

    def __init__(self, config: uvicorn.Config, worker: WorkerServer, own_signals: bool = True):
        super().__init__(config)
        self.worker = worker
        self.own_signals = own_signals
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Future[None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if not self.own_signals:
            yield
            return
        with super().capture_signals():
            try:
                yield
            finally:
                # uvicorn re-raises the signals it caught once it has shut down; after a
                # clean drain that would kill the process with SIGTERM's default action.
                self._captured_signals.clear()

    def handle_exit(self, sig: int, frame: Any) -> None:
        """The first signal drains: health and new requests answer 503 while requests in
        flight finish and decode workers pull the blocks pinned for them (the socket stays
        open for that); then the server stops. A second signal stops it at once."""
        # (A drain through /drain, the preStop hook's, is no first signal: this one still
        # waits for pinned blocks, and /undrain cannot take it back.)
        if self.worker.stopping or self._loop is None:
            super().handle_exit(sig, frame)
            return
        log.info("signal %s: draining for up to %.0f s", sig, self.worker.settings.drain_timeout_s)
        self.worker.draining = self.worker.stopping = True
        self._loop.call_soon_threadsafe(self._drain_then_exit)

    def _drain_then_exit(self) -> None:
        async def drain() -> None:
            await self.worker.drain(wait_for_pins=True)
            self.should_exit = True

        self._drain_task = asyncio.ensure_future(drain())

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        for server in self.servers:
            for sock in server.sockets:
                self.worker.bound_port = sock.getsockname()[1]


def uvicorn_server(
    worker: WorkerServer, *, own_signals: bool = True, log_level: str = "warning"
) -> _Uvicorn:
    s = worker.settings
    config = server_config(
        worker.app,
        host=s.host,
        port=s.port,
        # header time and size limits; connections per address effectively unlimited:
        # every request comes from the pool's few routers, whose pools are unbounded
        limits=HttpLimits(max_connections_per_client=2**20),
        drain_timeout_s=s.drain_timeout_s,
        log_level=log_level,
    )
    return _Uvicorn(config, worker, own_signals)


def serve(settings: WorkerSettings, log_level: str = "info") -> None:
    """Run one worker until SIGTERM/SIGINT, then drain."""
    worker = WorkerServer(settings)
    uvicorn_server(worker, log_level=log_level).run()


async def serve_many(all_settings: list[WorkerSettings], log_level: str = "warning") -> None:
    """Run several workers in one process and one event loop (the simulated fleet)."""
    servers = [
        uvicorn_server(WorkerServer(s), own_signals=False, log_level=log_level)
        for s in all_settings
    ]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda sig=sig: [s.handle_exit(sig, None) for s in servers])
    await asyncio.gather(*(s.serve() for s in servers))
