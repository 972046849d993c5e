"""Endpoints passed to a worker as they are (:class:`.server.Router`'s part):
``/v1/embeddings``, ``/tokenize`` and ``/detokenize``."""

from __future__ import annotations

import logging
import time

import aiohttp
from fastapi import Request
from fastapi.responses import Response

from kvpool.openai_api import (
    OpenAIError,
)

from ..admission.gate import Pass
from .forward import PASSED_HEADERS
from .receive import client_address, draining_error
from .request import parse_body

__all__ = ["PASSTHROUGH_PATHS", "Passthrough"]

log = logging.getLogger(__name__)

#: the endpoints passed to a healthy worker of the model as they are
PASSTHROUGH_PATHS = ("/v1/embeddings", "/tokenize", "/detokenize")


class Passthrough:
    """:class:`.server.Router`'s pass-through endpoints."""

    async def passthrough(self, request: Request) -> Response:
        """``/v1/embeddings``, ``/tokenize``, ``/detokenize``: to the least busy healthy
        worker of the model, as they are; another worker if that one cannot be reached."""
        if self.draining:
            raise draining_error()
        gate = self._gate()
        admitted = gate.enter(request.headers, client_address(request))
        try:
            return await self._pass(request, admitted)
        except OpenAIError as exc:
            admitted.error = exc.message
            raise
        finally:
            gate.finish(admitted)

    async def _pass(self, request: Request, admitted: Pass) -> Response:
        body = await self._body(request)
        obj = parse_body(body)
        model = obj.get("model")
        model = model if isinstance(model, str) and model != self.settings.model else None
        self._check_model(model)
        # an embeddings input is prefilled by the worker: load while it runs there, as a
        # generate request's is, so that the next one goes to another worker
        tokens = 0
        prefills = request.url.path == "/v1/embeddings"  # /tokenize, /detokenize: no engine
        if prefills and self.prompt_keys is not None:
            tokens = await self.prompt_keys.input_tokens(obj)
        pool = self._pool()
        now = time.monotonic()
        candidates = sorted(
            (
                s
                for s in pool.routable()
                if not s.breaker.is_open(now)
                and (model is None or model in s.models or s.model == model)
            ),
            key=lambda s: s.in_flight,
        )[: self.settings.max_attempts]
        headers = {"content-type": "application/json", "x-request-id": self._request_id(request)}
        headers.update({k: v for k in self._forwarded if (v := request.headers.get(k)) is not None})
        assert self.upstream is not None
        failures = []
        admitted.sent = bool(candidates)
        for state in candidates:
            ticket = (
                state.begin(tokens, state.prefill.predict(tokens), time.monotonic(), learn=False)
                if prefills
                else None
            )
            try:
                async with self.upstream.post(
                    state.url + request.url.path,
                    data=body,
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=self.settings.request_timeout_s),
                ) as resp:
                    content = await resp.read()
                    if resp.status >= 500:
                        failures.append(f"{resp.status}")
                        continue
                    passed = {k: v for k in PASSED_HEADERS if (v := resp.headers.get(k))}
                    return Response(content, status_code=resp.status, headers=passed)
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                log.warning("%s on worker %s failed: %r", request.url.path, state.id, exc)
                failures.append(type(exc).__name__)
            finally:
                if ticket is not None:
                    state.end(ticket)
        raise OpenAIError(
            503 if not failures else 502,
            "no worker can take this request now"
            + (f" ({len(failures)} tried: {', '.join(failures)})" if failures else ""),
            type="service_unavailable" if not failures else "server_error",
            code="no_worker" if not failures else "worker_unavailable",
            headers={"Retry-After": "1"},
        )
