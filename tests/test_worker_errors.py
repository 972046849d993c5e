"""What the worker answers to bad requests: OpenAI's error body with the status a client
expects and a message naming the problem, and the server keeps serving afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import EllipsisType
from typing import Any

import httpx
import pytest

from conftest import RunningWorker

MAX_MODEL_LEN = 64
BODY_LIMIT = 2048
VOCAB = 512  # the test tokenizer's size; checked against the engine below
OUT_OF_VOCAB = 99_999
CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def worker(llama_dir: Path, tiny_model: tuple[Any, Any]) -> Iterator[RunningWorker]:
    """One worker for the whole table, so every bad request lands on the same server and
    the good request after each shows that none of them broke it. A short context and a
    small body limit make those two refusals cheap to provoke."""
    from kvpool.worker.engine import LLMEngine
    from kvpool.worker.server import WorkerServer
    from kvpool.worker.serving import uvicorn_server
    from kvpool.worker.settings import WorkerSettings

    settings = WorkerSettings(
        model=str(llama_dir),
        port=0,
        num_blocks=128,
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        max_request_body_bytes=BODY_LIMIT,
    )
    model, tokenizer = tiny_model
    server = WorkerServer(
        settings, lambda sink: LLMEngine(model, tokenizer, settings.engine_config(), sink)
    )
    running = RunningWorker(server, uvicorn_server(server, own_signals=False))
    assert running.engine.vocab_size == VOCAB
    yield running
    running.stop()


def assert_error_body(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if code is not None:
        assert error["code"] == code, error
    return error


def assert_still_serving(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


@dataclass
class Bad:
    """A bad request and what it must get: the status, the error ``code`` and ``param``
    (``...``: not checked) and words the message must contain."""

    path: str
    body: dict[str, Any] | bytes | list[bytes] | None
    status: int = 400
    code: str | int | EllipsisType | None = ...
    param: str | EllipsisType | None = ...
    names: tuple[str, ...] = ()
    method: str = "POST"

    def send(self, client: httpx.Client) -> httpx.Response:
        if isinstance(self.body, dict):
            return client.request(self.method, self.path, json=self.body)
        if isinstance(self.body, list):  # chunked: no Content-Length to refuse it by
            return client.request(self.method, self.path, content=iter(self.body))
        return client.request(self.method, self.path, content=self.body)


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hello", **fields}


BAD = [
    # -- the model ------------------------------------------------------------------------
    pytest.param(
        Bad(
            "/v1/completions",
            completion(model="no-such-model"),
            404,
            404,  # vLLM's shape: the status as the code, NotFoundError as the type
            "model",
            ("The model `no-such-model` does not exist. Valid aliases: ",),
        ),
        id="unknown-model",
    ),
    pytest.param(
        Bad(
            "/v1/chat/completions",
            {"model": "no-such-model", "messages": CHAT},
            404,
            404,  # vLLM's shape: the status as the code, NotFoundError as the type
            "model",
            ("The model `no-such-model` does not exist. Valid aliases: ",),
        ),
        id="chat-unknown-model",
    ),
    # -- sampling parameters out of range ------------------------------------------------
    pytest.param(
        Bad(
            "/v1/completions",
            completion(temperature=-1),
            param="temperature",
            names=("temperature",),
        ),
        id="negative-temperature",
    ),
    pytest.param(
        Bad("/v1/completions", completion(max_tokens=0), param="max_tokens", names=("max_tokens",)),
        id="zero-max-tokens",
    ),
    pytest.param(
        Bad(
            "/v1/chat/completions",
            {"messages": CHAT, "max_tokens": 0},
            param="max_tokens",
            names=("max_tokens",),
        ),
        id="chat-zero-max-tokens",
    ),
    pytest.param(
        Bad(
            "/v1/chat/completions",
            {"messages": CHAT, "max_completion_tokens": 0},
            param="max_completion_tokens",
            names=("max_completion_tokens",),
        ),
        id="chat-zero-max-completion-tokens",
    ),
    pytest.param(
        Bad("/v1/completions", completion(top_p=2), param="top_p", names=("top_p",)),
        id="top-p-above-one",
    ),
    pytest.param(
        Bad("/v1/completions", completion(top_k=-5), param="top_k", names=("top_k",)),
        id="negative-top-k",
    ),
    pytest.param(
        Bad("/v1/completions", completion(logprobs=50), param="logprobs", names=("logprobs", "50")),
        id="too-many-logprobs",
    ),
    pytest.param(
        Bad(
            "/v1/completions",
            completion(min_tokens=10, max_tokens=5),
            param=None,  # as vLLM 0.32 names it: no param
            names=("min_tokens must be less than or equal to max_tokens=5, got 10.",),
        ),
        id="min-tokens-above-max-tokens",
    ),
    pytest.param(
        Bad("/v1/completions", completion(stop=[""]), param="stop", names=("stop", "empty")),
        id="stop-list-with-empty-string",
    ),
    pytest.param(
        Bad("/v1/completions", completion(stop=""), param="stop", names=("stop", "empty")),
        id="stop-empty-string",
    ),
    pytest.param(
        Bad(
            "/v1/completions",
            completion(stop_token_ids=[OUT_OF_VOCAB]),
            param="stop_token_ids",
            names=(str(OUT_OF_VOCAB), "vocabulary"),
        ),
        id="stop-token-id-outside-vocabulary",
    ),
    pytest.param(
        Bad(
            "/v1/completions",
            {"prompt": [5, OUT_OF_VOCAB]},
            param="prompt",
            names=("prompt", str(OUT_OF_VOCAB), "vocabulary"),
        ),
        id="prompt-token-id-outside-vocabulary",
    ),
    # -- the context ---------------------------------------------------------------------
    # vLLM 0.32's words for each (router and worker give the same ones)
    pytest.param(
        Bad(
            "/v1/completions",
            {"prompt": list(range(5, 105))},
            code=400,
            param="input_tokens",
            names=(
                f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your "
                "prompt contains 100 input tokens, which exceeds this limit even without any "
                "output tokens. Please reduce the length of the input prompt. "
                "(parameter=input_tokens, value=100)",
            ),
        ),
        id="prompt-longer-than-context",
    ),
    pytest.param(
        Bad(
            "/v1/completions",
            {"prompt": "word " * 200},
            code=400,
            param="input_tokens",
            # vLLM tokenizes a text to one token past the context
            names=(f"contains at least {MAX_MODEL_LEN + 1} input tokens",),
        ),
        id="text-longer-than-context",
    ),
    pytest.param(
        Bad(
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "word " * 200}]},
            code=400,
            param="input_tokens",
            names=(f"contains at least {MAX_MODEL_LEN + 1} input tokens",),
        ),
        id="chat-longer-than-context",
    ),
    pytest.param(
        Bad(
            "/v1/completions",
            {"prompt": "w" * 1500},  # the body limit here is 2 KiB
            code=400,
            param="input_text",
            names=("contains 1500 characters (more than", "(parameter=input_text, value=1500)"),
        ),
        id="text-longer-in-characters-than-the-context-could-hold",
    ),
    pytest.param(
        Bad(
            "/v1/completions",
            {"prompt": list(range(5, 5 + MAX_MODEL_LEN)), "max_tokens": 4},
            param="max_tokens",
            names=("max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",),
        ),
        id="prompt-filling-the-context",
    ),
    pytest.param(
        Bad(
            "/v1/completions",
            {"prompt": list(range(5, 15)), "max_tokens": MAX_MODEL_LEN + 1},
            param="max_tokens",
            names=(
                f"max_tokens={MAX_MODEL_LEN + 1} cannot be greater than "
                f"max_model_len={MAX_MODEL_LEN}. Please request fewer output tokens.",
            ),
        ),
        id="max-tokens-beyond-the-context",
    ),
    pytest.param(
        Bad(
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5,
                "max_completion_tokens": MAX_MODEL_LEN + 1,
            },
            param="max_completion_tokens",
            names=(f"max_completion_tokens={MAX_MODEL_LEN + 1} cannot be greater",),
        ),
        id="max-completion-tokens-beyond-the-context",
    ),
    # -- the body ------------------------------------------------------------------------
    pytest.param(
        Bad(
            "/v1/completions",
            completion(prompt="x" * (2 * BODY_LIMIT)),
            413,
            "request_too_large",
            names=(str(BODY_LIMIT),),
        ),
        id="body-over-limit",
    ),
    pytest.param(
        Bad(
            "/v1/completions",
            [b'{"prompt": "', b"x" * BODY_LIMIT, b"x" * BODY_LIMIT, b'"}'],
            413,
            "request_too_large",
            names=(str(BODY_LIMIT),),
        ),
        id="chunked-body-over-limit",
    ),
    pytest.param(
        Bad("/v1/completions", b'{"prompt": "hi",', code="invalid_json", names=("JSON",)),
        id="malformed-json",
    ),
    pytest.param(
        Bad("/v1/completions", b"", code="invalid_json", names=("JSON",)),
        id="empty-body",
    ),
    pytest.param(
        Bad("/v1/completions", {"max_tokens": 3}, param="prompt", names=("prompt",)),
        id="missing-prompt",
    ),
    # -- wrong types ---------------------------------------------------------------------
    pytest.param(
        Bad("/v1/completions", {"prompt": 123}, param="prompt", names=("prompt",)),
        id="prompt-as-number",
    ),
    pytest.param(
        Bad(
            "/v1/completions",
            completion(max_tokens="ten"),
            param="max_tokens",
            names=("max_tokens",),
        ),
        id="max-tokens-as-string",
    ),
    pytest.param(
        Bad("/v1/chat/completions", {"messages": "hi"}, param="messages", names=("messages",)),
        id="messages-as-string",
    ),
    pytest.param(
        Bad(
            "/v1/completions",
            completion(temperature="hot"),
            param="temperature",
            names=("temperature",),
        ),
        id="temperature-as-string",
    ),
    # (an unknown field is served and ignored, as vLLM does: test_worker_openai_fields.py)
    # -- empty and malformed prompts -----------------------------------------------------
    pytest.param(
        Bad("/v1/completions", {"prompt": []}, param="prompt", names=("prompt", "empty")),
        id="empty-prompt-list",
    ),
    pytest.param(
        Bad("/v1/completions", {"prompt": ""}, param="prompt", names=("prompt", "empty")),
        id="empty-prompt-string",
    ),
    pytest.param(
        Bad("/v1/chat/completions", {"messages": []}, param="messages", names=("messages",)),
        id="empty-messages",
    ),
    pytest.param(
        Bad(
            "/v1/chat/completions",
            {"messages": [{"role": "wizard", "content": "hi"}]},
            param="messages.0.role",
            names=("messages.0.role",),
        ),
        id="chat-bad-role",
    ),
    # -- other endpoints -----------------------------------------------------------------
    pytest.param(
        Bad(
            "/detokenize",
            {"tokens": [1, OUT_OF_VOCAB]},
            param="tokens",
            names=(str(OUT_OF_VOCAB), "vocabulary"),
        ),
        id="detokenize-token-outside-vocabulary",
    ),
    pytest.param(
        Bad("/v1/no-such-endpoint", None, 404, None, None, ("/v1/no-such-endpoint",), "GET"),
        id="unknown-path",
    ),
    pytest.param(
        Bad("/v1/completions", None, 405, names=("GET", "/v1/completions"), method="GET"),
        id="wrong-method",
    ),
]


@pytest.mark.parametrize("bad", BAD)
def test_bad_request_gets_openai_error_and_server_keeps_serving(
    worker: RunningWorker, bad: Bad
) -> None:
    with httpx.Client(base_url=worker.url, timeout=30) as client:
        r = bad.send(client)
    error = assert_error_body(r, bad.status)
    if bad.code is not ...:
        assert error["code"] == bad.code, error
    if bad.param is not ...:
        assert error["param"] == bad.param, error
    for word in bad.names:
        assert word in error["message"], error
    assert_still_serving(worker.url)


def test_max_tokens_beyond_the_room_left_is_cut_to_it_as_vllm_does(
    worker: RunningWorker,
) -> None:
    """vLLM 0.32 does not refuse a request whose prompt and max_tokens together exceed the
    context: it generates what the context leaves room for, and says it stopped at the
    length."""
    prompt = list(range(5, 5 + MAX_MODEL_LEN - 3))
    body = {"prompt": prompt, "max_tokens": 40, "ignore_eos": True}
    r = httpx.post(worker.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["usage"]["completion_tokens"] == 3
    assert answer["choices"][0]["finish_reason"] == "length"


def test_overloaded_worker_answers_429_with_retry_after(start_worker: Any) -> None:
    # A simulated step of ~1 s holds the first prompt in the queue long enough for a
    # second one to find the waiting-token budget (40) spent.
    w = start_worker(engine="sim", sim_time_scale=50, max_waiting_tokens=40)
    client = w.openai()
    first: list[Any] = []

    def occupy() -> None:
        try:
            stream = client.completions.create(
                model=None, prompt=list(range(10, 40)), max_tokens=2, stream=True
            )
            first.extend(stream)
        except Exception as exc:
            first.append(exc)

    thread = threading.Thread(target=occupy, daemon=True)
    thread.start()
    w.wait_for(lambda: w.worker.queued_tokens >= 30)

    second = {"prompt": list(range(50, 80)), "max_tokens": 1}
    r = httpx.post(w.url + "/v1/completions", json=second, timeout=30)
    error = assert_error_body(r, 429, "overloaded")
    assert error["type"] == "rate_limit_error"
    assert "40" in error["message"]
    retry_after = r.headers["retry-after"]
    assert retry_after.isdigit() and int(retry_after) >= 1

    w.wait_for(lambda: w.worker.queued_tokens == 0)
    r = httpx.post(w.url + "/v1/completions", json=second, timeout=30)
    assert r.status_code == 200, r.text
    thread.join(30)
    assert not thread.is_alive()
    assert first and not isinstance(first[-1], Exception), first[-1:]
    assert first[-1].choices[0].finish_reason == "length"


def test_sim_worker_answers_requests_without_a_seed(start_worker: Any) -> None:
    # Unseeded, the simulated engine draws a 64-bit seed from the prompt; about half of
    # all prompts give one at or above 2**63, which once overflowed into a 500.
    w = start_worker(engine="sim", sim_time_scale=0)
    with httpx.Client(base_url=w.url, timeout=30) as client:
        for start in range(0, 80, 10):
            body = {"prompt": list(range(start + 1, start + 31)), "max_tokens": 2}
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, (body, r.text)


def test_the_sglang_router_can_front_kvpool_workers(start_worker: Any, tmp_path: Any) -> None:
    # SGLang's router adds its own fields to every body it forwards (no_stop_trim,
    # return_hidden_states, the reasoning switches, ...): the worker takes them, so a
    # pool can sit behind that router as it is.
    import subprocess
    import sys
    import time

    from kvpool.stack import free_port, stop_process

    w = start_worker(engine="sim", sim_time_scale=0)
    port, metrics_port = free_port(), free_port()
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--policy", "cache_aware", "--log-level", "warn"]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    log = (tmp_path / "sglang-router.log").open("wb")
    proc = subprocess.Popen([*argv, "--worker-urls", w.url], stdout=log, stderr=log)
    try:
        model = httpx.get(w.url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "hello there", "max_tokens": 3}
        deadline, r = time.monotonic() + 60, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=10)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        assert r is not None and r.status_code == 200, (
            r.text if r is not None else (tmp_path / "sglang-router.log").read_text()[-2000:]
        )
        answer = r.json()
        assert answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] == 3
    finally:
        stop_process(proc)
        log.close()


def test_drained_worker_refuses_health_and_requests_with_503(start_worker: Any) -> None:
    w = start_worker(drain_timeout_s=1)
    assert_still_serving(w.url)
    r = httpx.post(w.url + "/drain", timeout=10)
    assert r.status_code == 200
    assert r.json() == {"drained": True, "in_flight": 0}

    health = httpx.get(w.url + "/health", timeout=10)
    assert_error_body(health, 503, "draining")
    r = httpx.post(w.url + "/v1/completions", json=completion(max_tokens=2), timeout=10)
    error = assert_error_body(r, 503, "draining")
    assert "draining" in error["message"]
    r = httpx.post(w.url + "/v1/chat/completions", json={"messages": CHAT}, timeout=10)
    assert_error_body(r, 503, "draining")


KVPOOL = Path(sys.executable).parent / "kvpool"


@pytest.mark.parametrize(
    ("args", "named"),
    [
        pytest.param(
            ["--model", "/nonexistent"], "model: /nonexistent", id="model-not-a-directory"
        ),
        pytest.param(["--max-num-seqs", "0"], "max_num_seqs:", id="max-num-seqs-zero"),
    ],
)
def test_serve_with_bad_setting_exits_2_naming_it(
    llama_dir: Path, args: list[str], named: str
) -> None:
    argv = [str(KVPOOL), "worker", "serve", "--model", str(llama_dir), "--port", "0", *args]
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert named in lines[0] and "bad settings" in lines[0], lines[0]
    assert done.stdout == ""


def test_drain_command_drains_the_local_worker_as_a_prestop_hook_would(
    start_worker: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvpool.stack import free_port
    from kvpool.worker.cli import main as worker_main

    w = start_worker(drain_timeout_s=1)
    port = httpx.URL(w.url).port
    assert worker_main(["drain", "--port", str(port)]) == 0
    assert '"drained": true' in capsys.readouterr().out
    assert_error_body(httpx.get(w.url + "/health", timeout=10), 503, "draining")

    assert worker_main(["drain", "--port", str(free_port())]) == 1  # nothing listens there
    assert "kvpool worker drain: http://127.0.0.1:" in capsys.readouterr().err
