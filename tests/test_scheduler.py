"""The scheduler against the block pool alone (no model): whatever arrives, every step keeps
the budget and the caps, blocks are never shared wrongly, and every request finishes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.hashing import BlockHasher
from kvpool.worker.block_pool import BlockPool
from kvpool.worker.scheduler import Scheduler, SchedulerConfig
from kvpool.worker.sequence import SamplingParams, Sequence, Status

BLOCK = 4
HASHER = BlockHasher(block_size=BLOCK)


def make_seq(i: int, prompt: list[int], max_tokens: int) -> Sequence:
    chain = HASHER.chain()
    chain.extend(prompt)
    return Sequence(
        f"r{i}", list(prompt), len(prompt), SamplingParams(max_tokens=max_tokens), chain
    )


def run_step(scheduler: Scheduler, pool: BlockPool, config: SchedulerConfig) -> list[Sequence]:
    """One engine step without a model: what the engine does with a scheduled batch."""
    batch = scheduler.schedule()
    assert batch.total_tokens <= config.max_num_batched_tokens
    assert len(scheduler.running) <= config.max_num_seqs
    owners: dict[int, Sequence] = {}
    for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
        assert seq.status is Status.RUNNING and n >= 1
        assert len(seq.block_ids) * BLOCK >= seq.num_computed_tokens + n
        for b in seq.block_ids[seq.num_cached_blocks :]:
            # a block still being written belongs to one request only
            assert b not in owners, (b, owners[b].request_id, seq.request_id)
            owners[b] = seq
    finished = []
    for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
        seq.num_computed_tokens += n
        scheduler.cache_computed_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(seq.num_tokens % 7)  # outputs repeat across requests: shared blocks
            if seq.num_output_tokens >= seq.params.max_tokens:
                scheduler.finish(seq)
                finished.append(seq)
    pool.check()
    return finished


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(
        st.tuples(
            st.integers(0, 3),  # which shared prefix
            st.integers(1, 14),  # prompt length after it
            st.integers(1, 10),  # max tokens
            st.integers(0, 3),  # arrival step
        ),
        min_size=1,
        max_size=12,
    ),
    budget=st.integers(1, 24),
    max_seqs=st.integers(1, 6),
    spare_blocks=st.integers(0, 6),
)
def test_every_request_finishes_within_the_budget_and_caps(
    requests, budget, max_seqs, spare_blocks
) -> None:
    prefixes = [[p + 1] * (4 * p) for p in range(4)]
    seqs = [
        make_seq(i, prefixes[p] + [100 + i] * n, max_tokens)
        for i, (p, n, max_tokens, _) in enumerate(requests)
    ]
    longest = max(s.num_tokens + s.params.max_tokens for s in seqs)
    pool = BlockPool(-(-longest // BLOCK) + spare_blocks, BLOCK)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=min(max_seqs, budget))
    scheduler = Scheduler(config, pool)
    done: list[Sequence] = []
    total_work = sum(s.num_tokens + s.params.max_tokens for s in seqs)
    for step in range(50 * total_work):
        for seq, (*_, arrival) in zip(seqs, requests, strict=True):
            if arrival == step:
                scheduler.add(seq)
        done += run_step(scheduler, pool, config)
        if len(done) == len(seqs):
            break
    assert len(done) == len(seqs), "a request never finished"
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert pool.usage == 0
    assert scheduler.stats.prefix_cache_hits <= scheduler.stats.prefix_cache_queries


def test_a_budget_smaller_than_the_running_cap_is_refused() -> None:
    import pytest

    with pytest.raises(ValueError, match="max_num_batched_tokens=8 must be at least"):
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=16)
