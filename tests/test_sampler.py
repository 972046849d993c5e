"""The sampler's truncation, seeds and bans, on logits made up for the purpose."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.worker.sampler import sample
from kvpool.worker.sequence import InvalidParam, SamplingParams

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


#: the most likely token is not the first: a NaN row's arg-max (0) cannot pass for it
PEAKED = torch.tensor([[0.5, 1.0, -2.0, 4.0, 3.5, 3.0, 0.0, -1.0]])


def test_temperatures_below_vllms_floor_answer_greedily() -> None:
    """vLLM and SGLang take a temperature under 1e-5 as greedy. Dividing by 1e-40 would
    make every logit infinite, softmax NaN, and the draw token 0 with a 200."""
    gen = torch.Generator().manual_seed(0)
    for t in (1e-40, 1e-300, 5e-324, 1e-5):
        params = SamplingParams(temperature=t)
        assert params.greedy
        out = sample(PEAKED.expand(50, -1).contiguous(), [params] * 50, [None] * 50, gen)
        assert set(out.token_ids) == {3}, t
    assert not SamplingParams(temperature=2e-5).greedy


def test_a_temperature_that_is_not_a_number_is_refused() -> None:
    for t in (float("inf"), float("nan")):
        with pytest.raises(InvalidParam) as err:
            SamplingParams(temperature=t)
        assert err.value.param == "temperature"


VOCAB = 12
_finite = st.floats(-1e30, 1e30, allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(
    logits=st.lists(st.lists(_finite, min_size=VOCAB, max_size=VOCAB), min_size=1, max_size=4),
    temperature=st.one_of(st.just(0.0), st.floats(0, 1e300, allow_nan=False, allow_subnormal=True)),
    top_k=st.integers(-1, VOCAB + 5),
    top_p=st.floats(0, 1, exclude_min=True, allow_subnormal=True),
    logprobs=st.one_of(st.none(), st.integers(0, 25)),
    banned=st.sets(st.integers(0, VOCAB - 1), max_size=VOCAB - 1),
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
)
def test_no_sampling_setting_yields_nan_or_a_token_outside_the_vocabulary(
    logits, temperature, top_k, top_p, logprobs, banned, seed
) -> None:
    params = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, logprobs=logprobs, seed=seed
    )
    rows = len(logits)
    gens = [torch.Generator().manual_seed(seed) if seed is not None else None] * rows
    out = sample(
        torch.tensor(logits),
        [params] * rows,
        gens,
        torch.Generator().manual_seed(1),
        [sorted(banned)] * rows,
    )
    for token in out.token_ids:
        assert 0 <= token < VOCAB and token not in banned
    for lp in out.logprobs:
        if logprobs is None:
            assert lp is None
            continue
        assert lp is not None
        chosen, top = lp
        assert not math.isnan(chosen)
        assert len(top) == min(logprobs, VOCAB)
        assert all(0 <= t < VOCAB and not math.isnan(v) for t, v in top)
