"""The router checks its cache predictions against the workers' reports: a worker that
hashes its blocks otherwise (a vLLM started without ``PYTHONHASHSEED``) is flagged, loses
its cache credit, and gets it back once it agrees (router/state/agreement.py).

The end-to-end test runs a router in front of two vLLM-like workers (no ``/kvpool/info``,
so no registration check can see their seed) that cache prompts by blocks, report
``cached_tokens`` and publish real KV events over ZMQ; one hashes with another seed.
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpool.hashing import DEFAULT_HASH_SEED, BlockHasher
from kvpool.kv_events import EventPublisher
from kvpool.operator.scaling import cache_condition
from kvpool.router.state.agreement import AgreementConfig, CacheAgreement
from kvpool.router.state.index import BlockIndex
from kvpool.tokenization import load_tokenizer

from conftest import RunningRouter
from recording_worker import RecordingWorker

BS = 16
CONFIG = AgreementConfig(window=16, min_answers=4, min_blocks=4)


def check() -> CacheAgreement:
    return CacheAgreement("w", BS, CONFIG)


# -- the verdict ----------------------------------------------------------------------------


def test_a_worker_serving_far_less_than_predicted_is_flagged_and_cleared_when_it_agrees(
    caplog: pytest.LogCaptureFixture,
) -> None:
    c = check()
    with caplog.at_level(logging.ERROR, "kvpool.router.state.agreement"):
        changes = [c.observe(128, 0) for _ in range(4)]
    assert changes == [False, False, False, True]
    assert c.flagged and c.cause == "over-predicted"
    assert "prefix caching off" in caplog.text and "worker w" in caplog.text
    # it agrees again: cleared once the window's agreement is back over clear_at
    for _ in range(15):
        c.observe(128, 128)
    assert not c.flagged and c.cause is None
    assert c.summary()["agreement"] == pytest.approx(15 / 16)


def test_no_verdict_without_evidence_and_none_for_noise() -> None:
    c = check()
    for _ in range(3):  # fewer answers claiming anything than min_answers
        c.observe(256, 0)
    assert not c.flagged
    c = check()
    for _ in range(16):  # a few blocks evicted between lookup and prefill: noise
        c.observe(128, 96)
    assert not c.flagged and c.ratio == pytest.approx(0.75)
    c = check()
    for _ in range(16):  # nothing cached, nothing predicted: no claim at all
        c.observe(0, 0)
    assert not c.flagged and c.ratio is None


def test_hits_the_index_did_not_predict_flag_a_worker_only_if_its_events_match_nothing() -> None:
    # Another hash seed: the worker reports hits, its events store blocks, and none of the
    # blocks sent is ever confirmed, even while speculation makes the router predict what
    # the worker does hold.
    seed = check()
    for i in range(6):
        seed.observe(128, 128, events=(8 * (i + 1), 0, 8 * (i + 1)))
    assert seed.flagged and seed.cause == "unseen"
    # An index that is behind (the router restarted; the worker holds a hot prefix from
    # before, whose hits store nothing): the new blocks each request computes confirm.
    behind = check()
    for i in range(16):
        behind.observe(0, 128, events=(10 * (i + 1), 2 * (i + 1), 2 * (i + 1)))
    assert not behind.flagged
    # Events that stopped coming (a wrong port, a network policy): no word on hashing.
    silent = check()
    for i in range(16):
        silent.observe(0, 128, events=(8 * (i + 1), 0, 0))
    assert not silent.flagged
    # A worker without events is never judged by them.
    untracked = check()
    for _ in range(16):
        untracked.observe(0, 128, events=None)
    assert not untracked.flagged


def test_an_answer_without_cached_tokens_counts_as_none_once_the_worker_has_reported_any() -> None:
    # vLLM without --enable-prompt-tokens-details: never a word, never judged
    quiet = check()
    for _ in range(16):
        quiet.observe(128, None)
    assert not quiet.flagged and quiet.summary()["answers"] == 0
    # vLLM with it leaves the details out when nothing was cached: a miss, counted
    c = check()
    c.observe(128, 128)
    for _ in range(15):
        c.observe(128, None)
    assert c.flagged and c.cause == "over-predicted"


def test_a_restart_drops_the_evidence_but_keeps_the_flag_until_the_new_process_agrees() -> None:
    c = check()
    for i in range(6):
        c.observe(128, 128, events=(8 * (i + 1), 0, 8 * (i + 1)))
    assert c.flagged
    c.restarted()
    assert c.flagged and c.summary()["answers"] == 0
    for i in range(6):
        n = 100 + 8 * (i + 1)
        c.observe(128, 128, events=(n, 8 * (i + 1), n))
    assert not c.flagged


def test_the_index_counts_speculated_blocks_its_events_confirm_even_late() -> None:
    now = [0.0]
    index = BlockIndex(speculative_ttl=2.0, clock=lambda: now[0])
    index.add_worker("w")
    index.speculate("w", [1, 2, 3])
    index.store("w", [1, 2])  # confirmed in time
    now[0] = 5.0
    index.match([9])  # block 3's guess expires unconfirmed
    index.store("w", [3])  # its store comes after a long queue: still a confirmation
    index.store("w", [40, 41])  # blocks the router never sent there
    assert index.confirmations("w") == (3, 3, 5)
    index.speculate("w", [50, 51])
    assert index.confirmations("w") == (5, 3, 5)
    # a guess that ran out and is made again (a prefix the worker holds, whose hits store
    # nothing) counts once; one withdrawn (the request never reached it) not at all
    now[0] = 10.0
    index.speculate("w", [50, 51, 52])
    assert index.confirmations("w") == (6, 3, 5)
    index.withdraw("w", [52])
    assert index.confirmations("w") == (5, 3, 5)


# -- end to end -------------------------------------------------------------------------------


def _vllm_like(
    tokenizer: Any, seed: str, port: int = 0, events_port: int = 0
) -> tuple[RecordingWorker, EventPublisher]:
    publisher = EventPublisher(
        endpoint=f"tcp://127.0.0.1:{events_port or '*'}", replay_endpoint=None
    ).start()
    worker = RecordingWorker(port=port)
    worker.publish_kv_events(
        lambda text: tokenizer.encode(text, add_special_tokens=True),
        BlockHasher(block_size=BS, hash_seed=seed),
        publisher,
    )
    return worker, publisher


def _send(router: RunningRouter, prompt: str) -> str:
    resp = httpx.post(
        router.url + "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 2},
        timeout=10,
    )
    assert resp.status_code == 200, resp.text
    return resp.headers["x-kvpool-worker"]


def _traffic_until(router: RunningRouter, done: Any, prefixes: list[str], seconds: float) -> int:
    """Requests on the shared prefixes, a new question each, until ``done()``; how many."""
    deadline = time.monotonic() + seconds
    sent = 0
    while not done():
        assert time.monotonic() < deadline, f"not within {seconds:.0f} s of traffic"
        for prefix in prefixes:
            _send(router, f"{prefix} question {uuid.uuid4().hex[:8]}")
            sent += 1
    return sent


@pytest.mark.timeout(180)
def test_a_worker_with_another_hash_seed_is_flagged_loses_credit_and_recovers_after_restart(
    start_router: Any, llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tokenizer = load_tokenizer(llama_dir)
    good, good_pub = _vllm_like(tokenizer, DEFAULT_HASH_SEED)
    bad, bad_pub = _vllm_like(tokenizer, "a seed of its own")
    bad_port, bad_events = bad.port, bad_pub.endpoint
    assert bad_events is not None
    try:
        router = start_router(
            worker=[
                f"{good.url},events={good_pub.endpoint},id=good",
                f"{bad.url},events={bad_events},id=bad",
            ],
            policy="round-robin",  # both get traffic, whatever their credit
            health_interval_s=0.2,
        )
        router.wait_workers_up(2)
        # three (odd) so that round-robin sends each prefix to both workers in turn
        prefixes = [f"system prompt {i}: " + "you are a helpful assistant " * 12 for i in range(3)]

        def flagged(worker: str) -> bool:
            return bool(router.workers()[worker]["cache_check"]["flagged"])

        with caplog.at_level(logging.ERROR, "kvpool.router.state.agreement"):
            start = time.monotonic()
            _traffic_until(router, lambda: flagged("bad"), prefixes, 60)
        took = time.monotonic() - start
        rows = router.workers()
        assert rows["bad"]["cache_check"]["cause"] == "unseen"
        assert rows["bad"]["cache_credit"] is False
        assert rows["bad"]["compatible"] is True  # nothing at registration could tell
        assert rows["good"]["cache_check"]["flagged"] is False
        assert rows["good"]["cache_check"]["agreement"] > 0.9
        assert "hash seed" in caplog.text and "worker bad" in caplog.text
        metrics = httpx.get(router.url + "/metrics", timeout=10).text
        assert 'kvpool_router_worker_cache_flagged{cause="unseen",worker="bad"} 1.0' in metrics
        assert 'kvpool_router_worker_cache_flags_total{worker="bad"} 1.0' in metrics
        # the operator's condition on the pool, from this page (and a router it could not
        # scrape, which changes nothing)
        status, reason, message = cache_condition([("r-0", metrics), ("r-1", None)])
        assert (status, reason) == ("False", "Disagree")
        assert "bad (unseen)" in message and "good" not in message

        # No cache credit: right after the bad worker got a prompt, the router's own
        # speculation would credit it with the prefix; flagged, it is credited nothing.
        prompt = prefixes[0] + " once more"
        while _send(router, prompt) != "bad":
            pass
        cands = {c["worker"]: c for c in router.route({"prompt": prompt})["candidates"]}
        assert cands["bad"]["cached_tokens"] == 0
        assert cands["good"]["cached_tokens"] > 0
        print(f"flagged after {took:.1f} s of traffic")

        # Restarted with the router's seed (same address): it agrees, and is unflagged.
        bad.stop()
        bad_pub.close()
        router.wait_for(lambda: router.workers()["bad"]["status"] != "up", 30)
        port = int(bad_events.rsplit(":", 1)[1])
        bad, bad_pub = _vllm_like(tokenizer, DEFAULT_HASH_SEED, bad_port, port)
        router.wait_workers_up(2)
        assert flagged("bad")  # a new process has to show it agrees first
        _traffic_until(router, lambda: not flagged("bad"), prefixes, 60)
        assert router.workers()["bad"]["cache_credit"] is True
        metrics = httpx.get(router.url + "/metrics", timeout=10).text
        assert cache_condition([("r-0", metrics)])[:2] == ("True", "Agree")
    finally:
        for w, p in ((good, good_pub), (bad, bad_pub)):
            w.stop()
            p.close()
