"""A router that starts in front of a worker that has served for a while replays the
worker's KV event history (its publisher's replay buffer: vLLM keeps 10,000 batches) into
its index before it routes there.

Until the history is in, the index says too little of what the worker holds (or, after a
cache reset in that history, too much), so the worker is not in rotation: its status is
``syncing`` and the router's readiness (``/health``) waits. The router keeps answering
meanwhile: a replay of tens of thousands of batches yields its event loop as it goes. A
replay that takes longer than ``index_sync_timeout_s`` puts the worker in rotation anyway,
with a warning.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from kvpool.hashing import DEFAULT_HASH_SEED, BlockHasher
from kvpool.kv_events import BlockStored, EventBatch, EventPublisher
from kvpool.tokenization import load_tokenizer

from recording_worker import RecordingWorker, serve_in_thread

BS = 16
HISTORY = 20_000  # batches the worker published before the router came
PROMPT = "the document everyone asks about: " + "a long shared context " * 40


def _worker_with_history(llama_dir: Path) -> tuple[RecordingWorker, EventPublisher, int]:
    """A vLLM-like worker whose publisher holds ``HISTORY`` batches of other blocks, then
    the blocks of :data:`PROMPT`; and how many of its tokens those blocks hold."""
    tokenizer = load_tokenizer(llama_dir)
    pub = EventPublisher(
        endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", buffer_size=HISTORY + 8
    ).start()
    rng = random.Random(7)
    for _ in range(HISTORY):
        keys = [rng.getrandbits(63) for _ in range(4)]
        tokens = [rng.randrange(1000) for _ in range(4 * BS)]
        pub.publish(EventBatch(events=[BlockStored(keys, None, tokens, BS)], ts=time.time()))
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    keys = BlockHasher(block_size=BS, hash_seed=DEFAULT_HASH_SEED).prompt_keys(ids)
    pub.publish(
        EventBatch(events=[BlockStored(keys, None, ids[: len(keys) * BS], BS)], ts=time.time())
    )
    deadline = time.monotonic() + 60
    while pub.next_seq < HISTORY + 1:  # every batch sent, so in the replay buffer
        assert time.monotonic() < deadline, "the publisher did not send its history"
        time.sleep(0.01)
    return RecordingWorker(), pub, len(keys) * BS


def _spec(worker: RecordingWorker, pub: EventPublisher) -> str:
    return f"{worker.url},events={pub.endpoint},replay={pub.replay_endpoint},id=w"


@pytest.mark.timeout(120)
def test_a_worker_enters_rotation_once_its_kv_history_is_in_the_index(
    start_router: Any, llama_dir: Path
) -> None:
    worker, pub, held = _worker_with_history(llama_dir)
    try:
        router = start_router(worker=[_spec(worker, pub)], health_interval_s=0.1)
        # each sample: /health's code and status, then the worker's status and events
        seen: list[tuple[int, str, str, int]] = []
        deadline = time.monotonic() + 60
        while True:
            health = httpx.get(router.url + "/health", timeout=10)
            row = router.workers()["w"]
            seen.append((health.status_code, health.json()["status"], row["status"],
                         row["events_seen"]))  # fmt: skip
            if row["status"] == "up":
                break
            assert time.monotonic() < deadline, seen[-1]
            time.sleep(0.005)
        # The first routing decision it takes part in sees the whole history: the prompt's
        # blocks, stored last, are credited.
        cands = {c["worker"]: c for c in router.route({"prompt": PROMPT})["candidates"]}
        assert cands["w"]["cached_tokens"] >= held - BS  # all but the last token's block
        # Meanwhile the router answered, and said what it was doing: not ready, the worker
        # syncing; and it was never ready before the history was in.
        assert any(s[:3] == (503, "syncing", "syncing") for s in seen), seen[-4:]
        assert all(s[2] == "up" for s in seen if s[0] == 200)
        assert httpx.get(router.url + "/health", timeout=10).json()["status"] == "ok"
        assert router.workers()["w"]["events_seen"] >= HISTORY
    finally:
        worker.stop()
        pub.close()


@pytest.mark.timeout(120)
def test_a_replay_longer_than_the_sync_timeout_puts_the_worker_in_rotation_with_a_warning(
    start_router: Any, llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    worker, pub, _ = _worker_with_history(llama_dir)
    try:
        with caplog.at_level(logging.WARNING, "kvpool.router.state.pool"):
            router = start_router(
                worker=[_spec(worker, pub)], health_interval_s=0.1, index_sync_timeout_s=0.01
            )
            router.wait_workers_up(1)
            assert router.workers()["w"]["events_seen"] < HISTORY  # still replaying
        assert "worker w" in caplog.text and "before its index caught up" in caplog.text
        resp = httpx.post(
            router.url + "/v1/completions",
            json={"model": "tiny", "prompt": "hello", "max_tokens": 2},
            timeout=10,
        )
        assert resp.status_code == 200 and resp.headers["x-kvpool-worker"] == "w"
    finally:
        worker.stop()
        pub.close()


@pytest.mark.timeout(120)
def test_a_new_router_is_not_ready_while_any_worker_it_knows_is_still_syncing(
    start_router: Any, llama_dir: Path
) -> None:
    """Ready with the first worker in, a new router would send it all of its traffic while
    the others replayed; a worker that answers its health check but cannot be registered
    does not keep the router out of service."""
    worker, pub, _ = _worker_with_history(llama_dir)
    empty = RecordingWorker()  # no history to replay: in at once
    broken = Starlette(routes=[Route("/health", lambda r: PlainTextResponse("ok"))])
    server, thread, port = serve_in_thread(broken, "unregistrable-worker", 0)
    try:
        router = start_router(
            worker=[
                _spec(worker, pub),
                f"{empty.url},id=empty",
                f"http://127.0.0.1:{port},id=broken",
            ],
            health_interval_s=0.1,
        )
        seen: list[tuple[int, dict[str, str]]] = []  # /health's code, the workers' statuses
        deadline = time.monotonic() + 60
        while True:
            health = httpx.get(router.url + "/health", timeout=10)
            statuses = {k: w["status"] for k, w in router.workers().items()}
            seen.append((health.status_code, statuses))
            if statuses["w"] == "up":
                break
            assert time.monotonic() < deadline, seen[-1]
            time.sleep(0.005)
        assert any(s == {"w": "syncing", "empty": "up", "broken": "unavailable"}
                   for _, s in seen), seen[-3:]  # fmt: skip
        assert all(code == 503 for code, s in seen if s["w"] != "up")
        router.wait_for(lambda: httpx.get(router.url + "/health", timeout=10).status_code == 200)
        body = httpx.get(router.url + "/health", timeout=10).json()
        assert (body["workers_up"], body["workers_syncing"], body["workers_registering"]) == (
            2,
            0,
            0,
        )
    finally:
        worker.stop()
        empty.stop()
        pub.close()
        server.should_exit = True
        thread.join(timeout=10)
