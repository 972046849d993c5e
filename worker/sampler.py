"""Pick the next token of every sampled sequence from its logits, in one batch.

First each row's logits are reshaped as its request asks, in vLLM's order: only its
allowed tokens, none that would complete a bad word, its logit bias, then the repetition,
frequency and presence penalties (these read the tokens so far). Greedy rows then take the
arg-max. Other rows apply temperature, then min-p, top-k and top-p, and draw with the
exponential-race trick (``argmax(p / q)``, ``q ~ Exp(1)``), which is an exact sample from
``p``. A row with a seed draws its noise from its own generator, so its tokens do not
depend on what else shares the batch. Log-probabilities are those of the model's own
distribution (before any of this), as vLLM reports them. A row's *banned* tokens
(end-of-sequence and stop tokens before ``min_tokens``) can never be chosen.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .sequence import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    # per row: (chosen token's logprob, [(token id, logprob)] top-n) or None
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class History(Protocol):
    """A row's tokens so far (prompt, then output), for penalties and bad words."""

    token_ids: list[int]
    num_prompt_tokens: int


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None = None,
    banned: list[list[int]] | None = None,
    history: Sequence[History] | None = None,
) -> SampleResult:
    raw = logits = logits.float()
    rows = logits.shape[0]
    reshaped = [i for i, p in enumerate(params) if _reshapes(p)]
    if reshaped or (banned and any(banned)):
        logits = logits.clone()
    for row in reshaped:
        _reshape(logits[row], params[row], history[row] if history is not None else None)
    if banned and any(banned):
        for row, ids in enumerate(banned):
            if ids:
                logits[row, ids] = float("-inf")
    chosen = torch.empty(rows, dtype=torch.long, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        idx = torch.tensor(greedy, device=logits.device)
        chosen[idx] = logits[idx].argmax(-1)
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        sub = logits[idx]
        temps = torch.tensor([params[i].temperature for i in random_rows], device=logits.device)
        # Temperatures over SAMPLING_EPS keep real logits finite; a logit that still
        # overflows is the largest float, never inf (inf - inf is NaN in softmax).
        sub = torch.nan_to_num(sub / temps[:, None], nan=-math.inf, neginf=-math.inf)
        sub = _min_p(sub, [params[i].min_p for i in random_rows])
        sub = _top_k_top_p(sub, [params[i] for i in random_rows])
        probs = torch.softmax(sub, dim=-1)
        noise = torch.empty_like(probs)
        for row, i in enumerate(random_rows):
            noise[row].exponential_(generator=generators[i] or default_generator)
        # A zero draw would make 0 / 0 (NaN, which arg-max takes) of a banned token.
        chosen[idx] = (probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(-1)
    token_ids = chosen.tolist()
    logprobs: list[tuple[float, list[tuple[int, float]]] | None] = [None] * rows
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if wanted:
        idx = torch.tensor(wanted, device=logits.device)
        lp = torch.log_softmax(raw[idx], dim=-1)
        n = min(max(params[i].logprobs or 0 for i in wanted), lp.shape[-1])
        picked = lp.gather(1, chosen[idx][:, None]).squeeze(1).cpu().tolist()
        top_vals: list[list[float]] = [[] for _ in wanted]
        top_ids: list[list[int]] = [[] for _ in wanted]
        if n:
            values, ids = lp.topk(n, dim=-1)
            top_vals, top_ids = values.cpu().tolist(), ids.cpu().tolist()  # one copy each
        for row, i in enumerate(wanted):
            k = params[i].logprobs or 0
            top = list(zip(top_ids[row][:k], top_vals[row][:k], strict=True))
            logprobs[i] = (picked[row], top)
    return SampleResult(token_ids, logprobs)


def _reshapes(p: SamplingParams) -> bool:
    return bool(p.allowed_token_ids is not None or p.logit_bias or p.reads_history)


def _reshape(row: torch.Tensor, p: SamplingParams, seq: History | None) -> None:
    """One row's logits as its request asks, in place (vLLM's order)."""
    inf = float("-inf")
    if p.allowed_token_ids is not None:
        keep = torch.zeros_like(row, dtype=torch.bool)
        keep[p.allowed_token_ids] = True
        row.masked_fill_(~keep, inf)
    if seq is None:  # a caller without the tokens so far: no penalties, no bad words
        output: list[int] = []
    else:
        output = seq.token_ids[seq.num_prompt_tokens :]
    for word in p.bad_words_token_ids:
        # The word's last token is banned when the output ends with the rest of it.
        prefix = word[:-1]
        if len(prefix) <= len(output) and output[len(output) - len(prefix) :] == prefix:
            row[word[-1]] = inf
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=row.device)
        row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), device=row.device))
    if seq is None or not p.reads_history:
        return
    vocab = row.shape[-1]
    counts = torch.bincount(
        torch.tensor(output, dtype=torch.long, device=row.device), minlength=vocab
    )[:vocab].to(row.dtype)
    if p.repetition_penalty != 1.0:
        seen = counts > 0
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        seen[torch.tensor(prompt, dtype=torch.long, device=row.device)] = True
        penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row.copy_(torch.where(seen, penalized, row))
    if p.frequency_penalty:
        row.sub_(p.frequency_penalty * counts)
    if p.presence_penalty:
        row.sub_(p.presence_penalty * (counts > 0).to(row.dtype))


def _min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Drop the tokens less likely than ``min_p`` times the likeliest one."""
    if not any(min_p):
        return logits
    probs = torch.softmax(logits, dim=-1)
    floor = probs.amax(-1, keepdim=True) * torch.tensor(min_p, device=logits.device)[:, None]
    return logits.masked_fill(probs < floor, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    top_k = [p.top_k if p.top_k > 0 else logits.shape[-1] for p in params]
    top_p = [p.top_p for p in params]
    if all(k >= logits.shape[-1] for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    k = torch.tensor(top_k, device=logits.device)[:, None]
    drop = ranks >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(-1) - probs  # mass of the tokens ranked above this one
    drop |= before >= torch.tensor(top_p, device=logits.device)[:, None]
    drop[:, 0] = False  # the most likely token stays (a top_p that rounds to 0 in float32)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
