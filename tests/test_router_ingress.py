"""The router behind an ingress: every client is one address, and that is not abuse.

Tried as a user would (a held-out trace, 8 workers, one load generator), a default router
answered 31% of the requests at 20 req/s with ``429 this client has 256 connections open``:
an ingress controller, a Gateway, a cloud load balancer or a mesh sidecar sends all its
traffic from one address. Here a default router takes thousands of streams from one
address, while the abuse defences still cut what an abuser holds (idle connections and
requests that do not arrive), and limits per client act on the client behind a trusted
proxy, never on an address a client wrote itself.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvpool.httpguard import TOO_MANY_CONNECTIONS, client_address, parse_networks

from conftest import RunningRouter
from recording_worker import RecordingWorker

STREAMS = 4000


# The workers: a process of their own, as real workers are (in the test's process they
# would share its interpreter lock with the router and the client, and a starved worker
# failing its health checks twice is rightly taken for hung). Each holds every generation
# request until told "open" on stdin; "count" prints how many they hold.
WORKERS = """
import sys, threading
sys.path.insert(0, sys.argv[1])
from recording_worker import RecordingWorker

workers = [RecordingWorker(name=sys.argv[2]) for _ in range(int(sys.argv[3]))]
for w in workers:
    w.mode = "stall"
print(" ".join(w.url for w in workers), flush=True)
for line in sys.stdin:
    if line.strip() == "count":
        print(sum(len(w.generation_requests()) for w in workers), flush=True)
    elif line.strip() == "open":
        for w in workers:
            w.gate.set()
        print("opened", flush=True)
for w in workers:
    w.stop()
"""


class StalledWorkers:
    def __init__(self, model: str, n: int) -> None:
        here = str(Path(__file__).parent)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKERS, here, model, str(n)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.urls = self._read().split()

    def _read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "the workers' process ended"
        return line.strip()

    def _say(self, what: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return self._read()

    def held(self) -> int:
        return int(self._say("count"))

    def open(self) -> None:
        self._say("open")

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture
def stalled(llama_dir: Path) -> Iterator[StalledWorkers]:
    """Four workers that hold every generation request until they are opened."""
    workers = StalledWorkers(llama_dir.name, 4)
    yield workers
    workers.stop()


def _port(router: RunningRouter) -> int:
    return int(router.url.rsplit(":", 1)[1])


def _refused_connections(router: RunningRouter) -> int:
    protocol = router.server.config.http
    return int(protocol.refusals[TOO_MANY_CONNECTIONS])


# The client: a process of its own, as an ingress is, opening one connection per stream
# from one address, all at once, and reading each stream to its end. It prints each
# stream's status and whether it ended with [DONE], one line each.
CLIENT = """
import asyncio, sys
import aiohttp

url, n, model = sys.argv[1], int(sys.argv[2]), sys.argv[3]
body = {"model": model, "prompt": "hello there", "max_tokens": 4, "stream": True}

async def one(session):
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            text = await resp.read()
            return f"{resp.status} {text.rstrip().endswith(b'data: [DONE]')}"
    except Exception as e:
        return f"error {type(e).__name__}"

async def main():
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for line in await asyncio.gather(*(one(session) for _ in range(n))):
            print(line)

asyncio.run(main())
"""


@pytest.mark.slow
def test_thousands_of_streams_from_one_address_all_reach_the_workers(
    start_router: Callable[..., RunningRouter],
    stalled: StalledWorkers,
    llama_dir: Path,
) -> None:
    specs = [f"{url},id=w{i}" for i, url in enumerate(stalled.urls)]
    router = start_router(worker=specs)
    router.wait_workers_up(len(specs))
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, router.url, str(STREAMS), llama_dir.name],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        # Every stream is at a worker at once (the workers hold them all) before any ends.
        deadline = time.monotonic() + 240
        while (held := stalled.held()) < STREAMS:
            assert client.poll() is None, f"the client ended with {held} streams at workers"
            assert time.monotonic() < deadline, f"{held} of {STREAMS} reached the workers"
            time.sleep(0.2)
        stalled.open()
        out, _ = client.communicate(timeout=240)
    finally:
        client.kill()
    answers = out.splitlines()
    assert len(answers) == STREAMS
    assert answers.count("200 True") == STREAMS, {a: answers.count(a) for a in set(answers)}
    assert _refused_connections(router) == 0
    assert stalled.held() == STREAMS  # each reached a worker once: none refused and retried


def test_an_idle_flood_from_one_address_is_still_cut(
    start_router: Callable[..., RunningRouter], llama_dir: Path
) -> None:
    """Connections that send nothing count against their address (after a short grace),
    and over the limit the next one is answered 429; a prompt client is served all along."""
    with RecordingWorker(name=llama_dir.name) as worker:
        router = start_router(worker=[worker.spec("a")], max_connections_per_client=5)
        router.wait_workers_up(1)
        held = [socket.create_connection(("127.0.0.1", _port(router))) for _ in range(5)]
        extra = socket.create_connection(("127.0.0.1", _port(router)))
        extra.sendall(b"POST /v1/completions HTTP/1.1\r\n")  # and the rest never comes
        held.append(extra)
        # Six late connections, five places: one is cut (429 if it began a request, closed
        # if it sent nothing; which one depends on when each grace ends).
        router.wait_for(lambda: _refused_connections(router) == 1, 60)
        assert router.server.config.http.clients.open == {"127.0.0.1": 5}
        # A client on the same address that sends its request at once is served meanwhile.
        body = {"model": llama_dir.name, "prompt": "hello there", "max_tokens": 4}
        assert httpx.post(router.url + "/v1/completions", json=body, timeout=10).status_code == 200
        for s in held:
            s.close()


def test_idle_kept_alive_connections_make_room_for_new_ones(
    start_router: Callable[..., RunningRouter], llama_dir: Path
) -> None:
    """A proxy's pool keeps connections alive after a burst; over the limit the oldest idle
    one is closed, and a new connection from the same address is served, not refused."""
    with RecordingWorker(name=llama_dir.name) as worker:
        router = start_router(worker=[worker.spec("a")], max_connections_per_client=3)
        router.wait_workers_up(1)
        body = {"model": llama_dir.name, "prompt": "hello there", "max_tokens": 4}
        clients = [httpx.Client(timeout=10) for _ in range(6)]
        try:
            for c in clients:  # six kept-alive connections, idle after their answer
                assert c.post(router.url + "/v1/completions", json=body).status_code == 200
            protocol = router.server.config.http
            deadline = time.monotonic() + 5
            while protocol.clients.open.get("127.0.0.1", 0) != 3:
                assert time.monotonic() < deadline, protocol.clients.open
                time.sleep(0.01)
            for c in clients:  # the closed ones reconnect; nobody is refused
                assert c.post(router.url + "/v1/completions", json=body).status_code == 200
        finally:
            for c in clients:
                c.close()
        assert _refused_connections(router) == 0


def test_a_per_client_limit_counts_the_client_behind_a_trusted_proxy(
    start_router: Callable[..., RunningRouter], llama_dir: Path
) -> None:
    """With --max-requests-per-client, requests through a trusted proxy count against the
    address its X-Forwarded-For names; an untrusted peer's header is ignored."""
    with RecordingWorker(name=llama_dir.name) as worker:
        worker.mode = "stall"
        router = start_router(
            worker=[worker.spec("a")], max_requests_per_client=1, trusted_proxies=["127.0.0.1/32"]
        )
        router.wait_workers_up(1)
        body = {"model": llama_dir.name, "prompt": "hello there", "max_tokens": 4}

        def arrived(n: int) -> Callable[[], bool]:
            return lambda: len(worker.generation_requests()) == n

        async def send(client: str, local: str = "127.0.0.1") -> int:
            transport = httpx.AsyncHTTPTransport(local_address=local)
            async with httpx.AsyncClient(transport=transport, timeout=30) as c:
                headers = {"x-forwarded-for": f"{client}, 127.0.0.1"}
                r = await c.post(router.url + "/v1/completions", json=body, headers=headers)
                return r.status_code

        async def run() -> dict[str, int]:
            first = asyncio.create_task(send("203.0.113.7"))  # held at the worker
            await asyncio.to_thread(worker.wait_for, arrived(1))
            again = await send("203.0.113.7")  # the same client through the proxy: over
            other = asyncio.create_task(send("198.51.100.9"))  # another client: its own
            await asyncio.to_thread(worker.wait_for, arrived(2))
            # Not through a trusted proxy (127.0.0.2): its header names nobody, its own
            # address is the client, and that has nothing in flight.
            spoofed = asyncio.create_task(send("203.0.113.7", local="127.0.0.2"))
            await asyncio.to_thread(worker.wait_for, arrived(3))
            worker.gate.set()
            return {
                "first": await first,
                "again": again,
                "other": await other,
                "spoofed": await spoofed,
            }

        codes = asyncio.run(run())
        assert codes == {"first": 200, "again": 429, "other": 200, "spoofed": 200}, codes
        assert (
            router.metric("kvpool_router_rate_limited_total", tenant="anonymous", limit="client")
            == 1
        )


@pytest.mark.parametrize(
    ("peer", "headers", "header", "expected"),
    [
        # not a trusted proxy: its header is the client's own word, never believed
        ("198.51.100.1", {"x-forwarded-for": "203.0.113.7"}, "x-forwarded-for", "198.51.100.1"),
        # through one trusted proxy
        ("10.0.0.5", {"x-forwarded-for": "203.0.113.7"}, "x-forwarded-for", "203.0.113.7"),
        # a client that writes its own header in front: the proxy appended the real one
        ("10.0.0.5", {"x-forwarded-for": "1.2.3.4, 203.0.113.7"}, "x-forwarded-for", "203.0.113.7"),
        # two trusted hops
        (
            "10.0.0.5",
            {"x-forwarded-for": "203.0.113.7, 10.0.0.9"},
            "x-forwarded-for",
            "203.0.113.7",
        ),
        # every hop trusted: the first
        ("10.0.0.5", {"x-forwarded-for": "10.1.1.1, 10.0.0.9"}, "x-forwarded-for", "10.1.1.1"),
        # garbage behind a trusted hop: nothing beyond it can be told apart
        ("10.0.0.5", {"x-forwarded-for": "evil, 10.0.0.9"}, "x-forwarded-for", "10.0.0.9"),
        # no header from a trusted proxy: the proxy
        ("10.0.0.5", {}, "x-forwarded-for", "10.0.0.5"),
        # RFC 7239, IPv6 with a port, and a v4-mapped peer
        (
            "::ffff:10.0.0.5",
            {"forwarded": 'for="[2001:db8::1]:4711";proto=https'},
            "forwarded",
            "2001:db8::1",
        ),
        ("10.0.0.5", {"forwarded": "for=192.0.2.60:80, for=10.0.0.9"}, "forwarded", "192.0.2.60"),
        # X-Forwarded-For with ports (some cloud load balancers write them)
        (
            "10.0.0.5",
            {"x-forwarded-for": "203.0.113.7:51234, [2001:db8::9]:443"},
            "x-forwarded-for",
            "2001:db8::9",
        ),
        ("10.0.0.5", {"x-forwarded-for": "203.0.113.7:51234"}, "x-forwarded-for", "203.0.113.7"),
        # the other header is not read
        ("10.0.0.5", {"forwarded": "for=192.0.2.60"}, "x-forwarded-for", "10.0.0.5"),
    ],
)
def test_the_client_address_is_taken_only_from_trusted_proxies(
    peer: str, headers: dict[str, str], header: str, expected: str
) -> None:
    trusted = parse_networks(["10.0.0.0/8"])
    assert client_address(peer, headers, trusted, header) == expected


def test_a_bad_trusted_proxy_is_named_at_start(llama_dir: Path) -> None:
    from kvpool.router.settings import RouterSettings

    with pytest.raises(ValueError, match=r"trusted_proxies: .10\.0\.0\.0/33. is not an IP address"):
        RouterSettings(
            model=str(llama_dir), worker=["http://127.0.0.1:1"], trusted_proxies=["10.0.0.0/33"]
        )
