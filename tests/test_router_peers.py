"""Router replicas share what each sends (router/state/peers.py): over real ZMQ sockets on
loopback between links, then between two routers in front of the same workers."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
import test_router_dropin as dropin
import zmq
import zmq.asyncio

from kvpool.router.state.peers import Load, PeerLink, _encoder
from kvpool.stack import free_port

from recording_worker import RecordingWorker

pytestmark = pytest.mark.timeout(120)

# the drop-in tests' recording workers, as a fixture of this module too
recording = dropin.recording


class Side:
    """One replica's link, and what it was told by the others."""

    def __init__(self, port: int, peers: list[int], secret: str | None = "s" * 32, **kw: Any):
        self.rows: dict[str, tuple[int, int, int]] = {}
        self.load: dict[str, tuple[int, int]] = {}
        self.prefilling: dict[str, int] = {}
        self.speculated: list[tuple[str, int | None, list[int]]] = []
        self.pinned: list[tuple[str, str, str]] = []
        self.link = PeerLink(
            f"tcp://127.0.0.1:{port}",
            [f"tcp://127.0.0.1:{p}" for p in peers],
            rows=lambda: dict(self.rows),
            on_load=self._loaded,
            on_speculated=lambda w, r, k: self.speculated.append((w, r, k)),
            on_pinned=lambda t, k, w: self.pinned.append((t, k, w)),
            secret=secret,
            **kw,
        )

    def _loaded(self, worker: str, in_flight: int, queued: int, prefilling: int) -> None:
        self.load[worker] = (in_flight, queued)
        self.prefilling[worker] = prefilling


async def until(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def linked(**kw: Any) -> tuple[Side, Side]:
    pa, pb = free_port(), free_port()
    a, b = Side(pa, [pb], **kw), Side(pb, [pa], **kw)
    a.link.start()
    b.link.start()
    # ZMQ's slow joiner: until a heartbeat of each has crossed, messages may be dropped
    a.rows["warm"] = b.rows["warm"] = (0, 0, 0)
    await until(lambda: a.link.received and b.link.received)
    return a, b


async def test_each_replica_sees_the_others_load_and_speculations() -> None:
    a, b = await linked(heartbeat_s=0.05)
    try:
        a.link.load_changed("w1", 3, 900, 2)
        await until(lambda: b.load.get("w1") == (3, 900))
        assert b.prefilling["w1"] == 2  # two of the three still wait for a first token
        b.link.load_changed("w1", 2, 100)
        await until(lambda: a.load.get("w1") == (2, 100))
        assert b.load["w1"] == (3, 900)  # its own row is not among the peers'
        a.link.speculated("w2", None, [11, 22, 33])
        await until(lambda: b.speculated == [("w2", None, [11, 22, 33])])
        # a heartbeat that no longer names a worker ends the sender's load there
        a.rows = {"w3": (1, 0, 1)}
        await until(lambda: b.load.get("w1") == (0, 0) and b.load.get("w3") == (1, 0))
        assert b.prefilling == {"w1": 0, "w3": 1}
    finally:
        for side in (a, b):
            await side.link.close()


async def test_where_a_replica_sends_a_conversation_reaches_the_others() -> None:
    a, b = await linked(heartbeat_s=0.05)
    try:
        a.link.pinned("response", "resp_abc", "w2")
        a.link.pinned("session", "user-7", "w1")
        await until(lambda: len(b.pinned) == 2)
        assert b.pinned == [("response", "resp_abc", "w2"), ("session", "user-7", "w1")]
        assert a.pinned == []  # a replica does not hear its own
    finally:
        for side in (a, b):
            await side.link.close()


def test_a_message_of_the_release_before_pins_is_still_read() -> None:
    import msgspec

    class Before(msgspec.Struct, tag="load", array_like=True):  # Load before pins came
        sender: str
        rows: dict[str, tuple[int, int]]
        full: bool = False
        chains: list[tuple[str, int | None, list[int]]] = []

    old = msgspec.msgpack.encode(Before("old", {"w1": (1, 2)}, chains=[("w1", None, [5])]))
    got = msgspec.msgpack.decode(old, type=Load)
    assert got.rows == {"w1": (1, 2)} and got.chains == [("w1", None, [5])] and got.pins == []
    # and what the new release sends, its requests prefilling too, the old one reads
    new = _encoder.encode(Load("new", {"w1": (3, 4)}, full=True))
    assert msgspec.msgpack.decode(new, type=Before).rows == {"w1": (3, 4)}
    newer = _encoder.encode(Load("new", {"w1": (3, 4)}, prefilling={"w1": 2}))
    assert msgspec.msgpack.decode(newer, type=Before).rows == {"w1": (3, 4)}


async def test_a_silent_replica_s_rows_expire() -> None:
    a, b = await linked(heartbeat_s=0.05, row_ttl_s=0.3)
    try:
        a.link.load_changed("w1", 5, 0)
        await until(lambda: b.load.get("w1") == (5, 0))
        a.rows["w1"] = (5, 0, 0)
        await a.link.close()  # cut off: its rows age out at b
        await until(lambda: b.load.get("w1") == (0, 0), timeout=3)
    finally:
        await b.link.close()


async def test_messages_without_the_pools_credential_are_dropped() -> None:
    a, b = await linked(heartbeat_s=0.05)
    ctx = zmq.asyncio.Context.instance()
    forger = ctx.socket(zmq.PUB)
    forger.bind("tcp://127.0.0.1:0")
    try:
        b.link.set_peers([*b.link.peers, forger.getsockopt_string(zmq.LAST_ENDPOINT)])
        payload = _encoder.encode(Load("mallory", {"w1": (1000, 10**9)}))
        deadline = time.monotonic() + 5
        while b.link.rejected < 3:  # untagged, wrong tag, garbage: each dropped
            assert time.monotonic() < deadline
            await forger.send_multipart((b"", payload))
            await forger.send_multipart((b"x" * 16, payload))
            await forger.send_multipart((b"", b"\xc1garbage"))
            await asyncio.sleep(0.05)
        assert "w1" not in b.load
        assert "mallory" not in b.link.summary()["heard"]
    finally:
        forger.close(0)
        for side in (a, b):
            await side.link.close()


def test_two_routers_count_each_others_streams_and_share_new_prefixes(
    worker_processes, start_router
) -> None:
    workers = worker_processes(2, sim_time_scale=40)
    pa, pb = free_port(), free_port()
    common = {"worker": [w.url for w in workers], "pool_secret": "k" * 32}
    ra = start_router(peer_bind=f"tcp://127.0.0.1:{pa}", peer=[f"tcp://127.0.0.1:{pb}"], **common)
    rb = start_router(peer_bind=f"tcp://127.0.0.1:{pb}", peer=[f"tcp://127.0.0.1:{pa}"], **common)
    ra.wait_workers_up(2)
    rb.wait_workers_up(2)
    prompt = " ".join(f"shared document line {i} of the new prefix" for i in range(40))
    with httpx.Client(timeout=60) as client:
        # a slow stream through a: b counts it on that worker
        with client.stream(
            "POST",
            ra.url + "/v1/completions",
            json={"prompt": "a long answer please", "max_tokens": 200, "stream": True},
        ) as resp:
            assert resp.status_code == 200
            busy = resp.headers["x-kvpool-worker"]
            rb.wait_for(lambda: rb.workers()[busy]["peers_in_flight"] == 1, 10)
            # a new prefix through a, then at once through b: b sends it where a did,
            # before the worker's own events could have told it
            first = client.post(
                ra.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}
            )
            second = client.post(
                rb.url + "/v1/completions", json={"prompt": prompt + " again", "max_tokens": 1}
            )
            assert first.status_code == second.status_code == 200
            assert second.headers["x-kvpool-worker"] == first.headers["x-kvpool-worker"]
        rb.wait_for(lambda: rb.workers()[busy]["peers_in_flight"] == 0, 10)


def test_a_stored_response_is_continued_on_its_worker_through_the_other_replica(
    llama_dir: Any, recording: Any, start_router: Any
) -> None:
    a, b = recording(llama_dir.name), recording(llama_dir.name)
    pa, pb = free_port(), free_port()
    common = {"worker": [a.spec("a"), b.spec("b")], "pool_secret": "k" * 32}
    common["policy"] = "round-robin"  # alone, each replica would alternate the workers
    ra = start_router(peer_bind=f"tcp://127.0.0.1:{pa}", peer=[f"tcp://127.0.0.1:{pb}"], **common)
    rb = start_router(peer_bind=f"tcp://127.0.0.1:{pb}", peer=[f"tcp://127.0.0.1:{pa}"], **common)
    ra.wait_workers_up(2)
    rb.wait_workers_up(2)
    admin = {"authorization": "Bearer " + "k" * 32}

    def pins_heard() -> int:
        answer = httpx.get(rb.url + "/debug/peers", headers=admin, timeout=5)
        return int(answer.json().get("pins_received", 0)) if answer.is_success else 0

    first = {"model": llama_dir.name, "input": "hello there"}
    resp = httpx.post(ra.url + "/v1/responses", json=first, timeout=10)
    assert resp.status_code == 200
    worker, response_id = resp.headers["x-kvpool-worker"], resp.json()["id"]
    rb.wait_for(lambda: pins_heard() >= 1, 10)
    for turn in range(3):
        follow = {"model": llama_dir.name, "input": f"and {turn}?",
                  "previous_response_id": response_id}  # fmt: skip
        again = httpx.post(rb.url + "/v1/responses", json=follow, timeout=10)
        assert again.status_code == 200
        assert again.headers["x-kvpool-worker"] == worker


async def test_a_replica_copies_a_hot_prefix_for_the_requests_its_peers_have_prefilling(
    start_router: Any,
) -> None:
    """A replica with nothing of its own in flight still sizes a hot prefix's holders by
    the requests its peers have waiting for a first token: twelve of them on the holder
    ask for every one of four workers (three a holder); once they have their first
    tokens, one holder does again. Behind ``--processes N`` an idle process is the common case."""
    fakes = [RecordingWorker() for _ in range(4)]
    pr, ps = free_port(), free_port()
    router = start_router(
        worker=[f.spec(f"w{i}") for i, f in enumerate(fakes)],
        peer_bind=f"tcp://127.0.0.1:{pr}",
        peer=[f"tcp://127.0.0.1:{ps}"],
        pool_secret="s" * 32,
    )
    router.debug_headers = {"authorization": "Bearer " + "s" * 32}
    side = Side(ps, [pr], heartbeat_s=0.05)
    try:
        router.wait_workers_up(4)
        side.link.start()
        system = "you are a careful assistant who answers in full sentences " * 20
        async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
            for i in range(8):  # seen eight times, one at a time: hot, on one holder
                body = {"model": "tiny", "prompt": system + f"question {i}", "max_tokens": 1}
                resp = await client.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
        holder = resp.headers["x-kvpool-worker"]

        def wanted() -> int:
            return int(router.route({"prompt": system + "?"})["spread"]["wanted_holders"])

        assert wanted() == 1
        side.rows = {holder: (12, 0, 12)}
        side.link.load_changed(holder, 12, 0, 12)
        await until(lambda: router.workers()[holder]["peers_prefilling"] == 12)
        assert wanted() == 4
        side.rows = {holder: (12, 0, 0)}  # first tokens out, decoding on
        side.link.load_changed(holder, 12, 0, 0)
        await until(lambda: router.workers()[holder]["peers_prefilling"] == 0)
        assert wanted() == 1
    finally:
        await side.link.close()
        for f in fakes:
            f.stop()
