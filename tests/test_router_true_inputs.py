"""What the router counts of a request is what the worker will do with it: a batch of
prompts loads its worker with every prompt, a chat's images with their tokens, an
embeddings request with its input; and a request vLLM serves without its prefix cache
(its prompt logprobs asked for) gets no cache credit and no say in the cache check.

Each end-to-end test runs a real router on 127.0.0.1 in front of recording workers
(vLLM-like stand-ins, tests/recording_worker.py) and reads what a user would: the
decision ``/debug/route`` explains, and the load and learned prefill rate
``/debug/workers`` shows.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response

from kvpool.hashing import DEFAULT_HASH_SEED, BlockHasher
from kvpool.kv_events import EventPublisher
from kvpool.router.proxy.request import read_fields, reads_prefix_cache
from kvpool.router.routing.inputs import RouteRequest, WorkerView
from kvpool.router.routing.planner import Planner, SplitConfig
from kvpool.router.routing.policy import PolicyConfig
from kvpool.router.routing.tokens import (
    DEFAULT_MEDIA_PART_TOKENS,
    Batch,
    BatchPrompt,
    media_part_tokens,
)
from kvpool.router.state.agreement import UNJUDGED, AgreementConfig, CacheAgreement
from kvpool.tokenization import load_tokenizer

from conftest import RunningRouter
from recording_worker import RecordingWorker

BS = 16


@pytest.fixture
def workers(recording_workers: Callable[..., RecordingWorker]) -> Callable[..., RecordingWorker]:
    return recording_workers


def _words(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


WORDS = [
    "river", "stone", "amber", "copper", "lantern", "meadow", "harbor", "violet", "thunder",
    "saddle", "orchid", "falcon", "granite", "willow", "ember", "canyon", "velvet", "cobalt",
]  # fmt: skip


def _prompts(body: dict[str, Any]) -> list[Any]:
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, list) and not isinstance(prompt[0], int) else [prompt]


# -- a batch of prompts ---------------------------------------------------------------------


class TimedWorker(RecordingWorker):
    """Its first token comes after its prompt tokens (every prompt of a batch: vLLM
    prefills them all) at ``rate`` tokens a second, as a real prefill's does."""

    rate = 4000.0

    async def _completion_stream(self, gen: Any, mode: str) -> AsyncIterator[bytes]:
        await asyncio.sleep(gen.prompt_tokens / self.rate)
        async for chunk in super()._completion_stream(gen, mode):
            yield chunk


def _count_with(tokenizer: Any) -> Callable[[str, dict[str, Any]], int]:
    def count(path: str, body: dict[str, Any]) -> int:
        return sum(len(tokenizer.encode(p)) for p in _prompts(body))

    return count


def _stream(router: RunningRouter, body: dict[str, Any]) -> str:
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", router.url + "/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        for _ in resp.iter_lines():
            pass
        return resp.headers["x-kvpool-worker"]


@pytest.mark.timeout(120)
def test_a_batch_of_prompts_loads_its_worker_with_every_prompt(
    llama_dir: Path,
    workers: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
) -> None:
    tokenizer = load_tokenizer(llama_dir)
    worker = workers(name=llama_dir.name)
    router = start_router(worker=[worker.spec("a")])
    router.wait_workers_up(1)
    rng = random.Random(7)
    prompts = [f"question {i}: " + _words(40 + 10 * i, rng) for i in range(6)]
    every = sum(len(tokenizer.encode(p)) for p in prompts)

    route = router.route({"prompt": prompts})
    assert route["num_tokens"] == every  # not the first prompt's alone

    # While the batch waits for its first token, the worker's queue holds all of it.
    worker.mode = "stall"
    body = {"prompt": prompts, "max_tokens": 2, "stream": True}
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(_stream, router, body)
        router.wait_for(lambda: router.workers()["a"]["in_flight"] == 1)
        assert router.workers()["a"]["queued_prefill_tokens"] == every
        worker.gate.set()
        assert sent.result(timeout=30) == "a"


@pytest.mark.timeout(180)
def test_a_worker_answering_batches_is_judged_by_its_true_prefill_rate(
    llama_dir: Path,
    workers: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
) -> None:
    """Eight batches of 2 to 9 prompts, streamed one after another, the only traffic: the
    rate the router learns is the worker's. Counting each batch as its first prompt, it
    learned about a tenth of it (a TTFT k times too long for its count), and sent the
    worker's next requests elsewhere."""
    tokenizer = load_tokenizer(llama_dir)
    worker = workers(TimedWorker, name=llama_dir.name)
    worker.count_prompt_tokens = _count_with(tokenizer)
    router = start_router(worker=[worker.spec("a")])
    router.wait_workers_up(1)
    rng = random.Random(11)
    for k in range(2, 10):
        batch = [f"{uuid.uuid4().hex[:6]} " + _words(12 * k, rng) for _ in range(k)]
        assert _stream(router, {"prompt": batch, "max_tokens": 1, "stream": True}) == "a"

    row = router.workers()["a"]
    assert row["prefill_model"] == "own"  # fitted to its own TTFTs, no prior, no peers'
    rate = row["prefill_rate_tokens_per_s"]
    print(f"learned {rate:.0f} tokens/s, the worker's {TimedWorker.rate:.0f}")
    assert TimedWorker.rate / 2 <= rate <= TimedWorker.rate * 2, rate


def test_prompts_of_a_batch_are_credited_what_each_finds_cached() -> None:
    """vLLM prefills each prompt of a batch as a request of its own, in turn: a later one
    finds cached the blocks an earlier one of the batch computes (on any worker), and
    those its worker held before; each is served the whole blocks before its last token."""
    rest = (
        BatchPrompt(tokens=56, keys=[1, 2, 9], shared=2),  # two blocks of the first's
        BatchPrompt(tokens=48, keys=[5, 6, 7], shared=0),  # its own, held on w1 only
        BatchPrompt(tokens=32, keys=[1, 2], shared=2),  # all of it: its last block computed
    )
    held = {(5, 6, 7): {"w1": (3, None)}, (1, 2, 9): {"w0": (3, None), "w1": (2, None)}}
    credit = Batch(first_tokens=50, rest=rest).credit(lambda keys: held.get(tuple(keys), {}), BS)
    assert credit.shared == 32 + 0 + 16
    assert credit.held == {"w0": 48 - 32, "w1": 32}

    req = RouteRequest(num_tokens=186, block_size=BS, matched_blocks={"w0": 4}, batch=credit)
    w0, w1 = WorkerView("w0"), WorkerView("w1")
    assert req.cached_tokens(w0) == 48 + 48 + 16  # its first prompt too: 3 whole blocks of 50
    assert req.cached_tokens(w1) == 0 + 48 + 32
    assert not req.judged  # vLLM's usage names one prompt's cached tokens


def test_a_batch_route_shows_the_blocks_its_prompts_share(
    llama_dir: Path,
    workers: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
) -> None:
    worker = workers(name=llama_dir.name)
    router = start_router(worker=[worker.spec("a")])
    router.wait_workers_up(1)
    tokenizer = load_tokenizer(llama_dir)
    rng = random.Random(3)
    shots = "answer in one word. " + _words(120, rng)
    prompts = [f"{shots} question {i}: {_words(8, rng)}" for i in range(4)]
    ids = [tokenizer.encode(p) for p in prompts]

    def shared(i: int) -> int:  # the full blocks prompt i has in common with one before it
        common = 0
        for earlier in ids[:i]:
            n = 0
            while n < min(len(earlier), len(ids[i])) and earlier[n] == ids[i][n]:
                n += 1
            common = max(common, n)
        return min(common // BS * BS, len(ids[i]) - 1)

    route = router.route({"prompt": prompts})

    # nothing is cached on the worker: the three after the first find the few-shot prefix
    # the first computes, and are credited it
    expected = sum(shared(i) for i in range(1, 4))
    assert expected >= 3 * 7 * BS
    assert route["cached_tokens"] == expected
    assert route["num_tokens"] == sum(map(len, ids))


# -- media -------------------------------------------------------------------------------------

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


def test_each_image_of_a_chat_counts_as_the_tokens_the_worker_makes_of_it(
    llama_dir: Path,
    workers: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
) -> None:
    worker = workers(name=llama_dir.name)
    router = start_router(worker=[worker.spec("a")])
    router.wait_workers_up(1)
    text = "describe these two pictures: " + "in detail " * 30
    with_images = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": text}]},
            {"role": "user", "content": [IMAGE, IMAGE]},
        ]
    }
    without = {"messages": [{"role": "user", "content": text}, {"role": "user", "content": ""}]}

    plain, route = router.route(without), router.route(with_images)

    # the test model has no vision tower in its config: a typical image's count
    assert route["num_tokens"] == plain["num_tokens"] + 2 * DEFAULT_MEDIA_PART_TOKENS
    assert "before the first image_url part" in route["reason"]


def test_a_set_media_part_count_is_used(
    llama_dir: Path,
    workers: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
) -> None:
    worker = workers(name=llama_dir.name)
    router = start_router(worker=[worker.spec("a")], media_part_tokens=100)
    router.wait_workers_up(1)
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    one = router.route({"messages": [{"role": "user", "content": [audio]}]})
    two = router.route({"messages": [{"role": "user", "content": [audio, audio]}]})
    assert two["num_tokens"] - one["num_tokens"] == 100


@pytest.mark.parametrize(
    ("files", "tokens"),
    [
        ({"config.json": {"mm_tokens_per_image": 256}}, 256),  # Gemma 3
        ({"config.json": {}, "preprocessor_config.json": {"image_seq_length": 1024}}, 1024),
        ({"config.json": {"vision_config": {"image_size": 336, "patch_size": 14}}}, 576),
        (
            {"config.json": {"vision_config": {"image_size": 448, "patch_size": 14}}},
            1024,
        ),
        (
            {
                "config.json": {
                    "vision_config": {"image_size": 448, "patch_size": 14, "spatial_merge_size": 2}
                }
            },
            256,
        ),
        # sized by its pixels (Qwen2-VL): a typical image
        ({"config.json": {"vision_config": {"patch_size": 14, "spatial_merge_size": 2}}}, 576),
        ({"config.json": {"architectures": ["LlamaForCausalLM"]}}, DEFAULT_MEDIA_PART_TOKENS),
    ],
)
def test_a_media_part_is_as_many_tokens_as_the_model_config_says(
    tmp_path: Path, files: dict[str, Any], tokens: int
) -> None:
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    assert media_part_tokens(tmp_path) == tokens


# -- embeddings --------------------------------------------------------------------------------


class HeldEmbeddings(RecordingWorker):
    """Holds every embeddings request until :attr:`release` is set; :attr:`arrived`
    counts them as they come."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.release = threading.Event()
        self.arrived = 0

    async def _embeddings(self, request: Request) -> Response:
        self.arrived += 1
        while not self.release.is_set():  # noqa: ASYNC110  (set from the test's thread)
            await asyncio.sleep(0.01)
        return await super()._embeddings(request)


@pytest.mark.timeout(120)
def test_embeddings_requests_count_as_load_and_spread_over_the_workers(
    llama_dir: Path,
    workers: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
) -> None:
    a = workers(HeldEmbeddings, name=llama_dir.name)
    b = workers(HeldEmbeddings, name=llama_dir.name)
    router = start_router(worker=[a.spec("a"), b.spec("b")])
    router.wait_workers_up(2)
    text = "an embedding of this sentence " * 8
    tokens = len(load_tokenizer(llama_dir).encode(text))

    def embed(_: int) -> int:
        resp = httpx.post(router.url + "/v1/embeddings", json={"input": [text]}, timeout=60)
        return resp.status_code

    with ThreadPoolExecutor(4) as pool:
        sent = [pool.submit(embed, i) for i in range(4)]
        try:
            router.wait_for(lambda: a.arrived + b.arrived == 4)
            # two each: each went to the worker with the fewest in flight then
            assert (a.arrived, b.arrived) == (2, 2)
            rows = router.workers()
            assert (rows["a"]["in_flight"], rows["b"]["in_flight"]) == (2, 2)
            assert rows["a"]["queued_prefill_tokens"] in (tokens, 2 * tokens)  # (2 s each)
        finally:
            a.release.set()
            b.release.set()
        assert [f.result(timeout=30) for f in sent] == [200] * 4
    router.wait_for(lambda: all(w["in_flight"] == 0 for w in router.workers().values()))
    assert len(a.requests_to("/v1/embeddings")) == len(b.requests_to("/v1/embeddings")) == 2


# -- requests vLLM serves without its prefix cache --------------------------------------------


def test_which_requests_vllm_serves_without_reading_its_prefix_cache() -> None:
    """vLLM's rule (SamplingParams.skip_reading_prefix_cache defaults to prompt_logprobs
    set; echo sets prompt_logprobs from logprobs, or a chat's top_logprobs, default 0)."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    completion = {"prompt": "hi"}
    cases = [
        (completion, True),
        ({**completion, "prompt_logprobs": 0}, False),
        ({**completion, "prompt_logprobs": None}, True),
        ({**completion, "echo": True}, True),  # echoes text, computes no logprobs
        ({**completion, "echo": True, "logprobs": 0}, False),
        ({**completion, "logprobs": 5}, True),  # the output's logprobs only
        (chat, True),
        ({**chat, "prompt_logprobs": 1}, False),
        ({**chat, "echo": True}, False),  # top_logprobs is 0 when not given
        ({**chat, "echo": True, "top_logprobs": None}, True),
        ({**chat, "logprobs": True, "top_logprobs": 5}, True),
    ]
    for body, reads in cases:
        kind = "chat" if "messages" in body else "completion"
        assert reads_prefix_cache(body, kind) is reads, body
        assert read_fields(body, kind).reads_cache is reads
    responses = {"input": "hi", "top_logprobs": 3}
    assert read_fields(responses, "responses").reads_cache is True


def test_an_unjudged_answer_is_not_observed() -> None:
    check = CacheAgreement("w", BS, AgreementConfig(window=16, min_answers=4, min_blocks=4))
    for _ in range(16):
        assert check.observe(UNJUDGED, 0) is False
    assert not check.flagged and check.summary()["answers"] == 0


def test_a_request_reading_no_cache_is_not_split() -> None:
    """Its prompt's logprobs are computed where it is answered: a decode leg would pull the
    blocks instead, and have no logits for them."""
    planner = Planner(PolicyConfig(), SplitConfig(mode="Disaggregated"))
    views = [WorkerView("p", role="prefill"), WorkerView("d", role="decode")]
    req = RouteRequest(num_tokens=4000, block_size=BS, matched_blocks={})
    assert planner.plan(req, views, dry_run=True).path == "disaggregated"
    req = RouteRequest(num_tokens=4000, block_size=BS, matched_blocks={}, reads_cache=False)
    plan = planner.plan(req, views, dry_run=True)
    assert (plan.path, plan.reason) == ("aggregated", "prompt_logprobs")


def _vllm_skips_cache(path: str, body: dict[str, Any]) -> bool:
    """vLLM's own rule, as its OpenAI server applies it (to_sampling_params)."""
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is None and body.get("echo"):
        if path == "/v1/completions":
            prompt_logprobs = body.get("logprobs")
        else:
            prompt_logprobs = body.get("top_logprobs", 0)
    return prompt_logprobs is not None


class EvalWorker(RecordingWorker):
    """A vLLM-like worker with its prefix cache (blocks, KV events): a request whose
    prompt logprobs are asked for reads none of it (reports 0 cached), but stores its
    blocks, as vLLM does."""

    def _admit(self, rec: Any, model: str, body: dict[str, Any]) -> Any:
        gen = super()._admit(rec, model, body)
        if _vllm_skips_cache(rec.path, body):
            gen.cached_tokens = rec.cached_tokens = 0
        return gen


@pytest.mark.timeout(180)
def test_an_evaluation_job_gets_no_cache_credit_and_leaves_its_worker_unflagged(
    llama_dir: Path,
    workers: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
) -> None:
    tokenizer = load_tokenizer(llama_dir)
    publisher = EventPublisher(endpoint="tcp://127.0.0.1:*", replay_endpoint=None).start()
    try:
        worker = workers(EvalWorker, name=llama_dir.name)
        worker.publish_kv_events(
            lambda text: tokenizer.encode(text, add_special_tokens=True),
            BlockHasher(block_size=BS, hash_seed=DEFAULT_HASH_SEED),
            publisher,
        )
        router = start_router(worker=[f"{worker.url},events={publisher.endpoint},id=w"])
        router.wait_workers_up(1)
        rng = random.Random(5)
        shots = "grade each answer. " + _words(150, rng)

        def complete(body: dict[str, Any]) -> dict[str, Any]:
            body = {"max_tokens": 1, **body}
            resp = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
            assert resp.status_code == 200, resp.text
            return resp.json()

        # the few-shot prefix is cached on the worker, and its events say so
        complete({"prompt": f"{shots} first"})
        router.wait_for(lambda: router.route({"prompt": f"{shots} next"})["cached_tokens"] > 128)

        # An evaluation job on it: every answer reports 0 cached tokens, from a healthy
        # cache, and judges nothing.
        for i in range(12):
            asks = {"prompt_logprobs": 1} if i % 2 else {"echo": True, "logprobs": 1}
            answer = complete({"prompt": f"{shots} item {i}: {_words(6, rng)}", **asks})
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        row = router.workers()["w"]
        assert row["cache_check"]["flagged"] is False, row["cache_check"]
        assert row["cache_credit"] is True
        assert row["cache_check"]["answers"] == 1  # the one request that read the cache
        assert router.route({"prompt": f"{shots} later"})["cached_tokens"] > 128

        # No cache hit is predicted for such a request: it computes the whole prompt.
        for asks in ({"prompt_logprobs": 1}, {"echo": True, "logprobs": 1}):
            route = router.route({"prompt": f"{shots} graded", **asks})
            assert route["cached_tokens"] == 0
            assert all(c["cached_tokens"] == 0 for c in route["candidates"])
    finally:
        publisher.close()


class StoringWorker(RecordingWorker):
    """Like vLLM's Responses API: a request continuing a stored response has that
    conversation put first, and finds it cached (the same worker computed it)."""

    history = 96  # the stored conversation's tokens, all cached

    def _admit(self, rec: Any, model: str, body: dict[str, Any]) -> Any:
        gen = super()._admit(rec, model, body)
        if body.get("previous_response_id"):
            gen.prompt_tokens += self.history
            gen.cached_tokens = rec.cached_tokens = self.history
        return gen


def test_a_response_continuing_a_stored_one_is_not_judged_by_the_cache_check(
    llama_dir: Path,
    workers: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
) -> None:
    """The router matches what the request carries; the worker's prompt begins with the
    stored conversation, so its cached tokens are more than any prediction: checked, a
    conversation's every turn would count against a healthy worker."""
    worker = workers(StoringWorker, name=llama_dir.name)
    router = start_router(worker=[worker.spec("w")])
    router.wait_workers_up(1)

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        resp = httpx.post(router.url + "/v1/responses", json=body, timeout=30)
        assert resp.status_code == 200, resp.text
        return resp.json()

    answer = respond({"input": "tell me a story about " + "a long river " * 20})
    for turn in range(10):
        answer = respond({"input": f"and then {turn}?", "previous_response_id": answer["id"]})
        assert answer["usage"]["input_tokens_details"]["cached_tokens"] == StoringWorker.history

    check = router.workers()["w"]["cache_check"]
    assert check["answers"] == 1  # the first turn's, which carried its whole prompt
    assert check["reported_tokens"] == 0 and not check["flagged"]
