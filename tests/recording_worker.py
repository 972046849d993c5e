"""A stand-in for a vLLM OpenAI server that records every request it gets.

:class:`RecordingWorker` is a real HTTP server on 127.0.0.1 (Starlette and uvicorn in a
daemon thread, port 0). It answers like ``vllm serve`` does and has no ``/kvpool/info``
(404 there, as vLLM), so a router treats it as a vLLM worker. Tests read back exactly what
the router sent (:attr:`RecordingWorker.requests`: path, lower-cased headers, raw body,
parsed JSON) and make it misbehave (:attr:`RecordingWorker.mode`).

Prompt tokens are counted as whitespace-separated words (token ids for a completion prompt
given as ids), so tests can predict them without a tokenizer; :attr:`count_prompt_tokens`
replaces the count. A prefix cache of its own gives ``cached_tokens``: the longest common
word prefix with any earlier prompt of the same model and ``cache_salt``, capped at the
prompt's length less one (vLLM always computes the last prompt token) and rounded down to
whole blocks of :attr:`block_size`. Both go into ``usage`` and into the counters
``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` for every generation
request the worker admits, streamed or not, with or without usage in the answer.

With :meth:`RecordingWorker.publish_kv_events`, a completion prompt is tokenized and cached
as vLLM does it instead: blocks keyed by a hash chain (with the hash seed given, which may
be another than the router's), ``cached_tokens`` the leading blocks already held, and each
new block published as a ``BlockStored`` KV event.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODES = (
    "ok",
    "die_after_headers",
    "end_without_token",
    "error_event",
    "stall",
    "slow",
    "stall_after_first",
)  # and "status:NNN"

_ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
_GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


@dataclass
class Recorded:
    """One request as the worker received it. ``prompt_tokens`` and ``cached_tokens`` are
    set for generation requests the worker admitted (what it reported, or would have)."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    json: Any
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


class _Dropped(Exception):
    """Raised inside a streamed body: uvicorn drops the connection mid-response."""


@dataclass
class _Gen:
    """What one admitted generation request is to produce."""

    kind: str  # "chat", "completion" or "response"
    model: str
    choices: int
    n_out: int
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    include_usage: bool
    continuous_usage: bool
    echo: str  # a completion's prompt text to echo, or ""


class RecordingWorker:
    """A vLLM-like OpenAI server on 127.0.0.1 that records requests and fails on demand.

    ``mode`` says what a generation request (chat, completions, responses) gets:

    * ``ok``: a normal answer (JSON, or SSE when the body says ``"stream": true``);
    * ``die_after_headers``: status 200 and headers, then the connection drops, no chunk;
    * ``end_without_token``: the role chunk, then ``data: [DONE]``, no content;
    * ``error_event``: an SSE ``data: {"error": ...}`` then ``[DONE]``, before any token
      (a non-streamed request gets a 500 error body);
    * ``status:NNN``: that status with an OpenAI error body (the request is not admitted);
    * ``stall``: nothing at all until :attr:`gate` is set, then a normal answer;
    * ``slow``: :attr:`tokens` tokens, one every :attr:`token_interval` seconds;
    * ``stall_after_first``: one token, then nothing until :attr:`gate` is set.

    :attr:`delay_headers` seconds pass before any generation request is answered at all.
    """

    def __init__(
        self, models: list[dict[str, Any]] | None = None, name: str = "tiny", port: int = 0
    ) -> None:
        self.name = name
        self.models: list[dict[str, Any]] = models or [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "vllm",
                "root": name,
                "parent": None,
            }
        ]
        self.requests: list[Recorded] = []
        self.mode = "ok"
        self.tokens = 4
        self.token_interval = 0.05
        self.delay_headers = 0.0
        self.error_code = 500  # the code of the "error_event" mode's error (4xx: the client's)
        self.health_status = 200
        self.health_delay = 0.0  # seconds before /health answers (a busy or hung worker)
        self.gate = threading.Event()
        self._gate_poll: asyncio.Future[None] | None = None
        self.block_size = 16
        #: replaces the word count: called with (path, body), returns the prompt's tokens
        self.count_prompt_tokens: Callable[[str, dict[str, Any]], int] | None = None
        #: False: usage has no prompt_tokens_details (vLLM without
        #: --enable-prompt-tokens-details)
        self.prompt_tokens_details = True
        # load gauges as /metrics shows them
        self.running = 0.0
        self.waiting = 0.0
        self.kv_usage = 0.0
        # prefix-cache counters (vLLM's vllm:prefix_cache_queries / _hits, in tokens)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._cache: list[tuple[tuple[str, str | None], list[str]]] = []
        # publish_kv_events: (encode, hasher, publisher), and the block keys held
        self._kv: tuple[Callable[[str], list[int]], Any, Any] | None = None
        self._blocks: set[int] = set()
        self._vocab: dict[int, str] = {}
        self._registry = CollectorRegistry()
        self._registry.register(_Collector(self))

        app = Starlette(
            routes=[
                Route("/health", self._health, methods=["GET"]),
                Route("/v1/models", self._list_models, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
                Route("/v1/chat/completions", self._generation, methods=["POST"]),
                Route("/v1/completions", self._generation, methods=["POST"]),
                Route("/v1/responses", self._generation, methods=["POST"]),
                Route("/v1/embeddings", self._embeddings, methods=["POST"]),
                Route("/tokenize", self._tokenize, methods=["POST"]),
                Route("/detokenize", self._detokenize, methods=["POST"]),
                Route("/{path:path}", self._not_found, methods=_ALL_METHODS),
            ]
        )
        self.server, self.thread, self.port = serve_in_thread(app, "recording-worker", port)
        self.url = f"http://127.0.0.1:{self.port}"

    # -- for tests ----------------------------------------------------------------------------

    def spec(self, worker_id: str) -> str:
        """The router's ``--worker`` form for this worker."""
        return f"{self.url},id={worker_id}"

    def requests_to(self, path: str) -> list[Recorded]:
        """The recorded requests for one path, in arrival order."""
        return [r for r in list(self.requests) if r.path == path]

    def generation_requests(self) -> list[Recorded]:
        """The recorded chat, completions and responses requests."""
        return [r for r in list(self.requests) if r.path in _GENERATION_PATHS]

    def wait_for(self, condition: Callable[[], bool], timeout: float = 10.0) -> None:
        """Wait (from the test's thread) until ``condition()`` holds, or fail."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError("the recording worker never reached the condition")
            time.sleep(0.01)

    def publish_kv_events(
        self, encode: Callable[[str], list[int]], hasher: Any, publisher: Any
    ) -> None:
        """Cache completion prompts by blocks as vLLM does, and publish them: ``encode``
        gives a prompt's token ids, ``hasher`` (a :class:`kvpool.hashing.BlockHasher`, its
        seed this worker's) their block keys, and ``publisher`` (a started
        :class:`kvpool.kv_events.EventPublisher`) gets a ``BlockStored`` for new blocks."""
        self._kv = (encode, hasher, publisher)

    def _cache_blocks(self, prompt: str, salt: str | None) -> tuple[int, int]:
        """(prompt tokens, cached tokens) of a prompt in the block cache; its new blocks
        are stored and published."""
        from kvpool.kv_events import BlockStored, EventBatch

        assert self._kv is not None
        encode, hasher, publisher = self._kv
        tokens = encode(prompt)
        keys = hasher.prompt_keys(tokens, cache_salt=salt)
        held = 0
        while held < len(keys) and keys[held] in self._blocks:
            held += 1
        size = hasher.block_size
        if held < len(keys):
            self._blocks.update(keys[held:])
            stored = BlockStored(
                block_hashes=keys[held:],
                parent_block_hash=keys[held - 1] if held else None,
                token_ids=tokens[held * size : len(keys) * size],
                block_size=size,
            )
            publisher.publish(EventBatch(events=[stored], ts=time.time()))
        # the last prompt token is always computed
        cached = min(held * size, (len(tokens) - 1) // size * size)
        return len(tokens), max(cached, 0)

    def reset_prefix_cache(self) -> None:
        """Forget every prompt seen, as vLLM's ``/reset_prefix_cache`` does."""
        self._cache.clear()

    @property
    def hit_ratio(self) -> float | None:
        """hits / queries of the prefix-cache counters; None before any query."""
        if not self.prefix_cache_queries:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries

    def stop(self) -> None:
        self.gate.set()
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> RecordingWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- plain endpoints ----------------------------------------------------------------------

    async def _record(self, request: Request) -> Recorded:
        body = await request.body()
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None
        rec = Recorded(
            method=request.method,
            path=request.url.path,
            headers={k.lower(): v for k, v in request.headers.items()},
            body=body,
            json=parsed,
        )
        self.requests.append(rec)
        return rec

    async def _health(self, request: Request) -> Response:
        await self._record(request)
        if self.health_delay:
            await asyncio.sleep(self.health_delay)
        return Response(status_code=self.health_status)

    async def _list_models(self, request: Request) -> Response:
        await self._record(request)
        return JSONResponse({"object": "list", "data": self.models})

    async def _metrics(self, request: Request) -> Response:
        await self._record(request)
        return Response(
            generate_latest(self._registry), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    async def _not_found(self, request: Request) -> Response:
        await self._record(request)
        return JSONResponse({"detail": "Not Found"}, status_code=404)

    async def _tokenize(self, request: Request) -> Response:
        rec = await self._record(request)
        body = rec.json if isinstance(rec.json, dict) else {}
        if "messages" in body:
            words = _chat_words(body.get("messages") or [])
        else:
            words = _prompt_words(body.get("prompt", ""))[0]
        ids = [self._token_id(w) for w in words]
        return JSONResponse(
            {"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": None}
        )

    async def _detokenize(self, request: Request) -> Response:
        rec = await self._record(request)
        body = rec.json if isinstance(rec.json, dict) else {}
        words = [self._vocab.get(int(t), f"<{t}>") for t in body.get("tokens") or []]
        return JSONResponse({"prompt": " ".join(words)})

    async def _embeddings(self, request: Request) -> Response:
        rec = await self._record(request)
        body = rec.json if isinstance(rec.json, dict) else {}
        inputs = body.get("input", "")
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        data, total = [], 0
        for i, item in enumerate(inputs):
            words = _prompt_words(item)[0]
            total += max(1, len(words))
            seed = zlib.crc32(" ".join(words).encode())
            vector = [((seed >> k) & 0xFF) / 255.0 for k in range(0, 32, 4)]
            data.append({"object": "embedding", "index": i, "embedding": vector})
        return JSONResponse(
            {
                "id": f"embd-{uuid.uuid4().hex}",
                "object": "list",
                "created": int(time.time()),
                "model": body.get("model") or self.name,
                "data": data,
                "usage": {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0},
            }
        )

    def _token_id(self, word: str) -> int:
        token = zlib.crc32(word.encode()) % 50_000
        self._vocab[token] = word
        return token

    # -- generation ---------------------------------------------------------------------------

    async def _generation(self, request: Request) -> Response:
        rec = await self._record(request)
        if self.delay_headers:
            await asyncio.sleep(self.delay_headers)
        body = rec.json
        if not isinstance(body, dict):
            return _error(400, "the body is not a JSON object", "BadRequestError")
        model = body.get("model") or self.models[0]["id"]
        if model not in {m["id"] for m in self.models}:
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        mode = self.mode
        if mode.startswith("status:"):
            status = int(mode.split(":", 1)[1])
            kind = "BadRequestError" if status < 500 else "InternalServerError"
            headers = {"Retry-After": "1"} if status in (429, 503) else None
            return _error(status, f"recording worker answers {status}", kind, headers=headers)
        gen = self._admit(rec, model, body)
        stream = bool(body.get("stream"))
        if mode == "stall":
            await self._wait_gate()
        if mode == "die_after_headers":
            media = "text/event-stream" if stream else "application/json"
            return StreamingResponse(_die(), media_type=media)
        if mode == "error_event":
            if not stream:
                return _error(500, "recording worker: engine failed", "InternalServerError")
            return StreamingResponse(self._error_stream(gen), media_type="text/event-stream")
        if stream:
            streams = {
                "chat": self._chat_stream,
                "completion": self._completion_stream,
                "response": self._response_stream,
            }
            return StreamingResponse(streams[gen.kind](gen, mode), media_type="text/event-stream")
        if mode == "end_without_token":
            gen.n_out, gen.finish_reason = 0, "stop"
        elif mode == "slow":
            await asyncio.sleep(gen.n_out * self.token_interval)
        elif mode == "stall_after_first":
            await self._wait_gate()
        answers = {"chat": self._chat_json, "completion": self._completion_json}
        return JSONResponse(answers.get(gen.kind, self._response_json)(gen))

    def _admit(self, rec: Recorded, model: str, body: dict[str, Any]) -> _Gen:
        """Count the prompt, look it up in the prefix cache, remember it, bump the counters."""
        kind = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}.get(
            rec.path, "response"
        )
        if kind == "chat":
            prompts = [_chat_words(body.get("messages") or [])]
        elif kind == "completion":
            prompts = _prompt_words(body.get("prompt", ""))
        else:
            prompts = [_response_words(body)]
        key = (model, body.get("cache_salt"))
        prompt_tokens = cached = 0
        prompt = body.get("prompt")
        if self._kv is not None and kind == "completion" and isinstance(prompt, str):
            prompt_tokens, cached = self._cache_blocks(prompt, body.get("cache_salt"))
        for words in prompts if not (prompt_tokens or cached) else []:
            prompt_tokens += max(1, len(words))
            cached += self._lookup(key, words)
            self._cache.append((key, words))
        if self.count_prompt_tokens is not None:
            prompt_tokens = int(self.count_prompt_tokens(rec.path, body))
            cached = min(cached, max(0, prompt_tokens - 1))
        self.prefix_cache_queries += prompt_tokens
        self.prefix_cache_hits += cached
        rec.prompt_tokens, rec.cached_tokens = prompt_tokens, cached

        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if kind == "response":
            limit = body.get("max_output_tokens")
        n_out = self.tokens
        finish = "stop"
        if isinstance(limit, int) and limit < n_out:
            n_out, finish = max(0, limit), "length"
        # usage comes last only when asked for in so many words; the default of an absent
        # include_usage has changed between vLLM versions (True, later False)
        options = body.get("stream_options") or {}
        include_usage = bool(body.get("stream")) and options.get("include_usage") is True
        n = body.get("n") if isinstance(body.get("n"), int) and body.get("n") > 0 else 1
        return _Gen(
            kind=kind,
            model=model,
            choices=n * len(prompts) if kind == "completion" else n,
            n_out=n_out,
            finish_reason=finish,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached,
            include_usage=include_usage,
            continuous_usage=include_usage and bool(options.get("continuous_usage_stats")),
            echo=prompt
            if kind == "completion" and body.get("echo") and isinstance(prompt, str)
            else "",
        )

    def _lookup(self, key: tuple[str, str | None], words: list[str]) -> int:
        best = 0
        for other_key, other in self._cache:
            if other_key != key:
                continue
            common = 0
            for a, b in zip(words, other, strict=False):
                if a != b:
                    break
                common += 1
            best = max(best, common)
        best = min(best, len(words) - 1)  # the last prompt token is always computed
        return max(0, best // self.block_size * self.block_size)

    async def _wait_gate(self) -> None:
        # One poll of the gate (set from another thread) however many requests wait on it:
        # thousands of waiters each polling would starve the server's loop.
        if self.gate.is_set():
            return
        if self._gate_poll is None or self._gate_poll.done():
            self._gate_poll = asyncio.ensure_future(self._poll_gate())
        await asyncio.shield(self._gate_poll)

    async def _poll_gate(self) -> None:
        while not self.gate.is_set():  # noqa: ASYNC110  (the gate is set from another thread)
            await asyncio.sleep(0.01)

    async def _pace(self, gen: _Gen, mode: str, index: int) -> None:
        """Wait before token ``index`` as the mode says."""
        if mode == "slow":
            await asyncio.sleep(self.token_interval)
        elif mode == "stall_after_first" and index == 1:
            await self._wait_gate()

    def _usage(self, gen: _Gen, completion_tokens: int) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": gen.prompt_tokens,
            "total_tokens": gen.prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        }
        if self.prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": gen.cached_tokens}
        return usage

    def _response_usage(self, gen: _Gen, output_tokens: int) -> dict[str, Any]:
        return {
            "input_tokens": gen.prompt_tokens,
            "input_tokens_details": {"cached_tokens": gen.cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": gen.prompt_tokens + output_tokens,
        }

    # chat

    def _chat_json(self, gen: _Gen) -> dict[str, Any]:
        text = "".join(_token(i) for i in range(gen.n_out))
        choices = [
            {
                "index": c,
                "message": {"role": "assistant", "content": text, "reasoning_content": None},
                "logprobs": None,
                "finish_reason": gen.finish_reason,
                "stop_reason": None,
            }
            for c in range(gen.choices)
        ]
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": gen.model,
            "choices": choices,
            "usage": self._usage(gen, gen.n_out * gen.choices),
            "prompt_logprobs": None,
            "kv_transfer_params": None,
        }

    async def _chat_stream(self, gen: _Gen, mode: str) -> AsyncIterator[bytes]:
        ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(choices: list[dict[str, Any]], done: int) -> bytes:
            data: dict[str, Any] = {
                "id": ident,
                "object": "chat.completion.chunk",
                "created": created,
                "model": gen.model,
                "choices": choices,
            }
            if gen.continuous_usage:
                data["usage"] = self._usage(gen, done)
            return _sse(data)

        for c in range(gen.choices):
            role = {"role": "assistant", "content": ""}
            yield chunk([{"index": c, "delta": role, "logprobs": None, "finish_reason": None}], 0)
        if mode == "end_without_token":
            yield b"data: [DONE]\n\n"
            return
        done = 0
        for i in range(gen.n_out):
            await self._pace(gen, mode, i)
            for c in range(gen.choices):
                done += 1
                delta = {"content": _token(i)}
                yield chunk(
                    [{"index": c, "delta": delta, "logprobs": None, "finish_reason": None}], done
                )
        for c in range(gen.choices):
            final = {
                "index": c,
                "delta": {"content": ""},
                "logprobs": None,
                "finish_reason": gen.finish_reason,
                "stop_reason": None,
            }
            yield chunk([final], done)
        if gen.include_usage:
            yield _sse(
                {
                    "id": ident,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": gen.model,
                    "choices": [],
                    "usage": self._usage(gen, done),
                }
            )
        yield b"data: [DONE]\n\n"

    # completions

    def _completion_json(self, gen: _Gen) -> dict[str, Any]:
        text = gen.echo + "".join(_token(i) for i in range(gen.n_out))
        choices = [
            {
                "index": c,
                "text": text,
                "logprobs": None,
                "finish_reason": gen.finish_reason,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
            for c in range(gen.choices)
        ]
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": gen.model,
            "choices": choices,
            "usage": self._usage(gen, gen.n_out * gen.choices),
            "kv_transfer_params": None,
        }

    async def _completion_stream(self, gen: _Gen, mode: str) -> AsyncIterator[bytes]:
        ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(index: int, text: str, finish: str | None, done: int) -> bytes:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = None
            data: dict[str, Any] = {
                "id": ident,
                "object": "text_completion",
                "created": created,
                "model": gen.model,
                "choices": [choice],
            }
            if gen.continuous_usage:
                data["usage"] = self._usage(gen, done)
            return _sse(data)

        if mode == "end_without_token":
            yield b"data: [DONE]\n\n"
            return
        done = 0
        for i in range(gen.n_out):
            await self._pace(gen, mode, i)
            for c in range(gen.choices):
                done += 1
                prefix = gen.echo if i == 0 else ""
                yield chunk(c, prefix + _token(i), None, done)
        for c in range(gen.choices):
            yield chunk(c, "", gen.finish_reason, done)
        if gen.include_usage:
            yield _sse(
                {
                    "id": ident,
                    "object": "text_completion",
                    "created": created,
                    "model": gen.model,
                    "choices": [],
                    "usage": self._usage(gen, done),
                }
            )
        yield b"data: [DONE]\n\n"

    # responses

    def _response_obj(self, gen: _Gen, ident: str, status: str, n_out: int) -> dict[str, Any]:
        text = "".join(_token(i) for i in range(n_out))
        output = []
        if status == "completed":
            output = [
                {
                    "id": f"msg_{ident[5:]}",
                    "type": "message",
                    "role": "assistant",
                    "status": "completed",
                    "content": [
                        {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
                    ],
                }
            ]
        return {
            "id": ident,
            "object": "response",
            "created_at": int(time.time()),
            "model": gen.model,
            "status": status,
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "incomplete_details": None,
            "usage": self._response_usage(gen, n_out) if status == "completed" else None,
        }

    def _response_json(self, gen: _Gen) -> dict[str, Any]:
        return self._response_obj(gen, f"resp_{uuid.uuid4().hex}", "completed", gen.n_out)

    async def _response_stream(self, gen: _Gen, mode: str) -> AsyncIterator[bytes]:
        ident = f"resp_{uuid.uuid4().hex}"
        seq = 0

        def event(kind: str, **fields: Any) -> bytes:
            nonlocal seq
            data = {"type": kind, "sequence_number": seq, **fields}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()

        yield event("response.created", response=self._response_obj(gen, ident, "in_progress", 0))
        if mode == "end_without_token":
            return
        for i in range(gen.n_out):
            await self._pace(gen, mode, i)
            yield event(
                "response.output_text.delta",
                item_id=f"msg_{ident[5:]}",
                output_index=0,
                content_index=0,
                delta=_token(i),
                logprobs=[],
            )
        yield event(
            "response.completed", response=self._response_obj(gen, ident, "completed", gen.n_out)
        )

    async def _error_stream(self, gen: _Gen) -> AsyncIterator[bytes]:
        message = "recording worker: engine failed"
        if gen.kind == "response":
            data = {"type": "error", "code": "500", "message": message, "param": None}
            yield f"event: error\ndata: {json.dumps(data)}\n\n".encode()
            return
        kind = "BadRequestError" if self.error_code < 500 else "InternalServerError"
        error = {"message": message, "type": kind, "param": None, "code": self.error_code}
        yield _sse({"error": error})
        yield b"data: [DONE]\n\n"


def serve_in_thread(
    app: Any, name: str, port: int = 0
) -> tuple[uvicorn.Server, threading.Thread, int]:
    """Serve an ASGI app on 127.0.0.1 (``port``, 0: a free one) in a daemon thread; returns
    the server (``should_exit`` stops it), its thread and its port once it accepts
    connections."""
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="critical",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=1,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"the {name} did not start")
        time.sleep(0.01)
    return server, thread, server.servers[0].sockets[0].getsockname()[1]


class _Collector(Collector):
    """vLLM's series, read from the worker at scrape time."""

    def __init__(self, worker: RecordingWorker) -> None:
        self.worker = worker

    def collect(self) -> Iterator[Metric]:
        w = self.worker
        labels = ["engine", "model_name"]
        values = ["0", w.name]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)  # exposed as <name>_total
            c.add_metric(values, v)
            return c

        yield gauge("vllm:num_requests_running", "Requests in model execution batches.", w.running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be processed.", w.waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.", w.kv_usage)
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            w.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            w.prefix_cache_hits,
        )


# -- prompt words ---------------------------------------------------------------------------


def _text_of(content: Any) -> str:
    """A message's text: a string, or its text parts joined with a newline (as vLLM does);
    other parts (images, audio) add nothing."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") in ("text", "input_text", "output_text")
        )
    return ""


def _chat_words(messages: list[Any]) -> list[str]:
    """The words of a chat: each message's text, and its tool calls' names and arguments."""
    parts: list[str] = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        parts.append(_text_of(m.get("content")))
        for call in m.get("tool_calls") or []:
            fn = (call.get("function") or {}) if isinstance(call, dict) else {}
            args = fn.get("arguments")
            parts += [str(fn.get("name", "")), args if isinstance(args, str) else json.dumps(args)]
    return " ".join(parts).split()


def _prompt_words(prompt: Any) -> list[list[str]]:
    """A completions prompt as one word list per prompt (token ids count one each)."""
    if isinstance(prompt, str):
        return [prompt.split()]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return [[str(t) for t in prompt]]
        return [w for p in prompt for w in _prompt_words(p)]
    return [[]]


def _response_words(body: dict[str, Any]) -> list[str]:
    """A Responses request's words: the instructions, then each input item's text."""
    parts = [str(body.get("instructions") or "")]
    items = body.get("input")
    if isinstance(items, str):
        parts.append(items)
    elif isinstance(items, list):
        for item in items:
            if not isinstance(item, dict):
                continue
            if item.get("type") == "function_call":
                parts += [str(item.get("name", "")), str(item.get("arguments", ""))]
            elif item.get("type") == "function_call_output":
                parts.append(str(item.get("output", "")))
            else:
                parts.append(_text_of(item.get("content")))
    return " ".join(parts).split()


# -- wire helpers ---------------------------------------------------------------------------


def _token(i: int) -> str:
    return f"tok{i} "


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def _error(
    status: int,
    message: str,
    kind: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """vLLM's error body (``code`` is the HTTP status, as vLLM sends it)."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


async def _die() -> AsyncIterator[bytes]:
    raise _Dropped("the recording worker dropped the connection after the headers")
    yield b""  # pragma: no cover  (makes this an async generator)
