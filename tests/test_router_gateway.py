"""The router in front of real tiny-model workers, driven by the ``openai`` client: what a
client sees through the router is what it would see from a worker, plus the routing."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(180)

SYSTEM = (
    "You are a terse assistant for the kvpool project. Keep every answer short, factual "
    "and friendly. Mention the router when it helps. "
) * 6


@pytest.fixture
def stack(start_worker, start_router, llama_dir):
    workers = [start_worker(kv_events_endpoint="tcp://127.0.0.1:*") for _ in range(2)]
    router = start_router(worker=[w.url for w in workers])
    router.wait_workers_up(2)
    return router, workers, llama_dir.name


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_chat_without_streaming_through_the_router(stack):
    router, workers, model = stack
    client = router.openai()
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=chat("What is kvpool?"), max_tokens=8, temperature=0
    )
    reply = raw.parse()
    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens == 8
    assert raw.headers["x-kvpool-worker"] in {f"127.0.0.1:{w.port}" for w in workers}
    # The same request straight to the worker the router chose gives the same greedy answer.
    chosen = next(w for w in workers if f"127.0.0.1:{w.port}" == raw.headers["x-kvpool-worker"])
    direct = chosen.openai().chat.completions.create(
        model=model, messages=chat("What is kvpool?"), max_tokens=8, temperature=0
    )
    assert direct.choices[0].message.content == reply.choices[0].message.content


def test_chat_streaming_through_the_router(stack):
    router, _, model = stack
    pieces, usage = [], None
    for chunk in router.openai().chat.completions.create(
        model=model,
        messages=chat("Stream please."),
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
    assert "".join(pieces)
    assert usage is not None and usage.completion_tokens == 10
    assert router.metric("kvpool_router_time_to_first_token_seconds_count") == 1
    assert router.metric("kvpool_router_inter_token_latency_seconds_count") >= 1


def test_completions_with_and_without_streaming(stack):
    router, _, model = stack
    client = router.openai()
    whole = client.completions.create(model=model, prompt="The router", max_tokens=6, temperature=0)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt="The router", max_tokens=6, temperature=0, stream=True
        )
        if c.choices
    )
    assert whole.choices[0].text == streamed


def test_second_request_of_a_shared_prefix_pair_reports_cached_tokens(stack):
    router, _, model = stack
    client = router.openai()
    first = client.chat.completions.with_raw_response.create(
        model=model, messages=chat("First question?"), max_tokens=4
    )
    second = client.chat.completions.with_raw_response.create(
        model=model, messages=chat("Second question?"), max_tokens=4
    )
    assert second.headers["x-kvpool-worker"] == first.headers["x-kvpool-worker"]
    usage = second.parse().usage
    assert usage.prompt_tokens_details.cached_tokens >= 16 * 10
    assert router.metric("kvpool_router_cached_prompt_tokens_total") >= 160
    assert router.metric("kvpool_router_predicted_cache_hit_tokens_total") >= 160


def test_models_is_the_union_of_the_workers_models(stack):
    router, _, model = stack
    assert [m.id for m in router.openai().models.list()] == [model]


def test_request_id_is_honoured_and_passed_to_the_worker(stack):
    router, _, model = stack
    resp = httpx.post(
        router.url + "/v1/completions",
        json={"model": model, "prompt": "hi", "max_tokens": 2},
        headers={"X-Request-Id": "trace-42"},
        timeout=30,
    )
    assert resp.status_code == 200
    assert resp.headers["x-request-id"] == "trace-42"
    assert resp.json()["id"] == "cmpl-trace-42"  # the worker built its id from ours
    made = httpx.post(
        router.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30
    )
    assert len(made.headers["x-request-id"]) == 32


def test_debug_route_shows_every_worker_and_changes_nothing(stack):
    router, _, model = stack
    client = router.openai()
    client.chat.completions.create(model=model, messages=chat("Warm up."), max_tokens=2)
    before = router.workers()
    decision = router.route({"model": model, "messages": chat("Where would this go?")})
    assert {c["worker"] for c in decision["candidates"]} == set(before)
    assert decision["reason"] == "prefix" and decision["cached_tokens"] >= 160
    assert decision["worker"] in decision["explanation"]
    after = router.workers()
    assert [w["in_flight"] for w in after.values()] == [w["in_flight"] for w in before.values()]
    index = httpx.get(router.url + "/debug/index", timeout=10).json()
    assert index["entries"] >= 10 and set(index["workers"]) == set(before)


def test_health_and_metrics(stack):
    router, _, _ = stack
    health = httpx.get(router.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["workers_up"] == 2
    text = httpx.get(router.url + "/metrics", timeout=10).text
    for name in (
        "kvpool_router_requests_total",
        "kvpool_router_worker_in_flight_requests",
        "kvpool_router_worker_indexed_blocks",
        "kvpool_router_decision_latency_seconds",
        "kvpool_router_kv_event_gaps_total",
    ):
        assert name in text


def test_bad_request_gets_the_openai_error_the_worker_would_give(stack):
    router, _, model = stack
    client = router.openai()
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="x", max_tokens=2, temperature=-3)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    # as vLLM refuses it, word for word
    assert missing.value.body["message"] == (
        f"The model `no-such-model` does not exist. Valid aliases: {model}."
    )
    assert (missing.value.body["type"], missing.value.body["code"]) == ("NotFoundError", 404)
    # A worker's own refusal (a prompt too long for the model) comes back as it is.
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model=model, prompt=[1] * 2000, max_tokens=2)
    assert (long.value.body["type"], long.value.body["param"]) == (
        "BadRequestError",
        "input_tokens",
    )
    assert "your prompt contains 2000 input tokens" in long.value.body["message"]
    # an output limit over the whole context is vLLM's first refusal, before the prompt's
    with pytest.raises(openai.BadRequestError) as output:
        client.completions.create(model=model, prompt=[1] * 2000, max_tokens=10**6)
    assert output.value.body["param"] == "max_tokens"
    assert output.value.body["message"].startswith("max_tokens=1000000 cannot be greater than")
    assert router.metric("kvpool_router_requests_total", outcome="client_error") == 4
    assert httpx.get(router.url + "/health", timeout=10).status_code == 200
