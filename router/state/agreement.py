"""Whether a worker's cache is the one the router thinks it is: each answer's cached prompt
tokens (``usage.prompt_tokens_details.cached_tokens``) against what the router predicted.

A worker that hashes its blocks differently (another hash seed: a vLLM started without
``PYTHONHASHSEED``; another block size or hash algorithm) or tokenizes differently (another
model or chat template) breaks cache-aware routing without an error anywhere: its events
name blocks the router never matches, or the router credits blocks the worker does not
have. This module keeps, per worker, the last answers' predicted and reported cached
tokens and judges them:

* **agreement**: over the window, the tokens both agree on over the tokens either claims
  (``sum(min(p, r)) / sum(max(p, r))``): 1 when every report matches its prediction, 0
  when none overlaps. The prediction is what the index says the worker holds, whether or
  not the policy credits it (a flagged worker's is still computed, so it can recover).
* **flagged** in one of two ways, with enough evidence:

  - ``over-predicted``: the agreement is under ``flag_below`` and the worker reports far
    fewer cached tokens than predicted (its prefix cache is off or smaller than the router
    thinks, or its tokens differ);
  - ``unseen``: the worker reports cached tokens (its cache works) while its KV events
    confirm almost none of the blocks the router sent it (under 5%): its events name
    blocks by other hashes. The router's own speculative entries can hide this for a while
    (they credit what it just sent there), so this verdict does not wait for the
    agreement to fall; and an index that is only behind (a router restarted without a
    replay) is not taken for it, since a worker that hashes alike confirms the new blocks
    it stores.

A flagged worker gets no cache credit until the window agrees again (``clear_at``); a
worker that has never reported ``cached_tokens`` (vLLM without
``--enable-prompt-tokens-details``) is not judged at all, and once one has, an answer
without them reports none (vLLM leaves the details out when nothing was cached).

An answer whose cached tokens say nothing of the worker's cache is not observed either
(its prediction is :data:`UNJUDGED`): a request vLLM serves without reading its prefix
cache (it computes the prompt's logprobs: ``prompt_logprobs``, or ``echo`` with
logprobs), which reports 0 from a healthy cache; a batch of prompts, whose usage names
one prompt's cached tokens (vLLM's last prompt's, or in a stream the first to answer) for
all their prompt tokens; and a Responses request continuing a stored response, whose
prompt in the worker begins with that conversation, which the router did not match. An
evaluation job would otherwise flag a healthy worker ``over-predicted``, and these answers
push the evidence of the requests that do measure it out of the window. Pure: the
gateway feeds it and reads it.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

__all__ = ["LIKELY_CAUSES", "UNJUDGED", "AgreementConfig", "CacheAgreement"]

log = logging.getLogger("kvpool.router.state.agreement")

#: the prediction of an answer that is not to be judged (see the module): not observed
UNJUDGED = -1

#: what to check when a worker is flagged, by the way it disagrees
LIKELY_CAUSES = {
    "unseen": (
        "its KV events never name the blocks the router sends it: its hash seed (vLLM's "
        "PYTHONHASHSEED; without it vLLM 0.32 seeds with 'vllm-none-hash'), block size or "
        "hash algorithm differs from the router's, or it hashes salted and adapter blocks by "
        "another scheme (vLLM before 0.32 hashed the bare salt and adapter name: "
        "--extra-keys bare)"
    ),
    "over-predicted": (
        "it serves far fewer cached tokens than the router credits it with: prefix caching "
        "off, a smaller KV cache than its events say, or it tokenizes prompts differently "
        "(another model or chat template)"
    ),
}


@dataclass(frozen=True)
class AgreementConfig:
    """``window`` answers are judged; at least ``min_answers`` of them claiming cached
    tokens, and ``min_blocks`` blocks claimed in all, before any verdict."""

    window: int = 32
    min_answers: int = 8
    min_blocks: int = 8
    flag_below: float = 0.25
    clear_at: float = 0.6

    def __post_init__(self) -> None:
        if not 0 <= self.flag_below < self.clear_at <= 1:
            raise ValueError("need 0 <= flag_below < clear_at <= 1")
        if not 1 <= self.min_answers <= self.window:
            raise ValueError("need 1 <= min_answers <= window")


@dataclass(slots=True)
class _Answer:
    predicted: int
    reported: int
    #: the worker's index counters when it came: blocks speculated there, how many of them
    #: its events stored, and the blocks its events stored in all (None: no events)
    speculated: int | None
    confirmed: int | None
    stored: int | None


class CacheAgreement:
    """One worker's recent predictions and reports, and the verdict on them."""

    __slots__ = ("_answers", "block_size", "cause", "config", "flagged", "reports", "worker")

    def __init__(self, worker: str, block_size: int, config: AgreementConfig) -> None:
        self.worker = worker
        self.block_size = block_size
        self.config = config
        self._answers: deque[_Answer] = deque(maxlen=config.window)
        self.flagged = False
        self.cause: str | None = None  # unseen or over-predicted, while flagged
        #: it has reported cached tokens at least once: from then on an answer without
        #: them reports none (vLLM leaves ``prompt_tokens_details`` out when it is 0)
        self.reports = False

    def observe(
        self,
        predicted: int,
        reported: int | None,
        events: tuple[int, int, int] | None = None,
    ) -> bool:
        """One answer: ``predicted`` cached tokens, ``reported`` by the worker (None: its
        usage names none), and ``events`` the index's (speculated, confirmed, stored)
        block counters of the worker (None when it publishes no events). Returns whether
        the verdict changed. A worker that has never reported cached tokens is not judged
        (vLLM without ``--enable-prompt-tokens-details``), nor an answer predicted
        :data:`UNJUDGED`."""
        if predicted == UNJUDGED:
            return False
        if reported is None:
            if not self.reports:
                return False
            reported = 0
        self.reports = True
        speculated, confirmed, stored = events if events is not None else (None, None, None)
        self._answers.append(
            _Answer(max(predicted, 0), max(reported, 0), speculated, confirmed, stored)
        )
        return self._judge()

    def restarted(self) -> None:
        """The worker is a new process (it registered again): what the old one answered says
        nothing of it. A flag stays until the new one agrees, so a restart with the same
        wrong setting gets no credit in between."""
        self._answers.clear()

    # -- the verdict ------------------------------------------------------------------------

    def totals(self) -> tuple[int, int, int]:
        """(predicted, reported, agreed) cached tokens over the window."""
        p = r = agreed = 0
        for a in self._answers:
            p += a.predicted
            r += a.reported
            agreed += min(a.predicted, a.reported)
        return p, r, agreed

    @property
    def ratio(self) -> float | None:
        """Agreed tokens over claimed ones in the window; None before any claim (an
        answer claims ``max(predicted, reported)``: ``p + r - agreed`` in all)."""
        p, r, agreed = self.totals()
        claimed = p + r - agreed
        return agreed / claimed if claimed else None

    def _evidence(self) -> bool:
        cfg = self.config
        claims = sum(1 for a in self._answers if a.predicted or a.reported)
        p, r, agreed = self.totals()
        return claims >= cfg.min_answers and p + r - agreed >= cfg.min_blocks * self.block_size

    def _events_delta(self) -> tuple[int, int, int]:
        """Over the window: blocks speculated on the worker, those its events confirmed,
        and the blocks its events stored (negative: the index forgot the worker meanwhile;
        zeros without events)."""
        first, last = self._answers[0], self._answers[-1]
        if first.speculated is None or last.speculated is None:
            return 0, 0, 0
        assert first.confirmed is not None and last.confirmed is not None
        assert first.stored is not None and last.stored is not None
        return (
            last.speculated - first.speculated,
            last.confirmed - first.confirmed,
            last.stored - first.stored,
        )

    def _unmatched_events(self) -> bool:
        """Whether, over the window, the worker's events stored blocks, the router
        speculated blocks there, and the events confirmed almost none of those. (Events
        that stop coming are a stream to mend, not another hash: no verdict.)"""
        sent, confirmed, stored = self._events_delta()
        enough = self.config.min_blocks
        return sent >= enough and stored >= enough and 0 <= confirmed * 20 < sent

    def _judge(self) -> bool:
        if not self._evidence():
            return False
        ratio = self.ratio
        assert ratio is not None
        cfg = self.config
        p, r, _ = self.totals()
        unseen = r >= cfg.min_blocks * self.block_size and self._unmatched_events()
        if self.flagged:
            if ratio >= cfg.clear_at and not unseen:
                self.flagged, self.cause = False, None
                log.warning(
                    "worker %s: its cached tokens agree with the router's predictions again "
                    "(%.0f%% over the last %d answers): cache credit restored",
                    self.worker,
                    100 * ratio,
                    len(self._answers),
                )
                return True
            return False
        if unseen:
            cause = "unseen"
        elif ratio < cfg.flag_below and r < p:
            cause = "over-predicted"
        else:
            return False
        self.flagged, self.cause = True, cause
        if cause == "unseen":
            sent, confirmed, _ = self._events_delta()
            evidence = (
                f"its KV events confirmed {confirmed} of the {sent} blocks the router sent it, "
                f"while it reported {r} cached tokens"
            )
        else:
            evidence = f"it reported {r} cached tokens against {p} predicted"
        log.error(
            "worker %s: its cache disagrees with the router's: over its last %d answers %s; "
            "likely cause: %s. It gets no cache credit until they agree.",
            self.worker,
            len(self._answers),
            evidence,
            LIKELY_CAUSES[cause],
        )
        return True

    def summary(self) -> dict[str, Any]:
        """What ``/debug/workers`` shows."""
        p, r, _ = self.totals()
        return {
            "flagged": self.flagged,
            "cause": self.cause,
            "likely_causes": LIKELY_CAUSES[self.cause] if self.cause else None,
            "agreement": self.ratio,
            "answers": len(self._answers),
            "predicted_tokens": p,
            "reported_tokens": r,
        }
