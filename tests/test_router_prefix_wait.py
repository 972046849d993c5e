"""A request whose prompt shares blocks with one still prefilling them on its worker waits
for that prefill (router/state/load.py ``WorkerLoad.leader``, router/proxy/forward.py ``_follow``):
sent at once, the worker would compute the shared blocks a second time beside the first
(an engine's prefix cache holds only computed blocks), and the two prefills slow each
other. The wait ends at the leader's first token, when it ends, or at a bound from its
predicted TTFT: a leader that never answers holds nobody for long."""

from __future__ import annotations

import concurrent.futures
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.router.state.load import PrefillModel, Ticket, WorkerLoad, common_prefix

from conftest import RunningRouter
from recording_worker import RecordingWorker

pytestmark = pytest.mark.timeout(60)

BS = 16
DOC = " ".join(f"clause {i} of the shared contract binds party {i % 7}." for i in range(40))
LEASE = " ".join(f"article {i} of the lease lets room {i % 5} to tenant {i}." for i in range(40))


# -- which request leads ---------------------------------------------------------------------


@given(
    st.lists(st.integers(0, 3), max_size=40),
    st.lists(st.integers(0, 3), max_size=40),
)
def test_the_shared_run_of_two_hash_chains_is_found(a: list[int], b: list[int]) -> None:
    def chain(items: list[int]) -> list[int]:  # each key stands for everything before it
        out, h = [], 0
        for x in items:
            h = hash((h, x))
            out.append(h)
        return out

    naive = 0
    while naive < min(len(a), len(b)) and a[naive] == b[naive]:
        naive += 1
    assert common_prefix(chain(a), chain(b)) == naive


def _begin(load: WorkerLoad, keys: list[int], credited: int, now: float, **kw: Any) -> Ticket:
    uncached = (len(keys) - credited) * BS
    return load.begin(
        uncached, 0.1, now, shows_first_token=True, keys=keys, credited_blocks=credited, **kw
    )


def test_a_follower_waits_for_the_request_prefilling_most_of_its_prompt() -> None:
    load = WorkerLoad()
    doc, other = list(range(100, 140)), list(range(500, 540))
    a = _begin(load, doc[:10], 0, 0.0)  # computes 10 blocks of the document
    b = _begin(load, doc[:30], 10, 0.1)  # credited a's 10 (speculated): computes 20 more
    _begin(load, other, 0, 0.2)  # another document entirely
    follower = _begin(load, [*doc, 7], 30, 0.3)
    leader, until = load.leader(follower, 4, BS)
    assert leader is b  # 20 shared blocks still to compute, against a's 10
    # by the leader's predicted time for its queue and those blocks, with the margin
    expected = b.routed_at + 1.5 * load.prefill.predict(b.queued_ahead + 20 * BS)
    assert until == pytest.approx(expected)
    # once it has its first token, the one still computing its part leads
    load.first_token(b, 0.5)
    assert b.prefilled().is_set()
    assert load.leader(follower, 4, BS)[0] is a
    load.end(a)
    assert a.prefilled().is_set()
    assert load.leader(follower, 4, BS) is None


def test_nobody_waits_for_a_few_blocks_a_later_request_or_an_answer_it_cannot_see() -> None:
    load = WorkerLoad()
    doc = list(range(100, 140))
    _begin(load, doc[:3], 0, 0.0)  # 3 shared blocks: under the 4 worth a wait
    # a whole (not streamed) answer shows no first token: nothing would end the wait early
    load.begin(400, 0.1, 0.1, keys=doc, credited_blocks=0)
    follower = _begin(load, doc, 0, 0.2)
    assert load.leader(follower, 4, BS) is None
    later = _begin(load, doc, 0, 0.3)  # routed after the follower: it leads nobody before it
    assert load.leader(follower, 4, BS) is None
    assert load.leader(later, 4, BS)[0] is follower
    assert load.leader(later, 0, BS) is None  # 0: waiting is off


def test_the_wait_is_bounded_by_the_model_routing_uses_and_unbounded_before_any_ttft() -> None:
    """A fresh worker's own model is the static prior (8,000 tokens/s, several times a real
    GPU's rate for a long prompt): a bound from it let the followers go while the first
    prefill still ran, and slowed it. The bound comes from the model routing judges the
    worker by; before the router has seen any TTFT there is none worth a cap."""
    load = WorkerLoad()
    doc = list(range(100, 160))
    leader = _begin(load, doc, 0, 0.0)
    follower = _begin(load, [*doc, 7], 60, 0.1)
    own = load.leader(follower, 4, BS)
    assert own is not None and own[0] is leader
    slower = PrefillModel()
    for n in (1000, 2000, 4000, 8000):  # a fleet prefilling at 2,000 tokens/s
        slower.observe(n, 0.05 + n / 2000)
    found = load.leader(follower, 4, BS, lambda: slower)
    assert found is not None and found[1] > own[1]
    assert found[1] == pytest.approx(1.5 * slower.predict(60 * BS), rel=0.01)
    assert load.leader(follower, 4, BS, lambda: None) == (leader, math.inf)


def test_a_holder_is_credited_the_blocks_a_request_there_has_not_computed_yet_as_none() -> None:
    """The index counts a routed prompt's blocks as held at once (speculation); what a
    request sent now would find is what is computed."""
    load = WorkerLoad()
    doc = list(range(100, 160))
    assert load.computing(doc) == 60  # nothing in flight: all it holds
    a = _begin(load, doc[:20], 0, 0.0)  # computes the first 20
    assert load.computing(doc) == 0
    b = _begin(load, doc[:50], 20, 0.1)  # credited a's 20, computes 30 more
    assert load.computing(doc[:10]) == 0
    load.first_token(a, 0.5)
    assert load.computing(doc) == 20  # a's are computed; b still computes from 20
    load.first_token(b, 0.6)
    assert load.computing(doc) == 60
    assert load.computing([1, 2, 3]) == 3  # a prompt it shares nothing with


# -- through the router ---------------------------------------------------------------------


@pytest.fixture
def stalling_worker(llama_dir: Path) -> Iterator[RecordingWorker]:
    worker = RecordingWorker(name=llama_dir.name)
    yield worker
    worker.stop()


def _stream(router: RunningRouter, prompt: str) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as resp:
        text = "".join(resp.iter_lines())
    return {"status": resp.status_code, "text": text}


def _generations(worker: RecordingWorker) -> int:
    return len(worker.generation_requests())


def test_a_follower_is_sent_when_its_leader_prefilled_or_at_the_bound(
    stalling_worker: RecordingWorker, start_router: Any
) -> None:
    worker = stalling_worker
    router = start_router(worker=[worker.spec("a")])
    router.wait_workers_up(1)
    # One answer that takes a second to its first token teaches the router this worker's
    # prefill time (about a second), which bounds how long a follower waits.
    worker.delay_headers = 1.0
    assert _stream(router, "a warm up question")["status"] == 200
    worker.delay_headers = 0.0
    worker.mode = "stall"  # no token until the gate opens
    worker.gate.clear()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        leader = pool.submit(_stream, router, DOC + " Question one: who signs?")
        worker.wait_for(lambda: _generations(worker) == 2)
        follower = pool.submit(_stream, router, DOC + " Question two: who pays?")
        unrelated = pool.submit(_stream, router, "a short note about the weather today")
        # the unrelated prompt goes at once; the follower is held while the leader prefills
        worker.wait_for(lambda: _generations(worker) == 3)
        time.sleep(0.3)
        sent = [r.json["prompt"] for r in worker.generation_requests()]
        assert not any("who pays" in p for p in sent), "the follower did not wait"
        # /debug/route says a third question on the document would wait too, for whom and
        # how long at most; an unrelated prompt would not
        wait = router.route({"prompt": DOC + " Question three: when?"})["prefix_wait"]
        assert wait is not None and wait["worker"] == "a", wait
        assert wait["shared_blocks_computing"] >= 4 and wait["leader_age_s"] >= 0.3
        assert 0 < wait["at_most_s"] < 10
        assert router.route({"prompt": "another note about the weather"})["prefix_wait"] is None
        worker.gate.set()  # the leader's first token: the follower goes now
        results = [f.result(timeout=30) for f in (leader, follower, unrelated)]
    assert all(r["status"] == 200 and "[DONE]" in r["text"] for r in results), results
    assert router.metric("kvpool_router_prefix_wait_seconds_count", outcome="prefilled") == 1

    # A leader whose first token never comes in time holds its follower only to the bound
    # (another document: the first is cached now, and nobody waits for it).
    worker.gate.clear()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        leader = pool.submit(_stream, router, LEASE + " Question three: when?")
        worker.wait_for(lambda: _generations(worker) == 5)
        start = time.monotonic()
        follower = pool.submit(_stream, router, LEASE + " Question four: where?")
        worker.wait_for(lambda: _generations(worker) == 6, timeout=20)
        held = time.monotonic() - start
        worker.gate.set()
        results = [f.result(timeout=30) for f in (leader, follower)]
    assert all(r["status"] == 200 for r in results), results
    assert held < 10, f"the follower was held {held:.1f} s behind a stuck leader"
    assert router.metric("kvpool_router_prefix_wait_seconds_count", outcome="timeout") == 1


def test_the_baselines_send_at_once(llama_dir: Path) -> None:
    from kvpool.router.settings import RouterSettings

    def blocks(policy: str) -> int:
        return RouterSettings(
            model=str(llama_dir), worker=["http://w:1"], policy=policy
        ).leader_blocks()

    assert blocks("kvpool") == 4
    assert [blocks(p) for p in ("round-robin", "least-loaded", "prefix-only")] == [0, 0, 0]


def test_with_prefix_wait_blocks_0_a_follower_is_sent_at_once(
    stalling_worker: RecordingWorker, start_router: Any
) -> None:
    worker = stalling_worker
    router = start_router(worker=[worker.spec("a")], prefix_wait_blocks=0)
    router.wait_workers_up(1)
    worker.mode = "stall"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        leader = pool.submit(_stream, router, DOC + " Question one: who signs?")
        worker.wait_for(lambda: _generations(worker) == 1)
        follower = pool.submit(_stream, router, DOC + " Question two: who pays?")
        worker.wait_for(lambda: _generations(worker) == 2)  # not held
        worker.gate.set()
        assert all(f.result(timeout=30)["status"] == 200 for f in (leader, follower))
    assert router.metric("kvpool_router_prefix_wait_seconds_count", outcome="prefilled") == 0
