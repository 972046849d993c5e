"""A worker's HTTP generation request as the server and its answers (:mod:`.responses`)
share it: its engine requests, how to answer, and its accounting."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from kvpool.openai_api import KVTransferParams

from .engine import PreparedRequest
from .engine_loop import TimedOutput
from .metrics import RequestTimer

__all__ = ["Job", "Trace"]


@dataclass
class Trace:
    """What a traced job's spans need beyond what the job keeps anyway."""

    context: Any  # the caller's trace context (from traceparent), or None: a new trace
    submitted: float = 0.0  # time.monotonic() when its requests went to the engine
    kv_pull: tuple[float, float, int | None] | None = None  # start, end, blocks stored


@dataclass
class Job:
    """One HTTP generation request: its engine requests and how to answer."""

    id: str
    kind: str  # "completion" or "chat"
    created: int
    arrival: float
    prepared: list[PreparedRequest]
    stream: bool
    include_usage: bool
    logprobs: int | None
    transfer: KVTransferParams | None
    queued_tokens: int = 0
    outputs: asyncio.Queue[TimedOutput] = field(default_factory=asyncio.Queue)
    unfinished: set[str] = field(default_factory=set)  # engine requests still running
    done: bool = False  # its accounting (in flight, queued tokens) is settled
    timers: list[RequestTimer] = field(default_factory=list)  # per choice, once read
    trace: Trace | None = None  # tracing is on
    n: int = 1  # choices per prompt: choice i is prompt i // n's
    echoed: list[str] | None = None  # per choice: the text echo puts before its answer
    echo_only: bool = False  # the answer is the echoed prompt alone (max_tokens 0)
    token_ids: bool = False  # return_token_ids: the prompt's and each choice's token ids
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprobs' tokens "token_id:N"
    continuous_usage: bool = False  # usage in every streamed chunk
    prompt_text: str | None = None  # return_prompt_text: the rendered chat prompt
