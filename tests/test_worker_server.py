"""The worker server, driven by the official ``openai`` client over real HTTP on loopback."""

from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from kvpool.hashing import HASH_ALGORITHM, block_key
from kvpool.kv_events import EventSubscriber, Received
from kvpool.worker.sequence import SamplingParams

from conftest import RunningWorker

PROMPT = "A router in front of a pool of inference workers reads every prompt"


@pytest.fixture
def worker(start_worker: Any) -> RunningWorker:
    return start_worker()


def greedy(worker: RunningWorker, prompt: Any, max_tokens: int) -> Any:
    """The engine's own answer, from a fresh engine over the same model."""
    from kvpool.worker.engine import EngineConfig, LLMEngine

    engine = worker.engine
    assert isinstance(engine, LLMEngine)
    fresh = LLMEngine(engine.model, engine.tokenizer, EngineConfig(device="cpu", num_blocks=64))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return fresh.generate([prompt], params)[0]


def test_completion_matches_the_engine_and_counts_usage(worker: RunningWorker) -> None:
    expected = greedy(worker, PROMPT, 12)
    r = worker.openai().completions.create(
        model=worker.worker.model_name,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "text_completion"
    assert r.choices[0].text == expected.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_prompts_as_token_ids_and_lists_give_one_choice_each(worker: RunningWorker) -> None:
    client = worker.openai()
    ids = worker.engine.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=None, prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(model=None, prompt=PROMPT, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = client.completions.create(
        model=None, prompt=[PROMPT, "Each worker keeps its cache"], max_tokens=6, temperature=0
    )
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == by_text.choices[0].text
    two = [greedy(worker, p, 6) for p in (PROMPT, "Each worker keeps its cache")]
    assert many.usage.prompt_tokens == sum(len(c.prompt_token_ids) for c in two)
    listed = client.completions.create(model=None, prompt=[ids, ids[:5]], max_tokens=3)
    assert len(listed.choices) == 2


def test_streamed_completion_equals_the_unstreamed_one(worker: RunningWorker) -> None:
    client = worker.openai()
    whole = client.completions.create(model=None, prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(
        client.completions.create(
            model=None,
            prompt=PROMPT,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[
        0
    ].finish_reason
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_completion_uses_the_chat_template(worker: RunningWorker) -> None:
    client = worker.openai()
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What does the router do?"},
    ]
    templated = worker.engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    expected = greedy(
        worker, worker.engine.tokenizer.encode(templated, add_special_tokens=False), 10
    )
    r = client.chat.completions.create(
        model=worker.worker.model_name,
        messages=messages,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected.text
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == 10
    counted = httpx.post(worker.url + "/tokenize", json={"messages": messages}).json()
    assert counted["count"] == r.usage.prompt_tokens

    stream = client.chat.completions.create(
        model=worker.worker.model_name,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
        r.usage.prompt_tokens,
        10,
    )


def test_stop_strings_and_logprobs(worker: RunningWorker) -> None:
    client = worker.openai()
    free = client.completions.create(model=None, prompt=PROMPT, max_tokens=24, temperature=0)
    text = free.choices[0].text
    stop = text[5:9]
    cut = client.completions.create(
        model=None, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"

    lp = client.completions.create(
        model=None, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3
    )
    assert len(lp.choices[0].logprobs.tokens) == 4
    assert all(len(top) == 3 for top in lp.choices[0].logprobs.top_logprobs)
    assert all(v <= 0 for v in lp.choices[0].logprobs.token_logprobs)
    chat = client.chat.completions.create(
        model=None,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


def test_models_info_tokenize_and_detokenize(worker: RunningWorker) -> None:
    models = worker.openai().models.list()
    assert [m.id for m in models.data] == [worker.worker.model_name]
    info = httpx.get(worker.url + "/kvpool/info").json()
    assert info["served_model_name"] == worker.worker.model_name
    assert info["block_size"] == 16 and info["hash_algo"] == HASH_ALGORITHM
    assert info["hash_seed"] == worker.engine.hasher.hash_seed
    assert info["role"] == "both" and info["engine"] == "kvpool"
    assert info["max_model_len"] == worker.engine.max_model_len
    tokens = httpx.post(worker.url + "/tokenize", json={"prompt": PROMPT}).json()
    assert tokens["tokens"] == worker.engine.tokenizer.encode(PROMPT)
    back = httpx.post(worker.url + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert PROMPT in back["prompt"]
    assert httpx.get(worker.url + "/health").status_code == 200


def test_metrics_agree_with_the_engine(worker: RunningWorker) -> None:
    client = worker.openai()
    shared = PROMPT + " and hashes each block together with the hash of the block before it."
    for i in range(4):  # the second and later find the shared prefix cached
        client.completions.create(model=None, prompt=f"{shared} Question {i}?", max_tokens=5)
    worker.wait_for(lambda: worker.worker.loop.stats.num_running == 0)
    stats = worker.engine.stats
    m = worker.metric
    # Independently: each later prompt finds cached the full blocks it shares with the
    # first (never the block of its last token).
    hasher = worker.engine.hasher
    ids = [worker.engine.tokenizer.encode(f"{shared} Question {i}?") for i in range(4)]
    first = hasher.hash_prompt(ids[0])
    shared_blocks = [
        sum(
            1
            for _ in itertools.takewhile(
                lambda ab: ab[0] == ab[1],
                zip(first, hasher.hash_prompt(p)[: (len(p) - 1) // 16], strict=False),
            )
        )
        for p in ids[1:]
    ]
    assert m("vllm:prefix_cache_hits_total") == 16 * sum(shared_blocks) > 0
    assert m("vllm:prefix_cache_queries_total") == sum(map(len, ids))
    assert m("vllm:prefix_cache_queries_total") == stats.prefix_cache_queries
    assert m("vllm:prefix_cache_hits_total") == stats.prefix_cache_hits > 0
    assert m("vllm:prompt_tokens_total") == stats.prompt_tokens
    assert m("vllm:generation_tokens_total") == stats.generation_tokens == 20
    assert m("vllm:num_preemptions_total") == stats.preemptions
    assert m("vllm:num_requests_running") == 0 and m("vllm:num_requests_waiting") == 0
    assert m("vllm:kv_cache_usage_perc") == stats.kv_usage == 0
    assert m("vllm:time_to_first_token_seconds_count") == 4
    # every latency is a real duration, and a first token comes before the end
    assert 0 < m("vllm:time_to_first_token_seconds_sum") < m("vllm:e2e_request_latency_seconds_sum")
    assert m("vllm:inter_token_latency_seconds_sum") > 0
    assert m("vllm:e2e_request_latency_seconds_count") == 4
    assert m("vllm:inter_token_latency_seconds_count") == 16
    assert m("vllm:request_success_total", finished_reason="length") == 4


@pytest.mark.parametrize(("encoding", "topic"), [("array", ""), ("map", "kv@worker-1")])
async def test_event_subscriber_ends_with_the_pool_s_blocks(
    start_worker: Any, encoding: str, topic: str
) -> None:
    # A small cache, so that the load also evicts.
    worker = start_worker(
        num_blocks=24,
        kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
        kv_events_encoding=encoding,
        kv_events_topic=topic,
    )
    async with httpx.AsyncClient(base_url=worker.url, timeout=60) as client:
        info = (await client.get("/kvpool/info")).json()["kv_events"]
    assert (info["encoding"], info["topic"]) == (encoding, topic)
    index: set[int] = set()
    evicted: set[int] = set()
    caught_up = asyncio.Event()
    last_seq: list[int] = []  # the publisher's last sequence number, once the load is done
    received = [-1]

    async def follow(sub: EventSubscriber) -> None:
        async for item in sub:
            assert isinstance(item, Received), item
            for event in item.batch.events:
                kind = type(event).__name__
                if kind == "BlockStored":
                    index.update(event.block_hashes)
                elif kind == "BlockRemoved":
                    index.difference_update(event.block_hashes)
                    evicted.update(event.block_hashes)
                else:
                    index.clear()
            received[0] = item.seq
            if last_seq and item.seq >= last_seq[0]:
                caught_up.set()

    raw = zmq.asyncio.Context.instance().socket(zmq.SUB)  # the wire itself, undecoded
    raw.setsockopt(zmq.SUBSCRIBE, topic.encode())
    raw.connect(info["endpoint"])
    async with EventSubscriber(
        info["endpoint"], info["replay_endpoint"], topic=topic, start_seq=0
    ) as sub:
        task = asyncio.create_task(follow(sub))
        async with httpx.AsyncClient(base_url=worker.url, timeout=60) as client:
            prompts = [f"{PROMPT} {'again ' * (i % 5)} number {i}" for i in range(24)]
            await asyncio.gather(
                *(
                    client.post("/v1/completions", json={"prompt": p, "max_tokens": 8})
                    for p in prompts
                )
            )
        last_seq.append(worker.worker.publisher.next_seq - 1)
        if received[0] >= last_seq[0]:
            caught_up.set()
        waiter = asyncio.create_task(caught_up.wait())
        await asyncio.wait({task, waiter}, timeout=20, return_when=asyncio.FIRST_COMPLETED)
        assert caught_up.is_set(), task.exception() if task.done() else "events stopped"
        task.cancel()
    frames = await asyncio.wait_for(raw.recv_multipart(), 10)
    raw.close(linger=0)
    assert frames[0] == topic.encode()
    first_event = msgspec.msgpack.decode(frames[2])[1][0]
    assert isinstance(first_event, dict) == (encoding == "map")
    pool = {block_key(d) for d in worker.engine.pool.cached_digests}
    assert worker.metric("vllm:prefix_cache_queries_total") > 0
    assert index == pool and len(pool) > 0
    assert evicted  # the load was big enough to evict, and evictions were followed


def _blocks_in_use(worker: RunningWorker) -> float:
    return worker.metric("vllm:kv_cache_usage_perc")


def test_a_client_that_leaves_a_stream_frees_its_blocks(worker: RunningWorker) -> None:
    stream = worker.openai().completions.create(
        model=None, prompt=PROMPT, max_tokens=900, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    worker.wait_for(lambda: _blocks_in_use(worker) > 0)
    stream.close()
    worker.wait_for(lambda: _blocks_in_use(worker) == 0 and worker.metric(
        "vllm:num_requests_running") == 0)  # fmt: skip
    assert worker.metric("vllm:request_success_total", finished_reason="abort") == 1


def test_a_client_that_gives_up_on_a_long_answer_frees_its_blocks(worker: RunningWorker) -> None:
    body = {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True}
    started = threading.Event()

    outcome: list[BaseException | httpx.Response] = []

    def give_up() -> None:
        started.set()
        try:
            outcome.append(httpx.post(worker.url + "/v1/completions", json=body, timeout=0.5))
        except httpx.HTTPError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=give_up)
    thread.start()
    started.wait()
    worker.wait_for(lambda: _blocks_in_use(worker) > 0)
    thread.join()
    assert isinstance(outcome[0], httpx.ReadTimeout), outcome
    worker.wait_for(lambda: _blocks_in_use(worker) == 0)
    assert worker.engine.stats.generation_tokens < 900
