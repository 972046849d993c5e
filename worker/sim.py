"""The simulated engine: the real scheduler, block pool, prefix cache, events, pins and
detokenizer, with a timing model in place of the forward pass.

A step takes as long as an 8B-class model on one H100 would take for the same batch, and
produces deterministic pseudo-random tokens. The router's tests and benchmarks run many of
these on a 2-core machine and see the cache hits, queueing and latencies of a real fleet.

The timing model prices a step as one pass of the model over all its rows, in
milliseconds. Row ``i`` computes ``T_i`` new tokens on top of ``P_i`` tokens already in the
cache (a cached prefix, earlier chunks, or its output so far); a *decode* row computes one
token after its prompt, every other row is a *prefill* row (a prompt, a chunk of one, or the
recomputation of a preempted request, output included)::

    overhead  = a if any prefill row else d            (one per step, mixed or not)
    linear    = b * sum(T_i, prefill rows) + e * (decode rows)
    attention = sum over rows of c * (2 * T_i * P_i + T_i ** 2) + f * (P_i + T_i)
    step      = (overhead + linear + attention) * time_scale

The attention term is compute (``c``: one query attending to one earlier token, twice,
so a cold prompt's causal attention is ``c * T**2``) and memory (``f``: one context
token's KV read once per step). A decode row's is ``f`` per context token, as before; a
chunk after 30k cached tokens pays for attending to them.

The coefficients are Llama-3-8B's in bf16 on one H100, calibrated against published
measurements of vLLM and SGLang (``bench/sim_calibration.py`` lists each source, the
scenario that reproduces it, and the model's error). b, 32 us per prefill token, is
SGLang's prefill rate on ~4k-token prompts (about 47% of the H100's bf16 peak for 15 GFLOP
a token); d, 7.2 ms a decode step, is vLLM's time per output token at batch 10 (the
weights, 16 GB, read at 3.35 TB/s take 4.8 ms of it); a is a prefill step's fixed cost;
c is attention's compute (524k FLOPs per query and key, twice, at the same efficiency);
f is one context token's KV (128 KiB: 32 layers x 8 KV heads x 128 x 2 x bf16) read at
3.35 TB/s; e is per-sequence sampling and bookkeeping.

A prefill/decode hand-off moves ``kv_bytes_per_token`` bytes per token of the blocks
pulled, over ``transfer_gb_s`` (a 400 Gb/s NIC per GPU by default, as in a DGX H100): the
decode worker waits that long for the bytes, outside the engine step, as with NIXL.
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
    a: float = 16.5  # ms per step with prefill rows
    b: float = 3.24e-2  # ms per prefill token (calibrated: SGLang's prefill rate)
    c: float = 4.21e-7  # ms per (new token, earlier token) pair, half of it (attention)
    d: float = 7.2  # ms per step of decode rows only (calibrated: vLLM's TPOT at batch 10)
    e: float = 0.03  # ms per decoding sequence
    f: float = 4.0e-5  # ms per context token read
    time_scale: float = 1.0  # 0.5: everything twice as fast
    kv_bytes_per_token: int = 131_072  # Llama-3-8B in bf16
    transfer_gb_s: float = 50.0  # a hand-off's bytes, GB/s

    def __post_init__(self) -> None:
        for name in ("a", "b", "c", "d", "e", "f", "time_scale", "kv_bytes_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"timing model {name}={getattr(self, name)} must not be negative")
        if not self.transfer_gb_s > 0:
            raise ValueError(f"timing model transfer_gb_s={self.transfer_gb_s} must be positive")

    def step_ms(self, prefill: Sequence[tuple[int, int]], decode: Sequence[int]) -> float:
        """One step: ``prefill`` holds each prefill row's (new tokens, tokens before
        them in the cache), ``decode`` each decode row's context before its new token."""
        if not prefill and not decode:
            return 0.0
        ms = self.a if prefill else self.d
        c, f = self.c, self.f
        for t, p in prefill:
            ms += self.b * t + c * (2 * t * p + t * t) + f * (p + t)
        for p in decode:
            ms += self.e + c * (2 * p + 1) + f * (p + 1)
        return ms

    def prefill_ms(self, tokens: Sequence[int], cached: Sequence[int] | None = None) -> float:
        """A step of prefill rows alone: ``tokens`` each row's new tokens, ``cached`` the
        tokens before them (none by default)."""
        return self.step_ms(list(zip(tokens, cached or [0] * len(tokens), strict=True)), [])

    def decode_ms(self, contexts: Sequence[int]) -> float:
        """A step of decode rows alone, each over its context (tokens before its new one)."""
        return self.step_ms([], contexts)

    def step_seconds(self, batch: ScheduledBatch) -> float:
        prefill: list[tuple[int, int]] = []
        decode: list[int] = []
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            done = seq.num_computed_tokens
            if n == 1 and done >= seq.num_prompt_tokens:
                decode.append(done)
            else:  # a prompt, a chunk of one, or a recomputation after preemption
                prefill.append((n, done))
        return self.step_ms(prefill, decode) * self.time_scale / 1000.0

    def transfer_seconds(self, tokens: int) -> float:
        """How long a hand-off of ``tokens`` tokens' KV takes to arrive."""
        return tokens * self.kv_bytes_per_token / (self.transfer_gb_s * 1e9) * self.time_scale


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

    def transfer_seconds(self, tokens: int) -> float:
        return self.timing.transfer_seconds(tokens)

    # The simulated cache holds hashes, not bytes: a hand-off moves the header only.
    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout("none", [])

    def read_blocks(self, block_ids: Sequence[int]) -> bytes | memoryview:
        return b""

    def _write_blocks(self, block_ids: list[int], data: bytes | memoryview) -> None:
        pass
