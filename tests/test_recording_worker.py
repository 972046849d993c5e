"""The recording worker behaves like a vLLM OpenAI server (shapes, usage, prefix-cache
counters) and fails as told; the vLLM request corpus and the tool chat template it ships
with are well formed."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from recording_worker import RecordingWorker

pytestmark = pytest.mark.timeout(60)

DATA = Path(__file__).parent / "data"
#: 48 words: three blocks of 16
LONG = " ".join(f"word{i}" for i in range(48))


@pytest.fixture
def worker() -> Iterator[RecordingWorker]:
    w = RecordingWorker()
    try:
        yield w
    finally:
        w.stop()


def _chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], **extra}


def _events(body: str) -> list[Any]:
    """The JSON payloads of an SSE body, with ``[DONE]`` as the string."""
    out: list[Any] = []
    for line in body.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _metrics(worker: RecordingWorker) -> dict[str, float]:
    text = httpx.get(worker.url + "/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_models_health_and_no_kvpool_info(worker: RecordingWorker) -> None:
    models = httpx.get(worker.url + "/v1/models").json()
    assert models["data"] == [
        {
            "id": "tiny",
            "object": "model",
            "created": 0,
            "owned_by": "vllm",
            "root": "tiny",
            "parent": None,
        }
    ]
    assert httpx.get(worker.url + "/health").status_code == 200
    worker.health_status = 503
    assert httpx.get(worker.url + "/health").status_code == 503
    assert httpx.get(worker.url + "/kvpool/info").status_code == 404
    assert [r.path for r in worker.requests] == ["/v1/models", "/health", "/health", "/kvpool/info"]
    assert worker.spec("w0") == f"{worker.url},id=w0"


def test_lora_cards_are_served_and_unknown_models_refused() -> None:
    base = {"id": "tiny", "object": "model", "created": 0, "owned_by": "vllm", "root": "tiny"}
    cards = [{**base, "parent": None}, {**base, "id": "sql-lora", "parent": "tiny"}]
    with RecordingWorker(models=cards) as w:
        assert [m["id"] for m in httpx.get(w.url + "/v1/models").json()["data"]] == [
            "tiny",
            "sql-lora",
        ]
        ok = httpx.post(w.url + "/v1/chat/completions", json={**_chat("hi"), "model": "sql-lora"})
        assert ok.status_code == 200 and ok.json()["model"] == "sql-lora"
        bad = httpx.post(w.url + "/v1/chat/completions", json={**_chat("hi"), "model": "nope"})
        assert bad.status_code == 404 and bad.json()["error"]["code"] == 404


def test_request_is_recorded_verbatim(worker: RecordingWorker) -> None:
    raw = b'{"model": "tiny", "prompt": "a b c", "max_tokens": 2, "x_extra": [1]}'
    headers = {"Content-Type": "application/json", "X-Request-Id": "req-1"}
    httpx.post(worker.url + "/v1/completions", content=raw, headers=headers)
    (rec,) = worker.requests_to("/v1/completions")
    assert rec.body == raw and rec.json["x_extra"] == [1]
    assert rec.headers["x-request-id"] == "req-1" and rec.method == "POST"
    assert (rec.prompt_tokens, rec.cached_tokens) == (3, 0)


def test_prefix_cache_reports_whole_blocks_and_counts_every_request(
    worker: RecordingWorker,
) -> None:
    first = httpx.post(worker.url + "/v1/chat/completions", json=_chat(LONG)).json()
    assert first["usage"]["prompt_tokens"] == 48
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    # 40 shared words: two whole blocks of 16
    second = _chat(" ".join(LONG.split()[:40]) + " and then something else", stream=True)
    httpx.post(worker.url + "/v1/chat/completions", json=second)  # no usage in the answer
    (_, rec) = worker.generation_requests()
    assert (rec.prompt_tokens, rec.cached_tokens) == (44, 32)
    # the same prompt again: all but the last token could hit, so two blocks, not three
    again = httpx.post(worker.url + "/v1/chat/completions", json=_chat(LONG)).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    # another cache_salt shares nothing
    salted = httpx.post(worker.url + "/v1/chat/completions", json=_chat(LONG, cache_salt="s"))
    assert salted.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    m = _metrics(worker)
    assert m["vllm:prefix_cache_queries_total"] == 48 + 44 + 48 + 48
    assert m["vllm:prefix_cache_hits_total"] == 32 + 32
    assert worker.hit_ratio == pytest.approx(64 / 188)
    assert {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    } <= m.keys()


def test_usage_chunk_only_when_asked(worker: RecordingWorker) -> None:
    url = worker.url + "/v1/chat/completions"
    plain = _events(httpx.post(url, json=_chat("a b c", stream=True)).text)
    assert plain[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["delta"]["content"] for e in plain[1:5]] == [
        "tok0 ",
        "tok1 ",
        "tok2 ",
        "tok3 ",
    ]
    assert plain[5]["choices"][0]["finish_reason"] == "stop" and plain[-1] == "[DONE]"
    assert all("usage" not in e for e in plain[:-1])

    off = _chat("a b c", stream=True, stream_options={"include_usage": False})
    assert all("usage" not in e for e in _events(httpx.post(url, json=off).text)[:-1])

    on = _chat("a b c", stream=True, stream_options={"include_usage": True}, max_tokens=2)
    events = _events(httpx.post(url, json=on).text)
    assert events[-2]["choices"] == []
    assert events[-2]["usage"] == {
        "prompt_tokens": 3,
        "total_tokens": 5,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in e for e in events[:-2])
    assert _metrics(worker)["vllm:prefix_cache_queries_total"] == 9


def test_continuous_usage_stats_put_usage_on_every_chunk(worker: RecordingWorker) -> None:
    body = _chat(
        "a b", stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}
    )
    events = _events(httpx.post(worker.url + "/v1/chat/completions", json=body).text)[:-1]
    assert all(e["usage"]["prompt_tokens"] == 2 for e in events)
    assert [e["usage"]["completion_tokens"] for e in events] == [0, 1, 2, 3, 4, 4, 4]


def test_openai_client_reads_chat_completions_and_responses(worker: RecordingWorker) -> None:
    client = openai.OpenAI(base_url=worker.url + "/v1", api_key="x", max_retries=0)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello there"}], n=2
    )
    assert [c.message.content for c in chat.choices] == ["tok0 tok1 tok2 tok3 "] * 2
    assert chat.usage.completion_tokens == 8 and chat.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello there"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        "tok0 tok1 tok2 tok3 "
    )
    assert chunks[-1].usage.prompt_tokens == 2
    done = client.responses.create(model="tiny", instructions="be brief", input="hello there")
    assert done.output_text == "tok0 tok1 tok2 tok3 "
    assert (done.usage.input_tokens, done.usage.output_tokens) == (4, 4)
    events = list(client.responses.create(model="tiny", input="hello", stream=True))
    assert [e.type for e in events] == [
        "response.created",
        *["response.output_text.delta"] * 4,
        "response.completed",
    ]
    assert events[-1].response.usage.input_tokens_details.cached_tokens == 0
    completion = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=3)
    assert completion.choices[0].text == "tok0 tok1 tok2 " and completion.usage.prompt_tokens == 3


def test_completions_stream_text_chunks_and_batches(worker: RecordingWorker) -> None:
    body = {
        "model": "tiny",
        "prompt": ["x y", "x z w"],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = _events(httpx.post(worker.url + "/v1/completions", json=body).text)
    texts = [e["choices"][0]["text"] for e in events[:-2] if e["choices"]]
    assert texts.count("tok0 ") == 2 and events[-2]["usage"]["prompt_tokens"] == 5
    echo = {"model": "tiny", "prompt": "say it", "echo": True, "max_tokens": 1}
    answer = httpx.post(worker.url + "/v1/completions", json=echo).json()
    assert answer["choices"][0]["text"] == "say ittok0 "


def test_tokenize_detokenize_and_embeddings(worker: RecordingWorker) -> None:
    ids = httpx.post(worker.url + "/tokenize", json={"model": "tiny", "prompt": "a b c"}).json()
    assert ids["count"] == 3
    text = httpx.post(worker.url + "/detokenize", json={"model": "tiny", "tokens": ids["tokens"]})
    assert text.json()["prompt"] == "a b c"
    emb = httpx.post(worker.url + "/v1/embeddings", json={"model": "tiny", "input": ["a", "b c"]})
    assert [d["index"] for d in emb.json()["data"]] == [0, 1]
    assert worker.prefix_cache_queries == 0  # only generation requests are counted


# -- fault modes ------------------------------------------------------------------------------


def test_die_after_headers_drops_the_connection_after_status_200(worker: RecordingWorker) -> None:
    worker.mode = "die_after_headers"
    with httpx.Client() as client:
        with client.stream(
            "POST", worker.url + "/v1/chat/completions", json=_chat("a", stream=True)
        ) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            with pytest.raises(httpx.RemoteProtocolError):
                r.read()
    assert worker.prefix_cache_queries == 1  # admitted before it died


def test_end_without_token_sends_only_the_role_chunk(worker: RecordingWorker) -> None:
    worker.mode = "end_without_token"
    events = _events(
        httpx.post(worker.url + "/v1/chat/completions", json=_chat("a", stream=True)).text
    )
    assert len(events) == 2 and events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_error_event_comes_before_any_token(worker: RecordingWorker) -> None:
    worker.mode = "error_event"
    r = httpx.post(
        worker.url + "/v1/completions", json={"model": "tiny", "prompt": "a", "stream": True}
    )
    assert r.status_code == 200
    events = _events(r.text)
    assert events[0]["error"]["code"] == 500 and events[1] == "[DONE]" and len(events) == 2
    plain = httpx.post(worker.url + "/v1/completions", json={"model": "tiny", "prompt": "a"})
    assert plain.status_code == 500


def test_status_mode_answers_an_openai_error(worker: RecordingWorker) -> None:
    worker.mode = "status:503"
    r = httpx.post(worker.url + "/v1/chat/completions", json=_chat("a"))
    assert r.status_code == 503 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.headers["retry-after"] == "1"
    assert worker.prefix_cache_queries == 0  # refused, not admitted


def test_stall_sends_nothing_until_the_gate_opens(worker: RecordingWorker) -> None:
    worker.mode = "stall"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(worker.url + "/v1/chat/completions", json=_chat("a"), timeout=0.3)
    worker.gate.set()
    assert httpx.post(worker.url + "/v1/chat/completions", json=_chat("a")).status_code == 200


def test_slow_paces_tokens(worker: RecordingWorker) -> None:
    worker.mode, worker.tokens, worker.token_interval = "slow", 3, 0.1
    start = time.monotonic()
    events = _events(
        httpx.post(worker.url + "/v1/chat/completions", json=_chat("a", stream=True)).text
    )
    assert time.monotonic() - start >= 0.3
    assert sum(1 for e in events[:-1] if e["choices"][0]["delta"].get("content")) == 3


def test_stall_after_first_sends_one_token_then_waits(worker: RecordingWorker) -> None:
    worker.mode = "stall_after_first"
    with httpx.Client(timeout=httpx.Timeout(5.0, read=0.3)) as client:
        with client.stream(
            "POST", worker.url + "/v1/chat/completions", json=_chat("a", stream=True)
        ) as r:
            lines = r.iter_lines()
            seen: list[str] = []
            with pytest.raises(httpx.ReadTimeout):
                for line in lines:
                    seen.append(line)
    contents = [
        json.loads(s[6:])["choices"][0]["delta"].get("content")
        for s in seen
        if s.startswith("data")
    ]
    assert contents == ["", "tok0 "]


def test_delay_headers_holds_the_answer(worker: RecordingWorker) -> None:
    worker.delay_headers = 0.3
    start = time.monotonic()
    assert httpx.post(worker.url + "/v1/chat/completions", json=_chat("a")).status_code == 200
    assert time.monotonic() - start >= 0.3


# -- the corpus and the template --------------------------------------------------------------


def _corpus() -> list[dict[str, Any]]:
    return json.loads((DATA / "vllm_requests.json").read_text())


def test_corpus_covers_the_fields_the_lead_asked_for() -> None:
    corpus = _corpus()
    assert len(corpus) >= 45
    assert len({e["name"] for e in corpus}) == len(corpus)
    assert all(e["body"]["model"] == "MODEL" for e in corpus)
    assert {e["endpoint"] for e in corpus} == {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
    }
    keys = {k for e in corpus for k in e["body"]}
    for field in (
        "tools",
        "tool_choice",
        "response_format",
        "n",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "top_k",
        "min_p",
        "guided_json",
        "structured_outputs",
        "chat_template_kwargs",
        "logprobs",
        "top_logprobs",
        "stream",
        "stream_options",
        "seed",
        "stop",
        "max_completion_tokens",
        "user",
        "cache_salt",
        "add_generation_prompt",
        "continue_final_message",
        "echo",
        "truncate_prompt_tokens",
        "priority",
        "ignore_eos",
        "min_tokens",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "parallel_tool_calls",
        "instructions",
        "input",
    ):
        assert field in keys, field
    choices = [json.dumps(e["body"]["tool_choice"]) for e in corpus if "tool_choice" in e["body"]]
    assert {'"auto"', '"none"', '"required"'} <= set(choices)
    assert any('"function"' in c for c in choices)
    text = json.dumps(corpus)
    for marker in (
        '"tool_call_id"',
        '"tool_calls"',
        '"image_url"',
        "data:image/png;base64,",
        '"input_audio"',
        '"developer"',
        '"name": "alice"',
        '"json_schema"',
        '"json_object"',
        '"continuous_usage_stats"',
    ):
        assert marker in text, marker
    calls = [
        c for e in corpus for m in e["body"].get("messages", []) for c in m.get("tool_calls") or []
    ]
    assert calls and all(isinstance(c["function"]["arguments"], str) for c in calls)
    prompts = [e["body"]["prompt"] for e in corpus if "prompt" in e["body"]]
    assert any(isinstance(p, list) and isinstance(p[0], int) for p in prompts)
    assert any(isinstance(p, list) and isinstance(p[0], str) for p in prompts)
    assert any(e["body"].get("logprobs") == 3 for e in corpus)
    assert any(len(json.dumps(e["body"]).split()) > 80 for e in corpus)  # spans several blocks


def test_worker_accepts_every_corpus_request(worker: RecordingWorker) -> None:
    with httpx.Client() as client:
        for entry in _corpus():
            body = {**entry["body"], "model": "tiny"}
            r = client.post(worker.url + entry["endpoint"], json=body)
            assert r.status_code == 200, entry["name"]
            if body.get("stream"):
                assert r.headers["content-type"].startswith("text/event-stream"), entry["name"]
    assert worker.prefix_cache_hits > 0  # the corpus repeats its system prompt and document


def _as_vllm_renders(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as vLLM hands them to a "string"-content template: text parts joined with a
    newline, null content as "", tool-call arguments parsed from JSON."""
    out = []
    for m in messages:
        m = json.loads(json.dumps(m))
        content = m.get("content")
        if isinstance(content, list):
            m["content"] = "\n".join(p["text"] for p in content if p.get("type") == "text")
        elif content is None:
            m["content"] = ""
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"] or "{}")
        out.append(m)
    return out


def test_tool_template_renders_every_corpus_chat(tmp_path: Path) -> None:
    from kvpool.worker.tiny import write_tokenizer

    tokenizer = write_tokenizer(tmp_path)
    template = (DATA / "tool_chat_template.jinja").read_text()
    rendered = {}
    for entry in _corpus():
        body = entry["body"]
        if entry["endpoint"] != "/v1/chat/completions":
            continue
        text = tokenizer.apply_chat_template(
            _as_vllm_renders(body["messages"]),
            tools=body.get("tools"),
            chat_template=template,
            tokenize=False,
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False),
            **body.get("chat_template_kwargs", {}),
        )
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text, entry["name"]
        rendered[entry["name"]] = text
    assert '"arguments": {"city": "Paris", "unit": "celsius"}' in rendered["chat_tool_call_history"]
    assert '<tool_response id="call_0002">' in rendered["chat_tool_call_history"]
    assert '"name": "get_time"' in rendered["chat_tools_auto"]
    assert rendered["chat_template_kwargs_no_thinking"].endswith("<think>\n\n</think>\n\n")
    assert rendered["chat_template_kwargs_thinking"].endswith("<|assistant|>")
    assert rendered["chat_continue_final_message"].endswith("The router sends every request to")
    assert "alice: Who am I?" in rendered["chat_user_name"]
    assert "<|developer|>Answer in French." in rendered["chat_developer_role"]
