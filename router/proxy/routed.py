"""The record of one request on its way through the router (:class:`Routed`): what
receiving it found (its tokens and keys, model, session, limits), what admission gave it
and the plan made for it; and the second half of a split request (:class:`DecodeLeg`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..admission.gate import Pass
from ..routing.planner import Plan
from ..routing.tokens import Batch
from ..state.worker import WorkerState
from .request import Kind

__all__ = ["DecodeLeg", "Routed"]


@dataclass
class Routed:
    """A request, tokenized and hashed, ready for the policy."""

    request_id: str
    path: str  # the worker's endpoint
    body: bytes  # what the workers get: the client's, but for the router's bookkeeping
    model: str | None
    stream: bool
    num_tokens: int
    keys: list[int]
    splittable: bool = True  # one prompt: the prefill/decode hand-off carries one
    #: the router asked for usage on the stream: the usage chunk is not passed on
    strip_usage: bool = False
    session: str | None = None
    #: why the prompt has less cache credit than tokens (content it cannot tokenize)
    credit_note: str | None = None
    #: worker -> the data-parallel rank holding its match, from the last lookup
    ranks: dict[str, int] = field(default_factory=dict)
    kind: Kind = "completion"
    #: the client's headers passed on (FORWARDED_HEADERS)
    headers: dict[str, str] = field(default_factory=dict)
    #: the worker that stored the response this one continues (previous_response_id)
    pin: str | None = None
    #: the most tokens it may generate, all choices together (for the tokens/minute limit)
    max_tokens: int = 0
    #: what admission gave it (its tenant, slot, reserved tokens), settled when it ends
    admitted: Pass | None = None
    #: the plan admission made when it let the request straight through (the pool was not
    #: saturated for it): the one it is sent by, not made twice
    plan: Plan | None = None
    #: its prefix was counted in the router's heat (once, whatever the plans made for it)
    heat_seen: bool = False
    #: a completion's list of prompts (``keys`` are its first's); None for one prompt
    batch: Batch | None = None
    #: False: the worker reads no prefix cache for it (prompt logprobs; request.py)
    reads_cache: bool = True


@dataclass
class DecodeLeg:
    """The second half of a split: the body with the prefill worker's ``kv_transfer_params``
    and where they came from (to release the blocks if no decode worker takes them)."""

    body: bytes
    params: dict[str, Any]
    prefill: WorkerState
    tail_tokens: int  # what the decode worker computes itself: the part of a block
    sent: bool = False  # a decode worker got it: that worker pulls and releases the blocks
