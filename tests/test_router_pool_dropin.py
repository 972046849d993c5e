"""The worker pool against workers as vLLM runs them: LoRA adapters at /v1/models,
data-parallel engines that publish KV events per rank, a worker that hangs, answers that
come back whole. Each worker is a real HTTP server on loopback; events go over real ZMQ."""

from __future__ import annotations

import asyncio
import importlib.util
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvpool.hashing import HASH_ALGORITHM
from kvpool.kv_events import BlockRemoved, BlockStored, EventBatch, EventPublisher
from kvpool.router.admin.debug import worker_rows
from kvpool.router.admin.metrics import RouterMetrics
from kvpool.router.routing.inputs import RouteRequest
from kvpool.router.routing.policy import Policy
from kvpool.router.routing.scorers import predicted_ttft
from kvpool.router.state.discovery import WorkerEndpoint
from kvpool.router.state.index import BlockIndex
from kvpool.router.state.load import PrefillModel, WorkerLoad
from kvpool.router.state.pool import WorkerPool
from kvpool.router.state.scrape import parse_load
from kvpool.router.state.worker import PoolConfig, WorkerState

pytestmark = pytest.mark.timeout(30)

SEED = "test-seed"
BASE = "meta-llama/Llama-3.2-1B"


def card(model_id: str, parent: str | None = None, **extra: Any) -> dict[str, Any]:
    """A model card as vLLM lists it: a LoRA adapter's ``parent`` names its base, its
    ``root`` the path it was loaded from."""
    return {
        "id": model_id,
        "object": "model",
        "owned_by": "vllm",
        "root": f"/adapters/{model_id}" if parent else model_id,
        "parent": parent,
        "max_model_len": 2048,
        **extra,
    }


def itl_metrics(*engines: tuple[float, float]) -> str:
    """vLLM's inter-token latency histogram, one label set per engine: (sum, count)."""
    lines = ["# TYPE vllm:inter_token_latency_seconds histogram"]
    for i, (total, count) in enumerate(engines):
        labels = f'engine="{i}",model_name="m"'
        lines += [
            f'vllm:inter_token_latency_seconds_bucket{{{labels},le="+Inf"}} {count}',
            f"vllm:inter_token_latency_seconds_sum{{{labels}}} {total}",
            f"vllm:inter_token_latency_seconds_count{{{labels}}} {count}",
        ]
    return "\n".join(lines) + "\n"


class Worker:
    """An HTTP server answering the paths the pool reads, as the test sets them."""

    def __init__(self) -> None:
        self.cards: list[dict[str, Any]] = [card(BASE)]
        self.models_status = 200
        self.info: dict[str, Any] | None = None  # None: no /kvpool/info (vLLM)
        self.health = "ok"  # ok, 503, hang
        self.metrics = ""
        self.release = asyncio.Event()  # lets hung handlers go at the end
        self.url = ""
        self._runner: web.AppRunner | None = None

    def kvpool(self, name: str, events: EventPublisher | None = None) -> None:
        self.info = {
            "served_model_name": name,
            "engine": "sim",
            "role": "both",
            "block_size": 16,
            "hash_seed": SEED,
            "hash_algo": HASH_ALGORITHM,
            "max_model_len": 2048,
            "num_blocks": 1000,
            "kv_events": None
            if events is None
            else {"endpoint": events.endpoint, "replay_endpoint": events.replay_endpoint},
            "kv_transfer_engine_id": "e0",
            "version": "test",
        }

    async def _health(self, request: web.Request) -> web.Response:
        if self.health == "hang":
            await self.release.wait()
        return web.Response(status=503 if self.health == "503" else 200)

    async def _info(self, request: web.Request) -> web.Response:
        if self.info is None:
            return web.Response(status=404)
        return web.json_response(self.info)

    async def _models(self, request: web.Request) -> web.Response:
        if self.models_status != 200:
            return web.json_response({"error": {"message": "no"}}, status=self.models_status)
        return web.json_response({"object": "list", "data": self.cards})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics, content_type="text/plain")

    async def start(self) -> Worker:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/kvpool/info", self._info)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()


class Attempt:
    """What the router hangs on a worker while a request is on it."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def abort(self, reason: str) -> None:
        self.reasons.append(reason)


async def eventually(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


Setup = Callable[..., Awaitable[tuple[WorkerPool, list[Worker]]]]


@pytest.fixture
async def pool_of() -> AsyncIterator[Setup]:
    """``await pool_of(worker, ...)``: the workers started, a pool over them, all up."""
    async with AsyncExitStack() as stack:

        async def make(*workers: Worker, **config: Any) -> tuple[WorkerPool, list[Worker]]:
            for w in workers:
                await w.start()
                stack.push_async_callback(w.stop)
            client = aiohttp.ClientSession()
            stack.push_async_callback(client.close)
            values: dict[str, Any] = {
                "block_size": 16,
                "hash_seed": SEED,
                "health_interval_s": 0.05,
                "health_timeout_s": 0.3,
                "scrape_interval_s": 0.05,
                "models_interval_s": 0.1,
                **config,
            }
            pool = WorkerPool(PoolConfig(**values), BlockIndex(), client)
            stack.push_async_callback(pool.close)
            pool.set_endpoints(
                WorkerEndpoint(id=f"w{i}", url=w.url) for i, w in enumerate(workers, 1)
            )
            await eventually(
                lambda: all(s.status == "up" for s in pool.workers.values()), "workers up"
            )
            return pool, list(workers)

        yield make


@pytest.fixture
def publisher(make_publisher: Callable[..., EventPublisher]) -> EventPublisher:
    return make_publisher()


def stored(*hashes: int) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=list(range(16 * len(hashes))),
        block_size=16,
    )


def on_rank(rank: int | None, *events: BlockStored | BlockRemoved) -> EventBatch:
    return EventBatch(events=list(events), ts=time.time(), data_parallel_rank=rank)


# -- LoRA adapters and model lists ----------------------------------------------------------


async def test_adapters_are_listed_with_their_base_and_the_pool_serves_the_union(
    pool_of: Setup,
) -> None:
    vllm = Worker()
    # An adapter listed before its base: the base is still the card without a parent.
    vllm.cards = [card("sql-lora", parent=BASE), card(BASE)]
    ours = Worker()
    ours.kvpool("tiny-llama")
    ours.cards = [card("tiny-llama", owned_by="kvpool")]
    pool, _ = await pool_of(vllm, ours)

    w1, w2 = pool.workers["w1"], pool.workers["w2"]
    assert (w1.model, w1.models) == (BASE, {BASE, "sql-lora"})
    assert (w2.model, w2.models) == ("tiny-llama", {"tiny-llama"})
    assert w1.view(time.monotonic()).models == {BASE, "sql-lora"}
    assert pool.models() == {BASE, "sql-lora", "tiny-llama"}
    # each with its path: vLLM hashes an adapter's blocks with it
    assert pool.adapters() == {"sql-lora": "/adapters/sql-lora"}
    cards = pool.model_cards()
    assert [c["id"] for c in cards] == sorted([BASE, "sql-lora", "tiny-llama"])
    # Each as its worker sent it: the adapter's parent and root, the context length.
    assert cards[[c["id"] for c in cards].index("sql-lora")] == card("sql-lora", parent=BASE)
    assert cards[[c["id"] for c in cards].index("tiny-llama")]["owned_by"] == "kvpool"


async def test_an_adapter_loaded_at_run_time_is_seen_within_the_models_interval(
    pool_of: Setup,
) -> None:
    vllm = Worker()
    pool, _ = await pool_of(vllm)
    assert pool.adapters() == {}

    vllm.cards = [card(BASE), card("chat-lora", parent=BASE)]  # POST /v1/load_lora_adapter
    await eventually(lambda: set(pool.adapters()) == {"chat-lora"}, "the new adapter")
    assert pool.models() == {BASE, "chat-lora"}

    vllm.cards = [card(BASE)]  # unloaded
    await eventually(lambda: pool.adapters() == {}, "the adapter gone")

    vllm.models_status = 500  # a failed read keeps what was known
    await asyncio.sleep(0.3)
    assert pool.models() == {BASE}


async def test_kvpool_worker_without_a_model_list_serves_its_info_model(pool_of: Setup) -> None:
    ours = Worker()
    ours.kvpool("tiny-llama")
    ours.models_status = 500
    pool, _ = await pool_of(ours)

    state = pool.workers["w1"]
    assert (state.model, state.models) == ("tiny-llama", {"tiny-llama"})
    assert [c["id"] for c in pool.model_cards()] == ["tiny-llama"]


async def test_a_down_workers_models_are_not_served(pool_of: Setup) -> None:
    a, b = Worker(), Worker()
    b.cards = [card("other"), card("other-lora", parent="other")]
    pool, _ = await pool_of(a, b)
    assert pool.models() == {BASE, "other", "other-lora"}

    pool.mark_down(pool.workers["w2"], "test")
    assert pool.models() == {BASE}
    assert pool.adapters() == {}
    assert [c["id"] for c in pool.model_cards()] == [BASE]


async def test_the_pools_context_follows_its_workers_and_is_not_computed_per_request(
    pool_of: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The longest prompt the pool takes is its up workers' longest context: it changes when
    a worker goes down, comes back, lists a new card or leaves, and is computed once per
    such change, not once per request (every request asks it)."""
    short, long = Worker(), Worker()
    long.cards = [card(BASE, max_model_len=8192)]
    pool, _ = await pool_of(short, long)
    assert pool.context_tokens() == 8192

    computed = []
    real = pool._longest_context
    monkeypatch.setattr(pool, "_longest_context", lambda: computed.append(1) or real())
    for _ in range(100):
        assert pool.context_tokens() == 8192
    assert computed == []  # nothing changed: nothing computed again

    pool.mark_down(pool.workers["w2"], "test")
    assert pool.context_tokens() == 2048
    await eventually(lambda: pool.context_tokens() == 8192, "the worker back up")
    long.cards = [card(BASE, max_model_len=16384)]  # restarted with a longer context
    await eventually(lambda: pool.context_tokens() == 16384, "its new card")
    pool.set_endpoints([WorkerEndpoint(id="w1", url=short.url)])
    assert pool.context_tokens() == 2048
    assert 0 < len(computed) < 100


# -- data-parallel ranks ----------------------------------------------------------------


async def test_ranks_of_one_worker_are_indexed_apart(
    pool_of: Setup, publisher: EventPublisher
) -> None:
    dp = Worker()
    dp.kvpool("tiny-llama", publisher)
    pool, _ = await pool_of(dp)

    publisher.publish(on_rank(0, stored(1, 2, 3)))
    publisher.publish(on_rank(1, stored(1, 2, 3, 4)))
    await eventually(lambda: pool.feed.match([1, 2, 3, 4]) == {"w1": (4, 1)}, "rank 1's blocks")
    assert pool.feed.ranks("w1") == [0, 1]
    assert pool.feed.indexed_blocks("w1") == 7

    # Rank 1 evicts the prefix: rank 0 still holds it, and the worker keeps its credit.
    publisher.publish(on_rank(1, BlockRemoved(block_hashes=[1, 2, 3, 4])))
    await eventually(lambda: pool.feed.match([1, 2, 3, 4]) == {"w1": (3, 0)}, "rank 0's blocks")

    # vLLM's single engine says rank 0, others None: the same engine, the same cache.
    publisher.publish(on_rank(None, BlockRemoved(block_hashes=[3])))
    await eventually(lambda: pool.feed.match([1, 2, 3, 4]) == {"w1": (2, 0)}, "rank 0 evicts")
    assert pool.index.num_blocks("w1") == 2  # what /debug/workers shows for the worker


async def test_equal_ranks_match_at_the_lowest_and_speculation_goes_to_the_chosen_rank(
    pool_of: Setup, publisher: EventPublisher
) -> None:
    dp = Worker()
    dp.kvpool("tiny-llama", publisher)
    pool, _ = await pool_of(dp)
    publisher.publish(on_rank(2, stored(7, 8)))
    publisher.publish(on_rank(1, stored(7, 8)))
    await eventually(lambda: pool.feed.ranks("w1") == [0, 1, 2], "both ranks")
    await eventually(lambda: pool.feed.match([7, 8]) == {"w1": (2, 1)}, "rank 1's blocks")

    hold = pool.feed.speculate("w1", [7, 8, 9], rank=2)
    assert hold is not None and (hold.worker, hold.keys) == ("w1@dp2", [9])
    assert pool.feed.match([7, 8, 9]) == {"w1": (3, 2)}
    pool.feed.withdraw(hold)
    assert pool.feed.match([7, 8, 9]) == {"w1": (2, 1)}
    # A rank the router pins before the worker has published from it is indexed too.
    hold = pool.feed.speculate("w1", [7], rank=3)
    assert hold is not None and hold.keys == [7]
    assert pool.feed.ranks("w1") == [0, 1, 2, 3]


async def test_going_down_drops_every_ranks_blocks(
    pool_of: Setup, publisher: EventPublisher
) -> None:
    dp = Worker()
    dp.kvpool("tiny-llama", publisher)
    pool, _ = await pool_of(dp)
    publisher.publish(on_rank(0, stored(1)))
    publisher.publish(on_rank(1, stored(1, 2)))
    await eventually(lambda: pool.feed.match([1, 2]) == {"w1": (2, 1)}, "both ranks")

    pool.feed.clear_worker("w1")  # what a lost stretch of events does
    assert pool.feed.match([1, 2]) == {}
    assert pool.feed.ranks("w1") == [0, 1]

    publisher.publish(on_rank(1, stored(1, 2)))
    await eventually(lambda: pool.feed.match([1, 2]) == {"w1": (2, 1)}, "rank 1 again")
    # Out of rotation is not cache loss: every rank keeps what it holds.
    pool.mark_down(pool.workers["w1"], "test")
    assert pool.feed.match([1, 2]) == {"w1": (2, 1)}
    assert pool.feed.ranks("w1") == [0, 1]

    pool.set_endpoints([])
    assert pool.index.workers() == []
    assert pool.feed.ranks("w1") == []


# -- speculation taken back ---------------------------------------------------------------


async def test_a_failed_attempt_leaves_an_untracked_worker_no_cache_credit(
    pool_of: Setup,
) -> None:
    pool, _ = await pool_of(Worker(), Worker())  # vLLM without events: approximate mode
    first = pool.feed.speculate("w1", [1, 2])
    assert first is not None and first.keys == [1, 2]
    added = pool.feed.speculate("w2", [1, 2, 3])
    assert pool.feed.match([1, 2, 3]) == {"w1": (2, None), "w2": (3, None)}

    pool.feed.withdraw(added)  # the worker answered 429: it computed nothing
    assert pool.feed.match([1, 2, 3]) == {"w1": (2, None)}

    # The worker may be gone by the time the attempt ends.
    late = pool.feed.speculate("w2", [5])
    pool.set_endpoints([WorkerEndpoint(id="w1", url=pool.workers["w1"].url)])
    assert pool.feed.speculate("w2", [5]) is None
    pool.feed.withdraw(late)
    assert pool.feed.match([1, 2, 3, 5]) == {"w1": (2, None)}


# -- attempts on a worker that goes down -----------------------------------------------------


async def test_a_hung_worker_fails_its_health_check_and_its_attempts_are_aborted(
    pool_of: Setup,
) -> None:
    hung, ok = Worker(), Worker()
    pool, _ = await pool_of(hung, ok)
    attempt, elsewhere = Attempt(), Attempt()
    pool.workers["w1"].attempts.add(attempt)
    pool.workers["w2"].attempts.add(elsewhere)

    hung.health = "hang"  # SIGSTOP: the connection is accepted, nothing comes back
    started = time.monotonic()
    await eventually(lambda: bool(attempt.reasons), "the attempt aborted")
    assert time.monotonic() - started < 2.0  # timeout 0.3 s, checks every 0.05 s
    assert attempt.reasons == ["worker w1 down: /health: TimeoutError no answer within 0.3 s"]
    assert pool.workers["w1"].status == "down"
    assert elsewhere.reasons == []


async def test_a_draining_worker_keeps_its_attempts_and_a_removed_one_aborts_them(
    pool_of: Setup,
) -> None:
    worker = Worker()
    pool, _ = await pool_of(worker)
    attempt = Attempt()
    pool.workers["w1"].attempts.add(attempt)

    worker.health = "503"  # draining: it finishes what it has
    await eventually(lambda: pool.workers["w1"].status == "unavailable", "503 seen")
    assert attempt.reasons == []

    pool.set_endpoints([])
    assert attempt.reasons == ["worker w1 down: removed"]


async def test_an_attempt_whose_abort_fails_does_not_spare_the_others(pool_of: Setup) -> None:
    class Broken:
        def abort(self, reason: str) -> None:
            raise RuntimeError("router bug")

    pool, _ = await pool_of(Worker())
    state = pool.workers["w1"]
    attempt = Attempt()
    state.attempts |= {Broken(), attempt}
    pool.mark_down(state, "connection failed", dead=True)
    assert attempt.reasons == ["worker w1 down: connection failed"]


async def test_one_failed_health_check_takes_a_worker_out_but_aborts_nothing(
    pool_of: Setup,
) -> None:
    pool, _ = await pool_of(Worker())
    state = pool.workers["w1"]
    attempt = Attempt()
    state.attempts.add(attempt)

    pool.mark_down(state, "/health: TimeoutError")  # a busy worker, slow to answer once
    assert state.status == "down" and attempt.reasons == []
    pool.mark_down(state, "/health: TimeoutError")  # again: it is hung
    assert attempt.reasons == ["worker w1 down: /health: TimeoutError"]


# -- learning from answers that are not streamed ------------------------------------------


async def test_time_per_output_token_is_learned_from_the_scraped_histogram(
    pool_of: Setup,
) -> None:
    worker = Worker()
    worker.metrics = itl_metrics((1.0, 100), (1.0, 100))
    pool, _ = await pool_of(worker)
    state = pool.workers["w1"]
    await eventually(lambda: state.itl_totals == (2.0, 200), "the first reading")
    assert state.itl is None  # a total since the worker started says nothing of now

    # 200 tokens over both engines took 1 s: 5 ms each.
    worker.metrics = itl_metrics((1.5, 200), (1.5, 200))
    await eventually(lambda: state.itl is not None, "the interval's mean")
    assert state.itl == pytest.approx(0.005)


def test_parse_load_reads_the_itl_histogram_beside_the_gauges() -> None:
    text = itl_metrics((1.0, 100), (0.5, 50)) + "vllm:num_requests_waiting 3\n"
    load = parse_load(text)
    assert load["vllm:inter_token_latency_seconds_sum"] == 1.5
    assert load["vllm:inter_token_latency_seconds_count"] == 150
    assert load["vllm:num_requests_waiting"] == 3


def vllm_metrics_page() -> str:
    """bench/scrape.py's vLLM-size page (one builder for the benchmark and this test)."""
    spec = importlib.util.spec_from_file_location(
        "bench_scrape", Path(__file__).parent.parent / "bench" / "scrape.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.vllm_metrics_page()


ITL_NAME = "vllm:inter_token_latency_seconds"


def test_parse_load_reads_only_its_series_from_a_vllm_size_page() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    page = vllm_metrics_page()
    assert len(page) > 100_000
    load = parse_load(page)
    assert load == {
        "vllm:num_requests_running": 7.0,
        "vllm:num_requests_waiting": 4.0,
        "vllm:kv_cache_usage_perc": 0.5,
        "vllm:inter_token_latency_seconds_sum": pytest.approx(0.4),
        "vllm:inter_token_latency_seconds_count": 20.0,
    }
    # the same numbers as a full parse of the page
    full = {
        s.name: s.value
        for fam in text_string_to_metric_families(page)
        for s in fam.samples
        if s.labels.get("engine") == "1"
    }
    assert full["vllm:num_requests_running"] == 4.0
    # samples that say nothing of load are left out; a page without the series says nothing
    assert parse_load('vllm:num_requests_running{engine="0"} NaN\n') == {}
    assert parse_load("# HELP vllm:num_requests_running 5\nfoo 1\n") == {}
    assert parse_load('vllm:num_requests_running{a="}"} 2 1700000000\n') == {
        "vllm:num_requests_running": 2.0
    }


def test_streamed_gaps_average_with_weight_a_tenth() -> None:
    state = WorkerState(endpoint=WorkerEndpoint(id="w", url="http://w"))
    state.observe_itl(0.01)
    state.observe_itl(0.02)
    state.observe_itl(float("nan"))
    assert state.itl == pytest.approx(0.011)


def test_whole_answers_teach_the_prefill_model_their_ttft_less_their_decode() -> None:
    """A pool whose clients never stream still learns each worker's prefill rate."""
    state = WorkerState(endpoint=WorkerEndpoint(id="w", url="http://w"))
    state.observe_itl(0.004)
    rate, overhead = 20_000.0, 0.05  # the worker's true prefill
    now = 0.0
    for i in range(40):
        tokens, out = 500 + 400 * (i % 7), 1 + 37 * (i % 5)
        ticket = state.begin(tokens, 0.1, now)
        elapsed = overhead + tokens / rate + (out - 1) * 0.004
        ttft = state.finish_whole(ticket, now + elapsed, out)
        assert ttft == pytest.approx(overhead + tokens / rate)
        state.end(ticket)
        now += 10.0
    assert state.prefill.observations == 40
    assert state.prefill.rate == pytest.approx(rate, rel=0.05)
    assert state.prefill.overhead == pytest.approx(overhead, abs=0.01)
    assert state.queued == {} and state.in_flight == 0


def test_a_replica_learns_prefill_from_the_whole_queue_ahead_the_others_included() -> None:
    """Two replicas send to one worker. A request's TTFT waits for every prompt token queued
    there, the other replica's too; the prefill model is asked with both (the worker's
    view), so it must be learned with both, or the other replica's backlog reads as a slow
    worker."""
    rate, overhead = 10_000.0, 0.05
    state = WorkerState(endpoint=WorkerEndpoint(id="w", url="http://w"))
    now = 0.0
    for i in range(40):
        state.peer_queued = 2000 * (i % 4)  # the other replica's prompts, not yet prefilled
        tokens = 500 + 300 * (i % 5)
        ticket = state.begin(tokens, 0.1, now, shows_first_token=True)
        state.first_token(ticket, now + overhead + (state.peer_queued + tokens) / rate)
        state.end(ticket)
        now += 10.0
    assert state.prefill.rate == pytest.approx(rate, rel=0.05)
    assert state.prefill.overhead == pytest.approx(overhead, abs=0.01)


async def test_workers_without_ttfts_of_their_own_are_judged_by_one_model_fitted_to_all() -> None:
    """Early in a pool's life no worker has seen enough TTFTs for a model of its own. A fit
    to one TTFT puts all its error in the overhead: on a fleet slower than the static prior,
    the worker that had answered looked slower than one whose first request was still
    prefilling, and the next request queued behind that prefill with an idle worker beside
    it. Until some worker has its own model, each is judged by one fitted to every TTFT."""
    async with aiohttp.ClientSession() as client:
        pool = WorkerPool(PoolConfig(16, SEED, health_interval_s=60.0), BlockIndex(), client)
        try:
            pool.set_endpoints(
                WorkerEndpoint(id=w, url="http://127.0.0.1:9") for w in ("answered", "busy")
            )
            answered, busy = pool.workers["answered"], pool.workers["busy"]
            answered.status = busy.status = "up"  # no await before the decision: it stays
            now = time.monotonic()
            first = answered.begin(2300, 0.3, now, shows_first_token=True)
            answered.first_token(first, now + 1.2)  # 2,300 tokens in 1.2 s: the prior says 0.3
            answered.end(first)
            busy.begin(2300, 0.3, now + 1.1, shows_first_token=True)  # not prefilled yet
            views = pool.views(now + 1.3)
            req = RouteRequest(2190, 16, {})
            ttft = {v.id: predicted_ttft(req, v) for v in views}
            assert ttft["answered"] < ttft["busy"]
            assert ttft["answered"] == pytest.approx(1.2 - 110 / 8000)  # what it was seen do
            assert Policy.named("kvpool").decide(req, views).worker == "answered"
        finally:
            await pool.close()


async def test_debug_workers_and_the_rate_metric_show_the_prefill_model_routing_uses() -> None:
    """A worker the router has seen answer few times is routed by its peers' model, so that
    is what ``/debug/workers`` and ``kvpool_router_worker_prefill_rate_tokens_per_second``
    (which the operator's backlog signal reads) show for it, with where it comes from. They
    used to show its own fit, the static prior for a fresh replica: after a scale-up the
    new replicas' 8,000 tokens/s outvoted the fleet's real rate in the operator's median.
    Before any TTFT the metric has no sample: the prior is a guess, not a measurement."""
    async with aiohttp.ClientSession() as client:
        pool = WorkerPool(PoolConfig(16, SEED, health_interval_s=60.0), BlockIndex(), client)
        metrics = RouterMetrics(
            lambda: list(pool.workers.values()), lambda w: 0, prefill_rates=pool.prefill_rates
        )

        def rates() -> dict[str, float]:
            text = metrics.render().decode()
            return {
                s.labels["worker"]: s.value
                for family in text_string_to_metric_families(text)
                if family.name == "kvpool_router_worker_prefill_rate_tokens_per_second"
                for s in family.samples
            }

        def rows() -> dict[str, tuple[str, float, int]]:
            return {
                r["id"]: (
                    r["prefill_model"],
                    r["prefill_rate_tokens_per_s"],
                    r["prefill_observations"],
                )
                for r in worker_rows(pool, time.monotonic())
            }

        try:
            pool.set_endpoints(
                WorkerEndpoint(id=w, url="http://127.0.0.1:9") for w in ("seasoned", "fresh")
            )
            seasoned = pool.workers["seasoned"]
            assert rows() == {"seasoned": ("prior", 8000.0, 0), "fresh": ("prior", 8000.0, 0)}
            assert rates() == {}
            now = time.monotonic()
            for i in range(12):  # 2,000 tokens a second and 0.1 s of overhead, seen 12 times
                tokens = 1000 + 250 * i
                t = seasoned.begin(tokens, 0.3, now, shows_first_token=True)
                seasoned.first_token(t, now + 0.1 + tokens / 2000)
                seasoned.end(t)
                if i == 0:  # one TTFT: every worker is judged by the pool's fit to it
                    seen = rows()
                    assert seen["seasoned"][0] == seen["fresh"][0] == "pool"
                    assert seen["fresh"][2] == 0
                    assert rates().keys() == {"seasoned", "fresh"}
            seen = rows()
            assert seen["seasoned"][0] == "own" and seen["fresh"][0] == "median"
            assert seen["seasoned"][1] == seen["fresh"][1] == pytest.approx(2000, rel=0.01)
            assert rates()["fresh"] == pytest.approx(2000, rel=0.01)
        finally:
            await pool.close()


def test_a_stream_counts_as_queued_until_its_first_token_however_long_the_wait() -> None:
    """A worker 20 s behind still has every stream's prompt ahead of the next request:
    were a stream's tokens forgotten after a fixed time, the router would think the queue
    empty and pile more on. A whole answer, which shows no first token, is forgotten
    once it should have been prefilled (twice its prediction)."""
    state = WorkerState(endpoint=WorkerEndpoint(id="w", url="http://w"))
    streamed = state.begin(3000, 0.5, 0.0, shows_first_token=True)
    whole = state.begin(1000, 0.5, 0.0)
    assert state.queued_tokens(1.9) == 4000
    assert state.queued_tokens(20.0) == 3000  # the whole answer's prediction has passed
    state.first_token(streamed, 21.0)
    assert state.queued_tokens(21.0) == 0
    state.end(streamed)
    state.end(whole)
    assert state.in_flight == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["begin", "stream", "first", "end", "wait"]),
            st.integers(0, 5000),
            st.integers(0, 30),
        ),
        max_size=60,
    )
)
def test_the_queued_tokens_a_decision_sees_are_those_of_the_tickets_still_queued(
    steps: list[tuple[str, int, int]],
) -> None:
    """The sum a decision reads (kept up to date, not recounted each time) is always what
    recounting the tickets would give: begun, no first token, not ended, not expired."""
    state = WorkerState(endpoint=WorkerEndpoint(id="w", url="http://w"))
    now = 0.0
    tickets: list[Any] = []
    for action, tokens, pick in steps:
        if action in ("begin", "stream"):
            tickets.append(
                state.begin(tokens, pick / 10, now, shows_first_token=action == "stream")
            )
        elif action == "wait":
            now += pick / 4
        elif tickets:
            ticket = tickets[pick % len(tickets)]
            if action == "first":
                state.first_token(ticket, now)
            else:
                state.end(ticket)
        expected = sum(
            t.tokens
            for t in tickets
            if not t.ended and not t.first_token_seen and t.expires_at > now
        )
        assert state.queued_tokens(now) == expected


def test_a_whole_answer_teaches_nothing_it_cannot_tell() -> None:
    state = WorkerState(endpoint=WorkerEndpoint(id="w", url="http://w"))
    ticket = state.begin(1000, 0.1, 0.0)
    assert state.finish_whole(ticket, 1.0, 10) is None  # no time per token known yet
    state.observe_itl(0.01)
    assert state.finish_whole(ticket, 1.0, None) is None  # the answer said no usage
    assert state.finish_whole(ticket, 1.0, 0) is None
    assert state.finish_whole(ticket, 1.0, 500) is None  # decode alone outlasts it
    decode_leg = state.begin(1000, 0.1, 0.0, learn=False)
    assert state.finish_whole(decode_leg, 1.0, 10) is None
    streamed = state.begin(1000, 0.1, 0.0)
    state.first_token(streamed, 0.2)
    assert state.finish_whole(streamed, 1.0, 10) is None
    assert state.prefill.observations == 1  # the streamed one's first token only

    assert state.finish_whole(ticket, 1.0, 11) == pytest.approx(0.9)
    assert state.finish_whole(ticket, 1.0, 11) is None  # once
    assert state.prefill.observations == 2


# -- clearing a big worker ------------------------------------------------------------------


async def test_a_cleared_worker_leaves_the_index_in_slices_between_other_work(
    pool_of: Setup,
) -> None:
    a, b = Worker(), Worker()
    pool, _ = await pool_of(a, b)
    pool.index.store("w1", range(1, 200_001))
    pool.index.store("w2", range(1, 1001))
    pool.feed.clear_worker("w1")  # what a lost stretch of events or a restart does
    # gone from every lookup at once; its entries still to sweep
    assert pool.feed.match(list(range(1, 11))) == {"w2": (10, None)}
    assert pool.index.pending_sweep() >= 200_000
    # the loop keeps turning while the sweep goes on, in many slices, not one
    ticks = 0
    while pool.index.pending_sweep():
        await asyncio.sleep(0)
        ticks += 1
    assert ticks >= 50
    assert pool.index.num_entries() == 1000
    assert pool.index.summary()["distinct_blocks"] == 1000


def test_a_queue_drains_at_the_prefill_rate_from_when_the_worker_began_on_it() -> None:
    """What a worker was sent and has not answered yet is not all still ahead of the next
    request: it has been prefilling it since its queue last started or a prefill there
    ended."""
    load = WorkerLoad(prefill=PrefillModel(rate=4000.0))
    first = load.begin(4000, 1.0, 10.0, shows_first_token=True)
    assert load.pending_tokens(10.0, 4000.0) == 4000
    assert load.pending_tokens(10.5, 4000.0) == 2000
    second = load.begin(1000, 1.0, 10.6, shows_first_token=True)  # behind the first
    assert second.queued_ahead == 4000 - 2400  # what was left of the first when it came
    assert load.pending_tokens(10.9, 4000.0) == 5000 - 3600
    assert load.queued_tokens(10.9) == 5000  # what it was sent (the metrics' figure)
    load.first_token(first, 11.2)  # slower than the rate said: the second starts now
    assert load.pending_tokens(11.2, 4000.0) == 1000
    assert load.pending_tokens(11.3, 4000.0) == 600
    load.first_token(second, 11.5)
    assert load.pending_tokens(11.6, 4000.0) == 0


async def test_a_request_goes_behind_a_prefill_nearly_done_not_one_just_begun() -> None:
    """Two workers were each sent a long prompt: one a second ago, one a moment ago. A new
    request waits least behind the first, whose prefill is nearly done, though it was sent
    a little more: the router used to count both queues whole, and chose the second."""
    async with aiohttp.ClientSession() as client:
        pool = WorkerPool(PoolConfig(16, SEED, health_interval_s=60.0), BlockIndex(), client)
        try:
            pool.set_endpoints(
                WorkerEndpoint(id=w, url="http://127.0.0.1:9") for w in ("early", "late")
            )
            now = time.monotonic()
            for state in pool.workers.values():
                state.status = "up"  # no await before the decision: it stays
                for i in range(12):  # 4,000 tokens a second and 0.1 s of overhead
                    tokens = 500 + 300 * i
                    ticket = state.begin(tokens, 0.1, now - 60, shows_first_token=True)
                    state.first_token(ticket, now - 60 + 0.1 + tokens / 4000)
                    state.end(ticket)
            pool.workers["early"].begin(4000, 1.1, now, shows_first_token=True)
            pool.workers["late"].begin(3900, 1.1, now + 0.9, shows_first_token=True)
            views = {v.id: v for v in pool.views(now + 1.0)}
            assert views["early"].queued_tokens == pytest.approx(0, abs=80)
            assert views["late"].queued_tokens == pytest.approx(3500, abs=80)
            req = RouteRequest(400, 16, {})
            decision = Policy.named("kvpool").decide(req, list(views.values()))
            assert decision.worker == "early"
            assert decision.predicted_ttft_s == pytest.approx(0.1 + 400 / 4000, abs=0.03)
        finally:
            await pool.close()


# -- a vLLM worker's cache configuration ------------------------------------------------------


def cache_config(**labels: str) -> str:
    """vLLM 0.32's ``vllm:cache_config_info`` line (a few of its many labels)."""
    values = {
        "block_size": "32",
        "enable_prefix_caching": "True",
        "hash_block_size": "None",
        "prefix_caching_hash_algo": "sha256_cbor",
        **labels,
    }
    text = ",".join(f'{k}="{v}"' for k, v in values.items())
    return (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{{text},engine="0"}} 1.0\n'
    )


async def test_a_vllm_whose_blocks_are_not_the_routers_is_named_with_the_fix(
    pool_of: Setup,
) -> None:
    """vLLM's CPU attention needs blocks of 32 tokens and the router defaults to 16: the
    router reads vLLM's block size from its metrics, says what to change, and gives that
    worker no cache credit (its events would name blocks the router never hashes)."""
    other, same, uncached = Worker(), Worker(), Worker()
    other.metrics = cache_config(block_size="32")
    same.metrics = cache_config(block_size="16")
    uncached.metrics = cache_config(block_size="16", enable_prefix_caching="False")
    pool, _ = await pool_of(other, same, uncached)
    w1, w2, w3 = (pool.workers[f"w{i}"] for i in (1, 2, 3))
    assert not w1.compatible
    assert "start the router with --block-size 32" in (w1.mismatch or "")
    assert w2.compatible and w2.mismatch is None
    assert not w3.compatible and "--enable-prefix-caching" in (w3.mismatch or "")
