"""Running the router: one process under uvicorn, or several sharing the port
(:mod:`.processes`), each draining at SIGTERM."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import threading
from typing import Any

import uvicorn

from kvpool.httpguard import HttpLimits, server_config

from .processes import ProcessSlot, supervise
from .server import Router
from .settings import RouterSettings

__all__ = ["serve", "uvicorn_server"]

log = logging.getLogger("kvpool.router.server")


class _Uvicorn(uvicorn.Server):
    """The first signal closes the listening socket (new connections are refused), answers
    503 to requests on connections still open, and lets the streams in flight finish, up to
    ``drain_timeout_s`` (uvicorn's graceful shutdown); a second Ctrl-C stops at once."""

    def __init__(self, config: uvicorn.Config, router: Router) -> None:
        super().__init__(config)
        self.router = router

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.router.draining:
            log.info("signal %s: draining %d requests", sig, self.router.active)
        elif not self.force_exit:  # a second signal, SIGTERM too (uvicorn: SIGINT only)
            log.info("signal %s: stopping at once", sig)
            self.force_exit = True
        self.router.draining = True
        super().handle_exit(sig, frame)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        for server in self.servers:
            for sock in server.sockets:
                self.router.bound_port = sock.getsockname()[1]


def uvicorn_server(router: Router, log_level: str = "warning") -> _Uvicorn:
    s = router.settings
    config = server_config(
        router.asgi,
        host=s.host,
        port=s.port,
        # what one client may hold: its connections, its headers' time and size
        limits=HttpLimits(
            header_timeout_s=s.header_timeout_s,
            max_header_bytes=s.max_header_bytes,
            max_connections_per_client=s.max_connections_per_client,
            trusted_proxies=tuple(s.trusted_proxies),
        ),
        drain_timeout_s=s.drain_timeout_s,
        log_level=log_level,
        interface="asgi3",
    )
    return _Uvicorn(config, router)


def run_process(
    settings: RouterSettings, slot: ProcessSlot, log_level: str, sock: socket.socket
) -> None:
    """One router process of several (the target :func:`.processes.supervise` spawns)."""
    # The supervisor blocks these while it starts a process, and a child inherits its mask:
    # one sent meanwhile is taken now (and ends it: nothing is served yet).
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGTERM, signal.SIGINT))
    os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the supervisor, which passes it on once
    from kvpool.cli import configure_logging

    configure_logging(log_level == "debug")

    server = uvicorn_server(Router(settings, slot=slot), log_level=log_level)
    parent = multiprocessing.parent_process()
    if parent is not None:  # the supervisor killed: drain and go, not serve on alone

        def orphaned() -> None:
            multiprocessing.connection.wait([parent.sentinel])
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=orphaned, name="kvpool-router-parent", daemon=True).start()
    server.run(sockets=[sock])


def serve(settings: RouterSettings, log_level: str = "info") -> int:
    """Run the router until SIGTERM/SIGINT, then drain; returns the exit code. With
    ``processes`` > 1, that many processes share the port (:mod:`.processes`)."""
    if settings.processes > 1:
        return supervise(settings, run_process, log_level)
    uvicorn_server(Router(settings), log_level=log_level).run()
    return 0
