"""What flow control's queue holds and answers (:mod:`.flow`): priority bands, an entry
waiting for a worker, the error a shed request gets, and the queue's figures."""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Literal

from kvpool.openai_api import OpenAIError

__all__ = [
    "ENTRY_OVERHEAD_BYTES",
    "Band",
    "Entry",
    "QueueRefused",
    "QueueStats",
    "ShedReason",
    "parse_band",
    "retry_after_header",
    "shed_error",
]

#: bytes charged per entry on top of what it declares: the Entry, its slots in the
#: queue's dicts and heaps (measured with tracemalloc: about 450 bytes; rounded up)
ENTRY_OVERHEAD_BYTES = 512

#: a dict that held more entries than this is copied once it is down to a quarter
_SHRINK_FROM = 256

#: why an entry left the queue without being served, or was never let in
ShedReason = Literal["queue_full", "queue_bytes", "deadline", "displaced"]


class Band(IntEnum):
    """Priority bands; a smaller value is served first."""

    HIGH = 0
    NORMAL = 1
    LOW = 2

    @property
    def label(self) -> str:
        """The name used in headers, the tenants file and metric labels."""
        return self.name.lower()

    @classmethod
    def of(cls, band: Band | str) -> Band:
        """A band, or its label (``high``, ``normal``, ``low``) as one."""
        return band if isinstance(band, Band) else cls[band.upper()]


def parse_band(value: str, source: str = "priority") -> Band:
    """``high``, ``normal`` or ``low`` (any case) as a :class:`Band`; anything else is a
    400 naming ``source`` (the header or field the value came from)."""
    try:
        return Band[value.strip().upper()]
    except KeyError:
        raise OpenAIError(
            400,
            f"{source} must be one of 'high', 'normal', 'low'",
            code="invalid_priority",
            param=source,
        ) from None


@dataclass(slots=True, eq=False)
class Entry:
    """One waiting request. Returned by :meth:`FairQueue.push`; the caller keeps it to
    cancel with :meth:`FairQueue.remove`, and gets it back from :meth:`FairQueue.pop_next`
    or the ``on_shed`` callback."""

    band: Band
    tenant: str
    #: tokens the request is expected to take (prompt + max_tokens): its VTC charge and
    #: its weight in wait predictions
    cost: int
    #: bytes it holds while waiting, as declared (the queue adds its own overhead)
    size: int
    weight: float
    enqueued_at: float
    #: absolute time (the queue's clock) by which it must be dispatched, if any
    deadline: float | None
    payload: Any
    seq: int
    #: queued | dispatched | cancelled | shed
    state: str = "queued"
    #: seconds it waited, set when it leaves the queue
    waited_s: float | None = None
    #: set when shed: one of :data:`ShedReason`
    shed_reason: str | None = None
    #: the caller's: the future its request awaits, say (the queue never touches it)
    future: Any = None


class QueueRefused(OpenAIError):
    """A push the queue could not take; an :class:`OpenAIError` the server can raise as
    it is (status, OpenAI body and ``Retry-After``).

    ``reason`` is ``queue_full`` or ``queue_bytes`` (429: too much is waiting already),
    ``displaced`` (429: it waited, and gave its place to a more deserving request; see
    :func:`shed_error`) or ``deadline`` (503: the pool cannot start it in time).
    ``retry_after_s`` is the predicted wait or time for the queue to drain, None without
    a measured drain rate (``Retry-After`` is then 1)."""

    def __init__(self, reason: ShedReason, message: str, retry_after_s: float | None) -> None:
        self.reason, self.retry_after_s = reason, retry_after_s
        status = 503 if reason == "deadline" else 429
        super().__init__(
            status,
            message,
            type="service_unavailable" if status == 503 else "rate_limit_error",
            code=reason,
            headers={"Retry-After": retry_after_header(retry_after_s)},
        )


def retry_after_header(seconds: float | None) -> str:
    """Whole seconds, rounded up, at least 1 (RFC 9110 allows only whole seconds)."""
    if seconds is None or not math.isfinite(seconds):
        return "1"
    return str(max(1, math.ceil(seconds - 1e-9)))


def shed_error(entry: Entry, retry_after_s: float | None = None) -> OpenAIError:
    """The error to answer for an entry the queue shed while it waited (deadline passed,
    or displaced by a more deserving one)."""
    if entry.shed_reason == "displaced":
        msg = "the router's queue is full and this request gave its place to another"
        return QueueRefused("displaced", msg, retry_after_s)
    msg = "the pool could not start this request before its deadline"
    return QueueRefused("deadline", msg, retry_after_s)


@dataclass
class QueueStats:
    """Counters for metrics (monotonic unless said otherwise)."""

    #: entries waiting per band now (a gauge)
    depth: dict[Band, int]
    #: bytes accounted now, overhead included (a gauge)
    bytes: int
    #: entries popped per band, and the sum of their waits
    popped: dict[Band, int]
    wait_seconds_sum: dict[Band, float]
    #: pushes refused and entries removed, by reason
    shed: dict[str, int]
    #: entries the caller removed (client left)
    cancelled: int
    #: tokens (entry cost) popped per tenant
    dispatched_tokens: dict[str, int]
    #: the measured drain rate in tokens per second, None before a measurement
    drain_rate: float | None


@dataclass(slots=True, eq=False)
class _Tenant:
    """A tenant with entries queued in one band."""

    name: str
    counter: float
    weight: float
    entries: OrderedDict[int, Entry] = field(default_factory=OrderedDict)
    queued_tokens: int = 0
    #: the most entries it held since ``entries`` was last copied (see ``_unlink``)
    peak: int = 0
    #: bumped whenever the tenant's heap item goes stale
    version: int = 0

    def finish(self) -> float:
        """Where its backlog ends in virtual time."""
        return self.counter + self.queued_tokens / self.weight


@dataclass(slots=True, eq=False)
class _Band:
    tenants: dict[str, _Tenant] = field(default_factory=dict)
    tenants_peak: int = 0
    #: (counter, tiebreak, version, tenant) of backlogged tenants; stale items skipped
    heap: list[tuple[float, int, int, _Tenant]] = field(default_factory=list)
    #: counters of tenants with nothing queued that are ahead of ``vtime``
    idle: dict[str, float] = field(default_factory=dict)
    idle_sweep_at: int = 64
    #: the counter of the last tenant served: where a newly backlogged tenant starts
    vtime: float = 0.0
    count: int = 0
    tokens: int = 0
