"""The OpenAI API's response shapes, built from engine outputs (pure functions).

Completions and chat completions differ only in a few names: a choice carries ``text`` or
a ``message``/``delta``, and log-probabilities come as parallel lists (completions) or as
one entry per token (chat).
"""

from __future__ import annotations

from typing import Any

from .engine import RequestOutput, TokenLogprob


def usage(lasts: list[RequestOutput], n: int = 1) -> dict[str, Any]:
    """Token counts of a response, from the last output of each of its choices (in order,
    ``n`` per prompt): a prompt counts once however many choices it has, as in vLLM."""
    firsts = lasts[::n]
    prompt = sum(o.num_prompt_tokens for o in firsts)
    completion = sum(o.num_output_tokens for o in lasts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in firsts)},
    }


def running_usage(out: RequestOutput) -> dict[str, Any]:
    """One choice's counts so far (a streamed chunk's, with ``continuous_usage_stats``)."""
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_output_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
    }


def choice(
    kind: str,
    index: int,
    text: str,
    out: RequestOutput,
    logprobs: dict[str, Any] | None,
    *,
    final: bool,
) -> dict[str, Any]:
    """One choice: whole (``final``) or a streamed delta."""
    finish = out.finish_reason if out.finished else None
    if kind == "chat":
        c: dict[str, Any] = {"index": index}
        if final:
            c["message"] = {"role": "assistant", "content": text}
        else:
            c["delta"] = {"content": text} if text else {}
        c.update(logprobs=logprobs, finish_reason=finish)
    else:
        c = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if out.finished:
        c["stop_reason"] = out.stop_reason  # vLLM's: the stop string or token that matched
    return c


def logprobs(
    kind: str,
    lps: list[TokenLogprob],
    tokenizer: Any | None,
    text_offset: int = 0,
    *,
    as_ids: bool = False,
) -> dict[str, Any]:
    """Log-probabilities of generated tokens and their top alternatives. ``text_offset``:
    where these tokens' text starts in the choice's text (a streamed chunk's is not 0).
    ``as_ids``: each token as ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``, for
    tokens whose text is not valid on its own)."""

    def text(token_id: int) -> str:
        if as_ids or tokenizer is None:
            return f"token_id:{token_id}" if as_ids else str(token_id)
        return tokenizer.decode([token_id])

    if kind == "chat":
        content = []
        for lp in lps:
            t = text(lp.token_id)
            top = [
                {"token": text(i), "logprob": v, "bytes": list(text(i).encode())} for i, v in lp.top
            ]
            content.append(
                {"token": t, "logprob": lp.logprob, "bytes": list(t.encode()), "top_logprobs": top}
            )
        return {"content": content}
    tokens = [text(lp.token_id) for lp in lps]
    offsets, at = [], text_offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{text(i): v for i, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }
