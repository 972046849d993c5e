"""A hot prefix is copied to as many workers as its share of the traffic calls for
(router/routing/heat.py and the policy's ``spread`` scorer)."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from kvpool.router.routing.heat import PrefixHeat

from recording_worker import RecordingWorker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_prefix_share_of_the_traffic_decays_and_names_how_many_should_hold_it() -> None:
    clock = Clock()
    heat = PrefixHeat(half_life_s=10.0, min_requests=4, clock=clock)
    for _ in range(8):
        heat.observe(1)
    for _ in range(8):
        heat.observe(None)  # requests sharing nothing count in the total
    half = heat.share(1)
    assert half == pytest.approx(0.5)
    assert heat.holders(half, 8, load=24) == 4  # half of 24 prefilling, three a holder
    assert heat.holders(half, 8, load=1) == 1  # one at a time: one holder does
    # a session's first request: the requests in flight, two a holder
    assert heat.holders(half, 8, load=16, session=True) == 4
    assert heat.holders(half, 8, load=100) == 4  # never more than its share of the pool
    assert heat.holders(half, 2, load=100) == 1
    heat.observe(2)
    assert heat.share(2) == 0.0 and heat.holders(heat.share(2), 8, 100) == 1  # too rare to call hot
    clock.now = 10.0  # a half-life later, a burst of another prefix
    for _ in range(17):
        heat.observe(3)
    assert heat.share(1) == pytest.approx(4 / (8.5 + 17), rel=0.01)
    assert heat.holders(heat.share(3), 8, load=24) == 6
    assert heat.holders(heat.share(3), 32, load=1000) == 22  # 17 of 25.5


def test_heat_remembers_a_bounded_number_of_prefixes() -> None:
    heat = PrefixHeat(capacity=3, min_requests=1, clock=Clock())
    for key in range(5):
        heat.observe(key)
    assert [heat.share(k) > 0 for k in range(5)] == [False, False, True, True, True]


def test_one_system_prompt_for_every_request_ends_up_on_every_worker(start_router: Any) -> None:
    """Sent to idle workers, every request would go to the first holder of the system
    prompt (its TTFT is the shortest); with requests waiting for their first token
    together (a non-streamed answer's comes with all of it), its share of them, three a
    holder, asks for a copy on each worker, made once it has been seen a few times. One
    at a time, one holder is enough. Dry runs do not count."""
    fakes = [RecordingWorker() for _ in range(4)]
    try:
        router = start_router(worker=[f.spec(f"w{i}") for i, f in enumerate(fakes)])
        router.wait_workers_up(4)
        system = "you are a careful assistant who answers in full sentences " * 20

        def send() -> str:
            body = {"model": "tiny", "prompt": system + uuid.uuid4().hex, "max_tokens": 1}
            resp = httpx.post(router.url + "/v1/completions", json=body, timeout=10)
            assert resp.status_code == 200, resp.text
            return resp.headers["x-kvpool-worker"]

        first = [send() for _ in range(3)]
        assert len(set(first)) == 1  # not hot yet: the holder is the quickest
        for _ in range(20):  # /debug/route plans without routing: no heat
            router.route({"prompt": system + "?"})
        first.append(send())  # seen three times, still under the four that make it hot
        first += [send() for _ in range(8)]  # hot now, but one at a time: one holder does
        assert len(set(first)) == 1
        for f in fakes:  # each answer now takes half a second: requests overlap
            f.mode, f.tokens, f.token_interval = "slow", 10, 0.05
        served = set(first)
        with ThreadPoolExecutor(12) as pool:
            # bursts of 12 until every worker has served (a loaded machine may overlap
            # fewer of them in a burst); a prefix that never spread would stay on few
            for _ in range(8):
                served |= set(pool.map(lambda _: send(), range(12)))
                if len(served) == 4:
                    break
        assert served == {"w0", "w1", "w2", "w3"}
        # /debug/route says how many holders the prefix wants, and what makes one
        spread = router.route({"prompt": system + "?"})["spread"]
        assert spread["wanted_holders"] >= 1 and spread["depth_blocks"] == 32
        assert spread["sized_by"].startswith("requests waiting for a first token")
        spread = httpx.post(
            router.url + "/debug/route",
            json={"prompt": system + "?"},
            headers={"x-session-id": "someone new"},
            timeout=10,
        ).json()["spread"]
        assert spread["sized_by"].startswith("requests in flight")  # a session's first
        decisions = httpx.get(router.url + "/metrics", timeout=10).text
        assert 'reason="spread"' in decisions
    finally:
        for f in fakes:
            f.stop()


def streams_sharing_a_prompt(start_router: Any, sessions: bool) -> tuple[list[str], set[str]]:
    """Five streams at a time share one system prompt, each decoding for about a second
    and a half after a first token that comes at once (``sessions``: each the first
    request of its own session, ``x-session-id``). The workers that served them, in
    order, and the reasons of the router's decisions."""
    fakes = [RecordingWorker() for _ in range(4)]
    try:
        router = start_router(worker=[f.spec(f"w{i}") for i, f in enumerate(fakes)])
        router.wait_workers_up(4)
        for f in fakes:
            f.mode, f.tokens, f.token_interval = "slow", 30, 0.05
        system = "you are a careful assistant who answers in full sentences " * 20

        def send(i: int) -> str:
            if i < 5:  # the streams start a third of a second apart, then follow on
                time.sleep(i / 3)
            body = {"model": "tiny", "prompt": system + uuid.uuid4().hex, "stream": True}
            headers = {"x-session-id": uuid.uuid4().hex} if sessions else {}
            url = router.url + "/v1/completions"
            with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as r:
                assert r.status_code == 200, r.read()
                assert any(line.startswith("data: [DONE]") for line in r.iter_lines())
                return r.headers["x-kvpool-worker"]

        send(5)  # the first holder
        with ThreadPoolExecutor(5) as pool:
            served = list(pool.map(send, range(30)))
        decisions = router.metrics()
        reasons = {dict(labels)["reason"] for name, labels in decisions if "decisions" in name}
        return served, reasons
    finally:
        for f in fakes:
            f.stop()


def test_requests_decoding_together_leave_a_prompt_on_the_holder_that_prefills_it_at_once(
    start_router: Any,
) -> None:
    """The prompt's holder never has a request waiting for a first token, so nothing
    calls for a copy: every request goes to the holder and reads the prompt from its
    cache, however many are decoding together (with holders sized by the requests in
    flight, this copied the prompt to three workers)."""
    served, reasons = streams_sharing_a_prompt(start_router, sessions=False)
    assert len(set(served)) == 1, served
    assert "spread" not in reasons and "prefix" in reasons, reasons


def test_sessions_starting_from_one_prompt_spread_over_the_workers(start_router: Any) -> None:
    """The same streams, each starting a session: a session's later steps stay where its
    first request went, so its first request sizes the prompt's holders by the requests in
    flight, two a holder, and the sessions spread (an agent's system prompt)."""
    served, reasons = streams_sharing_a_prompt(start_router, sessions=True)
    assert len(set(served)) >= 3, served
    assert "spread" in reasons, reasons
