"""The worker's HTTP side of the prefill/decode hand-off (contract 4).

The prefill side answers ``GET /kv/{request_id}`` (the pinned blocks, streamed, opened by
the hand-off's one-time token) and ``DELETE /kv/{request_id}`` (free the pin), and signs the
``kv_transfer_params`` a prefill leg answers. The decode side checks a leg's
``kv_transfer_params`` (the pool's signature), pulls the blocks into its cache (through
:class:`~.kv_transfer.ImportSink`), and falls back to computing the prompt itself on any
failure. The engine's side (pins, imports) is :mod:`.handoff`; the transfer's format is
:mod:`.kv_transfer`.

:class:`HandOffEndpoints` is a part of ``WorkerServer``, which provides its settings, the
pool secret, the admin token, the engine (``_ready``) and its address.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvpool.openai_api import KVTransferParams, OpenAIError
from kvpool.signing import (
    TOKEN_FIELD,
    InvalidSignature,
    bearer_token,
    constant_time_equal,
    new_token,
    sign_transfer_params,
    verify_transfer_params,
)

from .engine import EngineCore, PreparedRequest
from .engine_loop import EngineLoop
from .kv_transfer import ImportSink, TransferError, TransferHeader, pull_blocks_into, stream_blocks
from .metrics import WorkerMetrics
from .settings import WorkerSettings

log = logging.getLogger("kvpool.worker.server")

#: how long a hand-off's signature and token outlive the pin they open: room for clocks
#: that disagree by a few seconds
HANDOFF_SLACK_S = 10.0


def require_bearer(request: Request, message: str, code: str) -> str:
    """The request's bearer token, or 401 with ``message`` and ``code``."""
    token = bearer_token(request.headers.get("authorization"))
    if token is None:
        raise OpenAIError(
            401,
            message,
            type="authentication_error",
            code=code,
            headers={"WWW-Authenticate": "Bearer"},
        )
    return token


class HandOffEndpoints:
    """The hand-off's endpoints and both legs' plumbing (a part of ``WorkerServer``)."""

    settings: WorkerSettings
    engine_id: str
    advertised_host: str
    _secret: str | None
    _admin_token: str
    _kv_tokens: dict[str, tuple[str, float]]
    _http: httpx.AsyncClient | None

    def _ready(self) -> tuple[EngineCore, EngineLoop, WorkerMetrics]:
        raise NotImplementedError

    @property
    def port(self) -> int:
        raise NotImplementedError

    def _issue_kv_token(self, request_id: str) -> str:
        """A new one-time token for a request's pinned blocks (forgetting expired ones)."""
        now = time.monotonic()
        tokens = self._kv_tokens
        while tokens:
            oldest = next(iter(tokens))
            if tokens[oldest][1] > now:
                break
            del tokens[oldest]
        token = new_token()
        tokens[request_id] = (token, now + self.settings.kv_pin_timeout_s + HANDOFF_SLACK_S)
        return token

    def _take_kv_token(self, request: Request, request_id: str, *, admin_ok: bool) -> None:
        """Check (and use up) the hand-off's token for ``request_id``; ``admin_ok``: the
        admin token also opens it (freeing a pin, not reading it)."""
        token = require_bearer(
            request,
            "KV blocks are handed only to the holder of the hand-off's token: send "
            "'Authorization: Bearer <kv_transfer_params.kvpool_token>'",
            "kv_token_required",
        )
        token_of, expiry = self._kv_tokens.get(request_id, (None, 0.0))
        if expiry > time.monotonic() and constant_time_equal(token, token_of):
            del self._kv_tokens[request_id]  # one pull (or one release) per token
            return
        if admin_ok and constant_time_equal(token, self._admin_token):
            return
        raise OpenAIError(
            403,
            f"the token does not open the blocks of request {request_id!r} (wrong, used "
            "already, or expired)",
            type="permission_error",
            code="invalid_kv_token",
        )

    async def get_kv(self, request: Request) -> Response:
        request_id = request.path_params["request_id"]
        engine, loop, metrics = self._ready()
        self._take_kv_token(request, request_id, admin_ok=False)
        pin = await loop.call(engine.open_pinned, request_id)
        if pin is None:
            raise OpenAIError(
                404,
                f"no pinned blocks for request {request_id!r} (pulled, freed, or timed out)",
                type="not_found_error",
                code="kv_not_found",
            )
        layout = engine.kv_layout
        header = TransferHeader(
            request_id=request_id,
            dtype=layout.dtype,
            block_shape=layout.block_shape,
            layout=layout.layout,
            block_bytes=layout.block_bytes,
            block_size=engine.pool.block_size,
            num_prompt_tokens=pin.num_prompt_tokens,
            block_hashes=pin.block_keys,
        )

        async def read(ids: Sequence[int]) -> bytes | memoryview:
            # Off the engine's thread, alongside its steps (pinned blocks are immutable):
            # a busy prefill worker sends at the speed of the copy, not one chunk per step.
            # The reader's reference (open_pinned) keeps the blocks until done() below.
            return await asyncio.to_thread(engine.read_blocks, ids) if header.block_bytes else b""

        async def body() -> AsyncIterator[bytes | memoryview]:
            async for chunk in stream_blocks(header, pin.block_ids, read):
                yield chunk
            metrics.transferred("sent", len(pin.block_ids), header.body_bytes)

        def done() -> None:
            # The token is spent: nobody else can pull these blocks, so keep them no longer.
            engine.close_pinned(pin)
            engine.unpin(request_id)

        size = len(header.encode()) + header.body_bytes
        return ClosingStream(
            body(),
            lambda: loop.call_soon(done),
            media_type="application/octet-stream",
            headers={"Content-Length": str(size)},
        )

    async def delete_kv(self, request: Request) -> JSONResponse:
        request_id = request.path_params["request_id"]
        engine, loop, _ = self._ready()
        self._take_kv_token(request, request_id, admin_ok=True)
        if not await loop.call(engine.unpin, request_id):
            raise OpenAIError(
                404,
                f"no pinned blocks for request {request_id!r}",
                type="not_found_error",
                code="kv_not_found",
            )
        return JSONResponse({"freed": request_id})

    async def _pull_remote_prefill(
        self, prepared: PreparedRequest, transfer: KVTransferParams
    ) -> int | None:
        """Fetch a prefill worker's blocks into this cache; on any failure, log and count
        it, and let the request compute its prefill here. Returns how many blocks are
        cached, or None after a failure."""
        engine, loop, metrics = self._ready()
        host = transfer.remote_host or ""
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # an IPv6 address
        rid = urllib.parse.quote(transfer.remote_request_id or "", safe="")
        url = f"http://{host}:{transfer.remote_port}/kv/{rid}"
        # The one-time token: the prefill worker hands its blocks to no one else.
        auth = {"Authorization": f"Bearer {getattr(transfer, TOKEN_FIELD, '')}"}
        start = time.monotonic()
        sink = ImportSink(engine, loop, prepared)
        settled = False  # the import finished, or was given back
        try:
            try:
                header = await pull_blocks_into(
                    url,
                    sink,
                    timeout=self.settings.kv_transfer_timeout_s,
                    deadline_s=self.settings.kv_transfer_deadline_s,
                    headers=auth,
                )
                # What the bytes would take on the wire (a simulated engine's; a real one's
                # took their time already), waited out here, not in the engine's step.
                delay = engine.transfer_seconds(len(header.block_hashes) * header.block_size)
                if delay > 0:
                    await asyncio.sleep(delay)
                stored = await sink.finish(complete=True)
            except Exception as exc:  # whatever went wrong, the answer can be computed here
                metrics.kv_transfer_fallbacks.inc()
                # Blocks that arrived whole are kept (cached for this request); it computes
                # the rest of its prompt here.
                kept = await sink.finish(complete=False)
                settled = True
                log.warning(
                    "request %s: remote prefill unusable, computing it here (%d blocks kept): %s",
                    prepared.request_id,
                    kept,
                    exc,
                    exc_info=not isinstance(exc, TransferError | ValueError),
                )
                # A pull that was read to its end freed the pin; one that failed may not have.
                _background(self._release_remote(url, auth))
                return None
            settled = True
        finally:
            if not settled:  # cancelled (the client left, or shutdown): give the blocks back
                sink.abort()
        metrics.kv_pull_seconds.observe(time.monotonic() - start)
        metrics.transferred("received", len(header.block_hashes), header.body_bytes)
        if stored < len(header.block_hashes):  # no room here for the rest: computed here
            metrics.kv_transfer_fallbacks.inc()
            log.info(
                "request %s: %d of %d remote blocks stored (the cache had no room for the "
                "rest), computing the rest here",
                prepared.request_id,
                stored,
                len(header.block_hashes),
            )
        log.debug("request %s: %d remote blocks stored", prepared.request_id, stored)
        return stored

    async def _release_remote(self, url: str, headers: dict[str, str]) -> None:
        """Free the pin if the pull never reached it (a pull frees it itself)."""
        if self._http is None:
            return
        with contextlib.suppress(httpx.HTTPError):
            await self._http.delete(url, timeout=5.0, headers=headers)

    def _check_transfer(self, transfer: KVTransferParams, stream: bool) -> None:
        role = self.settings.role
        if transfer.do_remote_decode:
            if role == "decode":
                raise OpenAIError(
                    400,
                    "kv_transfer_params.do_remote_decode: this worker's role "
                    "is decode; send prefills to a prefill or both worker",
                    param="kv_transfer_params",
                )
            if self._secret is None:
                raise OpenAIError(
                    400,
                    "kv_transfer_params.do_remote_decode: this worker has no pool secret "
                    "(--pool-secret), so it cannot sign a hand-off; send the request whole",
                    code="kv_transfer_disabled",
                    param="kv_transfer_params",
                )
            if stream:
                raise OpenAIError(
                    400,
                    "kv_transfer_params.do_remote_decode: the prefill leg "
                    "answers once; use stream=false",
                    param="stream",
                )
        if transfer.do_remote_prefill:
            if role == "prefill":
                raise OpenAIError(
                    400,
                    "kv_transfer_params.do_remote_prefill: this worker's role is prefill",
                    param="kv_transfer_params",
                )
            missing = [
                name
                for name in ("remote_host", "remote_port", "remote_request_id")
                if getattr(transfer, name) is None
            ]
            if missing:
                raise OpenAIError(
                    400,
                    "kv_transfer_params.do_remote_prefill needs " + ", ".join(missing),
                    param="kv_transfer_params",
                )
            if self._secret is None:
                raise OpenAIError(
                    400,
                    "kv_transfer_params.do_remote_prefill: this worker has no pool secret "
                    "(--pool-secret), so it cannot tell a pool worker's hand-off from a "
                    "forged one; send the request whole",
                    code="kv_transfer_disabled",
                    param="kv_transfer_params",
                )
            try:
                verify_transfer_params(transfer.model_dump(), self._secret)
            except InvalidSignature as exc:
                raise OpenAIError(
                    400,
                    f"kv_transfer_params: {exc}. Only a prefill worker of this pool, through "
                    "the router, hands off a prefill; send the request without them",
                    code="invalid_kv_transfer_params",
                    param="kv_transfer_params",
                ) from None

    async def _transfer_params(self, prepared: PreparedRequest) -> dict[str, Any] | None:
        engine, loop, _ = self._ready()
        pin = await loop.call(engine.pinned, prepared.request_id)
        if pin is None:
            return None
        assert self._secret is not None  # _check_transfer refuses the leg without one
        params = KVTransferParams(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_block_ids=pin.block_ids,
            remote_engine_id=self.engine_id,
            remote_request_id=prepared.request_id,
            remote_host=self.advertised_host,
            remote_port=self.port,
        ).model_dump()
        params[TOKEN_FIELD] = self._issue_kv_token(prepared.request_id)
        ttl = self.settings.kv_pin_timeout_s + HANDOFF_SLACK_S
        return sign_transfer_params(params, self._secret, ttl_s=ttl)


#: tasks nobody awaits (releasing a remote pin), kept until done so none is collected early
_TASKS: set[asyncio.Task[None]] = set()


def _background(coro: Coroutine[Any, Any, None]) -> None:
    task = asyncio.ensure_future(coro)
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)


class ClosingStream(StreamingResponse):
    """A streamed response that runs ``on_close`` however it ends, even if the client left
    before the body started (then the body's own ``finally`` never runs)."""

    def __init__(self, body: AsyncIterator[Any], on_close: Callable[[], None], **kwargs: Any):
        super().__init__(body, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
