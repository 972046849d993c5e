"""Paged attention: keys and values live in fixed-size blocks of one big KV tensor.

The cache is ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``; a token's *slot*
is ``block_id * block_size + offset``. Each step the model runner builds one
:class:`AttentionMetadata` for the whole ragged batch, and every layer uses it twice: to
write the step's new keys and values into their slots, and to read each sequence's whole
context back through its block table.

The causal mask is aligned to the *end* of the key sequence: query ``j`` of a sequence that
has ``q`` new tokens and ``L`` keys in all sits at position ``L - q + j``. That is what
chunked prefill and prefix-cache hits need, since their queries start part-way through.

Decode rows (one query each) take one of two ways. With a :class:`PagedDecode` kernel (the
``paged`` path: :mod:`.attention_flex` on CUDA, :mod:`.attention_cpu` on CPU) they read the
cache in place through their block tables. Otherwise (the ``gather`` path) they are
gathered into padded batches of similar context length,
each bounded to ``DECODE_GATHER_TOKENS`` context slots and to ``GATHER_PADDING`` times the
context its rows use (so one long row does not pad every short one to its length), each run as
one ``scaled_dot_product_attention`` call; prefill rows run one sequence at a time, where
the query count makes the call worth its overhead. The same code runs on CPU and on CUDA,
where ``scaled_dot_product_attention`` dispatches to the fused flash or memory-efficient
kernels (for a masked call with grouped KV heads the heads are expanded first, since
PyTorch's memory-efficient kernel takes masks but not grouped heads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

#: context slots one padded decode gather may hold (rows x longest context)
DECODE_GATHER_TOKENS = 32768


class PagedDecode(Protocol):
    """The seam for a kernel that reads decode rows' K/V in place through their block
    tables: :class:`.attention_flex.FlexDecode` (FlexAttention, Triton on CUDA) and
    :class:`.attention_cpu.CpuPagedDecode` (a C kernel). The scheduler and the runner see
    only this."""

    def plan(self, tables: list[list[int]], lens: list[int]) -> None:
        """This step's decode rows: each one's block table and context length (its new
        token included), into the kernel's persistent buffers."""

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """``q`` ``[rows, heads, head_dim]`` (the planned rows' new tokens) against one
        layer's cache ``[num_blocks, block_size, kv_heads, head_dim]``."""


@dataclass
class PrefillRow:
    """One sequence with more than one new token."""

    q_start: int
    q_len: int
    ctx_slots: torch.Tensor | None  # None: no earlier context, attend over the new keys only
    mask: torch.Tensor | None  # None: plain causal (no earlier context)


@dataclass
class DecodeBatch:
    """Sequences with one new token each, their contexts padded to the longest."""

    q_index: torch.Tensor  # [B] rows of the flat batch
    slots: torch.Tensor  # [B * Lmax] context slots; padding points at slot 0 and is masked
    mask: torch.Tensor  # [B, 1, 1, Lmax] True where the key is real


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    query_start_loc: list[int]  # [B+1] offsets of each sequence in the flat batch
    seq_lens: list[int]  # [B] context length after this step, new tokens included
    block_tables: list[list[int]]  # [B] each sequence's blocks, in order
    block_size: int
    prefills: list[PrefillRow] = field(default_factory=list)
    decode: list[DecodeBatch] = field(default_factory=list)
    # the paged path: decode rows read the cache in place (``decode`` is then empty)
    paged: PagedDecode | None = None
    paged_rows: torch.Tensor | None = None

    @staticmethod
    def build(
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
        decode_gather_tokens: int = DECODE_GATHER_TOKENS,
        paged: PagedDecode | None = None,
    ) -> AttentionMetadata:
        """Everything the layers need, computed once per step (index tensors, masks)."""
        starts = [0]
        slot_parts: list[torch.Tensor | list[int]] = []
        prefills: list[PrefillRow] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        for q, total, table in zip(query_lens, seq_lens, block_tables, strict=True):
            start = starts[-1]
            starts.append(start + q)
            if q == 1:
                pos = total - 1
                slot = table[pos // block_size] * block_size + pos % block_size
                if slot_parts and isinstance(slot_parts[-1], list):
                    slot_parts[-1].append(slot)
                else:
                    slot_parts.append([slot])
                decode_rows.append(start)
                decode_tables.append(table[: -(-total // block_size)])
                decode_lens.append(total)
                continue
            ctx = _context_slots(table, total, block_size)
            slot_parts.append(ctx[total - q :])
            if total == q:
                prefills.append(PrefillRow(start, q, None, None))
            else:
                # built where it is used: it is q x context booleans
                keys = torch.arange(total, device=device)
                queries = torch.arange(total - q, total, device=device)
                mask = keys[None, :] <= queries[:, None]
                prefills.append(PrefillRow(start, q, ctx.to(device), mask))
        paged_rows = None
        if paged is not None and decode_rows:
            paged.plan(decode_tables, decode_lens)
            paged_rows = torch.tensor(decode_rows, device=device)
            decode = []
        else:
            paged = None
            decode = [
                _decode_batch(
                    [decode_rows[i] for i in group],
                    [decode_tables[i] for i in group],
                    [decode_lens[i] for i in group],
                    block_size,
                    device,
                )
                for group in _gather_groups(decode_lens, decode_gather_tokens)
            ]
        pieces = [torch.tensor(p) if isinstance(p, list) else p for p in slot_parts]
        slot_mapping = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)
        return AttentionMetadata(
            slot_mapping=slot_mapping.to(device),
            query_start_loc=starts,
            seq_lens=list(seq_lens),
            block_tables=block_tables,
            block_size=block_size,
            prefills=prefills,
            decode=decode,
            paged=paged,
            paged_rows=paged_rows,
        )


#: a padded decode group gathers at most this many times the context it uses: rows of very
#: different lengths (a long hand-off among short chats) go to groups of their own
GATHER_PADDING = 2


def _gather_groups(lens: list[int], budget: int) -> list[list[int]]:
    """The decode rows (indices into ``lens``) in groups of similar context length, each
    padded to its longest: a group's padded size (rows x longest) stays within ``budget``
    and within ``GATHER_PADDING`` times the context its rows use; a row longer than the
    budget is a group of its own."""
    groups: list[list[int]] = []
    group: list[int] = []
    used = 0
    for i in sorted(range(len(lens)), key=lens.__getitem__):
        total = lens[i]  # the longest so far: rows come shortest first
        padded = (len(group) + 1) * total
        if group and (padded > budget or padded > GATHER_PADDING * (used + total)):
            groups.append(group)
            group, used = [], 0
        group.append(i)
        used += total
    if group:
        groups.append(group)
    return groups


def _decode_batch(
    rows: list[int],
    tables: list[list[int]],
    lens: list[int],
    block_size: int,
    device: torch.device | str,
) -> DecodeBatch:
    width = max(len(t) for t in tables)
    flat: list[int] = []  # one flat list: torch.tensor is slow on nested ones
    for t in tables:
        flat.extend(t)
        flat.extend([0] * (width - len(t)))
    blocks = torch.tensor(flat).view(len(tables), width)
    slots = blocks[:, :, None] * block_size + torch.arange(block_size)
    longest = max(lens)
    slots = slots.view(len(rows), -1)[:, :longest]
    mask = torch.arange(longest)[None, :] < torch.tensor(lens)[:, None]
    return DecodeBatch(
        torch.tensor(rows, device=device),
        slots.reshape(-1).to(device),
        mask[:, None, None, :].to(device),
    )


def _context_slots(table: list[int], length: int, block_size: int) -> torch.Tensor:
    blocks = torch.tensor(table[: -(-length // block_size)], dtype=torch.long)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)[None, :]).reshape(-1)
    return slots[:length]


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Store this step's keys and values (``[T, kv_heads, head_dim]``) into their slots."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention for a flat ragged batch: ``q`` ``[T, heads, head_dim]``, ``k``/``v`` the new
    ``[T, kv_heads, head_dim]`` (already written to the cache). Returns ``[T, heads, head_dim]``."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    kv_heads, head_dim = k.shape[1], k.shape[2]
    k_flat = k_cache.view(-1, kv_heads, head_dim)
    v_flat = v_cache.view(-1, kv_heads, head_dim)
    out = torch.empty_like(q)
    for row in meta.prefills:
        rows = slice(row.q_start, row.q_start + row.q_len)
        qi = q[rows].transpose(0, 1).unsqueeze(0)
        if row.ctx_slots is None:
            ki, vi = k[rows], v[rows]
        else:
            ki = k_flat.index_select(0, row.ctx_slots)
            vi = v_flat.index_select(0, row.ctx_slots)
        ki = ki.transpose(0, 1).unsqueeze(0)
        vi = vi.transpose(0, 1).unsqueeze(0)
        o = _sdpa(qi, ki, vi, row.mask, scale)
        out[rows] = o.squeeze(0).transpose(0, 1)
    for d in meta.decode:
        batch = d.q_index.shape[0]
        qd = q[d.q_index].unsqueeze(2)  # [B, heads, 1, head_dim]
        # index_select over slots is the fastest gather on CPU (faster than by block)
        kd = k_flat.index_select(0, d.slots).view(batch, -1, kv_heads, head_dim).transpose(1, 2)
        vd = v_flat.index_select(0, d.slots).view(batch, -1, kv_heads, head_dim).transpose(1, 2)
        out[d.q_index] = _sdpa(qd, kd, vd, d.mask, scale).squeeze(2)
    if meta.paged is not None:
        rows = meta.paged_rows
        out[rows] = meta.paged.attend(q[rows], k_cache, v_cache, scale)
    return out


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """``[B, heads, q, d]`` attention over ``[B, kv_heads, L, d]``; no mask means causal."""
    group = q.shape[1] // k.shape[1]
    if group > 1 and mask is not None and q.is_cuda:
        # CUDA's flash kernel takes grouped heads but no mask; the memory-efficient kernel
        # takes a mask but no grouped heads. Expanding beats falling back to the math path.
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        group = 1
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=group > 1
    )


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The plain definition, one sequence and one head at a time, for tests to compare with."""
    kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    k_flat = k_cache.reshape(-1, kv_heads, head_dim).float()
    v_flat = v_cache.reshape(-1, kv_heads, head_dim).float()
    group = q.shape[1] // kv_heads
    out = torch.empty_like(q, dtype=torch.float32)
    for i, total in enumerate(meta.seq_lens):
        start, stop = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        slots = _context_slots(meta.block_tables[i], total, meta.block_size)
        keys, values = k_flat[slots], v_flat[slots]
        for j in range(stop - start):
            visible = total - (stop - start) + j + 1
            for h in range(q.shape[1]):
                scores = keys[:visible, h // group] @ q[start + j, h].float() * scale
                out[start + j, h] = torch.softmax(scores, 0) @ values[:visible, h // group]
    return out.to(q.dtype)
