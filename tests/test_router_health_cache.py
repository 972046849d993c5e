"""Health is not cache loss.

Tried on a busy pool, one ``/health`` answer slower than the health timeout (1 s) took a
worker out of rotation and wiped its index entries; it came back with only what its replay
buffer still held (a hot system prompt cached earlier never returns: a worker announces a
block once, when it first stores it). A router whose own loop stalled for a second marked
every worker down at once: 503 for everyone, every index dropped. Here a slow worker leaves
and re-enters rotation with its entries, a stalled router marks nobody down, and a worker
that really restarted (a new process at the same address) loses what the old one held.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpool.hashing import DEFAULT_HASH_SEED, BlockHasher
from kvpool.kv_events import EventPublisher
from kvpool.tokenization import load_tokenizer

from conftest import RunningRouter, WorkerProcess
from recording_worker import RecordingWorker

SYSTEM = "you are a careful assistant who answers in one short sentence " * 8


def _vllm_like(tokenizer: Any) -> tuple[RecordingWorker, EventPublisher]:
    """A vLLM stand-in publishing its blocks, with no replay buffer: what the router
    forgets of it, nothing brings back."""
    publisher = EventPublisher(endpoint="tcp://127.0.0.1:*", replay_endpoint=None).start()
    worker = RecordingWorker(name="tiny")
    worker.publish_kv_events(
        lambda text: tokenizer.encode(text, add_special_tokens=True),
        BlockHasher(block_size=16, hash_seed=DEFAULT_HASH_SEED),
        publisher,
    )
    return worker, publisher


def _complete(router: RunningRouter, model: str, prompt: str) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 2}
    resp = httpx.post(router.url + "/v1/completions", json=body, timeout=10)
    assert resp.status_code == 200, resp.text
    return resp


def _stable_blocks(router: RunningRouter, worker: str) -> int:
    """The worker's indexed blocks once its events have all arrived (unchanged for 0.3 s)."""
    last, since = -1, time.monotonic()
    deadline = since + 20
    while True:
        now_blocks = router.workers()[worker]["indexed_blocks"]
        if now_blocks != last:
            last, since = now_blocks, time.monotonic()
        elif last > 0 and time.monotonic() - since > 0.3:
            return last
        assert time.monotonic() < deadline, "the index did not settle"
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_a_worker_slow_to_answer_health_leaves_rotation_and_comes_back_with_its_index(
    start_router: Callable[..., RunningRouter], llama_dir: Path
) -> None:
    tokenizer = load_tokenizer(llama_dir)
    worker, publisher = _vllm_like(tokenizer)
    try:
        router = start_router(worker=[f"{worker.url},events={publisher.endpoint},id=a"])
        router.wait_workers_up(1)
        for i in range(3):
            _complete(router, "tiny", f"{SYSTEM} question {i}")
        held = _stable_blocks(router, "a")

        worker.health_delay = 1.5  # over the router's health timeout (1 s)
        router.wait_for(lambda: router.workers()["a"]["status"] != "up", 10)
        assert router.workers()["a"]["indexed_blocks"] == held  # out, not forgotten
        worker.health_delay = 0.0
        router.wait_for(lambda: router.workers()["a"]["status"] == "up", 10)
        assert router.workers()["a"]["indexed_blocks"] == held

        # Its prefix is still credited to it: a new question on the system prompt is
        # predicted to hit its cache, and the worker's answer agrees.
        route = router.route({"model": "tiny", "prompt": f"{SYSTEM} question 9"})
        (row,) = [c for c in route["candidates"] if c["worker"] == "a"]
        assert row["cached_tokens"] > 0
        usage = _complete(router, "tiny", f"{SYSTEM} question 9").json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == row["cached_tokens"]
    finally:
        worker.stop()
        publisher.close()


@pytest.mark.timeout(120)
def test_a_router_whose_loop_stalls_marks_no_worker_down(
    start_router: Callable[..., RunningRouter],
    llama_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    workers = [RecordingWorker(name=llama_dir.name) for _ in range(2)]
    for w in workers:
        w.health_delay = 0.2  # a probe is in flight most of the time
    try:
        router = start_router(worker=[w.spec(f"w{i}") for i, w in enumerate(workers)])
        router.wait_workers_up(2)
        loop = router.server.servers[0].get_loop()
        with caplog.at_level(logging.WARNING, "kvpool.router.state.pool"):
            for _ in range(3):  # blocked 3 s, three times, with health checks in flight
                loop.call_soon_threadsafe(time.sleep, 3.0)
                router.workers()  # answered once the loop runs again
                probes = [len(w.requests_to("/health")) for w in workers]
                # two more checks of each worker after the stall, judged on what they took
                pairs = list(zip(workers, probes, strict=True))
                router.wait_for(
                    lambda p=pairs: all(len(w.requests_to("/health")) > n + 1 for w, n in p),
                    10,
                )
                assert all(r["status"] == "up" for r in router.workers().values())
        assert not [r.getMessage() for r in caplog.records if "is down" in r.getMessage()]
        _complete(router, llama_dir.name, "hello there")
    finally:
        for w in workers:
            w.stop()


@pytest.mark.timeout(180)
def test_a_worker_restarted_at_the_same_address_loses_what_it_held(
    start_router: Callable[..., RunningRouter], llama_dir: Path, tmp_path: Path
) -> None:
    """The kill alone is no evidence (a worker that does not answer may be busy, or its
    network cut); the new process's boot id at registration is."""
    first = WorkerProcess(llama_dir)
    second = None
    try:
        first.wait_healthy()
        router = start_router(worker=[f"{first.url},id=a"])
        router.wait_workers_up(1)
        _complete(router, llama_dir.name, SYSTEM + uuid.uuid4().hex)
        held = _stable_blocks(router, "a")

        first.kill()
        router.wait_for(lambda: router.workers()["a"]["status"] == "down", 10)
        assert router.workers()["a"]["indexed_blocks"] == held

        second = WorkerProcess(
            llama_dir,
            port=first.port,
            kv_events_endpoint=first.events,
            kv_events_replay_endpoint=first.replay,
        )
        second.wait_healthy()
        router.wait_for(lambda: router.workers()["a"]["status"] == "up", 30)
        assert router.workers()["a"]["indexed_blocks"] == 0  # the new process holds nothing
        # and what it stores from now on is indexed, from its own events
        _complete(router, llama_dir.name, SYSTEM + uuid.uuid4().hex)
        assert _stable_blocks(router, "a") > 0
    finally:
        first.stop()
        if second is not None:
            second.stop()
