"""Every field of vLLM 0.32's completions and chat completions, on kvpool's own engine:
what it implements changes the answer as vLLM's would; what it cannot do is refused with a
400 in vLLM's error shape naming the field; a field nobody knows is served and logged."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from kvpool.worker.sampler import sample
from kvpool.worker.sequence import SamplingParams

from conftest import RunningWorker

PROMPT = "A router in front of a pool of inference workers reads every prompt"
CHAT = [{"role": "user", "content": "What does the router do?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            "strict": True,
        },
    }
]


@pytest.fixture(scope="module")
def worker(llama_dir: Path, tiny_model: tuple[Any, Any]) -> Iterator[RunningWorker]:
    """One worker for the module: none of these requests changes what the next one gets."""
    from kvpool.worker.engine import LLMEngine
    from kvpool.worker.server import WorkerServer
    from kvpool.worker.serving import uvicorn_server
    from kvpool.worker.settings import WorkerSettings

    settings = WorkerSettings(model=str(llama_dir), port=0, num_blocks=256, device="cpu")
    model, tokenizer = tiny_model
    server = WorkerServer(
        settings, lambda sink: LLMEngine(model, tokenizer, settings.engine_config(), sink)
    )
    running = RunningWorker(server, uvicorn_server(server, own_signals=False))
    yield running
    running.stop()


def post(worker: RunningWorker, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(worker.url + path, json=body, timeout=60)


def complete(worker: RunningWorker, **fields: Any) -> dict[str, Any]:
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **fields}
    r = post(worker, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def chat(worker: RunningWorker, **fields: Any) -> dict[str, Any]:
    body = {"messages": CHAT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **fields}
    r = post(worker, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def stream(worker: RunningWorker, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", worker.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def token_ids(worker: RunningWorker, **fields: Any) -> list[int]:
    return complete(worker, return_token_ids=True, **fields)["choices"][0]["token_ids"]


# -- what any client may send --------------------------------------------------------------


def test_an_sdk_body_with_unknown_and_vendor_fields_is_served_and_they_are_logged(
    worker: RunningWorker, caplog: pytest.LogCaptureFixture
) -> None:
    unknown = f"frobnicate_{uuid.uuid4().hex[:6]}"
    with caplog.at_level(logging.WARNING, logger="kvpool.openai_api"):
        r = worker.openai().chat.completions.create(
            model=worker.worker.model_name,
            messages=CHAT,
            max_tokens=4,
            # OpenAI's own fields that vLLM does not know, and those it knows and ignores
            store=True,
            metadata={"team": "search"},
            service_tier="auto",
            user="user-1",
            parallel_tool_calls=False,
            extra_body={
                unknown: {"any": ["thing"]},
                "best_of": 3,  # gone from vLLM 0.32: ignored there too
                "return_hidden_states": False,  # SGLang's router adds these
                "separate_reasoning": True,
                "priority": 0,
                "session_id": "conversation-7",
                "vllm_xargs": {"tag": "a"},
            },
        )
    assert r.choices[0].message.content and r.usage.completion_tokens == 4
    ignored = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert len(ignored) == 1, ignored
    for name in (unknown, "store", "metadata", "service_tier", "best_of"):
        assert name in ignored[0]


def test_vllms_removed_guided_fields_are_served_unconstrained_with_a_warning(
    worker: RunningWorker, caplog: pytest.LogCaptureFixture
) -> None:
    # vLLM 0.32 dropped guided_*: it ignores them (200) and warns that the output is not
    # constrained; so does kvpool, which refuses structured_outputs itself
    fresh = {f"tag_{uuid.uuid4().hex[:6]}": 1}  # a set of names not warned about yet
    with caplog.at_level(logging.WARNING, logger="kvpool.openai_api"):
        complete(worker, guided_json={"type": "object"}, guided_decoding_backend="x", **fresh)
    assert any("NOT be constrained" in rec.getMessage() for rec in caplog.records)


def test_sglangs_no_stop_trim_keeps_the_stop_string(worker: RunningWorker) -> None:
    text = complete(worker)["choices"][0]["text"]
    stop = text[5:9]
    trimmed = complete(worker, stop=[stop])["choices"][0]["text"]
    kept = complete(worker, stop=[stop], no_stop_trim=True)["choices"][0]["text"]
    assert kept == trimmed + stop


def test_a_known_field_is_type_checked_as_vllm_does_and_an_unknown_one_is_not(
    worker: RunningWorker,
) -> None:
    for body in (
        {"prompt": PROMPT, "logit_bias": "strongly"},
        {"prompt": PROMPT, "n": "two"},
        {"prompt": PROMPT, "response_format": {"type": "yaml"}},
        {"prompt": PROMPT, "bad_words": "word"},
    ):
        r = post(worker, "/v1/completions", body)
        assert r.status_code == 400, (body, r.text)
        field = next(k for k in body if k != "prompt")
        assert r.json()["error"]["param"].split(".")[0] == field, r.json()
    r = post(worker, "/v1/chat/completions", {"messages": CHAT, "tools": "all of them"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    # leniently, as pydantic's default reads them in vLLM too: "3" is 3
    answer = complete(worker, max_tokens="3", ignore_eos="true", n="1")
    assert answer["usage"]["completion_tokens"] == 3
    # a field nobody knows is not checked at all, whatever it holds
    complete(worker, frobnicate="two", widgets=[{"a": None}])


# -- implemented: each changes the answer as it should -------------------------------------


def test_n_runs_n_sequences_per_prompt(worker: RunningWorker) -> None:
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 7, "n": 3}
    three = complete(worker, **body)
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in three["choices"]]
    assert len(set(texts)) == 3  # each choice its own seed (7, 8, 9, as vLLM seeds them)
    assert complete(worker, **{**body, "n": 1})["choices"][0]["text"] == texts[0]
    assert [c["text"] for c in complete(worker, **body)["choices"]] == texts  # seeded
    one = complete(worker, **{**body, "n": 1})
    assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]  # counted once
    assert three["usage"]["completion_tokens"] == 30

    two_prompts = complete(worker, **{**body, "prompt": [PROMPT, "Each worker"], "n": 2})
    assert [c["index"] for c in two_prompts["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in two_prompts["choices"][:2]] == texts[:2]  # prompt 0's

    chunks = stream(worker, "/v1/chat/completions", {"messages": CHAT, "n": 2, "max_tokens": 3})
    assert {c["index"] for chunk in chunks for c in chunk["choices"]} == {0, 1}


def test_logit_bias_forbids_or_forces_a_token(worker: RunningWorker) -> None:
    first = token_ids(worker)[0]
    assert token_ids(worker, logit_bias={str(first): -100})[0] != first
    forced = 123
    assert set(token_ids(worker, logit_bias={str(forced): 100})) == {forced}
    assert token_ids(worker, logit_bias={}) == token_ids(worker)  # empty is off


@pytest.mark.parametrize(
    "penalty",
    [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 2.0}],
    ids=lambda p: next(iter(p)),
)
def test_penalties_stop_the_repetition_of_a_greedy_answer(
    worker: RunningWorker, penalty: dict[str, float]
) -> None:
    plain = token_ids(worker, max_tokens=24)
    assert len(set(plain)) < len(plain)  # the test model repeats itself
    penalized = token_ids(worker, max_tokens=24, **penalty)
    assert len(set(penalized)) == len(penalized)
    assert penalized[0] == plain[0]  # nothing to penalize before the first token


def test_penalties_and_bias_reshape_logits_as_vllm_does() -> None:
    """The sampler's arithmetic on made-up logits: repetition over prompt and output
    (divide a positive logit, multiply a negative one), frequency by count and presence
    once over the output only, after the bias."""

    class Seq:
        token_ids = [1, 2, 2, 2]  # prompt [1], output [2, 2, 2]
        num_prompt_tokens = 1

    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5]])
    params = SamplingParams(
        temperature=0,
        logprobs=4,
        logit_bias={3: 1.0},
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    expected = torch.tensor([1.0, 2.0 / 2, -1.0 * 2 - 0.5 * 3 - 0.25, 1.5])
    out = sample(logits, [params], [None], history=[Seq()])
    assert out.token_ids == [3]  # 1.5 beats 1.0: the bias and the penalties applied
    assert expected.argmax().item() == 3
    # reported log-probabilities stay the model's own (vLLM's raw_logprobs)
    assert out.logprobs[0] is not None
    raw = torch.log_softmax(logits[0], -1)
    assert out.logprobs[0][0] == pytest.approx(raw[3].item())


def test_allowed_tokens_bad_words_and_min_p(worker: RunningWorker) -> None:
    allowed = [40, 41, 42]
    assert set(token_ids(worker, allowed_token_ids=allowed, temperature=1.0, seed=1)) <= set(
        allowed
    )
    tokenizer = worker.engine.tokenizer
    plain = token_ids(worker)
    # a token of the answer that is a word of its own (its text encodes to it alone)
    word = next(
        t for t in plain if tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t]
    )
    banned = token_ids(worker, bad_words=[tokenizer.decode([word])])
    assert word not in banned and banned != plain
    # min_p 1 keeps only the likeliest token: sampling at any temperature is greedy
    assert token_ids(worker, temperature=1.5, min_p=1.0, seed=3) == token_ids(worker)


def test_echo_puts_the_prompt_first(worker: RunningWorker) -> None:
    plain = complete(worker)["choices"][0]["text"]
    echoed = complete(worker, echo=True)
    assert echoed["choices"][0]["text"] == PROMPT + plain
    assert echoed["usage"]["completion_tokens"] == 12
    only = complete(worker, echo=True, max_tokens=0)
    assert only["choices"][0]["text"] == PROMPT  # the prompt alone, as vLLM answers
    chunks = stream(worker, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12,
                                                 "temperature": 0, "ignore_eos": True,
                                                 "echo": True})  # fmt: skip
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == PROMPT + plain

    started = [*CHAT, {"role": "assistant", "content": "It routes"}]
    continued = chat(
        worker,
        messages=started,
        echo=True,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert continued["choices"][0]["message"]["content"].startswith("It routes")


def test_tools_are_served_with_tool_choice_none(worker: RunningWorker) -> None:
    plain = chat(worker)["choices"][0]["message"]["content"]
    for fields in ({"tool_choice": "none"}, {"tool_choice": None}):
        answer = chat(worker, tools=TOOLS, parallel_tool_calls=True, **fields)
        message = answer["choices"][0]["message"]
        assert message["content"] == plain  # this model's template does not list tools
        assert "tool_calls" not in message
    # a conversation that called a tool earlier (the OpenAI SDK's shape) is served too
    history = [
        *CHAT,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"},
    ]
    chat(worker, messages=history, tools=TOOLS, tool_choice="none")


def test_returned_ids_prompt_text_and_tokens_as_ids(worker: RunningWorker) -> None:
    prompt_ids = worker.engine.tokenizer.encode(PROMPT)
    answer = complete(worker, return_token_ids=True, logprobs=1, return_tokens_as_token_ids=True)
    choice = answer["choices"][0]
    assert choice["prompt_token_ids"] == prompt_ids
    assert len(choice["token_ids"]) == 12
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]

    answer = chat(worker, return_token_ids=True, return_prompt_text=True)
    assert answer["prompt_text"].endswith("<|assistant|>")
    assert len(answer["prompt_token_ids"]) == answer["usage"]["prompt_tokens"]


def test_request_id_truncation_and_special_tokens(worker: RunningWorker) -> None:
    assert complete(worker, request_id="mine-1")["id"] == "cmpl-mine-1"
    full = complete(worker)["usage"]["prompt_tokens"]
    assert complete(worker, truncate_prompt_tokens=5)["usage"]["prompt_tokens"] == 5
    left = complete(worker, truncate_prompt_tokens=5, truncation_side="left")
    right = complete(worker, truncate_prompt_tokens=5, truncation_side="right")
    assert left["choices"][0]["text"] != right["choices"][0]["text"]
    tokenizer = worker.engine.tokenizer
    for special in (True, False):
        counted = complete(worker, add_special_tokens=special)["usage"]["prompt_tokens"]
        assert counted == len(tokenizer.encode(PROMPT, add_special_tokens=special))
    assert full == len(tokenizer.encode(PROMPT))


def test_continuous_usage_stats_put_usage_in_every_chunk(worker: RunningWorker) -> None:
    body = {
        "prompt": PROMPT,
        "max_tokens": 5,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = stream(worker, "/v1/completions", body)
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


# -- refused: what needs vLLM ------------------------------------------------------------

REFUSED = {
    # name: (path, fields, param, words the message must contain)
    "json-object": ("chat", {"response_format": {"type": "json_object"}}, "response_format", ()),
    "json-schema": (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
        "response_format",
        ("json_schema",),
    ),
    "structured-outputs": (
        "completion",
        {"structured_outputs": {"choice": ["yes", "no"]}},
        "structured_outputs",
        (),
    ),
    "tools-auto": ("chat", {"tools": TOOLS}, "tool_choice", ("auto", "tool-call-parser")),
    "tool-choice-required": (
        "chat",
        {"tools": TOOLS, "tool_choice": "required"},
        "tool_choice",
        ("required",),
    ),
    "named-tool": (
        "chat",
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        "tool_choice",
        ("get_weather",),
    ),
    "beam-search": ("completion", {"use_beam_search": True}, "use_beam_search", ()),
    "prompt-logprobs": ("completion", {"prompt_logprobs": 1}, "prompt_logprobs", ()),
    "echo-with-logprobs": ("completion", {"echo": True, "logprobs": 1}, "echo", ("logprobs",)),
    "logprob-token-ids": (
        "chat",
        {"logprobs": True, "logprob_token_ids": [5]},
        "logprob_token_ids",
        (),
    ),
    "prompt-embeds": ("completion", {"prompt_embeds": "AAAA"}, "prompt_embeds", ()),
    "repetition-detection": (
        "completion",
        {"repetition_detection": {"min_ngram": 2}},
        "repetition_detection",
        (),
    ),
    "thinking-budget": ("chat", {"thinking_token_budget": 64}, "thinking_token_budget", ()),
    "image": (
        "chat",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}],
                }
            ]
        },
        "messages.0.content.0",
        ("image_url",),
    ),
}

#: refused as vLLM refuses them, in its words
VLLMS_OWN = {
    "suffix": ("completion", {"suffix": "end"}, "suffix", ("FIM",)),
    "n-greedy": ("completion", {"n": 2, "temperature": 0}, "n", ("greedy",)),
    "n-zero": ("completion", {"n": 0}, "n", ("at least 1",)),
    "negative-max-tokens": (
        "completion",
        {"max_tokens": -1},
        "max_tokens",
        ("max_tokens must be at least 1, got -1. (parameter=max_tokens, value=-1)",),
    ),
    "tool-choice-without-tools": ("chat", {"tool_choice": "auto"}, "tool_choice", ("tools",)),
    "empty-tools": ("chat", {"tools": []}, "tools", ("empty",)),
    "chat-template": ("chat", {"chat_template": "{{ 1 }}"}, "chat_template", ("untrusted",)),
    "stream-options-without-stream": (
        "completion",
        {"stream_options": {"include_usage": True}},
        "stream_options",
        ("stream",),
    ),
    "logit-bias-key": ("completion", {"logit_bias": {"abc": 1}}, "logit_bias", ("abc",)),
}


def _send(worker: RunningWorker, kind: str, fields: dict[str, Any]) -> httpx.Response:
    if kind == "chat":
        return post(worker, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, **fields})
    return post(worker, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **fields})


def _vllm_shaped(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    body = r.json()
    assert body == {
        "error": {"message": body["error"]["message"], "type": "BadRequestError",
                  "param": param, "code": 400}
    }, body  # fmt: skip
    return body["error"]["message"]


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_only_vllm_does_is_refused_naming_the_field(worker: RunningWorker, case: str) -> None:
    kind, fields, param, words = REFUSED[case]
    message = _vllm_shaped(_send(worker, kind, fields), param)
    assert "kvpool's engine" in message and "vLLM" in message, message
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("case", list(VLLMS_OWN))
def test_what_vllm_refuses_is_refused_in_its_words(worker: RunningWorker, case: str) -> None:
    kind, fields, param, words = VLLMS_OWN[case]
    message = _vllm_shaped(_send(worker, kind, fields), param)
    for word in words:
        assert word in message, message


@pytest.mark.parametrize(
    ("kind", "fields"),
    [
        ("chat", {"response_format": {"type": "text"}}),
        ("completion", {"structured_outputs": {}}),
        ("completion", {"structured_outputs": {"json": None, "disable_fallback": True}}),
        ("completion", {"n": 1, "logit_bias": {}, "use_beam_search": False}),
        ("chat", {"tools": TOOLS, "tool_choice": "none"}),
        ("chat", {"thinking_token_budget": -1, "prompt_logprobs": None}),
        ("completion", {"logprob_token_ids": [], "priority": 0, "watermarking": True}),
        ("chat", {"reasoning_effort": "low", "include_reasoning": False, "documents": []}),
        ("completion", {"stream_options": {}}),
    ],
    ids=lambda v: "+".join(v) if isinstance(v, dict) else v,
)
def test_a_value_that_turns_a_feature_off_is_served(
    worker: RunningWorker, kind: str, fields: dict[str, Any]
) -> None:
    r = _send(worker, kind, fields)
    assert r.status_code == 200, r.text
