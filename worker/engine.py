"""The engine: requests in, tokens out, one scheduled batch per :meth:`LLMEngine.step`.

It owns the scheduler, the block pool, the model runner, the sampler and the detokenizer,
and nothing else: the HTTP server drives ``step`` from its own thread and talks to it
through :meth:`add_request`, :meth:`abort` and each request's :class:`RequestStream`.
Those three are safe to call from any thread; a step and a call never interleave.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from kvpool.hashing import DEFAULT_BLOCK_SIZE, DEFAULT_HASH_SEED, BlockHasher
from kvpool.kv_events import KVCacheEvent
from kvpool.openai_api import MAX_LOGPROBS
from kvpool.tokenization import encode_prompt

from .block_pool import BlockPool
from .detokenizer import Detokenizer, DetokenizerState
from .handoff import KVHandOff, KVLayout, PinnedBlocks
from .loader import load_model, load_tokenizer
from .model import LlamaModel
from .model_runner import ModelRunner, blocks_for_memory
from .sampler import sample
from .scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from .sequence import InvalidParam, SamplingParams
from .sequence import Sequence as Seq

log = logging.getLogger(__name__)

EventSink = Callable[[list[KVCacheEvent]], None]

#: one sampled token: its sequence, the token id, and (logprob, top alternatives) or None
Sampled = tuple[Seq, int, "tuple[float, list[tuple[int, float]]] | None"]


@dataclass
class EngineConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    hash_seed: str = DEFAULT_HASH_SEED
    num_blocks: int | None = None  # None: from kv_cache_memory_fraction
    kv_cache_memory_fraction: float | None = None  # None: 0.9 of a GPU's free memory, 0.1 of RAM
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the model's, capped by the cache's capacity
    enable_prefix_caching: bool = True
    dtype: str = "auto"
    device: str = "auto"  # auto: cuda when a GPU is present
    seed: int = 0
    kv_pin_timeout_s: float = 30.0  # pinned prefill blocks are freed if not pulled by then
    # decode attention: "gather" copies each context into a padded batch (any device);
    # "paged" reads the cache in place (FlexAttention through Triton on CUDA, the C kernel
    # of attention_cpu on CPU); "flex" is FlexAttention on any device; "auto" is paged on
    # CUDA, where bench/engine.py measured it 3 to 5x faster per step, and gather on CPU,
    # which needs no compiler and was as fast or faster but at the longest contexts
    attention: str = "auto"

    def resolved_attention(self, device: torch.device) -> str:
        if self.attention == "auto":
            return "paged" if device.type == "cuda" else "gather"
        return self.attention

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


class PromptTooLong(ValueError):
    """The prompt leaves no room for output in the model's context."""

    def __init__(self, num_tokens: int, max_model_len: int) -> None:
        self.num_tokens, self.max_model_len = num_tokens, max_model_len
        super().__init__(
            f"the prompt has {num_tokens} tokens; this model's context is {max_model_len}, "
            f"so at most {max_model_len - 1} leave room for output"
        )


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """What one step added to one request (``finished`` marks the last)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0


@dataclass
class Completion:
    """A whole finished request, as :meth:`LLMEngine.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: str | int | None
    logprobs: list[TokenLogprob]
    num_cached_tokens: int


class OutputSink(Protocol):
    """Where a request's outputs go, in order (called by the engine, under its lock)."""

    def put(self, output: RequestOutput) -> None: ...


class RequestStream:
    """One request's outputs, in order; iterate to get them until the last."""

    def __init__(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self.ended = False  # the engine has sent the last output
        self.finished = False  # the reader has taken it

    def put(self, output: RequestOutput) -> None:
        self.ended = self.ended or output.finished
        self._queue.put(output)

    def get(self, timeout: float | None = None) -> RequestOutput:
        output = self._queue.get(timeout=timeout)
        self.finished = output.finished
        return output

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self.finished:
            yield self.get()


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of blocks held by requests
    num_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which were cached
    preemptions: int
    prompt_tokens: int  # prompt tokens of admitted requests (cached ones included)
    generation_tokens: int
    steps: int
    waiting_tokens: int = 0  # tokens of the requests waiting for admission
    pinned_requests: int = 0  # finished prefills whose blocks wait for a decode worker


@dataclass
class _Request:
    seq: Seq
    stream: OutputSink
    detok: DetokenizerState


@dataclass
class PreparedRequest:
    """A validated, tokenized and hashed request, ready for :meth:`EngineCore.submit`.
    Made by :meth:`EngineCore.prepare` outside the engine's lock (tokenizing and hashing a
    long prompt must not hold up a step)."""

    seq: Seq

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seq.token_ids[: self.seq.num_prompt_tokens]


class EngineCore(KVHandOff):
    """Requests, scheduling, the block pool, detokenizing, pinning and events: everything
    but the forward pass. :class:`LLMEngine` runs a real model; the simulated engine
    (``kvpool.worker.sim``) replaces the model with a timing model."""

    def __init__(
        self,
        tokenizer: Any | None,
        config: EngineConfig,
        num_blocks: int,
        *,
        vocab_size: int,
        max_model_len: int,
        limits: dict[str, int],
        eos_token_ids: Sequence[int],
        event_sink: EventSink | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.event_sink = event_sink
        self.vocab_size = vocab_size
        self.hasher = BlockHasher(block_size=config.block_size, hash_seed=config.hash_seed)
        if num_blocks < 1:
            raise ValueError("the KV cache has room for no block: give num_blocks or more memory")
        self.pool = BlockPool(num_blocks, config.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs), self.pool
        )
        limits = {**limits, "the KV cache's capacity": num_blocks * config.block_size}
        self.max_model_len = min(max_model_len, *limits.values())
        if config.max_model_len is not None:
            if config.max_model_len > self.max_model_len:
                raise ValueError(
                    f"max_model_len={config.max_model_len} exceeds what fits: "
                    + ", ".join(f"{k} {v}" for k, v in limits.items())
                )
            self.max_model_len = config.max_model_len
        self.eos_token_ids = set(eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self._requests: dict[str, _Request] = {}
        self._pinned: dict[str, PinnedBlocks] = {}
        self._lock = threading.RLock()
        self._generation_tokens = 0
        self._steps = 0
        # False when the last step found nothing it could run (waiting requests that do
        # not fit while pinned blocks hold the cache): the caller should wait, not spin.
        self.last_step_scheduled = True

    # -- requests ------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queue a request. ``cache_salt`` keeps its cached blocks apart from other
        tenants' (it enters the first block's hash, as in vLLM)."""
        prepared = self.prepare(prompt, params, request_id, cache_salt=cache_salt)
        stream = RequestStream(prepared.request_id, prepared.prompt_token_ids)
        self.submit(prepared, stream)
        return stream

    def prepare(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
        pin_blocks: bool = False,
    ) -> PreparedRequest:
        """Validate, tokenize and hash a request (raises ``ValueError`` saying what is
        wrong: :class:`PromptTooLong`, or :class:`InvalidParam` naming the setting).
        ``pin_blocks``: when it finishes, keep its full prompt blocks for a decode worker
        to pull (see :meth:`pinned`)."""
        token_ids = self.prompt_tokens_of(prompt)
        self.check_prompt_length(len(token_ids))
        return self.prepare_tokens(
            token_ids, params, request_id, cache_salt=cache_salt, pin_blocks=pin_blocks
        )

    def prepare_tokens(
        self,
        token_ids: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
        pin_blocks: bool = False,
    ) -> PreparedRequest:
        """:meth:`prepare` for a prompt already checked by :meth:`prompt_tokens_of` and
        :meth:`check_prompt_length` (a caller that needs its length first)."""
        params = params or SamplingParams()
        if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
            raise InvalidParam(
                "logprobs", f"logprobs={params.logprobs} exceeds the maximum of {MAX_LOGPROBS}"
            )
        self.check_vocabulary(params.stop_token_ids, "stop_token_ids", "stop token id")
        self.check_vocabulary(params.allowed_token_ids or [], "allowed_token_ids", "token id")
        self.check_vocabulary(list(params.logit_bias), "logit_bias", "token id")
        request_id = request_id or uuid.uuid4().hex
        chain = self.hasher.chain(cache_salt=cache_salt)
        chain.extend(token_ids)
        seq = Seq(request_id, list(token_ids), len(token_ids), params, chain)
        seq.pin_blocks = pin_blocks
        self._init_sequence(seq)
        return PreparedRequest(seq)

    def check_prompt_length(self, num_tokens: int) -> None:
        if num_tokens >= self.max_model_len:
            raise PromptTooLong(num_tokens, self.max_model_len)

    def _init_sequence(self, seq: Seq) -> None:
        """Per-request state of the forward pass (a seeded generator, for instance)."""

    def submit(self, prepared: PreparedRequest, stream: OutputSink) -> None:
        """Queue a prepared request; its outputs go to ``stream``."""
        seq = prepared.seq
        detok = DetokenizerState.for_prompt(seq.num_prompt_tokens)
        with self._lock:
            if seq.request_id in self._requests or seq.request_id in self._pinned:
                raise ValueError(f"request id {seq.request_id!r} is already in use")
            self._requests[seq.request_id] = _Request(seq, stream, detok)
            self.scheduler.add(seq)

    def prompt_tokens_of(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidParam("prompt", "prompt: this engine has no tokenizer; give token ids")
            token_ids = encode_prompt(self.tokenizer, prompt)  # as the router does
        else:
            token_ids = list(prompt)
            self.check_vocabulary(token_ids, "prompt", "token id")
        if not token_ids:
            raise InvalidParam("prompt", "prompt: the prompt is empty")
        return token_ids

    def check_vocabulary(self, token_ids: Sequence[int], param: str, what: str) -> None:
        """Raise :class:`InvalidParam` for ``param`` if a token id is not in the vocabulary."""
        vocab = self.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidParam(
                param, f"{param}: {what} {bad[0]!r} is not in the vocabulary [0, {vocab})"
            )

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks now. ``False`` if it is unknown or done."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                return False
            self._fail(request, "abort")
            return True

    def _fail(self, request: _Request, reason: str) -> None:
        """End a request early (abort, or an error in its step), freeing its blocks now
        and sending whatever text was held back."""
        self.scheduler.finish(request.seq)
        self._requests.pop(request.seq.request_id, None)
        request.seq.finish_reason = reason
        text = ""
        if self.detokenizer is not None:
            self.detokenizer.update(request.seq, request.detok, stops=False, final=True)
            text = self.detokenizer.take_delta(request.seq, request.detok)
        request.stream.put(self._output(request, [], [], text))

    def end_all(self, reason: str) -> None:
        """End every request now (``abort`` at shutdown, ``error`` after a failure)."""
        with self._lock:
            for request in list(self._requests.values()):
                self._fail(request, reason)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._requests)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes (reported as ``AllBlocksCleared``). ``False`` while
        requests run or blocks are pinned."""
        with self._lock:
            done = self.pool.reset_prefix_cache()
            self._flush_events()
            return done

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and report. Returns this step's outputs
        (also put on each request's stream).

        If the step fails (a bug, or the device running out of memory), the requests of
        that batch end with ``finish_reason="error"`` and the engine keeps serving.
        """
        with self._lock:
            batch = self.scheduler.schedule()
            self.last_step_scheduled = bool(batch)
            if not batch:
                self._flush_events()
                return []
            self._steps += 1
            try:
                sampled = self._execute(batch)
            except Exception:
                log.exception("engine step failed; its %d requests end in error", len(batch.seqs))
                for seq in batch.seqs:
                    self._fail(self._requests[seq.request_id], "error")
                self._flush_events()
                return []
            # Only now, with the step's results in hand, does the state move on.
            for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
                seq.num_computed_tokens += n
                if self.config.enable_prefix_caching:
                    self.scheduler.cache_computed_blocks(seq)
            outputs = [self._advance(seq, token, lp) for seq, token, lp in sampled]
            self._flush_events()
            return outputs

    def _execute(self, batch: ScheduledBatch) -> list[Sampled]:
        """Run the batch: a token (and its logprobs, if asked) for each sequence that
        reaches its last known token."""
        raise NotImplementedError

    def _banned(self, seq: Seq) -> list[int]:
        """Tokens that would end the request before ``min_tokens``: they cannot be drawn."""
        params = seq.params
        if seq.num_output_tokens >= params.min_tokens:
            return []
        ends = [] if params.ignore_eos else list(self.eos_token_ids)
        return ends + list(params.stop_token_ids)

    def _advance(
        self, seq: Seq, token: int, lp: tuple[float, list[tuple[int, float]]] | None
    ) -> RequestOutput:
        request = self._requests[seq.request_id]
        seq.append_token(token)
        self._generation_tokens += 1
        params = seq.params
        n_out = seq.num_output_tokens
        may_stop = n_out >= params.min_tokens
        if not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        at_length = n_out >= params.max_tokens or seq.num_tokens >= self.max_model_len
        if self.detokenizer is not None:
            # A stop token's own text is not part of the answer (unless asked for).
            keep = seq.finish_reason is None or params.include_stop_str_in_output
            hit = self.detokenizer.update(
                seq,
                request.detok,
                upto=None if keep else seq.num_tokens - 1,
                stops=may_stop,
                final=at_length or seq.finish_reason is not None,
            )
            if hit is not None and seq.finish_reason is None:
                seq.finish_reason, seq.stop_reason = "stop", hit
        if seq.finish_reason is None and at_length:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            if seq.pin_blocks and seq.finish_reason in ("stop", "length"):
                self._pin(seq)
            self.scheduler.finish(seq)
            del self._requests[seq.request_id]
        text = self.detokenizer.take_delta(seq, request.detok) if self.detokenizer else ""
        logprobs = [] if lp is None else [TokenLogprob(token, lp[0], lp[1])]
        output = self._output(request, [token], logprobs, text)
        request.stream.put(output)
        return output

    @staticmethod
    def _output(
        request: _Request, token_ids: list[int], logprobs: list[TokenLogprob], text: str
    ) -> RequestOutput:
        seq = request.seq
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=token_ids,
            new_text=text,
            finished=seq.finish_reason is not None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=logprobs,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens,
        )

    def _flush_events(self) -> None:
        if self.event_sink is None:
            self.pool.take_events()
            return
        events = self.pool.take_events()
        if not events:
            return
        try:
            self.event_sink(events)
        except Exception:
            # Keep them for the next step: a lost event would leave the router's index wrong.
            log.exception("the KV event sink failed; %d events kept for the next step", len(events))
            self.pool.requeue_events(events)

    # -- conveniences --------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        with self._lock:
            s = self.scheduler.stats
            return EngineStats(
                num_running=len(self.scheduler.running),
                num_waiting=len(self.scheduler.waiting),
                kv_usage=self.pool.usage,
                num_blocks=self.pool.num_blocks,
                prefix_cache_queries=s.prefix_cache_queries,
                prefix_cache_hits=s.prefix_cache_hits,
                preemptions=s.preemptions,
                prompt_tokens=s.prompt_tokens,
                generation_tokens=self._generation_tokens,
                steps=self._steps,
                waiting_tokens=sum(q.num_tokens for q in self.scheduler.waiting),
                pinned_requests=len(self._pinned),
            )

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run prompts to completion (all admitted together, batched by the scheduler)."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        streams: list[RequestStream] = []
        try:
            for prompt, sp in zip(prompts, params, strict=True):
                streams.append(self.add_request(prompt, sp))
        except ValueError:
            for stream in streams:  # all or nothing
                self.abort(stream.request_id)
            raise
        while not all(stream.ended for stream in streams):
            self.step()
        return [_completion(stream) for stream in streams]


class LLMEngine(EngineCore):
    """The engine over a real model: one forward pass and one sampling per step."""

    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Any | None,
        config: EngineConfig | None = None,
        event_sink: EventSink | None = None,
    ) -> None:
        config = config or EngineConfig()
        self.model = model
        param = next(model.parameters())
        num_blocks = config.num_blocks
        if num_blocks is None:
            if param.device.type == "cuda":
                torch.cuda.empty_cache()  # what loading freed is free for the cache
            fraction = config.kv_cache_memory_fraction
            if fraction is None:
                fraction = 0.9 if param.device.type == "cuda" else 0.1
            num_blocks = blocks_for_memory(
                model, config.block_size, param.dtype, param.device, fraction
            )
        limits = {"the model's positions": model.config.max_position}
        if model.config.sliding_window:
            # Attention here is always full: past the window it would differ from the
            # model's training, so the context stops at the window.
            limits["the model's sliding window"] = model.config.sliding_window
        super().__init__(
            tokenizer,
            config,
            num_blocks,
            vocab_size=model.config.vocab_size,
            max_model_len=model.config.max_position,
            limits=limits,
            eos_token_ids=model.config.eos_token_ids,
            event_sink=event_sink,
        )
        self.runner = ModelRunner(
            model,
            num_blocks,
            config.block_size,
            attention=config.resolved_attention(param.device),
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
        )
        self._generator = torch.Generator(device=param.device).manual_seed(config.seed)

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        event_sink: EventSink | None = None,
    ) -> LLMEngine:
        config = config or EngineConfig()
        device = config.resolved_device()
        model = load_model(model_dir, dtype=config.dtype, device=device)
        tokenizer = load_tokenizer(model_dir)
        log.info(
            "loaded %s (%s) on %s as %s",
            model_dir,
            model.config.architecture,
            device,
            next(model.parameters()).dtype,
        )
        return cls(model, tokenizer, config, event_sink)

    def _init_sequence(self, seq: Seq) -> None:
        if seq.params.seed is not None:
            seq.generator = torch.Generator(device=self.runner.device)
            seq.generator.manual_seed(seq.params.seed)

    def _execute(self, batch: ScheduledBatch) -> list[Sampled]:
        logits, rows = self.runner.execute(batch)
        if not rows:
            return []
        seqs = [batch.seqs[i] for i in rows]
        result = sample(
            logits,
            [s.params for s in seqs],
            [s.generator for s in seqs],
            self._generator,
            [self._banned(s) for s in seqs],
            seqs,
        )
        return list(zip(seqs, result.token_ids, result.logprobs, strict=True))

    # -- KV blocks as bytes (the prefill/decode hand-off) --------------------------------
    @property
    def _block_shape(self) -> list[int]:
        """One block of the cache ``[layers, 2, blocks, block_size, kv_heads, head_dim]``:
        the same without the blocks axis."""
        kv = self.runner.kv_cache
        return [kv.shape[0], kv.shape[1], *kv.shape[3:]]

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout(str(self.runner.kv_cache.dtype).removeprefix("torch."), self._block_shape)

    def read_blocks(self, block_ids: Sequence[int]) -> bytes | memoryview:
        kv = self.runner.kv_cache  # a block is strided across layers: copy each one out
        out = torch.empty((len(block_ids), *self._block_shape), dtype=kv.dtype)
        with self._copy_stream():
            for i, block_id in enumerate(block_ids):
                out[i].copy_(kv[:, :, block_id])
        return memoryview(out.view(torch.uint8).numpy()).cast("B")

    def _write_blocks(self, block_ids: list[int], data: bytes | memoryview) -> None:
        kv = self.runner.kv_cache
        shape = [len(block_ids), *self._block_shape]
        if (isinstance(data, memoryview) and data.readonly) or isinstance(data, bytes):
            data = bytearray(data)  # torch wants writable memory to wrap without copying
        raw = torch.frombuffer(data, dtype=torch.uint8)
        with self._copy_stream():
            blocks = raw.view(kv.dtype).view(shape).to(kv.device)
            index = torch.tensor(block_ids, device=kv.device)
            kv.index_copy_(2, index, blocks.permute(1, 2, 0, 3, 4, 5))

    @contextlib.contextmanager
    def _copy_stream(self) -> Iterator[None]:
        """Hand-off copies on CUDA run on a stream of their own, so that they neither wait
        for the step's kernels nor hold them up (the blocks they touch are no step's: see
        :mod:`.handoff`); the copy is complete when this returns."""
        device = self.runner.kv_cache.device
        if device.type != "cuda":
            yield
            return
        # one stream per copying thread, on the cache's device (a thread's current device
        # is cuda:0 whatever the cache's), so that one copy never waits on another's
        streams = _COPY_STREAMS.__dict__.setdefault("by_device", {})
        stream = streams.get(device)
        if stream is None:
            stream = streams[device] = torch.cuda.Stream(device=device)
        with torch.cuda.stream(stream):
            yield
        stream.synchronize()


#: each thread's hand-off copy streams, by CUDA device
_COPY_STREAMS = threading.local()


def _completion(stream: RequestStream) -> Completion:
    outputs = list(stream)
    last = outputs[-1]
    return Completion(
        request_id=stream.request_id,
        prompt_token_ids=stream.prompt_token_ids,
        token_ids=[t for o in outputs for t in o.new_token_ids],
        text="".join(o.new_text for o in outputs),
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        logprobs=[lp for o in outputs for lp in o.logprobs],
        num_cached_tokens=last.num_cached_tokens,
    )
