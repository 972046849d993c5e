"""Per-tenant rate limits (:class:`RateLimiter`): requests and tokens a minute, each a token
bucket, and the headers and errors that tell a client where it stands."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from kvpool.openai_api import OpenAIError

from .tenants import Tenant

__all__ = [
    "Admission",
    "RateLimitExceeded",
    "RateLimiter",
    "RequestTooLarge",
    "Reservation",
    "format_reset",
]


def format_reset(seconds: float) -> str:
    """A duration as OpenAI writes ``x-ratelimit-reset-*`` (Go's style): ``20ms``, ``1s``,
    ``1.5s``, ``6m0s``, ``1h0m0s``; rounded up to the millisecond."""
    ms = max(0, math.ceil(seconds * 1000 - 1e-6))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, frac = divmod(rest, 1000)
    sec = f"{s}" + (f".{frac:03d}".rstrip("0") if frac else "")
    return (f"{h}h" if h else "") + (f"{m}m" if h or m else "") + f"{sec}s"


def _retry_after(seconds: float) -> str:
    return str(max(1, math.ceil(seconds - 1e-9)))


@dataclass(slots=True)
class _Bucket:
    capacity: float
    rate: float  # per second
    level: float
    stamp: float

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
            self.stamp = now

    def wait_for(self, amount: float) -> float:
        return max(0.0, (amount - self.level) / self.rate)

    def reset_s(self) -> float:
        """Seconds until full again."""
        return max(0.0, (self.capacity - self.level) / self.rate)


@dataclass(slots=True)
class Reservation:
    """Tokens taken from a tenant's bucket at admission; give it to
    :meth:`RateLimiter.settle` with the real usage when the request ends."""

    tenant: str
    tokens: int
    settled: bool = False


@dataclass(slots=True)
class Admission:
    """An admitted request: its reservation and the ``x-ratelimit-*`` headers to send."""

    reservation: Reservation
    headers: dict[str, str]


class RateLimitExceeded(OpenAIError):
    """429 with OpenAI's body, ``Retry-After`` and ``x-ratelimit-*`` headers. ``limit``
    says which bucket refused (``requests`` or ``tokens``, or ``client``: the address's
    requests in flight); ``retry_after_s`` when it will have room."""

    def __init__(
        self,
        limit: Literal["requests", "tokens", "client"],
        message: str,
        retry_after_s: float,
        headers: dict[str, str],
    ) -> None:
        self.limit, self.retry_after_s = limit, retry_after_s
        super().__init__(
            429,
            message,
            type=limit,
            code="rate_limit_exceeded",
            headers={**headers, "Retry-After": _retry_after(retry_after_s)},
        )


class RequestTooLarge(OpenAIError):
    """400: the prompt plus ``max_tokens`` exceeds the tenant's whole tokens-per-minute
    limit, so no wait would let it in (a 429 would only make clients retry forever)."""

    def __init__(self, message: str, headers: dict[str, str]) -> None:
        super().__init__(
            400,
            message,
            type="invalid_request_error",
            code="request_too_large",
            param="max_tokens",
            headers=headers,
        )


class RateLimiter:
    """Per-tenant token buckets for requests per second and tokens per minute.

    Buckets are kept per tenant name and follow the tenant's current limits (a reload
    that changes them rebuilds the bucket, keeping what was used). A tenant without
    limits has no bucket and gets no headers.

    About ``x-ratelimit-*-requests``: OpenAI's limit is per minute, ours is a bucket of
    ``burst`` requests refilled at ``rps``. The headers describe the bucket, so that the
    three agree with each other: ``limit`` is its size (the most requests that may be
    sent at once), ``remaining`` what is left in it, ``reset`` the time until it is full
    again. The token headers are OpenAI's exactly: the limit per minute, what is left,
    and the time until all of it is back.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._requests: dict[str, _Bucket] = {}
        self._tokens: dict[str, _Bucket] = {}

    def admit(self, tenant: Tenant, tokens: int) -> Admission:
        """Let one request of ``tokens`` (prompt + max_tokens) in, taking one request and
        its tokens from the buckets at once; or raise :class:`RateLimitExceeded` (429,
        nothing taken) or :class:`RequestTooLarge` (400)."""
        return self._take(tenant, tokens, request=True)

    def admit_request(self, tenant: Tenant) -> dict[str, str]:
        """The request half of :meth:`admit`, for before the body is read (its tokens are
        not known yet): take one request, or raise :class:`RateLimitExceeded`. Returns
        the ``x-ratelimit-*`` headers as they stand."""
        return self._take(tenant, None, request=True).headers

    def reserve_tokens(self, tenant: Tenant, tokens: int) -> Admission:
        """The token half of :meth:`admit`, once the prompt is tokenized: reserve
        ``tokens`` (prompt + max_tokens), or raise :class:`RateLimitExceeded` or
        :class:`RequestTooLarge`."""
        return self._take(tenant, tokens, request=False)

    def settle(self, reservation: Reservation, actual_tokens: int | None) -> None:
        """The request ended having used ``actual_tokens`` (prompt + completion): give
        back what it reserved beyond that, or take what it used beyond its reservation.
        None (usage unknown, say a stream cut short) keeps the reservation as charged;
        a request no worker ran settles with 0. Settling twice changes nothing."""
        if reservation.settled:
            return
        reservation.settled = True
        bucket = self._tokens.get(reservation.tenant)
        if bucket is None or actual_tokens is None:
            return
        bucket.refill(self._clock())
        bucket.level = min(
            bucket.capacity, bucket.level + reservation.tokens - max(0, actual_tokens)
        )

    def headers(self, tenant: Tenant) -> dict[str, str]:
        """The ``x-ratelimit-*`` headers for the tenant's buckets as they are now."""
        rb, tb = self._buckets(tenant, self._clock())
        return _headers(rb, tb)

    def prune(self, keep: Iterable[str]) -> None:
        """Forget the buckets of tenants not in ``keep`` (after a reload removed them)."""
        names = set(keep)
        for table in (self._requests, self._tokens):
            for name in [n for n in table if n not in names]:
                del table[name]

    def _take(self, tenant: Tenant, tokens: int | None, *, request: bool) -> Admission:
        if tokens is not None and tokens < 0:
            raise ValueError(f"tokens must not be negative, not {tokens}")
        rb, tb = self._buckets(tenant, self._clock())
        # the buckets this call takes from; the headers describe both all the same
        rb_check = rb if request else None
        tb_check = tb if tokens is not None else None
        if tb_check is not None and tokens is not None and tokens > tb_check.capacity:
            raise RequestTooLarge(
                f"Request too large for tenant {tenant.name} on tokens per minute (TPM): "
                f"limit {tenant.tokens_per_minute}, requested {tokens} (the prompt plus "
                "max_tokens). Reduce the prompt or max_tokens.",
                _headers(rb, tb),
            )
        waits: dict[Literal["requests", "tokens"], float] = {}
        if rb_check is not None and rb_check.level + 1e-9 < 1:
            waits["requests"] = rb_check.wait_for(1)
        if tb_check is not None and tokens is not None and tb_check.level + 1e-9 < tokens:
            waits["tokens"] = tb_check.wait_for(tokens)
        if waits:
            limit = max(waits, key=lambda k: waits[k])
            wait = waits[limit]
            if limit == "requests":
                msg = (
                    f"Rate limit reached for requests on tenant {tenant.name}: limit "
                    f"{tenant.requests_per_second:g} per second (burst {tenant.request_burst})."
                )
            else:
                assert tb is not None
                msg = (
                    f"Rate limit reached for tokens per minute (TPM) on tenant {tenant.name}: "
                    f"limit {tenant.tokens_per_minute}, remaining {max(0, math.floor(tb.level))}"
                    f", requested {tokens}."
                )
            raise RateLimitExceeded(
                limit, f"{msg} Please try again in {format_reset(wait)}.", wait, _headers(rb, tb)
            )
        if rb_check is not None:
            rb_check.level -= 1
        reserved = 0
        if tb_check is not None and tokens is not None:
            tb_check.level -= tokens
            reserved = tokens
        return Admission(Reservation(tenant.name, reserved), _headers(rb, tb))

    def _buckets(self, tenant: Tenant, now: float) -> tuple[_Bucket | None, _Bucket | None]:
        rb = tb = None
        if tenant.requests_per_second is not None:
            rb = _bucket(
                self._requests,
                tenant.name,
                float(tenant.request_burst or 1),
                tenant.requests_per_second,
                now,
            )
        else:
            self._requests.pop(tenant.name, None)
        if tenant.tokens_per_minute is not None:
            tpm = float(tenant.tokens_per_minute)
            tb = _bucket(self._tokens, tenant.name, tpm, tpm / 60.0, now)
        else:
            self._tokens.pop(tenant.name, None)
        return rb, tb


def _bucket(
    table: dict[str, _Bucket], name: str, capacity: float, rate: float, now: float
) -> _Bucket:
    """The tenant's bucket, refilled to ``now``; rebuilt if its limits changed, keeping
    what was used of it."""
    b = table.get(name)
    if b is None:
        b = table[name] = _Bucket(capacity, rate, capacity, now)
        return b
    b.refill(now)
    if b.capacity != capacity or b.rate != rate:
        used = b.capacity - b.level
        b.capacity, b.rate, b.level = capacity, rate, capacity - used
        b.refill(now)
    return b


def _headers(rb: _Bucket | None, tb: _Bucket | None) -> dict[str, str]:
    h: dict[str, str] = {}
    if rb is not None:
        h["x-ratelimit-limit-requests"] = str(int(rb.capacity))
        h["x-ratelimit-remaining-requests"] = str(max(0, math.floor(rb.level + 1e-9)))
        h["x-ratelimit-reset-requests"] = format_reset(rb.reset_s())
    if tb is not None:
        h["x-ratelimit-limit-tokens"] = str(int(tb.capacity))
        h["x-ratelimit-remaining-tokens"] = str(max(0, math.floor(tb.level + 1e-9)))
        h["x-ratelimit-reset-tokens"] = format_reset(tb.reset_s())
    return h
