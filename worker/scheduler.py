"""Continuous batching: which requests run in the next step, and how many tokens each.

Each step has a token budget (``max_num_batched_tokens``) and a cap on running requests
(``max_num_seqs``). Running requests go first, one token each when decoding and a chunk
of the remaining prompt when a long prefill is still under way; waiting requests are then
admitted in arrival order (FCFS: one that does not fit blocks those behind it), each
taking its cached prefix from the block pool first.

When a running request needs a block and none is free, the newest running request is
preempted: its blocks go back to the pool (its full blocks stay cached, so it usually
finds them again) and it returns to the head of the queue to be recomputed.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .block_pool import BlockPool
from .sequence import Sequence, Status


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Otherwise the running requests beyond the budget would wait, holding blocks.
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be at least "
                f"max_num_seqs={self.max_num_seqs}, so every running request can decode each step"
            )


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # new tokens per sequence
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


@dataclass
class SchedulerStats:
    prefix_cache_queries: int = 0  # prompt tokens looked up at admission
    prefix_cache_hits: int = 0  # of which found cached
    prompt_tokens: int = 0  # prompt tokens of admitted requests, cached or not
    preemptions: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.pool.block_size)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = max(0, self._blocks_for(seq.num_computed_tokens + n) - len(seq.block_ids))
            while need > self.pool.num_free:
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break
            seq.block_ids.extend(self.pool.allocate(need))
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
            i += 1
        if batch.preempted:
            return batch  # memory is short: admit nobody new this step
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            plan = self._admission(seq, budget)
            if plan is None:
                # The head does not fit. A hand-off waiting behind it holds its imported
                # blocks, which may be the memory the head needs: it goes first when it
                # fits (it needs next to nothing), runs, and gives them back.
                for other in self.waiting:
                    if other.held_block_ids or other.imported_last is not None:
                        plan = self._admission(other, budget)
                        if plan is not None:
                            seq = other
                            break
                if plan is None:
                    break
            self.waiting.remove(seq)
            cached, own, computed, n, need = plan
            self.pool.touch(cached)
            if own:
                seq.imported_last = None  # the request's block now
            self.release_held(seq)  # imported for it: its own references hold them now
            seq.block_ids = cached + own + self.pool.allocate(need)
            seq.num_computed_tokens = computed
            seq.num_cached_blocks = len(cached)
            if not seq.admitted:  # a preempted request's return is not a new query
                seq.admitted = True
                seq.num_cached_tokens = computed
                self.stats.prefix_cache_queries += seq.num_prompt_tokens
                self.stats.prefix_cache_hits += computed
                self.stats.prompt_tokens += seq.num_prompt_tokens
                if seq.traced:  # its queue span ends here (no clock read when tracing is off)
                    seq.scheduled_at = time.monotonic()
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        return batch

    def _admission(
        self, seq: Sequence, budget: int
    ) -> tuple[list[int], list[int], int, int, int] | None:
        """How ``seq`` would be admitted now: its cached blocks, a hand-off's own last
        block, the tokens already computed, the tokens to compute this step, and the blocks
        to allocate; None if the pool cannot take it."""
        # The last prompt token is always computed, so that there are logits to sample.
        size = self.pool.block_size
        limit = (seq.num_tokens - 1) // size
        cached = self.pool.lookup(seq.hash_chain.digests[:limit])
        evictable_hits = sum(self.pool.blocks[b].ref_count == 0 for b in cached)
        computed = len(cached) * size
        # A hand-off's last block, imported into a block of its own: with every block
        # before it cached, only the last token is left to compute.
        last = seq.imported_last
        own: list[int] = []
        if last is not None and len(cached) == limit and seq.num_tokens == (limit + 1) * size:
            own, computed = [last], seq.num_tokens - 1
        n = min(seq.num_tokens - computed, budget)
        need = self._blocks_for(computed + n) - len(cached) - len(own)
        if need > self.pool.num_free - evictable_hits:
            return None
        return cached, own, computed, n, need

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """After a step: give the request's newly full, computed blocks their hashes. A
        block another request cached meanwhile stays the request's own copy (its block
        table is append-only: a kernel may keep it on the device), and the request holds
        the cached one beside it (:attr:`Sequence.shadow_block_ids`)."""
        size = self.pool.block_size
        full = seq.num_computed_tokens // size
        start = seq.num_cached_blocks
        if full <= start:
            return
        digests = seq.hash_chain.digests
        self.pool.cache_blocks(
            seq.block_ids[start:full],
            digests[start:full],
            [seq.token_ids[j * size : (j + 1) * size] for j in range(start, full)],
            digests[start - 1] if start else None,
            shadows=seq.shadow_block_ids,
        )
        seq.num_cached_blocks = full

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    def _release(self, seq: Sequence) -> None:
        self.pool.free(list(reversed(seq.block_ids)))
        seq.block_ids = []
        if seq.shadow_block_ids:
            self.pool.free(list(reversed(seq.shadow_block_ids)))
            seq.shadow_block_ids = []
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0
        self.release_held(seq)  # ended before it was admitted

    def release_held(self, seq: Sequence) -> None:
        """Free what a hand-off imported for ``seq`` and it has not taken over."""
        if seq.held_block_ids:
            self.pool.free(list(reversed(seq.held_block_ids)))
            seq.held_block_ids = []
        if seq.imported_last is not None:
            self.pool.free([seq.imported_last])
            seq.imported_last = None

    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted request out and free its blocks now."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED
