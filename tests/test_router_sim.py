"""The router over simulated workers (real processes, real HTTP and ZMQ on loopback): where
requests land, how a hot prompt spreads, what a dead worker or a lost event costs."""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from kvpool.hashing import DEFAULT_HASH_SEED, BlockHasher

pytestmark = pytest.mark.timeout(240)

HASHER = BlockHasher(block_size=16, hash_seed=DEFAULT_HASH_SEED)


def worker_ids(router: Any) -> list[str]:
    return sorted(router.workers())


async def stream(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed request: status, worker, TTFT, text, and the error event if any."""
    start = time.perf_counter()
    out: dict[str, Any] = {"ttft": None, "text": "", "error": None, "done": False}
    async with client.stream("POST", path, json={**body, "stream": True}) as resp:
        out["status"] = resp.status_code
        out["worker"] = resp.headers.get("x-kvpool-worker")
        if resp.status_code != 200:
            out["error"] = json.loads(await resp.aread())["error"]
            return out
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["error"] = chunk["error"]
                continue
            for c in chunk["choices"]:
                piece = c.get("text") or (c.get("delta") or {}).get("content") or ""
                if piece and out["ttft"] is None:
                    out["ttft"] = time.perf_counter() - start
                out["text"] += piece
    out["elapsed"] = time.perf_counter() - start
    return out


# -- cache locality --------------------------------------------------------------------------


def test_requests_sharing_a_prefix_land_where_it_is_cached(worker_processes, start_router):
    workers = worker_processes(4)
    router = start_router(worker=[w.url for w in workers])
    router.wait_workers_up(4)
    rng = random.Random(4)
    groups = [
        " ".join(f"group {g} document line {i} says {rng.random():.6f}." for i in range(14))
        for g in range(6)
    ]
    home: dict[int, str] = {}
    with httpx.Client(base_url=router.url, timeout=30) as client:

        def ask(g: int, q: int) -> tuple[str, int, int]:
            resp = client.post(
                "/v1/completions",
                json={"prompt": f"{groups[g]} Question {q}: why?", "max_tokens": 4},
            )
            assert resp.status_code == 200, resp.text
            usage = resp.json()["usage"]
            return (
                resp.headers["x-kvpool-worker"],
                usage["prompt_tokens_details"]["cached_tokens"],
                usage["prompt_tokens"],
            )

        for g in range(len(groups)):
            home[g], _, _ = ask(g, 0)
        # Each group's first answer put its prefix in some worker's cache; the events say so.
        router.wait_for(
            lambda: sum(w["indexed_blocks"] for w in router.workers().values()) >= 6 * 20
        )
        for q in range(1, 4):
            for g in range(len(groups)):
                worker, cached, prompt = ask(g, q)
                assert worker == home[g], f"group {g} left its cache on {home[g]} for {worker}"
                assert cached >= prompt - 2 * 16, (cached, prompt)
    # The groups were spread (no single worker holds every prefix).
    assert len(set(home.values())) >= 2
    assert router.metric("kvpool_router_routing_decisions_total", worker=home[0], reason="prefix")


# -- a hot prompt ------------------------------------------------------------------------------

HOT_SYSTEM = " ".join(f"Rule {i}: answer with care about topic number {i}." for i in range(60))


def hot_prompt_sizes(n: int, seed: int = 11) -> list[tuple[int, int]]:
    """(question words, max tokens) per request: mostly short questions, one in twelve a long
    document to read, so the prefill work of requests differs far more than their number."""
    rng = random.Random(seed)
    return [
        (rng.randint(300, 450) if rng.random() < 0.08 else rng.randint(4, 40), rng.randint(16, 64))
        for _ in range(n)
    ]


async def hot_prompt_load(url: str, sizes: list[tuple[int, int]], rate: float) -> dict[str, Any]:
    """Every request shares one system prompt; in-flight counts are sampled from the router
    as the load runs."""
    rng = random.Random(12)
    samples: list[list[int]] = []
    results: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        stop = asyncio.Event()

        async def sample() -> None:
            while not stop.is_set():
                rows = (await client.get("/debug/workers")).json()["workers"]
                samples.append([r["in_flight"] for r in sorted(rows, key=lambda r: r["id"])])
                await asyncio.sleep(0.05)

        async def one(i: int, words: int, max_tokens: int) -> None:
            question = " ".join(f"q{i} w{j}" for j in range(words))
            body = {
                "messages": [
                    {"role": "system", "content": HOT_SYSTEM},
                    {"role": "user", "content": question},
                ],
                "max_tokens": max_tokens,
            }
            results.append(await stream(client, "/v1/chat/completions", body))

        sampler = asyncio.create_task(sample())
        tasks = []
        for i, (words, max_tokens) in enumerate(sizes):
            tasks.append(asyncio.create_task(one(i, words, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        stop.set()
        await sampler
    bad = [r for r in results if r["status"] != 200 or not r["done"] or r["error"]]
    assert not bad, bad[:3]
    ttfts = sorted(r["ttft"] for r in results)
    busy = [s for s in samples if sum(s) >= len(s)]  # while there is load to share
    per_worker = [sum(col) / len(busy) for col in zip(*busy, strict=True)]
    return {
        "ttft_p90": ttfts[int(0.9 * len(ttfts))],
        "imbalance": max(per_worker) / (sum(per_worker) / len(per_worker)),
        "workers": {r["worker"] for r in results},
    }


@pytest.mark.slow
def test_one_system_prompt_for_every_request_spreads_over_the_pool(worker_processes, start_router):
    """The prompt every request shares must not pile onto the worker that cached it first
    (the SGLang router's cache-aware policy sends it all to one): it spreads to other
    workers as the holder's queue grows, so no worker carries more than twice the mean
    in-flight requests. The default keeps a prefix on its holders while they are within
    about 2x the best predicted TTFT and the decode-load guard (1.5x the mean + 4), so at
    this light load one worker may stay idle. How its time to first token compares with
    the other policies is a timing goal, measured side by side by ``bench/routing.py``
    (workload ``one-system-prompt``), not asserted here."""
    # Simulated steps three times as long as the H100 model's, so that the workers' time, not
    # this 2-core machine's, makes the latencies.
    workers = worker_processes(
        4, max_model_len=8192, num_blocks=4096, max_waiting_tokens=200_000, sim_time_scale=3
    )
    router = start_router(worker=[w.url for w in workers], policy="kvpool")
    router.wait_workers_up(4)
    ours = asyncio.run(hot_prompt_load(router.url, hot_prompt_sizes(200), rate=20))
    assert ours["imbalance"] <= 2.0, ours
    assert len(ours["workers"]) >= 3, ours


# -- failures ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_worker_killed_under_load_loses_no_request(worker_processes, start_router):
    """Each request succeeds, or ends fast with a clean error; none hangs."""
    workers = worker_processes(4, sim_time_scale=2, max_model_len=4096)
    router = start_router(worker=[w.url for w in workers])
    router.wait_workers_up(4)
    victim = workers[1]

    async def load() -> list[dict[str, Any]]:
        rng = random.Random(2)
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as client:

            async def one(i: int) -> dict[str, Any]:
                body = {"prompt": f"request {i} " + "context " * rng.randint(10, 200)}
                body["max_tokens"] = rng.randint(20, 80)
                if i % 2:
                    return await stream(client, "/v1/completions", body)
                start = time.perf_counter()
                resp = await client.post("/v1/completions", json=body)
                out = {"status": resp.status_code, "done": resp.status_code == 200}
                out["error"] = None if resp.status_code == 200 else resp.json()["error"]
                out["elapsed"] = time.perf_counter() - start
                return out

            tasks = []
            for i in range(80):
                tasks.append(asyncio.create_task(one(i)))
                if i == 30:
                    victim.kill()
                    killed_at = time.monotonic()
                await asyncio.sleep(0.03)
            out = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
            down = router.workers()[f"127.0.0.1:{victim.port}"]
            assert down["status"] == "down"
            assert time.monotonic() - killed_at < 60
            return out

    results = asyncio.run(load())
    ok = [r for r in results if r["status"] == 200 and r["done"] and not r["error"]]
    failed = [r for r in results if r not in ok]
    for r in failed:  # only streams already under way on the dead worker may fail
        assert r["error"]["code"] == "worker_failed", r
        assert r["elapsed"] < 10
    assert len(ok) >= len(results) - 8, failed
    assert router.metric("kvpool_router_requests_total", outcome="success") == len(ok)


def test_a_lost_event_batch_resyncs_that_worker(worker_processes, start_router, lossy_proxy):
    """A sequence gap that cannot be filled drops what the index holds for that worker (it
    may be wrong), rather than keeping a silently wrong index."""
    (worker,) = worker_processes(1)
    proxy = lossy_proxy(worker.events)
    router = start_router(worker=[f"{worker.url},events={proxy.endpoint}"], speculative_ttl_s=0.2)
    router.wait_workers_up(1)
    wid = f"127.0.0.1:{worker.port}"
    first = list(range(10, 10 + 16 * 8 + 3))

    with httpx.Client(base_url=router.url, timeout=30) as client:

        def send(prompt: list[int]) -> None:
            resp = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
            assert resp.status_code == 200, resp.text

        # The subscriber may join after the first batches went out: send until one arrives.
        def indexed() -> bool:
            send(first)
            return router.workers()[wid]["indexed_blocks"] >= 8

        router.wait_for(indexed)
        time.sleep(0.3)  # let speculation lapse; only what events say stays
        assert router.route({"prompt": first})["cached_tokens"] == 8 * 16
        last = proxy.last_seq
        proxy.drop = lambda seq: seq == last + 1
        send(list(range(200, 200 + 16 * 4)))  # its batch is lost
        router.wait_for(lambda: proxy.dropped)
        send(list(range(300, 300 + 16 * 4)))  # its batch shows the gap
        router.wait_for(lambda: router.metric("kvpool_router_kv_event_resyncs_total", worker=wid))
    assert router.metric("kvpool_router_kv_event_gaps_total", worker=wid) >= 1
    time.sleep(0.3)
    # The worker still holds the first prompt, but the index no longer claims it.
    assert router.route({"prompt": first})["cached_tokens"] == 0


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_vllm_format_events_are_indexed_in_both_encodings(encoding, worker_processes, start_router):
    """A worker whose events come the way vLLM publishes them (raw frames, either encoding)
    gets cache credit for exactly the blocks it announced."""
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.bind("tcp://127.0.0.1:*")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        (worker,) = worker_processes(1, kv_events_endpoint=None, kv_events_replay_endpoint=None)
        router = start_router(worker=[f"{worker.url},events={endpoint}"])
        router.wait_workers_up(1)
        prompt = list(range(100, 100 + 16 * 6 + 5))
        keys = HASHER.prompt_keys(prompt)
        assert len(keys) == 6
        stored_keys = keys[:4]  # the worker holds the first four blocks
        tokens = prompt[: 16 * 4]
        if encoding == "array":
            event: Any = ["BlockStored", stored_keys, None, tokens, 16, None, "GPU", None]
        else:
            event = {
                "type": "BlockStored",
                "block_hashes": stored_keys,
                "parent_block_hash": None,
                "token_ids": tokens,
                "block_size": 16,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "extra_keys": [None] * 4,
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            }
        seq = 0

        def published() -> bool:
            nonlocal seq
            payload = msgspec.msgpack.encode([time.time(), [event], 0])
            pub.send_multipart([b"", seq.to_bytes(8, "big", signed=True), payload])
            seq += 1
            return router.workers()[f"127.0.0.1:{worker.port}"]["indexed_blocks"] == 4

        router.wait_for(published)
        decision = router.route({"prompt": prompt})
        assert decision["cached_tokens"] == 4 * 16
        assert decision["reason"] == "single"
    finally:
        pub.close(0)


def test_a_client_leaving_a_whole_answer_frees_the_worker_at_once(worker_processes, start_router):
    """A non-streamed request whose client hangs up is aborted on the worker (which frees
    its blocks) rather than computed to the end for nobody."""
    (worker,) = worker_processes(1, sim_time_scale=20)  # 120 ms a token: 100 tokens, 12 s
    router = start_router(worker=[worker.url])
    router.wait_workers_up(1)
    wid = f"127.0.0.1:{worker.port}"
    body = {"prompt": "a long answer please", "max_tokens": 100}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(router.url + "/v1/completions", json=body, timeout=1.0)
    left = time.monotonic()

    def running() -> float:
        text = httpx.get(worker.url + "/metrics", timeout=5).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:num_requests_running")
        )

    router.wait_for(lambda: router.workers()[wid]["in_flight"] == 0 and running() == 0, 5)
    assert time.monotonic() - left < 5  # long before the answer's 12 s
    router.wait_for(lambda: router.metric("kvpool_router_requests_total", outcome="cancelled"))
