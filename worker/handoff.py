"""The prefill/decode hand-off, as the engine sees it: pinned blocks to read, blocks to import.

A prefill worker *pins* a finished prefill's full prompt blocks until a decode worker has
pulled them (or a timeout). A decode worker *imports* them: :meth:`KVHandOff.begin_import`
checks the sender's block keys against its own hashing of the prompt and allocates the
request's blocks before a byte arrives (as vLLM's NixlConnector does);
:meth:`~KVHandOff.write_import` copies each run of blocks into the cache as it arrives;
:meth:`~KVHandOff.finish_import` names the blocks that arrived whole (they become cached
prefix blocks, published as ``BlockStored``) and frees the rest.

Only ``begin`` and ``finish`` take the engine's lock, and both are cheap. Reading pinned
blocks and writing imported ones run outside the engine's step, on any thread: neither
touches a block that a step writes or reads (a pinned block is full and immutable; an
imported block belongs to no sequence and no hash until ``finish``), so the bytes move
while the engine keeps decoding, on CUDA on a stream of their own.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpool.hashing import BlockHasher, block_key

from .block_pool import BlockPool
from .scheduler import Scheduler
from .sequence import Sequence as Seq


@dataclass
class PinnedBlocks:
    """A finished prefill's full prompt blocks, held for a decode worker to pull."""

    request_id: str
    block_ids: list[int]
    block_keys: list[int]
    num_prompt_tokens: int
    deadline: float  # time.monotonic() after which they are freed unpulled
    readers: int = 0  # transfers under way (the pin does not expire during one)


@dataclass
class KVLayout:
    """How one block's KV bytes are laid out (the header of a KV transfer)."""

    dtype: str  # torch dtype name without "torch.", or "none" (the simulated engine)
    block_shape: list[int]  # [layers, 2 (k, v), block_size, kv_heads, head_dim]
    layout: str = "layer,kv,token,kv_head,head_dim"

    @property
    def block_bytes(self) -> int:
        if self.dtype == "none":
            return 0
        itemsize = torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()
        return math.prod(self.block_shape) * itemsize


@dataclass
class BlockImport:
    """An import under way: where each block of the transfer goes, and what arrived."""

    prompt_token_ids: Sequence[int]
    digests: list[bytes]  # the transfer's blocks' digests, as this worker hashes them
    hold_for: Seq | None
    prefix: list[int]  # blocks 0 .. have - 1: cached here already (held, not written)
    targets: list[int]  # blocks have .. end - 1: allocated here, written as they arrive
    own_last: int | None = None  # a block-aligned prompt's last block, the request's own
    received: int = 0  # transfer blocks 0 .. received - 1 are in place
    finished: bool = field(default=False, repr=False)

    @property
    def num_blocks(self) -> int:
        return len(self.digests)

    @property
    def have(self) -> int:
        return len(self.prefix)

    @property
    def end(self) -> int:
        """Transfer blocks with a block here to go to (the pool may have had room for
        fewer than were sent: the request computes the rest)."""
        return self.have + len(self.targets) + (self.own_last is not None)

    def destinations(self, first: int, count: int) -> list[tuple[int, int]]:
        """``(transfer block, cache block)`` for the blocks ``first .. first + count - 1``
        that are written here (the cached prefix is not, nor what found no room)."""
        out = []
        shared_end = self.have + len(self.targets)
        for i in range(max(first, self.have), min(first + count, self.end)):
            out.append((i, self.targets[i - self.have] if i < shared_end else self.own_last))
        return out  # type: ignore[return-value]


class KVHandOff:
    """The engine's side of the hand-off (a mixin of ``EngineCore``, which provides the
    pool, scheduler, hasher, lock, configuration and the cache's bytes)."""

    config: Any  # EngineConfig: kv_pin_timeout_s
    pool: BlockPool
    scheduler: Scheduler
    hasher: BlockHasher
    _lock: threading.RLock
    _pinned: dict[str, PinnedBlocks]

    @property
    def kv_layout(self) -> KVLayout:
        raise NotImplementedError

    def read_blocks(self, block_ids: Sequence[int]) -> bytes | memoryview:
        """The KV bytes of blocks, block after block, in :attr:`kv_layout`. Safe on any
        thread for pinned blocks (see the module's docstring)."""
        raise NotImplementedError

    def _write_blocks(self, block_ids: list[int], data: bytes | memoryview) -> None:
        """Copy whole blocks' bytes into the cache; safe on any thread for blocks that no
        sequence uses."""
        raise NotImplementedError

    def _flush_events(self) -> None:
        raise NotImplementedError

    def transfer_seconds(self, tokens: int) -> float:
        """How much longer a hand-off of ``tokens`` tokens' KV takes than its bytes did:
        nothing for an engine whose bytes are real (the simulated one prices its own)."""
        return 0.0

    # -- the prefill side ----------------------------------------------------------------
    def _pin(self, seq: Seq) -> None:
        n = seq.num_prompt_tokens // self.pool.block_size
        block_ids = seq.block_ids[:n]
        self.pool.touch(block_ids)  # a second reference: finishing the request keeps them
        self._pinned[seq.request_id] = PinnedBlocks(
            seq.request_id,
            block_ids,
            [block_key(d) for d in seq.hash_chain.digests[:n]],
            seq.num_prompt_tokens,
            time.monotonic() + self.config.kv_pin_timeout_s,
        )

    def pinned(self, request_id: str) -> PinnedBlocks | None:
        with self._lock:
            return self._pinned.get(request_id)

    def open_pinned(self, request_id: str) -> PinnedBlocks | None:
        """Start a transfer of pinned blocks. The reader holds its own reference on them
        until :meth:`close_pinned`, so an unpin meanwhile (a DELETE, a timeout) cannot hand
        them to another request while their bytes are being read."""
        with self._lock:
            pin = self._pinned.get(request_id)
            if pin is not None:
                pin.readers += 1
                self.pool.touch(pin.block_ids)
            return pin

    def close_pinned(self, pin: PinnedBlocks) -> None:
        with self._lock:
            pin.readers -= 1
            self.pool.free(list(reversed(pin.block_ids)))
            if self._pinned.get(pin.request_id) is pin:
                pin.deadline = time.monotonic() + self.config.kv_pin_timeout_s

    def unpin(self, request_id: str) -> bool:
        """Drop a request's pin (the decode side has its blocks). ``False`` if none."""
        with self._lock:
            pin = self._pinned.pop(request_id, None)
            if pin is None:
                return False
            self.pool.free(list(reversed(pin.block_ids)))
            return True

    def expire_pins(self, now: float | None = None) -> list[str]:
        """Free pins that nobody pulled in time; returns their request ids."""
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [
                rid for rid, p in self._pinned.items() if p.deadline <= now and not p.readers
            ]
            for rid in expired:
                self.unpin(rid)
            return expired

    # -- the decode side -----------------------------------------------------------------
    def begin_import(
        self,
        prompt_token_ids: Sequence[int],
        block_keys: Sequence[int],
        *,
        cache_salt: str | None = None,
        digests: Sequence[bytes] | None = None,
        hold_for: Seq | None = None,
    ) -> BlockImport:
        """Check a transfer's block keys against this engine's own hashes of the prompt
        (same model, block size and seed, or :class:`ValueError`) and allocate the blocks
        that are not cached here already. ``digests``: the prompt's hash chain if the
        caller has it (hashing a long prompt here would hold up the engine). ``hold_for``:
        the request they are for; from :meth:`finish_import` on it holds them (they cannot
        be evicted) until it is admitted, or until :meth:`release_held`."""
        size = self.pool.block_size
        n = len(block_keys)
        if n > len(prompt_token_ids) // size:
            raise ValueError(f"{n} blocks sent for a prompt of {len(prompt_token_ids)} tokens")
        if digests is None:
            chain = self.hasher.chain(cache_salt=cache_salt)
            chain.extend(prompt_token_ids[: n * size])
            digests = chain.digests
        digests = list(digests[:n])
        if [block_key(d) for d in digests] != list(block_keys):
            raise ValueError(
                "the sent blocks' hashes differ from this worker's: model, block size or "
                f"hash seed differ ({self.hasher.fingerprint} here)"
            )
        # A prompt that ends on a block boundary: its last block goes to a block of the
        # request's own, not to the prefix cache, so that only its last token is computed
        # here (it is written into that block again, which no other request reads).
        own_last = hold_for is not None and n > 0 and n * size == len(prompt_token_ids)
        shared = n - 1 if own_last else n
        with self._lock:
            prefix = self.pool.lookup(digests[:shared])
            have = len(prefix)
            # Hold the cached prefix from now on, or an allocation could evict it (and the
            # stored blocks would hang off a parent the index no longer has).
            self.pool.touch(prefix)
            # Keep one block for the prompt's tail, which the request computes here.
            room = max(0, self.pool.num_free - 1)
            end = have + min(shared - have, room)
            targets = self.pool.allocate(end - have) if end > have else []
            plan = BlockImport(prompt_token_ids, digests, hold_for, prefix, targets)
            if own_last and end == shared and self.pool.num_free:
                (plan.own_last,) = self.pool.allocate(1)
            plan.received = have  # nothing to write for the cached prefix
            return plan

    def write_import(self, plan: BlockImport, first: int, data: bytes | memoryview) -> None:
        """Copy the bytes of transfer blocks ``first ..`` (whole blocks, in order) into
        their blocks here. Runs on any thread, alongside the engine's steps."""
        block_bytes = self.kv_layout.block_bytes
        count = len(data) // block_bytes if block_bytes else 0
        if plan.finished:
            raise ValueError("the import is finished")
        if block_bytes and (len(data) % block_bytes or first > plan.received):
            raise ValueError(f"blocks must arrive whole and in order (block {first})")
        places = plan.destinations(first, count)
        if places:
            at = places[0][0] - first
            view = memoryview(data)[at * block_bytes : (at + len(places)) * block_bytes]
            self._write_blocks([b for _, b in places], view)
        plan.received = max(plan.received, first + count)

    def finish_import(self, plan: BlockImport, *, complete: bool = False) -> int:
        """Cache what arrived whole (published as ``BlockStored``), free the rest, and hand
        the blocks to the request they are for. ``complete``: every block's bytes arrived
        (a simulated engine's blocks have none to wait for); otherwise, what
        :meth:`write_import` saw arrive. Returns how many of the prompt's blocks are in
        place."""
        if plan.finished:
            raise ValueError("the import is finished")
        plan.finished = True
        size = self.pool.block_size
        received = plan.num_blocks if complete else plan.received
        shared_end = plan.have + len(plan.targets)
        good = max(plan.have, min(received, shared_end))
        kept, dropped = plan.targets[: good - plan.have], plan.targets[good - plan.have :]
        ids = plan.prompt_token_ids
        with self._lock:
            self.pool.free(list(reversed(dropped)))
            held = (
                self.pool.cache_blocks(
                    kept,
                    plan.digests[plan.have : good],
                    [ids[j * size : (j + 1) * size] for j in range(plan.have, good)],
                    plan.digests[plan.have - 1] if plan.have else None,
                )
                if kept
                else []
            )
            last = plan.own_last
            if last is not None and (good < shared_end or received < plan.num_blocks):
                self.pool.free([last])  # its bytes never came, or its parent did not
                last = None
            seq = plan.hold_for
            if seq is not None:  # the request keeps them until it is admitted
                self.pool.free(list(reversed(seq.held_block_ids)))
                seq.held_block_ids = plan.prefix + held
                if seq.imported_last is not None:
                    self.pool.free([seq.imported_last])
                seq.imported_last = last
            else:
                self.pool.free(list(reversed(held)))
                self.pool.free(list(reversed(plan.prefix)))
            self._flush_events()
        return good + (last is not None)

    def abort_import(self, plan: BlockImport) -> None:
        """Give back an import's blocks: its request will not run (its client left). What
        arrived whole stays in the prefix cache. Idempotent, and safe after
        :meth:`release_held` (an abort that waited for a copy to end can come later)."""
        with self._lock:
            if not plan.finished:
                self.finish_import(plan)
            if plan.hold_for is not None:
                self.release_held(plan.hold_for)

    def import_blocks(
        self,
        prompt_token_ids: Sequence[int],
        block_keys: Sequence[int],
        data: bytes | memoryview,
        *,
        cache_salt: str | None = None,
        digests: Sequence[bytes] | None = None,
        hold_for: Seq | None = None,
    ) -> int:
        """A whole transfer's bytes at once: :meth:`begin_import`, :meth:`write_import` and
        :meth:`finish_import` in one call. Returns how many blocks are now in place."""
        block_bytes = self.kv_layout.block_bytes
        if len(data) != len(block_keys) * block_bytes:
            raise ValueError(
                f"expected {len(block_keys) * block_bytes} bytes of KV, got {len(data)}"
            )
        with self._lock:
            plan = self.begin_import(
                prompt_token_ids,
                block_keys,
                cache_salt=cache_salt,
                digests=digests,
                hold_for=hold_for,
            )
            try:
                self.write_import(plan, 0, data)
            except BaseException:
                self.abort_import(plan)
                raise
            return self.finish_import(plan, complete=True)  # its length was checked above

    def release_held(self, seq: Seq) -> None:
        """Let go of blocks imported for a request that will not run (its client left
        before it was queued)."""
        with self._lock:
            self.scheduler.release_held(seq)
