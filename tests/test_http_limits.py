"""Slow and greedy clients against a real router: the attacks that starved everyone else.

Probed on loopback, 1,100 connections sending a byte every 5 s left every other client
with 429 for a minute, and a few connections streaming one endless header starved the
router's health checks until it marked a healthy worker down. Here the same attacks run
against a router with small limits, and the test is that other clients are served.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpool.httpguard import TOO_MANY_CONNECTIONS

from conftest import RunningRouter
from recording_worker import RecordingWorker


@pytest.fixture
def guarded(
    start_router: Callable[..., RunningRouter], llama_dir: Path
) -> Iterator[Callable[..., tuple[RecordingWorker, RunningRouter]]]:
    workers: list[RecordingWorker] = []

    def start(**settings: Any) -> tuple[RecordingWorker, RunningRouter]:
        worker = RecordingWorker(name=llama_dir.name)
        workers.append(worker)
        router = start_router(worker=[worker.spec("a")], **settings)
        router.wait_workers_up(1)
        return worker, router

    yield start
    for worker in workers:
        worker.stop()


def body(llama_dir: Path) -> dict[str, Any]:
    return {"model": llama_dir.name, "prompt": "hello there", "max_tokens": 4}


def _port(router: RunningRouter) -> int:
    return int(router.url.rsplit(":", 1)[1])


async def _read_all(reader: asyncio.StreamReader, timeout: float) -> bytes:
    try:
        return await asyncio.wait_for(reader.read(), timeout)
    except TimeoutError:
        return b"<still open>"
    except ConnectionError:  # cut, and our next byte met the closed socket first
        return b"<reset>"


def test_slow_headers_are_cut_and_other_clients_are_served_meanwhile(
    guarded: Callable[..., tuple[RecordingWorker, RunningRouter]], llama_dir: Path
) -> None:
    _, router = guarded(header_timeout_s=0.5, max_connections_per_client=1000)
    port = _port(router)

    async def attack() -> list[bytes]:
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(200)]
        for _, writer in conns:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        results = []
        async with httpx.AsyncClient(timeout=5) as client:
            # Dribble a byte on every connection while a well-behaved client is served.
            for i in range(10):
                for reader, writer in conns:
                    if reader.at_eof():
                        continue
                    try:
                        writer.write(b"X")
                    except ConnectionError:
                        pass  # cut already, as it should be
                ok = await client.post(router.url + "/v1/completions", json=body(llama_dir))
                assert ok.status_code == 200, (i, ok.text)
                await asyncio.sleep(0.05)
        for reader, writer in conns:
            results.append(await _read_all(reader, 5))
            writer.close()
        return results

    answers = asyncio.run(attack())
    # Every one was cut (a 408, or a reset our next byte met), none is left open.
    assert all(a.startswith(b"HTTP/1.1 408") or a == b"<reset>" for a in answers), answers[:3]
    quiet = socket.create_connection(("127.0.0.1", port))
    quiet.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    quiet.settimeout(5)
    assert quiet.recv(4096).startswith(b"HTTP/1.1 408")
    quiet.close()
    assert router.workers()["a"]["status"] == "up"


def test_an_endless_header_gets_431_and_the_router_keeps_serving(
    guarded: Callable[..., tuple[RecordingWorker, RunningRouter]], llama_dir: Path
) -> None:
    _, router = guarded(max_header_bytes=8192)
    port = _port(router)
    streams = []
    for _ in range(3):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: ")
        streams.append(s)
    answers = []
    for s in streams:
        try:
            for _ in range(64):  # 64 KiB of one header, 1 KiB at a time
                s.sendall(b"a" * 1024)
        except OSError:
            pass  # closed on us, as it should be
        s.settimeout(5)
        try:
            answers.append(s.recv(4096))
        except OSError:
            answers.append(b"")
        s.close()
    assert all(a.startswith(b"HTTP/1.1 431") for a in answers), answers
    # A big body with ordinary headers is not a big header.
    big = {**body(llama_dir), "prompt": "word " * 20000}
    assert httpx.post(router.url + "/v1/completions", json=big, timeout=30).status_code == 200
    assert httpx.post(router.url + "/v1/completions", json=body(llama_dir)).status_code == 200
    assert router.workers()["a"]["status"] == "up"


def test_one_address_cannot_take_every_connection(
    guarded: Callable[..., tuple[RecordingWorker, RunningRouter]], llama_dir: Path
) -> None:
    _, router = guarded(max_connections_per_client=5)
    port = _port(router)
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]
    extra = socket.create_connection(("127.0.0.1", port))
    extra.sendall(b"POST /v1/completions HTTP/1.1\r\n")  # and the rest never comes
    held.append(extra)
    # Six late connections, five places: one of them is cut (which one depends on when each
    # one's grace ends, which a stall of the loop may reorder).
    protocol = router.server.config.http
    router.wait_for(lambda: protocol.refusals[TOO_MANY_CONNECTIONS] == 1, 60)
    assert protocol.clients.open == {"127.0.0.1": 5}
    # Another address (all of 127/8 is loopback) is served while the first holds its five.
    transport = httpx.HTTPTransport(local_address="127.0.0.2")
    with httpx.Client(transport=transport, timeout=5) as client:
        other = client.post(router.url + "/v1/completions", json=body(llama_dir))
    assert other.status_code == 200
    for s in held:
        s.close()
    deadline = time.monotonic() + 5
    while True:  # the closed connections give their places back
        try:
            r = httpx.post(router.url + "/v1/completions", json=body(llama_dir), timeout=5)
            if r.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_body_that_does_not_arrive_in_time_gets_408_and_holds_no_slot(
    guarded: Callable[..., tuple[RecordingWorker, RunningRouter]], llama_dir: Path
) -> None:
    # Without flow control a taken slot answers 429 at once (with it, the good request
    # would only wait for the 408 and pass all the same).
    worker, router = guarded(body_timeout_s=2.0, max_concurrency=1, flow_control=False)
    port = _port(router)
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 100\r\n\r\n{"
    )
    time.sleep(0.2)  # its headers are in: only its body is awaited
    # While it dribbles, the one slot is free for others: a body being read holds none.
    assert httpx.post(router.url + "/v1/completions", json=body(llama_dir)).status_code == 200
    s.settimeout(5)
    answer = s.recv(4096)
    s.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"request_timeout" in answer
    assert worker.generation_requests()[-1].json["prompt"] == "hello there"
