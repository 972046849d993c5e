"""Credentials from the pool secret: one shared secret, many narrow keys.

A pool (its router and every kvpool worker) shares one random secret. Nothing sends the
secret itself over the network; each use gets its own key, ``HMAC-SHA256(secret, purpose)``,
so that a credential leaked for one use (an operator's admin token, say) cannot sign a
prefill/decode hand-off or read the KV event stream:

* :func:`admin_token`: the bearer token of a worker's admin endpoints (``/drain``,
  ``/undrain``, ``/reset_prefix_cache``);
* :func:`kv_events_credential`: the password of a worker's KV event sockets (ZMQ PLAIN);
* :func:`sign_transfer_params` / :func:`verify_transfer_params`: the ``kv_transfer_params``
  a prefill worker hands the router for a decode worker. The signature covers where the
  blocks are and the one-time token that opens them, and it expires: a decode worker that
  honours only signed hand-offs pulls only from the pool's own workers, never from a host a
  client names.

Pure and dependency-free (the router, the workers and the CLI all use it). Every compare of
a secret value is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Mapping
from typing import Any

__all__ = [
    "EXPIRES_FIELD",
    "MIN_SECRET_CHARS",
    "SIGNATURE_FIELD",
    "SIGNED_FIELDS",
    "TOKEN_FIELD",
    "InvalidSignature",
    "admin_token",
    "bearer_token",
    "check_secret",
    "constant_time_equal",
    "derive_credential",
    "kv_events_credential",
    "new_secret",
    "new_token",
    "sign_transfer_params",
    "transfer_signature",
    "verify_transfer_params",
]

#: a pool secret shorter than this is refused: it could be guessed offline from one
#: signed hand-off
MIN_SECRET_CHARS = 16

SIGNATURE_FIELD = "kvpool_signature"
EXPIRES_FIELD = "kvpool_expires"  # Unix time, whole seconds
TOKEN_FIELD = "kvpool_token"  # opens the pinned blocks once: GET /kv/{id} presents it

#: what a hand-off's signature covers: where the blocks are, which, and the key to them
SIGNED_FIELDS = (
    "do_remote_prefill",
    "remote_host",
    "remote_port",
    "remote_request_id",
    "remote_block_ids",
    "remote_engine_id",
    TOKEN_FIELD,
    EXPIRES_FIELD,
)

# Purposes: versioned, so a change of what a key means is a change of key.
_ADMIN = b"kvpool/v1/worker-admin"
_KV_EVENTS = b"kvpool/v1/kv-events"
_HANDOFF = b"kvpool/v1/kv-transfer-params"


class InvalidSignature(ValueError):
    """The hand-off is unsigned, signed with another secret, altered, or expired; the
    message says which, never what the right signature would be."""


def _key(secret: str | bytes) -> bytes:
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def check_secret(secret: str | bytes) -> None:
    """:class:`ValueError` for a secret too short to protect anything."""
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(
            f"the pool secret must have at least {MIN_SECRET_CHARS} characters "
            f"(it has {len(secret)}); generate one with `openssl rand -hex 32`"
        )


def new_secret() -> str:
    """A random pool secret (256 bits, hex)."""
    return secrets.token_hex(32)


def new_token() -> str:
    """A random one-time token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def derive_credential(secret: str | bytes, purpose: str | bytes) -> str:
    """``HMAC-SHA256(secret, purpose)`` as hex: a key for one purpose only."""
    return hmac.new(_key(secret), _key(purpose), hashlib.sha256).hexdigest()


def admin_token(secret: str | bytes) -> str:
    """The bearer token of a worker's admin endpoints."""
    return derive_credential(secret, _ADMIN)


def kv_events_credential(secret: str | bytes) -> str:
    """The password of a worker's KV event sockets (live stream and replay)."""
    return derive_credential(secret, _KV_EVENTS)


def constant_time_equal(a: str | bytes | None, b: str | bytes | None) -> bool:
    """Whether two credentials are equal, in time independent of where they differ;
    ``None`` equals nothing."""
    if a is None or b is None:
        return False
    return hmac.compare_digest(_key(a), _key(b))


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or ``None``."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _canonical(params: Mapping[str, Any]) -> bytes:
    """The signed fields as canonical JSON (sorted keys, no spaces, ASCII); a missing field
    is ``null``, so dropping a field changes the signature as much as altering it."""
    signed = {name: params.get(name) for name in SIGNED_FIELDS}
    return json.dumps(signed, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def transfer_signature(params: Mapping[str, Any], secret: str | bytes) -> str:
    key = derive_credential(secret, _HANDOFF).encode()
    return hmac.new(key, _canonical(params), hashlib.sha256).hexdigest()


def sign_transfer_params(
    params: Mapping[str, Any], secret: str | bytes, *, ttl_s: float, now: float | None = None
) -> dict[str, Any]:
    """A copy of ``params`` with an expiry ``ttl_s`` from now and a signature over
    :data:`SIGNED_FIELDS` (put the one-time token in :data:`TOKEN_FIELD` before signing)."""
    now = time.time() if now is None else now
    signed = {**params, EXPIRES_FIELD: int(now + ttl_s) + 1}
    signed.pop(SIGNATURE_FIELD, None)
    signed[SIGNATURE_FIELD] = transfer_signature(signed, secret)
    return signed


def verify_transfer_params(
    params: Mapping[str, Any], secret: str | bytes, *, now: float | None = None
) -> None:
    """Raise :class:`InvalidSignature` unless ``params`` carry this pool's unexpired
    signature over every signed field."""
    signature = params.get(SIGNATURE_FIELD)
    if not isinstance(signature, str) or not signature:
        raise InvalidSignature("the hand-off is not signed by a worker of this pool")
    if not constant_time_equal(signature, transfer_signature(params, secret)):
        raise InvalidSignature(
            "the hand-off's signature does not verify: it was altered, or signed by a "
            "worker with another pool secret"
        )
    expires = params.get(EXPIRES_FIELD)
    now = time.time() if now is None else now
    if not isinstance(expires, int | float) or isinstance(expires, bool) or now > expires:
        raise InvalidSignature("the hand-off has expired")
