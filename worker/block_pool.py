"""The KV cache's blocks: who uses each one, which prefix each one holds, which go first.

A block is *used* while any request holds it (``ref_count > 0``). A used block that is
full gets its prefix hash and becomes findable by later requests. When its last user lets
go, a hashed block is not wiped: it joins the LRU queue of evictable blocks and keeps its
hash until an allocation needs the space (then it is *evicted*, and only then reported as
``BlockRemoved``). Blocks without a hash are simply free and are handed out first.

Every change to the set of cached hashes is queued as a ``kvpool.kv_events`` event;
:meth:`BlockPool.take_events` drains them once per engine step.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.hashing import block_key
from kvpool.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


class NoFreeBlocks(RuntimeError):
    """Asked for more blocks than are free or evictable (the scheduler checks first)."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    digest: bytes | None = None  # the prefix hash, once the block is full and cached


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, *, medium: str = "GPU") -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, not {num_blocks}")
        self.block_size = block_size
        self.medium = medium
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))  # no hash: use first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # hashed, unused: LRU first
        self._cached: dict[bytes, int] = {}  # digest -> block id
        self._events: list[KVCacheEvent] = []

    # -- capacity ------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks an allocation could take now (free plus evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (evictable cached blocks count as free)."""
        return 1.0 - self.num_free / self.num_blocks

    @property
    def cached_digests(self) -> set[bytes]:
        return set(self._cached)

    # -- prefix cache --------------------------------------------------------------------
    def lookup(self, digests: Sequence[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix of a hash chain (stops at the first miss)."""
        found: list[int] = []
        for digest in digests:
            block_id = self._cached.get(digest)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks found by :meth:`lookup`."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._evictable[block_id]
            block.ref_count += 1

    def cache_blocks(
        self,
        block_ids: Sequence[int],
        digests: Sequence[bytes],
        token_ids: Sequence[Sequence[int]],
        parent: bytes | None,
        *,
        shadows: list[int] | None = None,
    ) -> list[int]:
        """Give full, computed blocks their hashes and report them as stored. Returns the
        blocks the request should hold from now on.

        When a digest is already cached in another block (two requests computed the same
        prefix at once), one block per hash keeps the index exact, and the request must
        hold the cached one, so that it cannot be evicted and the parent of every later
        ``BlockStored`` is a hash the index still has. Without ``shadows`` the request
        switches to the cached block and frees its own copy; with it, the request keeps its
        copy (unhashed: it is never reported, and is freed as a plain block), so that its
        block table is only ever appended to, and the cached block is appended to
        ``shadows``, a reference the request holds beside its table.
        """
        held: list[int] = []
        run: list[int] = []  # keys of consecutive newly stored blocks
        tokens: list[int] = []
        run_parent = parent
        for block_id, digest, ids in zip(block_ids, digests, token_ids, strict=True):
            block = self.blocks[block_id]
            existing = self._cached.get(digest)
            if block.digest is None and existing is None:
                block.digest = digest
                self._cached[digest] = block_id
                if not run:
                    run_parent = parent
                run.append(block_key(digest))
                tokens.extend(ids)
            else:
                if run:
                    self._flush_stored(run, run_parent, tokens)
                    run, tokens = [], []
                if block.digest is None and existing is not None:
                    self.touch([existing])
                    if shadows is None:
                        self.free([block_id])
                        block_id = existing
                    else:
                        shadows.append(existing)
            held.append(block_id)
            parent = digest
        if run:
            self._flush_stored(run, run_parent, tokens)
        return held

    def _flush_stored(self, keys: list[int], parent: bytes | None, tokens: list[int]) -> None:
        self._events.append(
            BlockStored(
                block_hashes=keys,
                parent_block_hash=None if parent is None else block_key(parent),
                token_ids=tokens,
                block_size=self.block_size,
                medium=self.medium,
            )
        )

    # -- allocation ----------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` blocks for a request (reference count 1), evicting LRU cached blocks if the
        plain free ones run out."""
        if n > self.num_free:
            raise NoFreeBlocks(f"asked for {n} blocks, {self.num_free} free")
        out: list[int] = []
        evicted: list[int] = []
        for _ in range(n):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                block = self.blocks[block_id]
                assert block.digest is not None
                del self._cached[block.digest]
                evicted.append(block_key(block.digest))
                block.digest = None
            self.blocks[block_id].ref_count = 1
            out.append(block_id)
        if evicted:
            self._events.append(BlockRemoved(block_hashes=evicted, medium=self.medium))
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block. Pass a request's blocks in reverse order, so
        that its tail (the least shared part) is evicted first."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise ValueError(f"block {block_id} freed more often than it was taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.digest is None:
                    self._free.append(block_id)
                else:
                    self._evictable[block_id] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (``False``) while requests hold blocks, since
        their blocks would lose hashes the router may still route by."""
        if any(b.ref_count for b in self.blocks):
            return False
        for block_id in self._evictable:
            self.blocks[block_id].digest = None
            self._free.append(block_id)
        self._evictable.clear()
        self._cached.clear()
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def requeue_events(self, events: list[KVCacheEvent]) -> None:
        """Put back events a sink could not take, ahead of newer ones."""
        self._events[:0] = events

    def check(self) -> None:
        """Assert the pool's invariants (for tests and debugging)."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free) and not free & evictable
        for block in self.blocks:
            in_free = block.block_id in free or block.block_id in evictable
            assert in_free == (block.ref_count == 0), block
            assert (block.block_id in evictable) == (
                block.ref_count == 0 and block.digest is not None
            )
            if block.digest is not None:
                assert self._cached[block.digest] == block.block_id
        assert len(self._cached) == sum(b.digest is not None for b in self.blocks)
