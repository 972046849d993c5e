"""The prefill/decode split through the router (issue 8): which requests are split and
where each half goes (pure), then real workers behind a real router: a split answer is the
answer one worker gives, short or cached prompts are served whole, and a prefill worker
that fails mid-request costs the client nothing (another prefill worker, or the request
served whole)."""

from __future__ import annotations

import json
import signal
import socket
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpool.router.routing.inputs import RouteRequest, WorkerView
from kvpool.router.routing.planner import Planner, SplitConfig
from kvpool.router.routing.policy import PolicyConfig

from conftest import TEST_POOL_SECRET, RunningRouter, RunningWorker, WorkerProcess

pytestmark = pytest.mark.timeout(120)

# -- the decision, in policy terms --------------------------------------------------------


def planner(mode: str = "Auto", threshold: int = 256) -> Planner:
    import random

    return Planner(PolicyConfig(), SplitConfig(mode, threshold), random.Random(0))  # type: ignore[arg-type]


def pool(**overrides: dict[str, Any]) -> list[WorkerView]:
    """Two prefill workers and two decode workers, idle unless told otherwise."""
    views = {
        "p0": WorkerView("p0", role="prefill"),
        "p1": WorkerView("p1", role="prefill"),
        "d0": WorkerView("d0", role="decode"),
        "d1": WorkerView("d1", role="decode"),
    }
    for wid, fields in overrides.items():
        for name, value in fields.items():
            setattr(views[wid], name, value)
    return list(views.values())


def req(num_tokens: int = 1000, **matched: int) -> RouteRequest:
    return RouteRequest(num_tokens=num_tokens, block_size=16, matched_blocks=matched)


def test_a_long_uncached_prompt_is_split_prefill_by_cache_decode_by_load() -> None:
    plan = planner().plan(req(1000, p1=40), pool(d0={"in_flight": 3}))
    assert plan.path == "disaggregated" and plan.reason == "above_threshold"
    assert plan.uncached_tokens == 1000
    assert plan.prefill is not None and plan.prefill.worker == "p1"  # holds 640 of it
    assert plan.worker == "d1"  # decodes fewer sequences
    assert "prefill p1" in plan.explain() and "decode d1" in plan.explain()


def test_a_busy_prefill_worker_loses_its_cache_advantage() -> None:
    plan = planner().plan(req(1000, p1=20), pool(p1={"queued_tokens": 50_000}))
    assert plan.prefill is not None and plan.prefill.worker == "p0"


def test_the_decode_leg_prefers_the_cache_only_between_equal_loads() -> None:
    plan = planner().plan(req(2000, d0=10), pool())
    assert plan.path == "disaggregated" and plan.worker == "d0"  # tie on load: the cache
    plan = planner().plan(req(2000, d0=10), pool(d0={"in_flight": 1}))
    assert plan.path == "disaggregated" and plan.worker == "d1"  # load first


def test_what_the_decode_side_holds_counts_against_the_threshold() -> None:
    # 1000 tokens, 800 of them cached where the request would be served whole: 200 to
    # compute there, under the threshold of 256.
    plan = planner().plan(req(1000, d0=50), pool())
    assert (plan.path, plan.reason, plan.worker) == ("aggregated", "below_threshold", "d0")
    assert plan.uncached_tokens == 200 and plan.prefill is None
    assert planner().plan(req(200), pool()).reason == "below_threshold"
    assert planner().plan(req(257), pool()).path == "disaggregated"


def test_disaggregated_mode_splits_whenever_a_block_can_move() -> None:
    split = planner("Disaggregated", threshold=10_000)
    assert split.plan(req(40), pool()).reason == "mode_disaggregated"  # two full blocks
    assert split.plan(req(15), pool()).reason == "no_blocks_to_move"  # under one block
    # Every full block already where it is decoded: nothing for a prefill worker to do.
    assert split.plan(req(40, d0=2, d1=2), pool()).reason == "no_blocks_to_move"


def test_aggregated_mode_and_batches_are_never_split() -> None:
    assert planner("Aggregated").plan(req(5000), pool()).reason == "mode_aggregated"
    batch = planner().plan(req(5000), pool(), splittable=False)
    assert (batch.path, batch.reason) == ("aggregated", "batch")


def test_without_a_prefill_worker_the_request_is_served_whole() -> None:
    down = pool(p0={"healthy": False}, p1={"breaker_open": True})
    plan = planner("Disaggregated").plan(req(5000), down)
    assert (plan.path, plan.reason, plan.prefill) == ("aggregated", "no_prefill_worker", None)
    assert plan.worker in ("d0", "d1")
    nothing = pool(d0={"healthy": False}, d1={"draining": True})
    assert planner().plan(req(5000), nothing).reason == "no_worker"


def test_both_workers_decode_and_prefill_workers_never_serve_whole() -> None:
    views = [WorkerView("p", role="prefill"), WorkerView("b", role="both")]
    assert planner().plan(req(100), views).worker == "b"  # aggregated: never the prefill one
    plan = planner().plan(req(5000), views)
    assert plan.path == "disaggregated" and plan.prefill is not None
    assert (plan.prefill.worker, plan.worker) == ("p", "b")


# -- real workers behind a real router ------------------------------------------------------

PROMPT = (
    "A router in front of a pool of inference workers reads every prompt, cuts it into blocks "
    "of sixteen tokens, and hashes each block together with the hash of the block before it."
)  # 56 tokens
SHORT = "Tell me about the decode worker, and then about the prefill worker."  # 1 block
THRESHOLD = 40
MAX_TOKENS = 12


def ask(
    url: str, prompt: str, *, chat: bool = False, stream: bool = False, **extra: Any
) -> tuple[str, dict[str, str], dict[str, Any]]:
    """(text, response headers, usage) of one request, streamed or not."""
    body: dict[str, Any] = {
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        headers = dict(r.headers)
        if not stream:
            answer = json.loads(r.read())
            choice = answer["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
            return text, headers, answer["usage"]
        text, usage, done = "", {}, False
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            usage = event.get("usage") or usage
            for c in event["choices"]:
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
        assert done
        return text, headers, usage


def wid(worker: RunningWorker | Relay) -> str:
    """The id the router gives a worker of a static list: its host and port."""
    return f"127.0.0.1:{worker.port}"


def prefill_worker(router: RunningRouter, prompt: str) -> str | None:
    """Where a dry run of the prompt would send its prefill leg."""
    return (router.route({"prompt": prompt})["prefill"] or {}).get("worker")


def start_pd_worker(start_worker: Any, role: str) -> RunningWorker:
    """A worker of the test pool: hand-offs are signed with its secret."""
    return start_worker(
        role=role, kv_events_endpoint="tcp://127.0.0.1:*", pool_secret=TEST_POOL_SECRET
    )


def paths(router: RunningRouter) -> dict[str, float]:
    return {
        p: router.metric("kvpool_router_pd_requests_total", path=p)
        for p in ("disaggregated", "aggregated", "fallback")
    }


@pytest.fixture
def split(start_worker: Any, start_router: Any) -> tuple[RunningRouter, Any, Any, Any]:
    """A router over one prefill and one decode worker, and a ``both`` worker beside them
    (not behind the router) for the answers one worker gives."""
    whole = start_worker()
    p, d = start_pd_worker(start_worker, "prefill"), start_pd_worker(start_worker, "decode")
    router = start_router(
        pool_secret=TEST_POOL_SECRET,
        worker=[f"{p.url},role=prefill", f"{d.url},role=decode"],
        pd_mode="Auto",
        pd_threshold_tokens=THRESHOLD,
    )
    router.wait_workers_up(2)
    return router, whole, p, d


def test_a_request_for_several_choices_is_served_whole(split: Any) -> None:
    """The hand-off carries one prompt and one choice: a request for n=2 above the threshold
    is not split (its prefill leg would be refused), it is served whole, both choices."""
    router, _, _, _ = split
    _, headers, _ = ask(router.url, PROMPT, n=2, temperature=1.0, seed=7)
    answer = httpx.post(
        router.url + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 4, "n": "2", "temperature": 1.0},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"]) == 2
    assert "x-kvpool-prefill-worker" not in headers
    assert paths(router) == {"disaggregated": 0, "aggregated": 2, "fallback": 0}
    assert router.metric("kvpool_router_pd_decisions_total", reason="batch") == 2


@pytest.mark.parametrize(
    ("chat", "stream"), [(False, False), (False, True), (True, False), (True, True)]
)
def test_a_split_request_answers_like_one_worker(split: Any, chat: bool, stream: bool) -> None:
    router, whole, p, d = split
    prompt = f"{'chat' if chat else 'text'} {'streamed' if stream else 'whole'}: {PROMPT}"
    expected, _, expected_usage = ask(whole.url, prompt, chat=chat, stream=stream)
    text, headers, usage = ask(router.url, prompt, chat=chat, stream=stream)
    assert text == expected
    assert headers["x-kvpool-prefill-worker"] == wid(p)
    assert headers["x-kvpool-worker"] == wid(d)
    assert usage["prompt_tokens"] == expected_usage["prompt_tokens"]
    assert usage["completion_tokens"] == MAX_TOKENS
    assert paths(router) == {"disaggregated": 1, "aggregated": 0, "fallback": 0}
    assert router.metric("kvpool_router_pd_decisions_total", reason="above_threshold") == 1
    assert router.metric("kvpool_router_prefill_leg_seconds_count") == 1
    assert router.metric("kvpool_router_requests_total", outcome="success") == 1
    # The decode worker pulled the prefill's blocks: it did not compute the prompt again.
    blocks = usage["prompt_tokens"] // 16
    assert d.metric("kvpool_worker_kv_transfer_blocks_total", direction="received") == blocks
    assert d.metric("kvpool_worker_kv_transfer_fallbacks_total") == 0
    assert d.metric("vllm:prefix_cache_hits_total") == blocks * 16
    # Each leg is counted as a routing decision on its own worker; none stays in flight.
    workers = router.workers()
    assert workers[wid(p)]["in_flight"] == workers[wid(d)]["in_flight"] == 0
    decided = {
        dict(labels)["worker"]
        for (name, labels), value in router.metrics().items()
        if name == "kvpool_router_routing_decisions_total" and value
    }
    assert decided == {wid(p), wid(d)}


def test_short_or_cached_prompts_go_straight_to_decode(split: Any) -> None:
    router, whole, p, d = split
    plan = router.route({"prompt": SHORT})
    assert (plan["path"], plan["pd_reason"], plan["worker"]) == (
        "aggregated",
        "below_threshold",
        wid(d),
    )
    assert plan["prefill"] is None
    text, headers, _ = ask(router.url, SHORT)
    assert text == ask(whole.url, SHORT)[0]
    assert "x-kvpool-prefill-worker" not in headers and headers["x-kvpool-worker"] == wid(d)

    longer = PROMPT + " Then it asks the index which worker holds them."  # 72 tokens
    plan = router.route({"prompt": longer})  # a dry run: nothing is sent
    assert (plan["path"], plan["pd_reason"]) == ("disaggregated", "above_threshold")
    assert plan["prefill"]["worker"] == wid(p) and plan["worker"] == wid(d)
    assert plan["uncached_tokens"] == 72
    ask(router.url, PROMPT)  # split: the decode worker pulls its 3 blocks and keeps them
    router.wait_for(lambda: router.route({"prompt": PROMPT})["pd_reason"] == "no_blocks_to_move")
    # The longer prompt shares those 48 tokens: 24 are left to compute, under the threshold.
    plan = router.route({"prompt": longer})
    assert (plan["path"], plan["pd_reason"], plan["uncached_tokens"]) == (
        "aggregated",
        "below_threshold",
        24,
    )
    text, headers, usage = ask(router.url, longer)
    assert text == ask(whole.url, longer)[0]
    assert "x-kvpool-prefill-worker" not in headers and headers["x-kvpool-worker"] == wid(d)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 48
    assert paths(router) == {"disaggregated": 1, "aggregated": 2, "fallback": 0}
    assert p.metric("vllm:prompt_tokens_total") == 56  # the one split request's prefill


class Relay:
    """A TCP hop in front of a worker that passes everything through until told otherwise:
    ``cut`` forwards a generation request, then closes both sides (to the router, a worker
    that died mid-request); ``hang`` takes generation requests and never answers."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.mode = "pass"
        self.caught = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                return
            self._open += [client, upstream]
            held = threading.Event()
            for src, dst, inbound in ((client, upstream, True), (upstream, client, False)):
                args = (src, dst, inbound, held)
                threading.Thread(target=self._pump, args=args, daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, inbound: bool, held: Any) -> None:
        try:
            while data := src.recv(65536):
                if inbound and self.mode != "pass" and data.startswith(b"POST /v1/"):
                    self.caught += 1
                    if self.mode == "hang":
                        held.set()  # this connection's requests go nowhere from now on
                    else:
                        dst.sendall(data)
                        break
                if not held.is_set():
                    dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            _shut(s)

    def close(self) -> None:
        self.sock.close()
        for s in self._open:
            _shut(s)


def _shut(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


@pytest.fixture
def relay() -> Any:
    relays: list[Relay] = []

    def make(port: int) -> Relay:
        relays.append(Relay(port))
        return relays[-1]

    yield make
    for r in relays:
        r.close()


def test_a_prefill_worker_dying_mid_request_hands_the_prefill_to_another(
    start_worker: Any, start_router: Any, relay: Any
) -> None:
    whole = start_worker()
    dying, other, d = (start_pd_worker(start_worker, r) for r in ("prefill", "prefill", "decode"))
    hop = relay(dying.port)
    router = start_router(
        pool_secret=TEST_POOL_SECRET,
        worker=[f"{hop.url},role=prefill", f"{other.url},role=prefill", f"{d.url},role=decode"],
        pd_threshold_tokens=THRESHOLD,
    )
    router.wait_workers_up(3)
    # The worker behind the relay holds the prompt, so the router sends the prefill there.
    ask(dying.url, PROMPT, max_tokens=1)
    router.wait_for(lambda: prefill_worker(router, PROMPT) == wid(hop))
    hop.mode = "cut"
    text, headers, _ = ask(router.url, PROMPT, chat=False, stream=True)
    assert text == ask(whole.url, PROMPT, stream=True)[0]
    assert hop.caught == 1
    assert headers["x-kvpool-prefill-worker"] == wid(other)
    assert router.metric("kvpool_router_prefill_leg_failures_total", reason="connection") == 1
    assert router.metric("kvpool_router_retries_total", reason="connection") == 1
    assert paths(router) == {"disaggregated": 1, "aggregated": 0, "fallback": 0}
    assert d.metric("kvpool_worker_kv_transfer_fallbacks_total") == 0


def test_a_prefill_worker_that_hangs_past_its_timeout_leaves_the_request_whole(
    start_worker: Any, start_router: Any, relay: Any
) -> None:
    whole = start_worker()
    p, d = start_pd_worker(start_worker, "prefill"), start_pd_worker(start_worker, "decode")
    hop = relay(p.port)
    router = start_router(
        pool_secret=TEST_POOL_SECRET,
        worker=[f"{hop.url},role=prefill", f"{d.url},role=decode"],
        pd_mode="Disaggregated",
        pd_prefill_timeout_s=1.0,
    )
    router.wait_workers_up(2)
    hop.mode = "hang"
    text, headers, _ = ask(router.url, PROMPT, chat=True)
    assert text == ask(whole.url, PROMPT, chat=True)[0]
    assert hop.caught == 1 and "x-kvpool-prefill-worker" not in headers
    assert router.metric("kvpool_router_prefill_leg_failures_total", reason="timeout") == 1
    assert paths(router) == {"disaggregated": 0, "aggregated": 0, "fallback": 1}


def test_a_prefill_process_killed_mid_request_leaves_the_request_whole(
    start_worker: Any, start_router: Any, llama_dir: Path, tmp_path: Path
) -> None:
    whole = start_worker()
    d = start_pd_worker(start_worker, "decode")
    p = WorkerProcess(
        llama_dir,
        engine="kvpool",
        log=tmp_path / "prefill.log",
        role="prefill",
        device="cpu",
        num_blocks=128,
        pool_secret=TEST_POOL_SECRET,
    )
    try:
        p.wait_healthy()
        # A health check that waits 5 s keeps the stopped worker in rotation meanwhile.
        router = start_router(
            pool_secret=TEST_POOL_SECRET,
            worker=[f"{p.url},role=prefill", f"{d.url},role=decode"],
            pd_mode="Disaggregated",
            health_timeout_s=5.0,
        )
        router.wait_workers_up(2)
        expected = ask(whole.url, PROMPT)[0]
        p.proc.send_signal(signal.SIGSTOP)  # it hangs...
        answers: list[tuple[str, dict[str, str], dict[str, Any]]] = []
        asking = threading.Thread(target=lambda: answers.append(ask(router.url, PROMPT)))
        asking.start()
        router.wait_for(lambda: router.workers()[f"127.0.0.1:{p.port}"]["in_flight"] == 1)
        p.kill()  # ...and is killed with the prefill leg in flight
        asking.join(timeout=60)
    finally:
        p.kill()
    assert answers, "the request did not finish"
    text, headers, _ = answers[0]
    assert text == expected and "x-kvpool-prefill-worker" not in headers
    assert router.metric("kvpool_router_prefill_leg_failures_total", reason="connection") == 1
    assert paths(router) == {"disaggregated": 0, "aggregated": 0, "fallback": 1}
    assert router.metric("kvpool_router_requests_total", outcome="success") == 1
