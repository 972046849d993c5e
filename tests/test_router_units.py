"""Small pure pieces of the router's shell: reading a worker's load, watching an SSE stream
pass, and settings checked at start-up."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpool.router.proxy.sse import SSEWatch
from kvpool.router.settings import RouterSettings
from kvpool.router.state.scrape import parse_load

WORKER_METRICS = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 4.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} NaN
"""


def test_worker_load_sums_engines_and_takes_the_fullest_cache() -> None:
    load = parse_load(WORKER_METRICS)
    assert load["vllm:kv_cache_usage_perc"] == 0.75
    assert load["vllm:num_requests_waiting"] == 7.0


def test_a_nan_reading_is_no_reading() -> None:
    assert "vllm:num_requests_running" not in parse_load(WORKER_METRICS)


def event(body: dict) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def test_sse_watch_sees_the_first_token_not_the_role_chunk() -> None:
    watch = SSEWatch()
    role = event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    assert watch.feed(role) == (role, 0) and not watch.started
    token = event({"choices": [{"index": 0, "delta": {"content": "Hi"}}]})
    # An event may arrive in pieces: it passes on, and counts, when it is whole.
    assert watch.feed(token[:10]) == (b"", 0)
    assert watch.feed(token[10:]) == (token, 1) and watch.started
    usage = {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 8}}
    watch.feed(event({"choices": [], "usage": usage}))
    assert watch.usage == usage
    watch.feed(b"data: [DONE]\n\n")
    assert watch.done and not watch.error


@pytest.mark.parametrize(
    "delta",
    [
        {"reasoning_content": "Let me think"},
        {"reasoning": "Let me think"},
        {"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": ""}}]},
    ],
)
def test_reasoning_and_tool_call_deltas_are_a_first_token(delta: dict) -> None:
    watch = SSEWatch()
    _, outputs = watch.feed(event({"choices": [{"index": 0, "delta": delta}]}))
    assert outputs == 1 and watch.started


def test_usage_the_client_did_not_ask_for_is_read_and_not_passed_on() -> None:
    watch = SSEWatch(strip_usage=True)
    usage = {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}
    token = event({"choices": [{"index": 0, "text": "a", "finish_reason": "length"}]})
    out, _ = watch.feed(token + event({"choices": [], "usage": usage}) + b"data: [DONE]\n\n")
    assert out == token + b"data: [DONE]\n\n"
    assert watch.usage == usage and watch.done


def test_responses_api_stream_is_read_by_its_event_types() -> None:
    watch = SSEWatch()

    def named(kind: str, **body: object) -> bytes:
        return f"event: {kind}\n".encode() + event({"type": kind, **body})

    assert watch.feed(named("response.created", response={}))[1] == 0
    assert watch.feed(named("response.output_text.delta", delta="Hi"))[1] == 1
    assert watch.feed(named("response.output_text.done", text="Hi"))[1] == 0
    usage = {"input_tokens": 20, "input_tokens_details": {"cached_tokens": 16}}
    watch.feed(named("response.completed", response={"usage": usage}))
    assert watch.done and watch.usage == usage


def test_an_error_before_the_first_token_is_seen() -> None:
    watch = SSEWatch()
    watch.feed(event({"error": {"message": "engine dead", "type": "server_error"}}))
    assert watch.error and not watch.started


def test_the_same_worker_twice_is_refused_at_start_up(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="the same worker is given twice"):
        RouterSettings(model=str(llama_dir), worker=["http://h:1", "http://h:1/"])


def test_a_scorer_weight_must_be_a_finite_number(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="finite"):
        RouterSettings(model=str(llama_dir), worker=["http://h:1"], scorer=["ttft=nan"])


def test_debug_route_tells_a_completion_that_mentions_messages_from_a_chat(
    start_router, llama_dir: Path
) -> None:
    router = start_router(worker=["http://127.0.0.1:9"])  # nothing listens: a dry run only
    decision = router.route({"prompt": "messages"})  # the word, in a completion's prompt
    assert decision["num_tokens"] > 0 and decision["worker"] is None
    assert router.route({"messages": [{"role": "user", "content": "hi"}]})["num_tokens"] > 0


def test_a_responses_stream_that_completes_without_a_delta_has_answered() -> None:
    watch = SSEWatch()
    completed = {"type": "response.completed", "response": {"id": "resp_1", "usage": {}}}
    watch.feed(b"event: response.completed\n" + event(completed))
    assert watch.started and watch.done and watch.response_id == "resp_1"


def test_an_error_event_with_a_4xx_code_is_the_clients() -> None:
    watch = SSEWatch()
    watch.feed(event({"error": {"message": "bad schema", "type": "BadRequestError", "code": 400}}))
    assert watch.client_error
    other = SSEWatch()
    other.feed(event({"error": {"message": "engine dead", "type": "server_error", "code": 500}}))
    assert other.error and not other.client_error


def test_a_short_chat_is_tokenized_on_the_loop_and_a_long_one_in_a_thread() -> None:
    """A thread hop costs a short chat twice the CPU (bench/chat_tokens.py); a long chat,
    many messages, or tools and documents (long templates) still go to a thread."""
    from kvpool.router.proxy.request import read_fields
    from kvpool.router.routing.tokens import INLINE_CHAT_MESSAGES, INLINE_PROMPT_SIZE, _inline_chat

    def chat(*messages: str, **extra: Any) -> Any:
        body = {"model": "m", "messages": [{"role": "user", "content": m} for m in messages]}
        return read_fields({**body, **extra}, "chat")

    assert _inline_chat(chat("hello", "how are you?"))
    assert not _inline_chat(chat("x" * (INLINE_PROMPT_SIZE + 1)))
    assert not _inline_chat(chat(*["hi"] * (INLINE_CHAT_MESSAGES + 1)))
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    assert not _inline_chat(chat("hello", tools=[tool]))
    parts = [{"type": "text", "text": "y" * INLINE_PROMPT_SIZE}, {"type": "text", "text": "z"}]
    assert not _inline_chat(read_fields({"model": "m", "messages": [
        {"role": "user", "content": parts}]}, "chat"))  # fmt: skip
