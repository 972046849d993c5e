"""Turn each request's new tokens into new text, and find stop strings in it.

Text is decoded through a short window of recent tokens (as vLLM does), so a step costs
the same at token 10 as at token 10,000, and a token that ends inside a multi-byte
character yields nothing until the character is complete. While a stop string could
still be forming, the last ``len(longest stop) - 1`` characters are held back, so a
stream never shows text that a stop string later takes away.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .sequence import Sequence


@dataclass
class DetokenizerState:
    prefix_offset: int = 0  # into output tokens: where the decoding window starts
    read_offset: int = 0  # output tokens already turned into text
    text: str = ""  # all text decoded so far (stop strings not yet applied)
    emitted: int = 0  # characters of text already sent


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def update(self, seq: Sequence, state: DetokenizerState) -> str | None:
        """Decode the sequence's new tokens. Returns the stop string if one was found (the
        caller finishes the request); ``seq.output_text`` holds the text so far."""
        ids = seq.output_token_ids
        skip = seq.params.skip_special_tokens
        prefix = self.tokenizer.decode(
            ids[state.prefix_offset : state.read_offset], skip_special_tokens=skip
        )
        full = self.tokenizer.decode(ids[state.prefix_offset :], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            state.text += full[len(prefix) :]
            state.prefix_offset = state.read_offset
            state.read_offset = len(ids)
        hit = self._find_stop(seq, state)
        seq.output_text = state.text
        return hit

    def _find_stop(self, seq: Sequence, state: DetokenizerState) -> str | None:
        stops = seq.params.stop
        if not stops:
            return None
        # Only the new text and the few characters before it can hold a new match.
        start = max(0, state.emitted - max(len(s) for s in stops))
        best: tuple[int, str] | None = None
        for stop in stops:
            at = state.text.find(stop, start)
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
