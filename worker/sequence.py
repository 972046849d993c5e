"""One request as the engine sees it: its tokens, how many have KV computed, its blocks,
its sampling settings, and its place in the queue."""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field

import torch

from kvpool.hashing import BlockHashChain


class InvalidParam(ValueError):
    """A request setting that cannot be served; ``param`` names it (for an API error)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


#: temperatures at or below this are greedy, as in vLLM and SGLang (dividing logits by
#: 1e-40 would overflow them to infinity, and softmax to NaN)
SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. A temperature of at most
    :data:`SAMPLING_EPS` (0 too) is greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # top-n alternatives per generated token (0: chosen only)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # What reshapes the logits before a token is drawn, as vLLM applies them: only the
    # allowed tokens, no token that would complete a bad word, the logit bias, then the
    # penalties (repetition over prompt and output; presence and frequency over the
    # output, as OpenAI defines them); min_p after the temperature.
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    logit_bias: dict[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (math.isfinite(self.temperature), "temperature", "must be a finite number"),
            (self.temperature >= 0, "temperature", "must not be negative"),
            (self.top_k >= -1, "top_k", "must be -1, 0 (off) or a positive count"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.min_tokens >= 0, "min_tokens", "must not be negative"),
            (self.min_tokens <= self.max_tokens, "min_tokens", "must not exceed max_tokens"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs", "must not be negative"),
            (all(s for s in self.stop), "stop", "must not contain an empty string"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (math.isfinite(self.repetition_penalty), "repetition_penalty", "must be finite"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be greater than 0"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (self.allowed_token_ids != [], "allowed_token_ids", "must not be empty"),
            (all(self.bad_words_token_ids), "bad_words_token_ids", "must not hold an empty word"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise InvalidParam(name, f"{name}={getattr(self, name)!r} {why}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= SAMPLING_EPS or self.top_k == 1

    @property
    def reads_history(self) -> bool:
        """Whether picking a token depends on the tokens so far (penalties, bad words)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.bad_words_token_ids
        )


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_arrival = itertools.count()


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt then output
    num_prompt_tokens: int
    params: SamplingParams
    hash_chain: BlockHashChain
    arrival: int = field(default_factory=lambda: next(_arrival))
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already given their hash in the pool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    admitted: bool = False  # scheduled at least once (stats count the first admission only)
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    output_text: str = ""
    token_seed: int = 0  # the simulated engine's output tokens derive from it
    pin_blocks: bool = False  # a prefill for a decode worker: keep its blocks when done
    #: blocks imported from a prefill worker for this request, held (referenced) until it
    #: is admitted, so that no other request's allocation evicts them meanwhile
    held_block_ids: list[int] = field(default_factory=list)
    #: the imported KV of a block-aligned prompt's last block, in a block of its own (not
    #: in the prefix cache): admitted with it, the request computes its last token only
    imported_last: int | None = None
    #: cached blocks identical to blocks of this request's own (computed at the same time
    #: by another request), held so that its later blocks' parents stay in the index
    shadow_block_ids: list[int] = field(default_factory=list)
    traced: bool = False  # tracing is on: note when it is first scheduled
    scheduled_at: float | None = None  # time.monotonic() of its first admission, if traced

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.hash_chain.extend((token_id,))
