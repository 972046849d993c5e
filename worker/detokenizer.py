"""Turn each request's new tokens into new text, and find stop strings in it.

Text is decoded through a short window of recent tokens (as vLLM does), so a step costs
the same at token 10 as at token 10,000, and a token that ends inside a multi-byte
character yields nothing until the character is complete. The window starts a few tokens
inside the prompt, so that tokenizers which drop a leading space at the start of a text
(SentencePiece's Metaspace: Llama 2, Mistral) keep the space of the first output word.
While a stop string could still be forming, the last ``len(longest stop) - 1`` characters
are held back, so a stream never shows text that a stop string later takes away.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .sequence import Sequence

_PROMPT_CONTEXT = 5  # prompt tokens decoded with the first output tokens (as vLLM)


@dataclass
class DetokenizerState:
    prefix_offset: int  # into all tokens: where the decoding window starts
    read_offset: int  # tokens already turned into text
    text: str = ""  # output text decoded so far (a matched stop string cuts it)
    emitted: int = 0  # characters of text already sent

    @staticmethod
    def for_prompt(num_prompt_tokens: int) -> DetokenizerState:
        return DetokenizerState(max(0, num_prompt_tokens - _PROMPT_CONTEXT), num_prompt_tokens)


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def update(
        self,
        seq: Sequence,
        state: DetokenizerState,
        *,
        upto: int | None = None,
        stops: bool,
        final: bool = False,
    ) -> str | None:
        """Decode the sequence's tokens up to ``upto`` (default: all). With ``stops``, look
        for stop strings in the new text: the first match cuts the text and is returned
        (the caller finishes the request). ``final``: the request ends here, so a character
        left incomplete is decoded as it is. ``seq.output_text`` holds the text so far."""
        ids = seq.token_ids[: len(seq.token_ids) if upto is None else upto]
        if len(ids) > state.read_offset:
            skip = seq.params.skip_special_tokens
            decode = self.tokenizer.decode
            prefix = decode(ids[state.prefix_offset : state.read_offset], skip_special_tokens=skip)
            full = decode(ids[state.prefix_offset :], skip_special_tokens=skip)
            if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
                searched_from = len(state.text)
                state.text += full[len(prefix) :]
                state.prefix_offset, state.read_offset = state.read_offset, len(ids)
                if stops:
                    hit = self._cut_at_stop(seq, state, searched_from)
                    if hit is not None:
                        seq.output_text = state.text
                        return hit
        seq.output_text = state.text
        return None

    @staticmethod
    def _cut_at_stop(seq: Sequence, state: DetokenizerState, new_from: int) -> str | None:
        stops = seq.params.stop
        if not stops:
            return None
        best: tuple[int, str] | None = None
        for stop in stops:
            # A match must end in the new text, so it starts at most len(stop) - 1 before
            # it; text before that was searched already, or decoded before min_tokens.
            at = state.text.find(stop, max(0, new_from - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        state.text = state.text[: at + len(stop) if seq.params.include_stop_str_in_output else at]
        return stop

    def take_delta(self, seq: Sequence, state: DetokenizerState) -> str:
        """Text to send now; on an unfinished request, hold back a possible partial stop."""
        end = len(state.text)
        if not seq.finished and seq.params.stop and not seq.params.include_stop_str_in_output:
            end = max(state.emitted, end - (max(len(s) for s in seq.params.stop) - 1))
        delta = state.text[state.emitted : end]
        state.emitted = end
        return delta
