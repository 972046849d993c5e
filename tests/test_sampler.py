"""The sampler's truncation, seeds and bans, on logits made up for the purpose."""

from __future__ import annotations

import torch

from kvpool.worker.sampler import sample
from kvpool.worker.sequence import SamplingParams

LOGITS = torch.tensor([[4.0, 3.5, 3.0, 1.0, 0.5, 0.0, -1.0, -2.0]])


def draws(params: SamplingParams, n: int = 400, banned=None) -> set[int]:
    gen = torch.Generator().manual_seed(0)
    logits = LOGITS.expand(n, -1).contiguous()
    return set(sample(logits, [params] * n, [None] * n, gen, banned).token_ids)


def test_top_k_draws_only_from_the_k_most_likely_tokens() -> None:
    assert draws(SamplingParams(temperature=5.0, top_k=3)) == {0, 1, 2}
    assert len(draws(SamplingParams(temperature=5.0))) == 8  # untruncated, all show up


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.softmax(LOGITS[0], -1)  # about 0.48, 0.29, 0.18, ...
    assert probs[0] < 0.6 < probs[0] + probs[1] < 0.9 < probs[:3].sum()
    assert draws(SamplingParams(top_p=0.6)) == {0, 1}
    assert draws(SamplingParams(top_p=0.9)) == {0, 1, 2}


def test_banned_tokens_are_never_drawn_even_greedily() -> None:
    assert draws(SamplingParams(temperature=0), n=1, banned=[[0]]) == {1}
    assert 0 not in draws(SamplingParams(), banned=[[0, 2]] * 400)


def test_a_rows_seed_fixes_its_draws() -> None:
    seeded = SamplingParams(temperature=2.0, seed=5)
    runs = []
    for _ in range(2):
        gens = [torch.Generator().manual_seed(5) for _ in range(3)]
        logits = LOGITS.expand(3, -1).contiguous()
        runs.append(sample(logits, [seeded] * 3, gens).token_ids)
    assert runs[0] == runs[1]
