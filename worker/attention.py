"""Paged attention: keys and values live in fixed-size blocks of one big KV tensor.

The cache is ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``; a token's *slot*
is ``block_id * block_size + offset``. Each step the model runner builds one
:class:`AttentionMetadata` for the whole ragged batch, and every layer uses it twice: to
write the step's new keys and values into their slots, and to read each sequence's whole
context back through its block table.

The causal mask is aligned to the *end* of the key sequence: query ``j`` of a sequence that
has ``q`` new tokens and ``L`` keys in all sits at position ``L - q + j``. That is what
chunked prefill and prefix-cache hits need, since their queries start part-way through.

Decode rows (one query each) are gathered into one padded batch and run as a single
``scaled_dot_product_attention`` call; prefill rows run one sequence at a time, where the
query count makes the call worth its overhead. The same code runs on CPU and on CUDA, where
``scaled_dot_product_attention`` dispatches to the fused flash or memory-efficient kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillRow:
    """One sequence with more than one new token."""

    q_start: int
    q_len: int
    ctx_len: int
    ctx_slots: torch.Tensor | None  # None: no earlier context, attend over the new keys only
    mask: torch.Tensor | None  # None: plain causal (no earlier context)


@dataclass
class DecodeBatch:
    """Sequences with one new token each, padded to the longest context."""

    q_index: torch.Tensor  # [B] rows of the flat batch
    slots: torch.Tensor  # [B, Lmax] context slots, padding points at slot 0
    mask: torch.Tensor  # [B, 1, 1, Lmax] True where the key is real


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    query_start_loc: list[int]  # [B+1] offsets of each sequence in the flat batch
    seq_lens: list[int]  # [B] context length after this step, new tokens included
    block_tables: list[list[int]]  # [B] each sequence's blocks, in order
    block_size: int
    prefills: list[PrefillRow] = field(default_factory=list)
    decode: DecodeBatch | None = None

    @staticmethod
    def build(
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        slot_rows: list[torch.Tensor] = []
        prefills: list[PrefillRow] = []
        decode_rows: list[int] = []
        decode_ctx: list[torch.Tensor] = []
        for i, (q, total, table) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
            ctx = _context_slots(table, total, block_size)
            slot_rows.append(ctx[total - q :])
            if q == 1:
                decode_rows.append(starts[i])
                decode_ctx.append(ctx)
            elif total == q:
                prefills.append(PrefillRow(starts[i], q, total, None, None))
            else:
                keys = torch.arange(total)
                queries = torch.arange(total - q, total)
                mask = keys[None, :] <= queries[:, None]
                prefills.append(PrefillRow(starts[i], q, total, ctx.to(device), mask.to(device)))
        decode = None
        if decode_rows:
            longest = max(len(c) for c in decode_ctx)
            slots = torch.zeros(len(decode_ctx), longest, dtype=torch.long)
            mask = torch.zeros(len(decode_ctx), 1, 1, longest, dtype=torch.bool)
            for row, ctx in enumerate(decode_ctx):
                slots[row, : len(ctx)] = ctx
                mask[row, 0, 0, : len(ctx)] = True
            decode = DecodeBatch(
                torch.tensor(decode_rows, device=device), slots.to(device), mask.to(device)
            )
        slot_mapping = torch.cat(slot_rows) if slot_rows else torch.empty(0, dtype=torch.long)
        return AttentionMetadata(
            slot_mapping=slot_mapping.to(device),
            query_start_loc=starts,
            seq_lens=list(seq_lens),
            block_tables=[list(t) for t in block_tables],
            block_size=block_size,
            prefills=prefills,
            decode=decode,
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
    gqa = q.shape[1] != kv_heads
    out = torch.empty_like(q)
    for row in meta.prefills:
        rows = slice(row.q_start, row.q_start + row.q_len)
        qi = q[rows].transpose(0, 1).unsqueeze(0)
        if row.ctx_slots is None:
            ki, vi = k[rows], v[rows]
        else:
            ki, vi = k_flat[row.ctx_slots], v_flat[row.ctx_slots]
        ki = ki.transpose(0, 1).unsqueeze(0)
        vi = vi.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=row.mask, is_causal=row.mask is None, scale=scale, enable_gqa=gqa
        )
        out[rows] = o.squeeze(0).transpose(0, 1)
    if meta.decode is not None:
        d = meta.decode
        qd = q[d.q_index].unsqueeze(2)  # [B, heads, 1, head_dim]
        kd = k_flat[d.slots].transpose(1, 2)  # [B, kv_heads, Lmax, head_dim]
        vd = v_flat[d.slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=d.mask, scale=scale, enable_gqa=gqa
        )
        out[d.q_index] = o.squeeze(2)
    return out


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
