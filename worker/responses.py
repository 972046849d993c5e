"""A worker's answers: the engine's outputs as OpenAI responses, whole or streamed (SSE).

:class:`Responses` is a part of ``WorkerServer``, which provides the job's outputs
(``_outputs``), its clean-up (``_close``, ``_done``), the model's name and tokenizer, and the
hand-off's parameters for a prefill leg's answer (``_transfer_params``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvpool.openai_api import OpenAIError

from . import openai_format as fmt
from .engine import EngineCore, PreparedRequest, RequestOutput
from .engine_loop import TimedOutput
from .handoff_http import ClosingStream
from .jobs import Job


class Responses:
    """Whole answers and SSE streams of a job's outputs (a part of ``WorkerServer``)."""

    model_name: str
    engine: EngineCore | None

    def _outputs(self, job: Job) -> AsyncIterator[tuple[int, TimedOutput]]:
        raise NotImplementedError

    def _close(self, job: Job) -> None:
        raise NotImplementedError

    def _done(self, job: Job) -> None:
        raise NotImplementedError

    async def _transfer_params(self, prepared: PreparedRequest) -> dict[str, Any] | None:
        raise NotImplementedError

    async def _answer(self, request: Request, job: Job) -> Response:
        headers = {"X-Request-Id": job.id.split("-", 1)[1]}
        if job.stream:
            return ClosingStream(
                self._sse(job),
                lambda: self._close(job),
                media_type="text/event-stream",
                headers=headers,
            )
        collect = asyncio.create_task(self._collect(job))
        gone = asyncio.create_task(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client left (or we were cancelled): stop its requests
                collect.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await collect
        if collect.cancelled():
            return Response(status_code=499)  # nobody is listening
        return JSONResponse(collect.result(), headers=headers)

    async def _collect(self, job: Job) -> dict[str, Any]:
        n = len(job.prepared)
        texts = [""] * n
        outs: list[list[RequestOutput]] = [[] for _ in range(n)]
        try:
            async with contextlib.aclosing(self._outputs(job)) as outputs:
                async for i, item in outputs:
                    outs[i].append(item.output)
                    texts[i] += item.output.new_text
        finally:
            self._done(job)
        choices = []
        for i in range(n):
            last = outs[i][-1]
            if last.finish_reason == "error":
                raise OpenAIError(
                    500,
                    "the engine failed while running this request",
                    type="server_error",
                    code="engine_error",
                )
            lps = [lp for o in outs[i] for lp in o.logprobs]
            text = "" if job.echo_only else texts[i]
            if job.echoed is not None:
                text = job.echoed[i] + text
            c = self._choice(job, i, text, last, lps, final=True)
            if job.token_ids:
                if job.kind == "completion":
                    c["prompt_token_ids"] = job.prepared[i].prompt_token_ids
                c["token_ids"] = [t for o in outs[i] for t in o.new_token_ids]
            choices.append(c)
        body: dict[str, Any] = {
            "id": job.id,
            "object": "chat.completion" if job.kind == "chat" else "text_completion",
            "created": job.created,
            "model": self.model_name,
            "choices": choices,
            "usage": fmt.usage([o[-1] for o in outs], job.n),
        }
        if job.kind == "chat" and job.token_ids:
            body["prompt_token_ids"] = job.prepared[0].prompt_token_ids
        if job.prompt_text is not None:
            body["prompt_text"] = job.prompt_text
        if job.transfer is not None and job.transfer.do_remote_decode:
            body["kv_transfer_params"] = await self._transfer_params(job.prepared[0])
        return body

    def _choice(
        self,
        job: Job,
        index: int,
        text: str,
        out: RequestOutput,
        lps: list[Any],
        *,
        final: bool,
        text_offset: int = 0,
    ) -> dict[str, Any]:
        logprobs = None
        if job.logprobs is not None:
            tokenizer = self.engine.tokenizer if self.engine is not None else None
            logprobs = fmt.logprobs(job.kind, lps, tokenizer, text_offset, as_ids=job.tokens_as_ids)
        return fmt.choice(job.kind, index, text, out, logprobs, final=final)

    async def _sse(self, job: Job) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if job.kind == "chat" else "text_completion"

        def chunk(choices: list[dict[str, Any]], usage: Any = None, **extra: Any) -> bytes:
            body: dict[str, Any] = {
                "id": job.id,
                "object": obj,
                "created": job.created,
                "model": self.model_name,
                "choices": choices,
                **extra,
            }
            if job.include_usage:
                body["usage"] = usage
            return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"

        lasts: dict[int, RequestOutput] = {}
        offsets: dict[int, int] = {}  # per choice: where the next logprob token's text starts
        begun: set[int] = set()  # choices whose first output has been sent
        try:
            if job.kind == "chat":
                first: dict[str, Any] = {}
                if job.token_ids:
                    first["prompt_token_ids"] = job.prepared[0].prompt_token_ids
                if job.prompt_text is not None:
                    first["prompt_text"] = job.prompt_text
                prompt_tokens = len(job.prepared[0].prompt_token_ids)
                yield chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                        for i in range(len(job.prepared))
                    ],
                    (
                        {
                            "prompt_tokens": prompt_tokens,
                            "completion_tokens": 0,
                            "total_tokens": prompt_tokens,
                        }
                        if job.continuous_usage
                        else None
                    ),
                    **first,
                )
            async with contextlib.aclosing(self._outputs(job)) as outputs:
                async for i, item in outputs:
                    out = item.output
                    if out.finish_reason == "error":
                        err = OpenAIError(
                            500,
                            "the engine failed while running this request",
                            type="server_error",
                            code="engine_error",
                        )
                        yield b"data: " + json.dumps(err.body()).encode() + b"\n\n"
                        yield b"data: [DONE]\n\n"
                        return
                    if out.finished:
                        lasts[i] = out
                    text = "" if job.echo_only else out.new_text
                    if i not in begun and job.echoed is not None:
                        text = job.echoed[i] + text
                    if text or out.finished or job.logprobs is not None or job.token_ids:
                        c = self._choice(
                            job,
                            i,
                            text,
                            out,
                            out.logprobs,
                            final=False,
                            text_offset=offsets.get(i, 0),
                        )
                        if c["logprobs"] and "tokens" in c["logprobs"]:
                            offsets[i] = offsets.get(i, 0) + sum(map(len, c["logprobs"]["tokens"]))
                        if job.token_ids:
                            if job.kind == "completion" and i not in begun:
                                c["prompt_token_ids"] = job.prepared[i].prompt_token_ids
                            c["token_ids"] = out.new_token_ids
                        begun.add(i)
                        usage = fmt.running_usage(out) if job.continuous_usage else None
                        yield chunk([c], usage)
            if job.include_usage:
                yield chunk([], fmt.usage([lasts[i] for i in sorted(lasts)], job.n))
            yield b"data: [DONE]\n\n"
        finally:
            self._done(job)


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
