"""Prefix block hashing: contract 1 of the architecture.

A prompt's token ids are cut into full blocks of ``block_size`` tokens; block ``i`` is named
by ``sha256(cbor([parent_digest, tokens_of_block_i, extra_keys]))``, chained from a digest of
the configured hash seed. Equal digests therefore mean equal prefixes. This is the scheme
vLLM calls ``sha256_cbor`` (with ``PYTHONHASHSEED`` as the seed), so the router can index
vLLM workers and ours with the same code.

Extra keys (a LoRA adapter, a cache salt) are hashed as vLLM 0.32 hashes them, each tagged
with what it is: ``("lora", name, path)`` on every block, ``("cache_salt", salt)`` on the
first. vLLM's KV events still publish the bare values. Older vLLMs hashed the bare values
too (``EXTRA_KEYS_BARE``), where a salt and an adapter of the same name collided.

Two ways in, which must agree exactly:

* :meth:`BlockHasher.hash_prompt` hashes a whole prompt at once (the router, per request);
* :class:`BlockHashChain` extends one sequence's chain as tokens arrive in pieces
  (the worker, as prefill chunks and decoded tokens complete blocks).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import cbor2

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_HASH_SEED",
    "EXTRA_KEYS_BARE",
    "EXTRA_KEYS_SCHEMES",
    "EXTRA_KEYS_TAGGED",
    "HASH_ALGORITHM",
    "BlockHashChain",
    "BlockHasher",
    "HashSchemeMismatch",
    "block_extra_keys",
    "block_key",
    "hash_block",
    "seed_digest",
]

HASH_ALGORITHM = "sha256_cbor"
DEFAULT_BLOCK_SIZE = 16
# vLLM 0.32 seeds its sha256 chains with PYTHONHASHSEED, or without it the fixed string
# "vllm-none-hash" (older vLLMs drew a random seed per process). The router and every worker
# must share one; ours is "0", which the operator gives vLLM pods as PYTHONHASHSEED.
DEFAULT_HASH_SEED = "0"
#: how extra keys enter a block's hash: tagged with their kind (vLLM 0.32), or bare (older)
EXTRA_KEYS_TAGGED = "tagged"
EXTRA_KEYS_BARE = "bare"
EXTRA_KEYS_SCHEMES = (EXTRA_KEYS_TAGGED, EXTRA_KEYS_BARE)


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


@lru_cache(maxsize=64)
def seed_digest(hash_seed: str) -> bytes:
    """The digest that stands as the parent of every chain's first block."""
    return _sha256_cbor(hash_seed)


def hash_block(
    parent: bytes, token_ids: Sequence[int], extra_keys: tuple[Any, ...] | None
) -> bytes:
    """The 32-byte digest of one block, given its parent's digest."""
    return _sha256_cbor((parent, token_ids, extra_keys))


#: What the digests of recently hashed blocks may take, in bytes. Prompts share prefixes
#: (system prompts, earlier turns), so most of a prompt's blocks were hashed moments ago: a
#: lookup costs a fifth of a sha256 over CBOR.
RECENT_BLOCKS_BYTES = 32 * 2**20


def recent_entry_bytes(block_size: int) -> int:
    """What one cached block digest costs (CPython 3.11, measured): the key's tuple of
    token ids (a slot and an int object each), the parent and the digest, the cache's
    node; about 950 bytes at block size 16 and 5.4 KB at 128."""
    return 330 + 40 * block_size


@lru_cache(maxsize=8)  # one cache per block size in use (a process has one or two)
def _recent_blocks(block_size: int) -> Callable[..., bytes]:
    entries = max(1, RECENT_BLOCKS_BYTES // recent_entry_bytes(block_size))
    return lru_cache(maxsize=entries)(hash_block)


def block_key(digest: bytes) -> int:
    """The 64-bit form of a digest (last 8 bytes, big-endian, unsigned) used in KV events."""
    return int.from_bytes(digest[-8:], "big")


def block_extra_keys(
    block_index: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    *,
    lora_path: str | None = None,
    scheme: str = EXTRA_KEYS_TAGGED,
) -> tuple[Any, ...] | None:
    """Extra keys mixed into block ``block_index``: the LoRA adapter on every block, the
    cache salt on the first block only (it then changes every later digest through the
    chain). Tagged, ``("lora", name, path)`` and ``("cache_salt", salt)``, as vLLM 0.32
    hashes them; ``scheme="bare"``: the name and the salt alone, as older vLLMs did.
    ``None`` when there are none, as vLLM hashes it."""
    keys: list[Any] = []
    tagged = scheme == EXTRA_KEYS_TAGGED
    if lora_name:
        keys.append(("lora", lora_name, lora_path) if tagged else lora_name)
    if cache_salt and block_index == 0:
        keys.append(("cache_salt", cache_salt) if tagged else cache_salt)
    return tuple(keys) if keys else None


class HashSchemeMismatch(ValueError):
    """Two parties (router and worker, say) hash blocks differently, so their block hashes
    would never match: reported rather than silently producing zero cache hits."""


@dataclass(frozen=True)
class BlockHasher:
    """Hashes prompts into chained block digests under one block size and hash seed."""

    block_size: int = DEFAULT_BLOCK_SIZE
    hash_seed: str = DEFAULT_HASH_SEED
    extra_keys: str = EXTRA_KEYS_TAGGED

    def __post_init__(self) -> None:
        if self.extra_keys not in EXTRA_KEYS_SCHEMES:
            raise ValueError(
                f"extra_keys must be one of {', '.join(EXTRA_KEYS_SCHEMES)}, "
                f"got {self.extra_keys!r}"
            )
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise ValueError(f"block_size must be an integer, got {self.block_size!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if not isinstance(self.hash_seed, str):
            raise ValueError(f"hash_seed must be a string, got {type(self.hash_seed).__name__}")

    @property
    def root(self) -> bytes:
        """The parent digest of every chain's first block."""
        return seed_digest(self.hash_seed)

    @property
    def fingerprint(self) -> str:
        """A short, comparable description of the scheme: equal fingerprints hash alike."""
        return f"{HASH_ALGORITHM}/bs{self.block_size}/{self.root[-4:].hex()}"

    def check_compatible(self, other: BlockHasher, what: str = "peer") -> None:
        """Raise :class:`HashSchemeMismatch` with both schemes named if they differ."""
        if (self.block_size, self.hash_seed) != (other.block_size, other.hash_seed):
            raise HashSchemeMismatch(
                f"{what} hashes blocks as {other.fingerprint} but this side uses "
                f"{self.fingerprint}: block size and hash seed must be the same everywhere"
            )

    def hash_prompt(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        lora_path: str | None = None,
    ) -> list[bytes]:
        """Digests of every full block of ``token_ids``; a partial tail block is not hashed.
        ``lora_path``: where the worker loaded the adapter from (vLLM's ``/v1/models`` card
        gives it as ``root``), part of a tagged LoRA key."""
        size = self.block_size
        # a list is sliced as it is: copying a long prompt's ids first cost as much again
        tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
        digests: list[bytes] = []
        parent = self.root
        recent = _recent_blocks(size)
        for index, start in enumerate(range(0, len(tokens) - size + 1, size)):
            extra = block_extra_keys(
                index, lora_name, cache_salt, lora_path=lora_path, scheme=self.extra_keys
            )
            parent = recent(parent, tuple(tokens[start : start + size]), extra)
            digests.append(parent)
        return digests

    def prompt_keys(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        lora_path: str | None = None,
    ) -> list[int]:
        """64-bit keys of every full block of ``token_ids`` (the form KV events carry)."""
        digests = self.hash_prompt(
            token_ids, lora_name=lora_name, cache_salt=cache_salt, lora_path=lora_path
        )
        return [block_key(d) for d in digests]

    def chain(
        self,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        lora_path: str | None = None,
    ) -> BlockHashChain:
        """A chain for one sequence whose tokens arrive in pieces."""
        return BlockHashChain(self, lora_name=lora_name, cache_salt=cache_salt, lora_path=lora_path)


@dataclass
class BlockHashChain:
    """One sequence's block digests, extended as its tokens arrive.

    Tokens that do not yet fill a block wait in :attr:`pending`; each call to
    :meth:`extend` returns the digests of the blocks it completed.
    """

    hasher: BlockHasher
    lora_name: str | None = None
    cache_salt: str | None = None
    lora_path: str | None = None
    digests: list[bytes] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)

    @property
    def keys(self) -> list[int]:
        return [block_key(d) for d in self.digests]

    @property
    def num_tokens(self) -> int:
        return len(self.digests) * self.hasher.block_size + len(self.pending)

    def extend(self, token_ids: Iterable[int]) -> list[bytes]:
        size = self.hasher.block_size
        pending = self.pending
        pending.extend(token_ids)
        completed: list[bytes] = []
        start = 0
        while len(pending) - start >= size:
            parent = self.digests[-1] if self.digests else self.hasher.root
            extra = block_extra_keys(
                len(self.digests),
                self.lora_name,
                self.cache_salt,
                lora_path=self.lora_path,
                scheme=self.hasher.extra_keys,
            )
            digest = hash_block(parent, pending[start : start + size], extra)
            self.digests.append(digest)
            completed.append(digest)
            start += size
        del pending[:start]
        return completed
