"""The router as a drop-in gateway in front of a vLLM fleet.

Every request body vLLM accepts reaches the worker unchanged (but for the usage the router
asks for on a stream), with the router's routing tokens equal to the chat template's; a
failure before the first token is invisible to the client; every answer counts in the
realised hit ratio; LoRA adapters, data-parallel ranks and sessions are routed for.
Workers are :class:`RecordingWorker` (a vLLM-shaped HTTP server on loopback that records
what it gets) or real ``kvpool worker serve --engine sim`` processes.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import RunningRouter
from recording_worker import RecordingWorker

pytestmark = pytest.mark.timeout(90)

DATA = Path(__file__).parent / "data"
CORPUS = json.loads((DATA / "vllm_requests.json").read_text())
LONG = "the router reads every prompt and cuts it into blocks of sixteen tokens " * 6


@pytest.fixture(scope="session")
def tools_model(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test model's tokenizer with a tool-aware chat template (Hermes/Qwen style)."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tools") / "tiny-tools"
    out.mkdir()
    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir), local_files_only=True)
    tokenizer.chat_template = (DATA / "tool_chat_template.jinja").read_text()
    tokenizer.save_pretrained(str(out))
    shutil.copy(llama_dir / "config.json", out / "config.json")
    return out


@pytest.fixture
def recording(
    start_router: Callable[..., RunningRouter],
) -> Iterator[Callable[..., RecordingWorker]]:
    """Start recording workers; they stop before the routers (this fixture asks for
    ``start_router``, so it is torn down first)."""
    started: list[RecordingWorker] = []

    def start(name: str, **kwargs: Any) -> RecordingWorker:
        worker = RecordingWorker(name=name, **kwargs)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


def _one(
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
    model: Path,
    **settings: Any,
) -> tuple[RecordingWorker, RunningRouter]:
    """Worker "a" behind a router."""
    worker = recording(model.name)
    router = start_router(model=str(model), worker=[worker.spec("a")], **settings)
    router.wait_workers_up(1)
    return worker, router


def _pair(
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
    model: Path,
    **settings: Any,
) -> tuple[RecordingWorker, RecordingWorker, RunningRouter]:
    """Workers "a" and "b" behind a router; round-robin sends the first request to "a"."""
    a, b = recording(model.name), recording(model.name)
    settings.setdefault("policy", "round-robin")
    router = start_router(model=str(model), worker=[a.spec("a"), b.spec("b")], **settings)
    router.wait_workers_up(2)
    return a, b, router


def sse(resp: httpx.Response) -> list[str]:
    return [line[5:].strip() for line in resp.iter_lines() if line.startswith("data:")]


def stream(url: str, body: dict[str, Any], **kwargs: Any) -> tuple[int, list[str]]:
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", url, json=body, **kwargs) as resp,
    ):
        return resp.status_code, sse(resp)


# -- what passes through ---------------------------------------------------------------------


def _served(body: dict[str, Any], name: str) -> dict[str, Any]:
    body = copy.deepcopy(body)
    body["model"] = name
    return body


@pytest.mark.parametrize("case", CORPUS, ids=[c["name"] for c in CORPUS])
def test_every_vllm_request_reaches_the_worker_unchanged(
    case: dict[str, Any],
    tools_model: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
) -> None:
    worker = recording(tools_model.name)
    router = start_router(model=str(tools_model), worker=[worker.spec("a")])
    router.wait_workers_up(1)
    body = _served(case["body"], tools_model.name)
    raw = json.dumps(body).encode()

    resp = httpx.post(
        router.url + case["endpoint"],
        content=raw,
        headers={"content-type": "application/json"},
        timeout=30,
    )

    assert resp.status_code == 200, resp.text
    (got,) = worker.generation_requests()
    assert got.path == case["endpoint"]
    options = body.get("stream_options") or {}
    if (
        body.get("stream")
        and not options.get("include_usage")
        and case["endpoint"] != ("/v1/responses")
    ):
        # the one change: the router asks for the stream's usage, for the hit ratio...
        expected = {**body, "stream_options": {**options, "include_usage": True}}
        expected["stream_options"].pop("continuous_usage_stats", None)
        assert got.json == expected
        # ... and keeps it from a client that did not ask for it
        chunks = [json.loads(d) for d in sse_lines(resp.text) if d != "[DONE]"]
        assert chunks and not any("usage" in c for c in chunks)
    else:
        assert got.body == raw


def sse_lines(text: str) -> list[str]:
    return [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]


def _vllm_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as vLLM's server gives them to the template (written out here on its
    own, from vLLM's chat_utils: text parts joined by a newline, null content empty, tool
    call arguments parsed)."""
    out = []
    for m in copy.deepcopy(messages):
        content = m.get("content")
        if content is None:
            m["content"] = ""
        elif isinstance(content, list):
            m["content"] = "\n".join(p["text"] for p in content)
        for call in m.get("tool_calls") or ():
            args = json.loads(call["function"]["arguments"] or "{}")
            call["function"]["arguments"] = args if isinstance(args, dict) else {}
        out.append(m)
    return out


def _vllm_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    return [
        {
            "type": "function",
            "function": {
                "name": t["function"]["name"],
                "description": t["function"].get("description"),
                "parameters": t["function"].get("parameters"),
            },
        }
        for t in tools
    ]


def _has_media(body: dict[str, Any]) -> bool:
    return any(
        isinstance(m.get("content"), list)
        and any(p.get("type") not in ("text",) for p in m["content"])
        for m in body.get("messages", [])
    )


CHATS = [c for c in CORPUS if c["endpoint"] == "/v1/chat/completions" and not _has_media(c["body"])]


@pytest.mark.parametrize("case", CHATS, ids=[c["name"] for c in CHATS])
def test_routing_tokens_are_what_the_chat_template_renders(
    case: dict[str, Any], tools_model: Path
) -> None:
    from transformers import AutoTokenizer

    from kvpool.hashing import BlockHasher
    from kvpool.router.proxy.request import read_fields
    from kvpool.router.routing.tokens import PromptKeys
    from kvpool.tokenization import PrefixTokenCache

    body = case["body"]
    tokenizer = AutoTokenizer.from_pretrained(str(tools_model), local_files_only=True)
    hasher = BlockHasher()  # the router's default block size and seed
    prompt_keys = PromptKeys(tokenizer, PrefixTokenCache(tokenizer), hasher)

    prompt = asyncio.run(prompt_keys.of(read_fields(body, "chat"), None, None))

    # vLLM renders the template to text, then encodes it without special tokens
    text = tokenizer.apply_chat_template(
        _vllm_messages(body["messages"]),
        tools=_vllm_tools(body.get("tools")),
        add_generation_prompt=body.get("add_generation_prompt", True),
        continue_final_message=body.get("continue_final_message", False),
        tokenize=False,
        **(body.get("chat_template_kwargs") or {}),
    )
    expected = tokenizer.encode(text, add_special_tokens=False)
    if body.get("truncate_prompt_tokens"):  # vLLM keeps the last tokens
        expected = expected[-body["truncate_prompt_tokens"] :]
    assert prompt.note is None
    assert prompt.num_tokens == len(expected)
    assert prompt.keys == hasher.prompt_keys(expected, cache_salt=body.get("cache_salt"))


def test_an_image_gives_cache_credit_only_for_the_text_before_it(
    llama_dir: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
) -> None:
    _worker, router = _one(recording, start_router, llama_dir)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    text_only = {"messages": [{"role": "user", "content": LONG}]}
    with_image = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": LONG}, image]},
            {"role": "assistant", "content": "seen"},
            {"role": "user", "content": LONG},
        ]
    }

    plain = router.route(text_only)
    route = router.route(with_image)

    assert "before the first image_url part" in route["reason"]
    # the blocks before the image are hashed, none after it; all the text counts as load
    assert 0 < route["num_blocks"] < plain["num_blocks"] + 1
    assert route["num_tokens"] > plain["num_tokens"]
    assert route["num_blocks"] * 16 <= plain["num_tokens"]


# -- a failure before the first token --------------------------------------------------------


@pytest.mark.parametrize("mode", ["die_after_headers", "end_without_token", "error_event"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_stream_that_fails_before_its_first_token_is_served_by_another_worker(
    mode: str,
    path: str,
    llama_dir: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
) -> None:
    a, b, router = _pair(recording, start_router, llama_dir)
    a.mode = mode
    body: dict[str, Any] = {"model": llama_dir.name, "stream": True, "max_tokens": 4}
    if path == "/v1/completions":
        body["prompt"] = LONG
    else:
        body["messages"] = [{"role": "user", "content": LONG}]

    status, events = stream(router.url + path, body)

    assert status == 200
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks)  # one clean answer
    if path == "/v1/completions":
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    else:
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert len(text.split()) == 4
    assert len(a.generation_requests()) == 1 and len(b.generation_requests()) == 1
    assert router.metric("kvpool_router_retries_total", reason="no_token") == 1
    assert router.metric("kvpool_router_requests_total", outcome="success") == 1


def test_a_client_that_leaves_before_the_workers_headers_is_released_within_a_second(
    llama_dir: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
) -> None:
    worker = recording(llama_dir.name)
    worker.mode = "stall"
    router = start_router(worker=[worker.spec("a")])
    router.wait_workers_up(1)
    body = {"model": llama_dir.name, "prompt": LONG, "stream": True, "max_tokens": 4}

    with pytest.raises(httpx.ReadTimeout):
        stream(router.url + "/v1/completions", body, timeout=0.5)
    left = time.monotonic()

    router.wait_for(lambda: router.workers()["a"]["in_flight"] == 0, timeout=1.0)
    assert time.monotonic() - left <= 1.0
    assert router.router.active == 0
    router.wait_for(lambda: router.metric("kvpool_router_requests_total", outcome="cancelled") == 1)


def test_a_long_stream_that_keeps_producing_is_not_cut(
    llama_dir: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
) -> None:
    worker = recording(llama_dir.name)
    worker.mode, worker.tokens, worker.token_interval = "slow", 20, 0.1
    # limits far below the stream's 2 s: the old total deadline would have cut it
    router = start_router(
        worker=[worker.spec("a")],
        request_timeout_s=0.5,
        first_token_timeout_s=1.0,
        stream_idle_timeout_s=0.5,
    )
    router.wait_workers_up(1)
    body = {"model": llama_dir.name, "prompt": LONG, "stream": True, "max_tokens": 20}

    t0 = time.monotonic()
    status, events = stream(router.url + "/v1/completions", body)

    assert status == 200 and time.monotonic() - t0 >= 1.9
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    assert not any("error" in c for c in chunks)
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"]) == 20


def test_a_429_in_approximate_mode_leaves_the_worker_no_cache_credit(
    llama_dir: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
) -> None:
    a, _, router = _pair(recording, start_router, llama_dir)
    a.mode = "status:429"
    body = {"model": llama_dir.name, "prompt": LONG, "max_tokens": 4}

    resp = httpx.post(router.url + "/v1/completions", json=body, timeout=30)

    assert resp.status_code == 200 and resp.headers["x-kvpool-worker"] == "b"
    route = router.route(body)
    cached = {c["worker"]: c["cached_tokens"] for c in route["candidates"]}
    assert cached["a"] == 0 and cached["b"] > 0


def test_a_stopped_worker_holds_no_request_and_its_requests_go_to_another(
    worker_processes: Callable[..., Any], start_router: Callable[..., RunningRouter]
) -> None:
    a, b = worker_processes(2)
    router = start_router(
        worker=[f"{a.url},id=a", f"{b.url},id=b"],
        policy="round-robin",
        first_token_timeout_s=5.0,
        request_timeout_s=5.0,
    )
    router.wait_workers_up(2)
    os.kill(a.proc.pid, signal.SIGSTOP)
    try:
        results: list[tuple[str, float, str]] = []

        def one(i: int) -> None:
            body = {"prompt": f"{LONG} {i}", "max_tokens": 4, "stream": i % 2 == 0}
            t0 = time.monotonic()
            with httpx.Client(timeout=30) as client:
                resp = client.post(router.url + "/v1/completions", json=body)
            results.append(
                (resp.headers.get("x-kvpool-worker", ""), time.monotonic() - t0, resp.text)
            )
            assert resp.status_code == 200, resp.text

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(results) == 4
        for worker, elapsed, text in results:
            assert worker == "b" and '"error"' not in text
            assert elapsed < 5.0  # never past the time-to-first-token limit
        assert router.workers()["a"]["in_flight"] == 0
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)


def test_a_clients_mistake_never_opens_a_workers_breaker(
    llama_dir: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
) -> None:
    _worker, router = _one(recording, start_router, llama_dir)
    body = {"model": llama_dir.name, "prompt": LONG, "max_tokens": 4}

    for _ in range(4):
        resp = httpx.post(
            router.url + "/v1/completions",
            json=body,
            headers={"x-request-id": "x" * 9000},
            timeout=10,
        )
        assert resp.status_code == 400
        assert resp.json()["error"]["param"] == "x-request-id"

    assert router.workers()["a"]["circuit_open"] is False
    assert httpx.post(router.url + "/v1/completions", json=body, timeout=10).status_code == 200


def test_nested_or_cut_off_bodies_answer_4xx_and_log_no_traceback(
    llama_dir: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker, router = _one(recording, start_router, llama_dir)
    nested = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    caplog.set_level(logging.INFO)

    for path in ("/debug/route", "/v1/chat/completions", "/v1/completions", "/v1/responses"):
        resp = httpx.post(
            router.url + path, content=nested, headers={"content-type": "application/json"}
        )
        assert 400 <= resp.status_code < 500, (path, resp.text)
        assert resp.json()["error"]["type"] == "invalid_request_error"

    host, port = router.url.removeprefix("http://").split(":")
    for _ in range(5):  # a client that promises a body and leaves halfway through it
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                b'{"prompt": "half'
            )
    time.sleep(0.5)
    assert httpx.get(router.url + "/health").status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], [
        r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR
    ]
    assert worker.generation_requests() == []


def test_worker_failures_do_not_show_worker_addresses_to_clients(
    llama_dir: Path, start_router: Callable[..., RunningRouter]
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    router = start_router(worker=[f"http://127.0.0.1:{port},id=a"], health_interval_s=60)
    router.router.pool.workers["a"].status = "up"  # as if it had just answered its check

    resp = httpx.post(router.url + "/v1/completions", json={"prompt": LONG}, timeout=10)

    assert resp.status_code in (502, 503)
    assert "127.0.0.1" not in resp.text and str(port) not in resp.text


def test_openapi_describes_the_openai_endpoints(
    llama_dir: Path, start_router: Callable[..., RunningRouter]
) -> None:
    router = start_router(worker=["http://127.0.0.1:9"])

    spec = httpx.get(router.url + "/openapi.json").json()

    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings"):
        post = spec["paths"][path]["post"]
        assert post["requestBody"]["content"]["application/json"]["schema"]["type"] == "object"
    chat = spec["paths"]["/v1/chat/completions"]["post"]
    assert "messages" in chat["requestBody"]["content"]["application/json"]["schema"]["required"]
    assert "text/event-stream" in chat["responses"]["200"]["content"]
    assert "get" in spec["paths"]["/v1/models"]


# -- learning from every answer --------------------------------------------------------------


def test_the_hit_ratio_counts_streams_whose_clients_did_not_ask_for_usage(
    llama_dir: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
) -> None:
    worker, router = _one(recording, start_router, llama_dir)

    for i in range(6):
        prompt = LONG + f" question {i} " * (i + 1)
        status, events = stream(
            router.url + "/v1/completions",
            {"model": llama_dir.name, "prompt": prompt, "stream": True, "max_tokens": 3},
        )
        assert status == 200
        assert not any("usage" in json.loads(e) for e in events if e != "[DONE]")
    # a whole answer counts too
    httpx.post(
        router.url + "/v1/completions",
        json={"model": llama_dir.name, "prompt": LONG, "max_tokens": 3},
        timeout=10,
    )

    hits = router.metric("kvpool_router_cached_prompt_tokens_total")
    queries = router.metric("kvpool_router_reported_prompt_tokens_total")
    worker_hits = sum(r.cached_tokens or 0 for r in worker.generation_requests())
    worker_queries = sum(r.prompt_tokens or 0 for r in worker.generation_requests())
    assert queries == worker_queries > 0
    assert hits == worker_hits > 0
    assert round(hits / queries, 4) == round(worker.hit_ratio, 4)


def test_answers_that_are_not_streamed_teach_the_prefill_model(
    llama_dir: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
) -> None:
    worker, router = _one(recording, start_router, llama_dir)
    state = router.router.pool.workers["a"]
    state.observe_itl(0.001)  # its time per token, as streams or its metrics would tell
    worker.delay_headers = 0.05  # a prefill that takes time

    for i in range(10):
        prompt = f"{i} " + LONG * (1 + i % 3)
        body = {"model": llama_dir.name, "prompt": prompt, "max_tokens": 4}
        assert httpx.post(router.url + "/v1/completions", json=body, timeout=10).status_code == 200

    assert state.prefill.observations == 10


# -- LoRA adapters, data-parallel ranks, sessions --------------------------------------------


def _lora_card(adapter: str, base: str) -> dict[str, Any]:
    return {"id": adapter, "object": "model", "created": 0, "owned_by": "vllm", "root": "/x",
            "parent": base}  # fmt: skip


def test_adapter_requests_go_only_to_their_workers_and_credit_never_crosses_adapters(
    llama_dir: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
) -> None:
    base = llama_dir.name
    card = {"id": base, "object": "model", "created": 0, "owned_by": "vllm", "root": base,
            "parent": None}  # fmt: skip
    a = recording(base, models=[card, _lora_card("sql-lora", base)])
    b = recording(base, models=[card, _lora_card("chat-lora", base)])
    router = start_router(worker=[a.spec("a"), b.spec("b")])
    router.wait_workers_up(2)
    router.wait_for(lambda: len(router.router.pool.adapters()) == 2)

    ids = [m["id"] for m in httpx.get(router.url + "/v1/models").json()["data"]]
    assert sorted(ids) == sorted([base, "sql-lora", "chat-lora"])
    for _ in range(3):
        for adapter, worker in (("sql-lora", "a"), ("chat-lora", "b")):
            body = {"model": adapter, "prompt": LONG, "max_tokens": 2}
            resp = httpx.post(router.url + "/v1/completions", json=body, timeout=10)
            assert resp.status_code == 200 and resp.headers["x-kvpool-worker"] == worker

    # "a" holds the prompt under sql-lora: no credit for the base model or another adapter
    for model in (base, "chat-lora"):
        cached = {
            c["worker"]: c["cached_tokens"]
            for c in router.route({"model": model, "prompt": LONG})["candidates"]
        }
        assert cached["a"] == 0, model
    lora = router.route({"model": "sql-lora", "prompt": LONG})
    assert lora["worker"] == "a" and lora["cached_tokens"] > 0
    missing = httpx.post(router.url + "/v1/completions", json={"model": "no-lora", "prompt": "x"})
    assert missing.status_code == 404


def test_the_rank_holding_the_prefix_gets_the_request_by_vllms_header(
    llama_dir: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
    make_publisher: Callable[..., Any],
) -> None:
    from kvpool.hashing import BlockHasher
    from kvpool.kv_events import BlockRemoved, BlockStored, EventBatch
    from kvpool.tokenization import load_tokenizer

    worker = recording(llama_dir.name)
    publisher = make_publisher()
    spec = f"{worker.url},id=a,events={publisher.endpoint},replay={publisher.replay_endpoint}"
    router = start_router(worker=[spec])
    router.wait_workers_up(1)
    tokens = load_tokenizer(llama_dir).encode(LONG)
    keys = BlockHasher().prompt_keys(tokens)

    def stored(n: int) -> BlockStored:
        return BlockStored(
            block_hashes=keys[:n], parent_block_hash=None, token_ids=tokens[: 16 * n],
            block_size=16,
        )  # fmt: skip

    def publish(event: Any, rank: int) -> None:
        publisher.publish(EventBatch(events=[event], ts=time.time(), data_parallel_rank=rank))

    def cached() -> int:
        return router.route({"prompt": LONG})["cached_tokens"]

    publish(stored(len(keys)), 1)  # rank 1 holds the whole prompt, rank 0 its first block
    publish(stored(1), 0)
    router.wait_for(lambda: cached() >= 16 * (len(keys) - 1))

    route = router.route({"prompt": LONG})
    assert route["data_parallel_rank"] == 1
    # a removal on rank 1 leaves rank 0's block: credit falls to rank 0's one block
    publish(BlockRemoved(block_hashes=keys), 1)
    router.wait_for(lambda: router.route({"prompt": LONG})["cached_tokens"] == 16)
    assert router.route({"prompt": LONG})["data_parallel_rank"] == 0  # named: the pod has two ranks

    publish(stored(len(keys)), 1)
    router.wait_for(lambda: router.route({"prompt": LONG})["data_parallel_rank"] == 1)
    resp = httpx.post(router.url + "/v1/completions", json={"prompt": LONG, "max_tokens": 2})
    assert resp.status_code == 200
    assert worker.generation_requests()[-1].headers["x-data-parallel-rank"] == "1"


def test_a_session_stays_on_its_worker_and_the_decision_says_why(
    llama_dir: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
) -> None:
    a, b = recording(llama_dir.name), recording(llama_dir.name)
    router = start_router(worker=[a.spec("a"), b.spec("b")])
    router.wait_workers_up(2)

    for session in ("alice", "bob", "carol"):
        served = set()
        for turn in range(4):  # unrelated prompts: only the session ties them
            body = {"prompt": f"{session} turn {turn} " + "word " * (5 * turn), "max_tokens": 2}
            resp = httpx.post(
                router.url + "/v1/completions", json=body, headers={"x-session-id": session}
            )
            served.add(resp.headers["x-kvpool-worker"])
        assert len(served) == 1, session
    explained = httpx.post(
        router.url + "/debug/route",
        json={"prompt": "one more thing"},
        headers={"x-session-id": "alice"},
    ).json()
    scores = {c["worker"]: c["scores"].get("affinity") for c in explained["candidates"]}
    assert sorted(scores.values()) == [0.0, 1.0]


# -- what the review found ---------------------------------------------------------------------


def test_a_prompt_that_does_not_tokenize_is_forwarded_without_credit_not_a_500(
    llama_dir: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker, router = _one(recording, start_router, llama_dir)
    # a lone surrogate is valid JSON, and no tokenizer encodes it
    raw = b'{"prompt": "hi \\ud800 there", "max_tokens": 2, "stream": true, "stop": ["\\ud800"]}'

    resp = httpx.post(
        router.url + "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )

    assert resp.status_code == 200, resp.text
    (got,) = worker.generation_requests()
    assert got.json["prompt"] == "hi \ud800 there"  # what the client sent, for the worker
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_refusal_the_worker_sends_inside_its_stream_reaches_the_client_as_sent(
    llama_dir: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
) -> None:
    a, b, router = _pair(recording, start_router, llama_dir)
    for worker in (a, b):
        worker.mode, worker.error_code = "error_event", 400
    body = {"model": llama_dir.name, "prompt": LONG, "stream": True, "max_tokens": 4}

    status, events = stream(router.url + "/v1/completions", body)

    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[0])["error"]["code"] == 400  # the worker's, not a 502
    assert len(a.generation_requests()) + len(b.generation_requests()) == 1  # not retried
    assert router.metric("kvpool_router_requests_total", outcome="client_error") == 1


def test_a_stored_response_is_continued_on_the_worker_that_stored_it(
    llama_dir: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
) -> None:
    a, b = recording(llama_dir.name), recording(llama_dir.name)
    router = start_router(worker=[a.spec("a"), b.spec("b")], policy="round-robin")
    router.wait_workers_up(2)
    url = router.url + "/v1/responses"

    for streamed in (False, True):
        first = {"model": llama_dir.name, "input": "hello there", "stream": streamed}
        resp = httpx.post(url, json=first, timeout=10)
        worker = resp.headers["x-kvpool-worker"]
        if streamed:
            created = json.loads(sse_lines(resp.text)[0])
            response_id = created["response"]["id"]
        else:
            response_id = resp.json()["id"]
        for turn in range(3):  # round-robin would alternate: the stored response decides
            follow = {"model": llama_dir.name, "input": f"and {turn}?",
                      "previous_response_id": response_id}  # fmt: skip
            again = httpx.post(url, json=follow, timeout=10)
            assert again.status_code == 200
            assert again.headers["x-kvpool-worker"] == worker


def test_credentials_and_trace_context_reach_the_workers(
    llama_dir: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
) -> None:
    trace = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    passing, keyed = recording(llama_dir.name), recording(llama_dir.name)
    plain = start_router(worker=[passing.spec("a")])
    with_key = start_router(worker=[keyed.spec("a")], worker_api_key="sk-workers")
    body = {"prompt": LONG, "max_tokens": 2}
    for router in (plain, with_key):
        router.wait_workers_up(1)
        headers = {**trace, "authorization": "Bearer sk-client"}
        assert httpx.post(router.url + "/v1/completions", json=body, headers=headers).is_success

    (got,) = passing.generation_requests()
    assert got.headers["authorization"] == "Bearer sk-client"  # no key of its own: the client's
    assert got.headers["traceparent"] == trace["traceparent"]
    (got,) = keyed.generation_requests()
    assert got.headers["authorization"] == "Bearer sk-workers"
    assert got.headers["traceparent"] == trace["traceparent"]
    # the worker's model list and health are asked with the key too (vLLM's --api-key)
    assert all(
        r.headers.get("authorization") == "Bearer sk-workers"
        for r in keyed.requests
        if r.path in ("/v1/models", "/health")
    )


def test_a_stream_stuck_behind_a_live_health_check_goes_to_another_worker(
    llama_dir: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
) -> None:
    # a stuck engine behind an API server that still answers /health: only the
    # time-to-first-token limit can tell, and it is the attempt's, not the request's
    a, b, router = _pair(recording, start_router, llama_dir, first_token_timeout_s=1.0)
    a.mode = "stall"
    body = {"model": llama_dir.name, "prompt": LONG, "stream": True, "max_tokens": 4}

    t0 = time.monotonic()
    status, events = stream(router.url + "/v1/completions", body)

    assert status == 200 and events[-1] == "[DONE]"
    assert not any("error" in json.loads(e) for e in events[:-1])
    assert 1.0 <= time.monotonic() - t0 < 3.0
    assert len(a.generation_requests()) == 1 and len(b.generation_requests()) == 1
    assert router.metric("kvpool_router_retries_total", reason="ttft_timeout") == 1
    assert router.workers()["a"]["status"] == "up"  # its health check never failed
