"""The simulated engine: the real scheduler, block pool, prefix cache, events, pins and
detokenizer, with a timing model in place of the forward pass.

A step takes as long as an 8B-class model on one H100 would take for the same batch, and
produces deterministic pseudo-random tokens. The router's tests and benchmarks run many of
these on a 2-core machine and see the cache hits, queueing and latencies of a real fleet.

The timing model, in milliseconds, for a step whose prefill sequences compute ``T_i``
uncached tokens and whose ``B`` decoding sequences hold ``C`` context tokens in all::

    prefill = a + b * sum(T_i) + c * sum(T_i ** 2)      (if any prefill)
    decode  = d + e * B + f * C                        (if any decode)
    step    = (prefill + decode) * time_scale

a, b and c are a published fit of Llama-3-8B prefill on an H100. d, e and f follow from
the hardware: d is the weights (16 GB in bf16) read once per step at 3.35 TB/s plus launch
overhead, f is one context token's KV (128 KiB: 32 layers x 8 KV heads x 128 x 2 x bf16)
read at the same bandwidth, e is per-sequence sampling and bookkeeping.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ModelConfig
from .engine import EngineConfig, EngineCore, EventSink, KVLayout, RequestOutput, Sampled
from .loader import load_tokenizer
from .scheduler import ScheduledBatch
from .sequence import Sequence as Seq

#: blocks of the simulated cache by default: an 8B model's KV in ~55 GiB of an H100
DEFAULT_SIM_BLOCKS = 28_000


@dataclass
class TimingModel:
    a: float = 16.5  # ms per prefill step
    b: float = 1.518e-2  # ms per prefill token
    c: float = 4.21e-7  # ms per prefill token squared (attention)
    d: float = 6.0  # ms per decode step
    e: float = 0.03  # ms per decoding sequence
    f: float = 4.0e-5  # ms per context token read
    time_scale: float = 1.0  # 0.5: everything twice as fast

    def __post_init__(self) -> None:
        for name in ("a", "b", "c", "d", "e", "f", "time_scale"):
            if getattr(self, name) < 0:
                raise ValueError(f"timing model {name}={getattr(self, name)} must not be negative")

    def prefill_ms(self, tokens: Sequence[int]) -> float:
        """One step's prefill work: ``tokens`` holds each sequence's uncached tokens."""
        if not tokens:
            return 0.0
        return self.a + self.b * sum(tokens) + self.c * sum(t * t for t in tokens)

    def decode_ms(self, batch: int, context: int) -> float:
        return self.d + self.e * batch + self.f * context if batch else 0.0

    def step_seconds(self, batch: ScheduledBatch) -> float:
        prefill: list[int] = []
        decode = context = 0
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            if seq.num_computed_tokens < seq.num_prompt_tokens:  # a prompt, or a chunk of one
                prefill.append(n)
            else:
                decode += 1
                context += seq.num_computed_tokens + n
        ms = self.prefill_ms(prefill) + self.decode_ms(decode, context)
        return ms * self.time_scale / 1000.0


class SimEngine(EngineCore):
    """An engine whose steps take the timing model's time (``virtual=True``: no sleeping;
    :attr:`now` advances instead, for replays that predict a workload's latencies)."""

    def __init__(
        self,
        tokenizer: Any | None,
        config: EngineConfig | None = None,
        *,
        timing: TimingModel | None = None,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: Sequence[int] = (),
        event_sink: EventSink | None = None,
        virtual: bool = False,
    ) -> None:
        config = config or EngineConfig()
        super().__init__(
            tokenizer,
            config,
            config.num_blocks or DEFAULT_SIM_BLOCKS,
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            limits={"the model's positions": max_model_len},
            eos_token_ids=eos_token_ids,
            event_sink=event_sink,
        )
        self.timing = timing or TimingModel()
        self.virtual = virtual
        self.now = 0.0 if virtual else time.monotonic()
        self._step_start = self.now
        self._deadline: float | None = None
        # Output tokens are drawn from ordinary tokens only: a simulated request ends at
        # max_tokens or a stop string, never by chance, so benchmark lengths are exact.
        special = set(self.eos_token_ids)
        ordinary = range(vocab_size)
        if tokenizer is not None:
            special |= set(getattr(tokenizer, "all_special_ids", []))
            # ... and only tokens that are text by themselves, as the client gets them
            # (special tokens skipped: a chat template's role and end-of-turn tokens are
            # special without being in all_special_ids; a piece of a UTF-8 character is
            # nothing yet), so every simulated token streams at once, as TTFT assumes.
            texts = tokenizer.batch_decode([[t] for t in ordinary], skip_special_tokens=True)
            ordinary = [
                t for t, text in zip(ordinary, texts, strict=True) if text and "\ufffd" not in text
            ]
        self._tokens = [t for t in ordinary if t not in special]

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        *,
        timing: TimingModel | None = None,
        max_model_len: int | None = None,
        event_sink: EventSink | None = None,
    ) -> SimEngine:
        """A simulated engine with a model directory's tokenizer and limits (no weights
        are read)."""
        model_config = ModelConfig.from_dir(model_dir)
        tokenizer = load_tokenizer(model_dir)
        return cls(
            tokenizer,
            config,
            timing=timing,
            vocab_size=model_config.vocab_size,
            max_model_len=max_model_len or model_config.max_position,
            eos_token_ids=model_config.eos_token_ids,
            event_sink=event_sink,
        )

    def _init_sequence(self, seq: Seq) -> None:
        seed = seq.params.seed
        if seed is None:
            # The same prompt gives the same output, as a greedy model would.
            digest = hashlib.blake2b(repr(seq.token_ids).encode(), digest_size=8).digest()
            seed = int.from_bytes(digest)
        seq.token_seed = seed

    def _token(self, seq: Seq) -> int:
        raw = hashlib.blake2b(
            (seq.token_seed % 2**64).to_bytes(8, "big") + seq.num_tokens.to_bytes(4, "big"),
            digest_size=8,
        ).digest()
        return self._tokens[int.from_bytes(raw) % len(self._tokens)]

    def step(self) -> list[RequestOutput]:
        # The step ends at its deadline, counted from before scheduling: the Python work
        # of the step (scheduling, caching, detokenizing) is part of it, not added to it.
        self._step_start = time.monotonic()
        outputs = super().step()
        if self._deadline is not None:
            delay = self._deadline - time.monotonic()
            self._deadline = None
            if delay > 0:
                time.sleep(delay)
        return outputs

    def _execute(self, batch: ScheduledBatch) -> list[Sampled]:
        seconds = self.timing.step_seconds(batch)
        if self.virtual:
            self.now += seconds
        else:
            self.now = max(self.now, self._step_start) + seconds
            self._deadline = self.now
        out: list[Sampled] = []
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            if seq.num_computed_tokens + n == seq.num_tokens:
                lp = None
                token = self._token(seq)
                if seq.params.logprobs is not None:
                    lp = (0.0, [(token, 0.0)][: seq.params.logprobs])
                out.append((seq, token, lp))
        return out

    # The simulated cache holds hashes, not bytes: a hand-off moves the header only.
    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout("none", [])

    def read_blocks(self, block_ids: Sequence[int]) -> bytes | memoryview:
        return b""

    def _write_blocks(self, block_ids: list[int], data: bytes | memoryview) -> None:
        pass
