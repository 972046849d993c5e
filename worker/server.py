"""The worker's HTTP server: the OpenAI API (contract 3), metrics (contract 5), KV events
(contract 2), the prefill/decode hand-off (contract 4) and an info document for routers.

A thin shell: handlers validate the body, turn it into engine requests, and stream the
engine loop's outputs back. Every refusal is OpenAI's error JSON with the status a client
expects; nothing a client sends can stop the server from serving the next request.

What a client could abuse is keyed by the pool secret (:mod:`kvpool.signing`): a decode
worker honours only hand-offs signed by a worker of its pool, so it pulls only from the
pool's own workers; the prefill side hands its pinned blocks only to whoever presents the
hand-off's one-time token; ``/drain``, ``/undrain`` and ``/reset_prefix_cache`` need the
admin token; the KV event sockets need the pool's event credential. Without a pool secret
a worker refuses hand-offs and answers admin requests from loopback only.

With tracing on (``OTEL_*``, :mod:`kvpool.tracing`) each generation request continues the
trace its ``traceparent`` names and, once over, records its queue, prefill and decode spans
from times the engine took anyway; with tracing off a request pays one ``None`` test.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import ipaddress
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvpool import __version__, tracing
from kvpool.hashing import HASH_ALGORITHM
from kvpool.kv_events import EventPublisher
from kvpool.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    KVEventsInfo,
    KVTransferParams,
    OpenAIError,
    TokenizeRequest,
    WorkerInfo,
    exception_handlers,
    model_not_found,
    output_limit,
    output_over_context,
    parse_request,
    vllm_error,
)
from kvpool.signing import (
    admin_token,
    constant_time_equal,
    kv_events_credential,
)
from kvpool.tokenization import (
    PromptTooLong,
    check_text_length,
    encode_prompt,
    encode_within,
    render_chat_text,
)

from .engine import EngineCore, EventSink, PreparedRequest
from .engine_loop import EngineLoop, TimedOutput
from .handoff_http import HandOffEndpoints, require_bearer
from .jobs import Job, Trace
from .metrics import RequestTimer, WorkerMetrics
from .responses import Responses
from .sequence import InvalidParam, SamplingParams
from .settings import WorkerSettings

log = logging.getLogger(__name__)

EngineFactory = Callable[[EventSink | None], EngineCore]

#: prompts up to this many characters or token ids are tokenized and hashed on the event
#: loop (well under a millisecond); longer ones in a thread
INLINE_PREPARE_LIMIT = 2048

# Engines load one at a time: several workers in one process (a simulated fleet) would
# otherwise import transformers' lazy modules from several threads at once, which races.
_LOAD_LOCK = threading.Lock()


def default_engine_factory(settings: WorkerSettings) -> EngineFactory:
    def make(sink: EventSink | None) -> EngineCore:
        if settings.engine == "sim":
            from .sim import SimEngine

            return SimEngine.from_model_dir(
                settings.model,
                settings.engine_config(),
                timing=settings.timing(),
                max_model_len=settings.max_model_len,
                event_sink=sink,
            )
        from .engine import LLMEngine

        return LLMEngine.from_pretrained(settings.model, settings.engine_config(), sink)

    return make


class WorkerServer(HandOffEndpoints, Responses):
    def __init__(
        self, settings: WorkerSettings, engine_factory: EngineFactory | None = None
    ) -> None:
        self.settings = settings
        self.model_name = settings.model_name
        self.engine_factory = engine_factory or default_engine_factory(settings)
        self.engine: EngineCore | None = None
        self.loop: EngineLoop | None = None
        self.publisher: EventPublisher | None = None
        self.metrics: WorkerMetrics | None = None
        self.load_error: str | None = None
        self.draining = False
        self.stopping = False  # a signal or shutdown: a drain that /undrain cannot take back
        secret = settings.secret
        self._secret = secret
        self._admin_token = admin_token(secret) if secret else None
        # the one-time tokens of this worker's pinned blocks: request id -> (token, expiry
        # on the monotonic clock), in the order issued (so expiry order)
        self._kv_tokens: dict[str, tuple[str, float]] = {}
        self.in_flight = 0
        self.queued_tokens = 0  # prompt tokens submitted and not yet prefilled
        self.engine_id = uuid.uuid4().hex[:16]
        self.boot_id = uuid.uuid4().hex  # this process's: a router sees a restart by it
        self.created = int(time.time())
        self._idle = asyncio.Event()
        self._load_task: asyncio.Task[None] | None = None
        self._http: httpx.AsyncClient | None = None
        self.bound_port: int | None = None  # the port actually bound (with --port 0)
        self.advertised_host = settings.advertised_host()  # resolved once, not per request
        self.app = self._build_app()

    # -- lifecycle -----------------------------------------------------------------------
    async def startup(self) -> None:
        self._idle.set()
        tracing.configure("kvpool-worker")
        if self._secret is None:
            log.warning(
                "no pool secret (--pool-secret): prefill/decode hand-offs are refused, admin "
                "endpoints answer loopback only, and the KV event sockets are open to anyone "
                "who reaches them"
            )
        self._http = httpx.AsyncClient(timeout=self.settings.kv_transfer_timeout_s)
        self._load_task = asyncio.create_task(self._load())

    async def _load(self) -> None:
        s = self.settings
        try:
            sink = None
            if s.kv_events_endpoint:
                self.publisher = EventPublisher(
                    s.kv_events_endpoint,
                    s.kv_events_replay_endpoint,
                    topic=s.kv_events_topic,
                    encoding=s.kv_events_encoding,
                    credential=kv_events_credential(self._secret) if self._secret else None,
                )
                await asyncio.to_thread(self.publisher.start)
                sink = self.publisher.publish
            engine = await asyncio.to_thread(self._make_engine, sink)
            loop = EngineLoop(engine, name=f"engine-{self.model_name}")
            metrics = WorkerMetrics(
                self.model_name,
                lambda: loop.stats,
                {
                    "block_size": str(engine.pool.block_size),
                    "num_gpu_blocks": str(engine.pool.num_blocks),
                    "enable_prefix_caching": str(engine.config.enable_prefix_caching),
                    "cache_dtype": engine.kv_layout.dtype,
                },
            )
            loop.on_pins_expired = lambda ids: metrics.kv_pins_expired.inc(len(ids))
            loop.start()
            self.engine, self.loop, self.metrics = engine, loop, metrics
            log.info(
                "%s ready: %s engine, role %s, %d blocks of %d tokens, context %d",
                self.model_name,
                s.engine,
                s.role,
                engine.pool.num_blocks,
                engine.pool.block_size,
                engine.max_model_len,
            )
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.exception("the model did not load; /health will answer 503")

    def _make_engine(self, sink: EventSink | None) -> EngineCore:
        with _LOAD_LOCK:
            engine = self.engine_factory(sink)
            # What loading made lives as long as the process: take it out of the cyclic
            # collector's reach, or every full collection walks it (hundreds of ms with a
            # fleet of engines in one process, stalling every request).
            gc.collect()
            gc.freeze()
            return engine

    async def shutdown(self) -> None:
        self.draining = self.stopping = True
        if self._load_task is not None:
            await self._load_task
        if self.loop is not None:
            await self.loop.stop()
        if self.publisher is not None:
            await asyncio.to_thread(self.publisher.close)
        if self._http is not None:
            await self._http.aclose()

    async def drain(self, timeout: float | None = None, *, wait_for_pins: bool = False) -> bool:
        """Stop taking requests and wait for those in flight (and, at shutdown, for the
        blocks pinned for decode workers to be pulled), up to ``timeout``."""
        self.draining = True
        timeout = self.settings.drain_timeout_s if timeout is None else timeout

        def pinned() -> int:
            return self.loop.stats.pinned_requests if wait_for_pins and self.loop else 0

        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
                # The count lives in the engine thread: look again shortly.
                while pinned():  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            return True
        except TimeoutError:
            return False

    # -- the app -------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            await self.startup()
            yield
            await self.shutdown()

        app = FastAPI(
            title="kvpool worker",
            version=__version__,
            lifespan=lifespan,
            exception_handlers=exception_handlers(log),
        )
        app.state.worker = self

        app.add_route("/health", self.health, methods=["GET"])
        app.add_route("/metrics", self.metrics_endpoint, methods=["GET"])
        app.add_route("/v1/models", self.models, methods=["GET"])
        app.add_route("/kvpool/info", self.info, methods=["GET"])
        app.add_route("/v1/completions", self.completions, methods=["POST"])
        app.add_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_route("/detokenize", self.detokenize, methods=["POST"])
        app.add_route("/drain", self.drain_endpoint, methods=["POST"])
        app.add_route("/undrain", self.undrain_endpoint, methods=["POST"])
        app.add_route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"])
        app.add_route("/kv/{request_id:path}", self.get_kv, methods=["GET"])
        app.add_route("/kv/{request_id:path}", self.delete_kv, methods=["DELETE"])
        return app

    # -- plumbing ------------------------------------------------------------------------
    def _ready(self) -> tuple[EngineCore, EngineLoop, WorkerMetrics]:
        if self.load_error is not None:
            raise OpenAIError(
                503,
                f"the model failed to load: {self.load_error}",
                type="service_unavailable",
                code="load_failed",
            )
        if self.engine is None or self.loop is None or self.metrics is None:
            raise OpenAIError(
                503,
                "the model is still loading",
                type="service_unavailable",
                code="loading",
                headers={"Retry-After": "5"},
            )
        return self.engine, self.loop, self.metrics

    def _serving(self) -> tuple[EngineCore, EngineLoop, WorkerMetrics]:
        ready = self._ready()
        if self.draining:
            raise OpenAIError(
                503,
                "this worker is draining and takes no new requests",
                type="service_unavailable",
                code="draining",
            )
        return ready

    async def _body(self, request: Request) -> bytes:
        limit = self.settings.max_request_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise self._too_large(int(declared))
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise self._too_large(len(body))
        return bytes(body)

    def _too_large(self, size: int) -> OpenAIError:
        if self.metrics is not None:
            self.metrics.reject("body_too_large")
        return OpenAIError(
            413,
            f"the request body has at least {size} bytes; the limit is "
            f"{self.settings.max_request_body_bytes}",
            code="request_too_large",
        )

    def _check_model(self, model: str | None) -> None:
        # The model path as given also names it (vLLM's default served name).
        if model is not None and model not in (self.model_name, self.settings.model):
            raise model_not_found(model, [self.model_name])

    # -- small endpoints -----------------------------------------------------------------
    async def health(self, request: Request) -> JSONResponse:
        self._serving()
        return JSONResponse({"status": "ok"})

    async def metrics_endpoint(self, request: Request) -> Response:
        _, _, metrics = self._ready()
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request) -> JSONResponse:
        max_len = self.engine.max_model_len if self.engine is not None else None
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kvpool",
            "root": self.settings.model,
            "parent": None,
            "max_model_len": max_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def info(self, request: Request) -> JSONResponse:
        engine, _, _ = self._ready()
        events = None
        if self.publisher is not None:
            replay = self.publisher.replay_endpoint
            events = KVEventsInfo(
                endpoint=_reachable(self.publisher.endpoint, self.advertised_host),
                replay_endpoint=_reachable(replay, self.advertised_host) if replay else None,
                topic=self.settings.kv_events_topic,
                encoding=self.settings.kv_events_encoding,
            )
        info = WorkerInfo(
            served_model_name=self.model_name,
            engine=self.settings.engine,
            role=self.settings.role,
            block_size=engine.pool.block_size,
            hash_seed=engine.hasher.hash_seed,
            hash_algo=HASH_ALGORITHM,
            max_model_len=engine.max_model_len,
            num_blocks=engine.pool.num_blocks,
            kv_events=events,
            kv_transfer_engine_id=self.engine_id,
            version=__version__,
            max_num_seqs=engine.scheduler.config.max_num_seqs,
            boot_id=self.boot_id,
        )
        return JSONResponse(info.model_dump())

    # -- admin ---------------------------------------------------------------------------
    def _require_admin(self, request: Request) -> None:
        """The admin token as a bearer token; without a pool secret, a loopback client."""
        if self._admin_token is None:
            if _loopback(request.client.host if request.client else None):
                return
            raise OpenAIError(
                403,
                "admin endpoints answer only from loopback when the worker has no pool "
                "secret (--pool-secret)",
                type="permission_error",
                code="admin_forbidden",
            )
        token = require_bearer(
            request,
            "this admin endpoint needs 'Authorization: Bearer <admin token>' "
            "(`kvpool worker admin-token` derives it from the pool secret)",
            "admin_token_required",
        )
        if not constant_time_equal(token, self._admin_token):
            raise OpenAIError(
                401,
                "the admin token is not this pool's",
                type="authentication_error",
                code="invalid_admin_token",
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def drain_endpoint(self, request: Request) -> JSONResponse:
        self._require_admin(request)
        drained = await self.drain()
        return JSONResponse({"drained": drained, "in_flight": self.in_flight})

    async def undrain_endpoint(self, request: Request) -> JSONResponse:
        """Take requests again after ``/drain`` (not after a signal: that one stops)."""
        self._require_admin(request)
        if self.stopping:
            raise OpenAIError(
                409,
                "this worker is shutting down; a drain for shutdown cannot be undone",
                code="shutting_down",
            )
        if self.draining:
            log.info("undrained: taking requests again")
        self.draining = False
        return JSONResponse({"draining": False, "in_flight": self.in_flight})

    async def reset_prefix_cache(self, request: Request) -> JSONResponse:
        self._require_admin(request)
        engine, loop, _ = self._ready()
        if not await loop.call(engine.reset_prefix_cache):
            raise OpenAIError(
                409, "requests are running or blocks are pinned; try again idle", code="busy"
            )
        return JSONResponse({"reset": True})

    async def tokenize(self, request: Request) -> JSONResponse:
        engine, _, _ = self._ready()
        req = parse_request(TokenizeRequest, await self._body(request))
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            tokens, _ = await asyncio.to_thread(self._render_chat, engine, req)
        else:
            tokenizer = self._tokenizer(engine)
            encode = functools.partial(
                tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens
            )
            small = len(req.prompt or "") <= INLINE_PREPARE_LIMIT
            tokens = encode() if small else await asyncio.to_thread(encode)
        return JSONResponse(
            {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}
        )

    async def detokenize(self, request: Request) -> JSONResponse:
        engine, _, _ = self._ready()
        req = parse_request(DetokenizeRequest, await self._body(request))
        self._check_model(req.model)
        try:
            engine.check_vocabulary(req.tokens, "tokens", "token id")
        except InvalidParam as exc:
            raise OpenAIError(400, str(exc), param=exc.param) from None
        return JSONResponse({"prompt": self._tokenizer(engine).decode(req.tokens)})

    @staticmethod
    def _tokenizer(engine: EngineCore) -> Any:
        if engine.tokenizer is None:
            raise OpenAIError(400, "this worker has no tokenizer", code="no_tokenizer")
        return engine.tokenizer

    # -- generation ----------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        req = parse_request(CompletionRequest, await self._body(request))
        job = await self._job(request, req, "completion", arrival)
        return await self._answer(request, job)

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        req = parse_request(ChatCompletionRequest, await self._body(request))
        job = await self._job(request, req, "chat", arrival)
        return await self._answer(request, job)

    async def _job(
        self,
        request: Request,
        req: CompletionRequest | ChatCompletionRequest,
        kind: str,
        arrival: float,
    ) -> Job:
        self._check_model(req.model)
        engine, _, metrics = self._serving()
        refused = req.unsupported()
        if refused is not None:
            raise refused
        transfer = req.kv_transfer_params
        if transfer is not None:
            self._check_transfer(transfer, bool(req.stream))
        # vLLM's order: the header, then the body's request_id
        base_id = request.headers.get("x-request-id") or req.request_id or uuid.uuid4().hex
        prompt_text = None
        _check_output_limit(req, engine.max_model_len)
        if isinstance(req, ChatCompletionRequest):
            ids, text = await asyncio.to_thread(
                self._render_chat, engine, req, engine.max_model_len
            )
            prompts: list[str | list[int]] = [ids]
            prompt_text = text if req.return_prompt_text else None
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            max_tokens = (
                req.max_completion_tokens
                if req.max_completion_tokens is not None
                else req.max_tokens
            )
            echoed = [req.echoed()] if req.echo else None
        else:
            prompts = req.prompts()
            if not prompts:
                raise OpenAIError(400, "prompt: must not be empty", param="prompt")
            logprobs = req.logprobs
            # echo with max_tokens 0 answers with the prompt alone; one token is computed
            # (and counted) all the same, as vLLM does
            max_tokens = (
                1 if req.echo_only else req.max_tokens if req.max_tokens is not None else 16
            )
            echoed = None
            if req.echo:  # vLLM echoes no text when it returns the prompt's token ids
                echoed = [
                    "" if req.return_token_ids else self._prompt_text(engine, p) for p in prompts
                ]
        n = req.choices_per_prompt
        if transfer is not None and len(prompts) * n != 1:
            raise OpenAIError(
                400,
                "kv_transfer_params: a request of the prefill/decode hand-off has one prompt "
                "and one choice",
                param="kv_transfer_params",
            )
        prepared: list[PreparedRequest] = []
        for i, prompt in enumerate(prompts):
            args = (engine, prompt, req, max_tokens, logprobs, base_id, i * n, transfer)
            if len(prompt) <= INLINE_PREPARE_LIMIT:  # cheaper here than a thread hop
                prepared += self._prepare(*args)
            else:  # tokenizing and hashing a long prompt would stall the event loop
                prepared += await asyncio.to_thread(self._prepare, *args)
        options = req.stream_options
        job = Job(
            id=("chatcmpl-" if kind == "chat" else "cmpl-") + base_id,
            kind=kind,
            created=int(time.time()),
            arrival=arrival,
            prepared=prepared,
            stream=bool(req.stream),
            include_usage=bool(options and options.include_usage),
            logprobs=logprobs,
            transfer=transfer,
            n=n,
            echoed=None if echoed is None else [e for e in echoed for _ in range(n)],
            echo_only=isinstance(req, CompletionRequest) and req.echo_only,
            token_ids=bool(req.return_token_ids),
            tokens_as_ids=bool(req.return_tokens_as_token_ids),
            continuous_usage=bool(
                options and options.include_usage and options.continuous_usage_stats
            ),
            prompt_text=prompt_text,
        )
        if tracing.tracer() is not None:
            job.trace = Trace(tracing.extract(request.headers))
            for p in prepared:
                p.seq.traced = True
        self._admit(job, metrics)
        try:
            await self._start(job)
        except BaseException:  # cancelled mid-pull (shutdown): nothing of the job may stay
            self._close(job)
            raise
        log.debug(
            "request %s: %s, %d prompt(s), %d choice(s), %d prompt tokens%s",
            base_id,
            kind,
            len(prompts),
            len(prepared),
            job.queued_tokens,
            ", remote prefill" if transfer and transfer.do_remote_prefill else "",
        )
        return job

    def _render_chat(
        self,
        engine: EngineCore,
        req: ChatCompletionRequest | TokenizeRequest,
        limit: int | None = None,
    ) -> tuple[list[int], str]:
        """A chat's prompt, as token ids and as text, rendered as vLLM renders it: its
        messages, tools (listed even with ``tool_choice: "none"``), documents and template
        arguments through the model's chat template."""
        tokenizer = self._tokenizer(engine)
        messages = [m.for_template() for m in req.messages or ()]
        chat = req if isinstance(req, ChatCompletionRequest) else None
        try:
            text = render_chat_text(
                tokenizer,
                messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=chat.continue_final_message if chat else False,
                chat_template_kwargs=chat.template_kwargs() if chat else None,
                tools=chat.template_tools() if chat else None,
                documents=chat.documents if chat else None,
            )
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="messages") from None
        special = chat.add_special_tokens if chat else False
        if limit is None or (chat is not None and chat.truncate_prompt_tokens is not None):
            return encode_prompt(tokenizer, text, add_special_tokens=special), text
        try:  # the rendered text is refused as vLLM refuses a text over the context
            return encode_within(tokenizer, text, limit, add_special_tokens=special), text
        except PromptTooLong as exc:
            raise vllm_error(str(exc), exc.param, exc.value) from None

    def _prompt_text(self, engine: EngineCore, prompt: str | list[int]) -> str:
        """A completion's prompt as ``echo`` puts it first: its text, or its token ids'."""
        if isinstance(prompt, str):
            return prompt
        if engine.tokenizer is None:
            return ""
        try:
            return str(engine.tokenizer.decode(prompt))
        except Exception:  # ids outside the vocabulary: refused when prepared
            return ""

    def _prompt_ids(
        self,
        engine: EngineCore,
        prompt: str | list[int],
        req: CompletionRequest | ChatCompletionRequest,
    ) -> list[int]:
        """The prompt's token ids: tokenized with special tokens or not as the request
        says, then cut to ``truncate_prompt_tokens`` from the side it says (vLLM's
        semantics: -1 is the longest prompt that leaves room for one token)."""
        if isinstance(prompt, str) and not req.add_special_tokens:
            ids = encode_prompt(self._tokenizer(engine), prompt, add_special_tokens=False)
            if not ids:
                raise InvalidParam("prompt", "prompt: the prompt is empty")
        else:
            ids = engine.prompt_tokens_of(prompt)
        keep = req.truncate_prompt_tokens
        if keep is None:
            return ids
        limit = engine.max_model_len
        if keep > limit:
            raise vllm_error(
                f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = "
                f"{limit}. Please request a smaller truncation size.",
                "truncate_prompt_tokens",
            )
        if keep < 0:
            keep = limit - 1
        if len(ids) <= keep:
            return ids
        if keep == 0:
            raise InvalidParam(
                "truncate_prompt_tokens", "truncate_prompt_tokens=0 leaves no prompt"
            )
        side = req.truncation_side or getattr(engine.tokenizer, "truncation_side", "right")
        return ids[len(ids) - keep :] if side == "left" else ids[:keep]

    def _prepare(
        self,
        engine: EngineCore,
        prompt: str | list[int],
        req: CompletionRequest | ChatCompletionRequest,
        max_tokens: int | None,
        logprobs: int | None,
        base_id: str,
        first: int,
        transfer: KVTransferParams | None,
    ) -> list[PreparedRequest]:
        """One prompt's engine requests: ``n`` of them (choices ``first`` on), each with its
        own seed (the request's plus its place, as vLLM seeds them)."""
        limit = engine.max_model_len
        try:
            if isinstance(prompt, str) and req.truncate_prompt_tokens is None:
                check_text_length(engine.tokenizer, prompt, limit)  # before tokenizing it
            ids = self._prompt_ids(engine, prompt, req)
            if len(ids) > limit:
                raise PromptTooLong.tokens(limit, len(ids), text=isinstance(prompt, str))
        except PromptTooLong as exc:
            raise vllm_error(str(exc), exc.param, exc.value) from None
        except InvalidParam as exc:
            raise OpenAIError(400, str(exc), param=exc.param) from None
        max_tokens = _output_room(limit - len(ids), max_tokens, req.min_tokens)
        stop = req.stop if isinstance(req.stop, list) else [] if req.stop is None else [req.stop]
        bad_words = _bad_words(self._tokenizer(engine), req.bad_words) if req.bad_words else []
        prepared = []
        try:
            for j in range(req.choices_per_prompt):
                params = SamplingParams(
                    max_tokens=max_tokens,
                    temperature=1.0 if req.temperature is None else req.temperature,
                    top_k=req.top_k or 0,
                    top_p=1.0 if req.top_p is None else req.top_p,
                    min_p=req.min_p or 0.0,
                    seed=_seed(req.seed, j),
                    stop=stop,
                    stop_token_ids=list(req.stop_token_ids or []),
                    ignore_eos=req.ignore_eos,
                    min_tokens=req.min_tokens,
                    logprobs=logprobs,
                    include_stop_str_in_output=req.include_stop_str_in_output or req.no_stop_trim,
                    skip_special_tokens=req.skip_special_tokens,
                    allowed_token_ids=req.allowed_token_ids,
                    bad_words_token_ids=bad_words,
                    logit_bias=req.logit_bias_ids(),
                    presence_penalty=req.presence_penalty or 0.0,
                    frequency_penalty=req.frequency_penalty or 0.0,
                    repetition_penalty=(
                        1.0 if req.repetition_penalty is None else req.repetition_penalty
                    ),
                )
                # Unique in the engine even when a client reuses its X-Request-Id.
                request_id = f"{base_id}-{first + j}-{uuid.uuid4().hex[:8]}"
                prepared.append(
                    engine.prepare_tokens(
                        ids,
                        params,
                        request_id,
                        cache_salt=req.cache_salt,
                        pin_blocks=bool(transfer and transfer.do_remote_decode),
                    )
                )
        except InvalidParam as exc:
            raise OpenAIError(400, str(exc), param=exc.param) from None
        return prepared

    def _admit(self, job: Job, metrics: WorkerMetrics) -> None:
        """Bound the work waiting for prefill: beyond the limit, 429 with a Retry-After from
        the recent prefill rate, so latency does not grow without bound."""
        tokens = sum(len(p.prompt_token_ids) for p in job.prepared)
        limit = self.settings.waiting_token_limit
        if self.queued_tokens and self.queued_tokens + tokens > limit:
            assert self.loop is not None
            rate = self.loop.prompt_token_rate
            wait = self.queued_tokens / rate if rate > 0 else 1.0
            retry = max(1, min(60, math.ceil(wait)))
            metrics.reject("overloaded")
            raise OpenAIError(
                429,
                f"this worker has {self.queued_tokens} prompt tokens waiting "
                f"(limit {limit}); retry in {retry} s",
                type="rate_limit_error",
                code="overloaded",
                headers={"Retry-After": str(retry)},
            )
        job.queued_tokens = tokens
        self.queued_tokens += tokens
        self.in_flight += 1
        self._idle.clear()

    def _close(self, job: Job) -> None:
        """After a streamed response, sent or not: nothing of the job may outlive it."""
        self._abandon(job)
        self._done(job)

    def _done(self, job: Job) -> None:
        if job.done:
            return
        job.done = True
        self.queued_tokens -= job.queued_tokens
        job.queued_tokens = 0
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()
        if job.trace is not None:
            try:
                self._record_trace(job, job.trace)
            except Exception:  # a trace is never worth a request
                log.exception("request %s: recording its trace failed", job.id)

    def _record_trace(self, job: Job, trace: Trace) -> None:
        """The job's spans, now that it is over: ``kvpool.worker.request`` (arrival to
        end) under the caller's span, and under it each choice's queue (sent to the engine
        to first scheduled), prefill (to its first token) and decode (to its end), plus the
        KV pull of a decode leg. Times are the engine's own (its outputs' stamps)."""
        now = time.monotonic()
        wall = tracing.wall_ns
        many = len(job.prepared) > 1
        phases: list[tuple[str, float, float, dict[str, Any]]] = []
        reasons: list[str] = []
        totals = {"kvpool.prompt_tokens": 0, "kvpool.cached_tokens": 0, "kvpool.output_tokens": 0}
        ends: list[float] = []
        for i, prepared in enumerate(job.prepared):
            seq = prepared.seq
            timer = job.timers[i] if job.timers else None
            first = timer.first if timer is not None else None
            if timer is not None and timer.end is not None:
                choice_end, reason = timer.end, timer.finish_reason or "stop"
            else:  # its client left, or it never reached the engine
                choice_end, reason = now, "abort"
            ends.append(choice_end)
            reasons.append(reason)
            counts = {
                "kvpool.prompt_tokens": seq.num_prompt_tokens,
                "kvpool.cached_tokens": seq.num_cached_tokens,
                "kvpool.output_tokens": seq.num_output_tokens,
            }
            for k, v in counts.items():
                totals[k] += v
            label = {"kvpool.choice": i} if many else {}
            queued = trace.submitted or job.arrival
            scheduled = seq.scheduled_at
            if scheduled is None:  # ended before the engine got to it
                phases.append(("kvpool.worker.queue", queued, choice_end, label))
                continue
            phases.append(("kvpool.worker.queue", queued, scheduled, label))
            prefill = {
                **label,
                "kvpool.prompt_tokens": seq.num_prompt_tokens,
                "kvpool.cached_tokens": seq.num_cached_tokens,
            }
            phases.append(("kvpool.worker.prefill", scheduled, first or choice_end, prefill))
            if first is not None:
                decode = {**label, "kvpool.output_tokens": seq.num_output_tokens}
                phases.append(("kvpool.worker.decode", first, choice_end, decode))
        distinct = sorted(set(reasons))
        parent = tracing.record_span(
            "kvpool.worker.request",
            wall(job.arrival),
            wall(max(ends, default=now)),
            {
                "kvpool.request_id": job.id.split("-", 1)[1],
                "kvpool.model": self.model_name,
                "kvpool.role": self.settings.role,
                "kvpool.kind": job.kind,
                "kvpool.stream": job.stream,
                "kvpool.finish_reason": ",".join(distinct),
                **totals,
            },
            context=trace.context,
            error="the engine failed while running this request" if "error" in distinct else None,
        )
        under = tracing.child_context(parent)
        if trace.kv_pull is not None:
            start, stop, stored = trace.kv_pull
            tracing.record_span(
                "kvpool.worker.kv_pull",
                wall(start),
                wall(stop),
                {"kvpool.blocks": stored or 0},
                context=under,
                error=None if stored is not None else "the pull failed; prefill computed here",
            )
        for name, start, stop, attributes in phases:
            tracing.record_span(name, wall(start), wall(stop), attributes, context=under)

    def _prefilled(self, job: Job, prepared: PreparedRequest) -> None:
        n = min(job.queued_tokens, len(prepared.prompt_token_ids))
        job.queued_tokens -= n
        self.queued_tokens -= n

    async def _start(self, job: Job) -> None:
        """Hand the job's requests to the engine now (a decode leg pulls its prefill first),
        so the engine works while the response is being set up."""
        engine, loop, _ = self._ready()
        trace = job.trace
        for i, prepared in enumerate(job.prepared):
            t = job.transfer
            if t is not None and t.do_remote_prefill:
                try:
                    if trace is None:
                        await self._pull_remote_prefill(prepared, t)
                    else:
                        start = time.monotonic()
                        stored = await self._pull_remote_prefill(prepared, t)
                        trace.kv_pull = (start, time.monotonic(), stored)
                except BaseException:  # the client left: the blocks it holds go back
                    loop.call_soon(engine.release_held, prepared.seq)
                    raise
            if trace is not None and not trace.submitted:
                trace.submitted = time.monotonic()
            job.unfinished.add(prepared.request_id)
            loop.submit(prepared, job.outputs, i)

    async def _outputs(self, job: Job) -> AsyncIterator[tuple[int, TimedOutput]]:
        """All the job's engine outputs as they come, tagged with their choice index. A
        reader that stops early aborts the requests still running."""
        _, _, metrics = self._ready()
        timers = job.timers = [RequestTimer(metrics, job.arrival) for _ in job.prepared]
        started = [False] * len(job.prepared)
        try:
            while job.unfinished:
                item = await job.outputs.get()
                i, out = item.tag, item.output
                if not started[i]:
                    started[i] = True
                    self._prefilled(job, job.prepared[i])
                timers[i].observe(out, item.time)
                if out.finished:
                    job.unfinished.discard(out.request_id)
                yield i, item
        finally:
            self._abandon(job)

    def _abandon(self, job: Job) -> None:
        """Abort what still runs of a job whose client left (idempotent)."""
        if job.unfinished and self.loop is not None and self.metrics is not None:
            self.metrics.request_success.labels(self.model_name, "abort").inc(len(job.unfinished))
            for request_id in job.unfinished:
                self.loop.abort(request_id)
            job.unfinished.clear()

    @property
    def port(self) -> int:
        return self.bound_port or self.settings.port


def _seed(seed: int | None, index: int) -> int | None:
    """The seed of a prompt's ``index``-th choice: the request's plus the index, in 64 bits
    (vLLM's); -1 is none, as there."""
    if seed is None or seed == -1:
        return None
    seed += index
    return seed - 2**64 if seed >= 2**64 else seed


def _bad_words(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """``bad_words`` as token sequences, as vLLM tokenizes them: each word as it is and,
    where that gives a different first token of the same length, with a leading space (a
    word is banned at the start of the text and inside it)."""
    out: list[list[int]] = []
    for word in words:
        if not word:
            raise vllm_error("bad_words cannot contain an empty string.", "bad_words")
        for space in ("", " "):
            ids = list(tokenizer.encode(space + word.lstrip(), add_special_tokens=False))
            if not ids:
                if not space:
                    raise vllm_error(
                        "bad_words entries must tokenize to at least one token.", "bad_words"
                    )
                continue
            if not space or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
    return out


def _loopback(host: str | None) -> bool:
    """Whether a client address is this host's own (IPv4, IPv6, or IPv4 mapped in IPv6)."""
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def _reachable(endpoint: str, host: str) -> str:
    """A bound ZMQ endpoint as others can reach it (a wildcard bind names no host)."""
    for wildcard in ("0.0.0.0", "*", "[::]"):
        endpoint = endpoint.replace(f"//{wildcard}:", f"//{host}:")
    return endpoint


def _check_output_limit(req: CompletionRequest | ChatCompletionRequest, limit: int) -> None:
    """vLLM refuses a request for more output tokens than the whole context, before it
    reads the prompt, naming the field the request gave."""
    named = output_limit(req, "chat" if isinstance(req, ChatCompletionRequest) else "completion")
    if named is not None and named[1] > limit:
        raise output_over_context(named[0], named[1], limit)


def _output_room(room: int, max_tokens: int | None, min_tokens: int) -> int:
    """The tokens a prompt may generate, as vLLM 0.32 sets them: what it asks for, cut to
    the room its context leaves (not refused); refused when no token fits, or when fewer
    fit than ``min_tokens`` asks for."""
    max_tokens = room if max_tokens is None else min(max_tokens, room)
    if max_tokens < 1:
        raise vllm_error(
            f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens
        )
    if min_tokens > max_tokens:
        raise vllm_error(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
            None,
        )
    return max_tokens
