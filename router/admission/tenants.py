"""Tenants: who is calling (API keys), what class they are, and how fast they may go (pure).

A tenant is a named client of the pool with one or more API keys, a priority class, a
share within its class and optional rate limits. The router learns them from a tenants
file, in practice the ``tenants.yaml`` key of a Kubernetes Secret mounted as a volume:

.. code-block:: yaml

    tenants:
      - name: team-a
        keys: ["sk-team-a-0123456789"]   # one or more, at least 16 characters each
        priority: normal                 # high | normal | low: its band, and the highest
                                         # band its requests may ask for
        weight: 1.0                      # its share within the band (default 1)
        requests_per_second: 20          # optional; burst: optional, default max(1, rps)
        tokens_per_minute: 200000        # optional: prompt + max_tokens, settled with usage
        ttft_slo_s: 1.0                  # optional: the deadline of its requests' first token
        admin: false                     # may use /debug/*

Keys are secrets: they are compared in constant time, never logged, never put in an error
message, and kept out of every ``repr``. :class:`KeyStore` indexes them by SHA-256 (a
dict probe on the digest reveals nothing of the key text) and lets
:func:`hmac.compare_digest` decide. A Secret volume updates by swapping a symlink, so
:meth:`KeyStore.reload_if_changed` compares the file's content hash, not its mtime; a bad
new file leaves the old keys serving and reports why.

:class:`RateLimiter` holds two token buckets per tenant: one for requests (``rps`` per
second up to ``burst``) and one for tokens (``tokens_per_minute`` per minute up to that
many). Admission reserves the prompt plus ``max_tokens``; :meth:`RateLimiter.settle`
later refunds what the request did not use, or charges what it used beyond, in which case
the bucket may go negative and delay the tenant's next requests. Every answer carries
OpenAI's ``x-ratelimit-*`` headers; a refusal is a 429 with ``Retry-After``.

No I/O but reading the tenants file, no asyncio: the caller owns the clock.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from kvpool.openai_api import OpenAIError

from .entries import Band

__all__ = [
    "ANONYMOUS",
    "MIN_KEY_CHARS",
    "AuthError",
    "KeyStore",
    "ReloadResult",
    "Tenant",
    "TenantsError",
    "parse_tenants",
]

log = logging.getLogger(__name__)

#: the shortest key accepted: long enough not to be guessed, and nothing shorter from the
#: file is ever echoed in an error (so a misplaced key cannot be)
MIN_KEY_CHARS = 16
#: a presented key longer than this is refused without hashing
MAX_KEY_CHARS = 512
#: a tenants file larger than this is refused
MAX_FILE_BYTES = 1 << 20

Priority = Literal["high", "normal", "low"]


class TenantsError(ValueError):
    """The tenants file is unreadable or invalid. The message names the tenant and the
    field, never a key."""


class Tenant(BaseModel):
    """One tenant of the pool, as the tenants file declares it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    keys: list[SecretStr] = Field(min_length=1, repr=False)
    priority: Priority = "normal"
    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    requests_per_second: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    burst: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, gt=0)
    ttft_slo_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    admin: bool = False

    @field_validator("keys")
    @classmethod
    def _keys_are_usable(cls, keys: list[SecretStr]) -> list[SecretStr]:
        seen: dict[str, int] = {}
        for i, key in enumerate(keys):
            text = key.get_secret_value()
            if len(text) < MIN_KEY_CHARS:
                raise ValueError(f"key #{i + 1} is shorter than {MIN_KEY_CHARS} characters")
            if len(text) > MAX_KEY_CHARS:
                raise ValueError(f"key #{i + 1} is longer than {MAX_KEY_CHARS} characters")
            if not all("!" <= c <= "~" for c in text):
                raise ValueError(
                    f"key #{i + 1} has a character that cannot be sent in a header "
                    "(only visible ASCII, no spaces)"
                )
            if text in seen:
                raise ValueError(f"key #{i + 1} repeats key #{seen[text] + 1}")
            seen[text] = i
        return keys

    @property
    def band(self) -> Band:
        """The tenant's class as a flow-control band."""
        return Band[self.priority.upper()]

    def band_for(self, requested: Band | None) -> Band:
        """The band of one request: what it asked for (a header), but never above the
        tenant's own class."""
        if requested is None:
            return self.band
        return Band(max(int(requested), int(self.band)))

    @property
    def request_burst(self) -> int | None:
        """The request bucket's size: ``burst``, by default ``max(1, ceil(rps))``."""
        if self.requests_per_second is None:
            return None
        return self.burst or max(1, math.ceil(self.requests_per_second))


#: the tenant of every request when auth is off: normal band, no limits
ANONYMOUS = Tenant.model_construct(name="anonymous", keys=[], priority="normal")


class _TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: list[Tenant] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> _TenantsFile:
        names: dict[str, int] = {}
        owners: dict[str, str] = {}
        for i, tenant in enumerate(self.tenants):
            if tenant.name in names:
                raise ValueError(
                    f"tenants #{names[tenant.name] + 1} and #{i + 1} are both named {tenant.name!r}"
                )
            names[tenant.name] = i
            for k, key in enumerate(tenant.keys):
                text = key.get_secret_value()
                if text in owners:
                    raise ValueError(
                        f"tenant {tenant.name!r}: key #{k + 1} is also a key of tenant "
                        f"{owners[text]!r} (each key identifies one tenant)"
                    )
                owners[text] = tenant.name
        return self


def parse_tenants(text: str | bytes, source: str = "tenants file") -> list[Tenant]:
    """The tenants a file declares (YAML, or JSON), or :class:`TenantsError` naming the
    tenant and field at fault; no part of a key is ever in the message."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TenantsError(f"{source}: not UTF-8 (byte {exc.start})") from None
    try:
        if text.lstrip().startswith("{"):
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise TenantsError(f"{source}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
    except yaml.YAMLError as exc:
        raise TenantsError(f"{source}: invalid YAML{_yaml_where(exc)}") from None
    if not isinstance(data, dict):
        raise TenantsError(f"{source}: must be a mapping with a 'tenants' list")
    try:
        return _TenantsFile.model_validate(data).tenants
    except ValidationError as exc:
        raise TenantsError(f"{source}: " + "; ".join(_describe(exc, data))) from None


def _yaml_where(exc: yaml.YAMLError) -> str:
    """Where a YAML error is and what it is, without the snippet of the file that PyYAML
    quotes (it may be a line holding a key)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return where + (f": {problem}" if isinstance(problem, str) and problem else "")


def _describe(exc: ValidationError, data: dict[str, Any]) -> list[str]:
    """Pydantic's errors, with the tenant named and without the input values (which
    pydantic would quote, and which may be keys)."""
    raw = data.get("tenants")
    out = []
    for err in exc.errors(include_input=False, include_url=False):
        loc = list(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        where = ""
        if len(loc) >= 2 and loc[0] == "tenants" and isinstance(loc[1], int):
            i = loc[1]
            name = (
                raw[i].get("name") if isinstance(raw, list) and isinstance(raw[i], dict) else None
            )
            where = f"tenant {name!r}" if isinstance(name, str) else f"tenant #{i + 1}"
            loc = loc[2:]
        if err["type"] == "extra_forbidden" and loc:
            field = str(loc[-1])
            # an unknown field's name is the file's text: shown only when too short to be
            # a key (a key pasted as a mapping key must not be echoed)
            loc[-1] = f"unknown field {field!r}" if len(field) < MIN_KEY_CHARS else "unknown field"
            msg = "not allowed"
        path = ".".join(str(p) if not isinstance(p, int) else f"#{p + 1}" for p in loc)
        out.append(": ".join(p for p in (where, path, msg) if p))
    return out


# -- keys ------------------------------------------------------------------------------------


class AuthError(OpenAIError):
    """401 in OpenAI's body; ``reason`` (missing, malformed, unknown) is for metrics and
    logs. The message never contains the presented key."""

    def __init__(self, reason: Literal["missing", "malformed", "unknown"], message: str) -> None:
        self.reason = reason
        super().__init__(
            401,
            message,
            type="invalid_request_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": 'Bearer realm="kvpool"'},
        )


@dataclass(frozen=True)
class ReloadResult:
    """What :meth:`KeyStore.reload_if_changed` did: ``changed`` when new keys serve now;
    ``error`` when the file is bad and the previous keys still serve."""

    changed: bool
    error: str | None = None


@dataclass(frozen=True, repr=False)
class _Snapshot:
    #: sha256(key) -> (key bytes, tenant)
    by_digest: dict[bytes, tuple[bytes, Tenant]]
    tenants: tuple[Tenant, ...]
    by_name: dict[str, Tenant]
    content_hash: bytes | None


def _snapshot(tenants: Iterable[Tenant], content_hash: bytes | None) -> _Snapshot:
    tenants = tuple(tenants)
    by_digest: dict[bytes, tuple[bytes, Tenant]] = {}
    for tenant in tenants:
        for key in tenant.keys:
            raw = key.get_secret_value().encode("ascii")
            by_digest[hashlib.sha256(raw).digest()] = (raw, tenant)
    return _Snapshot(by_digest, tenants, {t.name: t for t in tenants}, content_hash)


#: compared against on a miss, so a miss does the same work as a hit
_NO_KEY = b"\0" * 32


class KeyStore:
    """Presented key -> tenant, from a tenants file that may change under it.

    The tenants and keys are one immutable snapshot, swapped whole by a reload, so a
    lookup never sees half of a file (and a reload may run in a worker thread)."""

    def __init__(self, tenants: Iterable[Tenant], *, path: Path | str | None = None) -> None:
        self._path = Path(path) if path is not None else None
        self._snap = _snapshot(tenants, None)
        self._bad_hash: bytes | None = None

    @classmethod
    def from_file(cls, path: Path | str) -> KeyStore:
        """Load the tenants file; :class:`TenantsError` if it is unreadable or invalid."""
        store = cls((), path=path)
        data = store._read()
        store._snap = _snapshot(parse_tenants(data, str(path)), hashlib.sha256(data).digest())
        snap = store._snap
        log.info(
            "tenants: %d tenants with %d keys from %s", len(snap.tenants), len(snap.by_digest), path
        )
        return store

    def __repr__(self) -> str:
        return f"KeyStore(path={str(self._path)!r}, tenants={[t.name for t in self.tenants]})"

    @property
    def tenants(self) -> tuple[Tenant, ...]:
        return self._snap.tenants

    def tenant(self, name: str) -> Tenant | None:
        return self._snap.by_name.get(name)

    def lookup(self, presented: str) -> Tenant | None:
        """The tenant whose key this is, or None. The time taken depends on the key's
        length and on whether it is valid, never on how much of it matches a key."""
        if not presented or len(presented) > MAX_KEY_CHARS:
            return None
        try:
            raw = presented.encode("ascii")
        except UnicodeEncodeError:
            return None
        hit = self._snap.by_digest.get(hashlib.sha256(raw).digest())
        stored, tenant = hit if hit is not None else (_NO_KEY, None)
        if hmac.compare_digest(stored, raw) and tenant is not None:
            return tenant
        return None

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant an ``Authorization`` header names, or :class:`AuthError` (401)."""
        if authorization is None or not authorization.strip():
            raise AuthError(
                "missing",
                "You didn't provide an API key. Send it in an Authorization header "
                "using Bearer auth (Authorization: Bearer YOUR_KEY).",
            )
        scheme, _, rest = authorization.strip().partition(" ")
        key = rest.strip()
        if scheme.lower() != "bearer" or not key or any(c.isspace() for c in key):
            raise AuthError(
                "malformed",
                "The Authorization header must be 'Bearer YOUR_KEY' (one key, no other scheme).",
            )
        tenant = self.lookup(key)
        if tenant is None:
            raise AuthError(
                "unknown",
                "Incorrect API key provided. Ask the pool's administrator for a valid key.",
            )
        return tenant

    def reload_if_changed(self) -> ReloadResult:
        """Read the file again and serve its keys if its content changed. A bad file is
        reported (logged once per distinct content, and returned) and the keys already
        loaded keep serving. Reads a file: call it from a thread, not the event loop."""
        if self._path is None:
            return ReloadResult(changed=False)
        try:
            data = self._read()
        except TenantsError as exc:
            return self._bad(str(exc), None)
        digest = hashlib.sha256(data).digest()
        if digest == self._snap.content_hash:
            self._bad_hash = None
            return ReloadResult(changed=False)
        try:
            tenants = parse_tenants(data, str(self._path))
        except TenantsError as exc:
            return self._bad(str(exc), digest)
        self._snap = _snapshot(tenants, digest)
        self._bad_hash = None
        log.info(
            "tenants reloaded: %d tenants with %d keys from %s",
            len(self._snap.tenants),
            len(self._snap.by_digest),
            self._path,
        )
        return ReloadResult(changed=True)

    def _bad(self, error: str, digest: bytes | None) -> ReloadResult:
        if digest is None or digest != self._bad_hash:
            log.warning("%s; keeping the %d tenants loaded before", error, len(self.tenants))
        self._bad_hash = digest
        return ReloadResult(changed=False, error=error)

    def _read(self) -> bytes:
        assert self._path is not None
        try:
            with self._path.open("rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise TenantsError(f"{self._path}: cannot read: {exc.strerror}") from None
        if len(data) > MAX_FILE_BYTES:
            raise TenantsError(f"{self._path}: larger than {MAX_FILE_BYTES} bytes")
        return data
