"""Decode attention that reads the paged cache in place, through PyTorch's FlexAttention.

The gather path (:mod:`.attention`) copies every decoding sequence's whole context into a
padded tensor each layer, each step. Here nothing is copied: the cache of one layer,
``[num_blocks, block_size, kv_heads, head_dim]``, is viewed as one long key sequence
``[1, kv_heads, num_blocks * block_size, head_dim]``, and a FlexAttention *block mask* whose
KV block is the cache's block tells the kernel which physical blocks each sequence visits,
in order: its block table. Every block but a sequence's last is full (no mask is evaluated
inside it); the last is partial, and the mask keeps its first ``fill`` slots.

FlexAttention runs compiled: through Triton on CUDA and through inductor's C++ template on
CPU. A compiled kernel is specialised on the batch, so the decode batch is padded up to a
power of two (padding rows visit no block and are dropped): at most ``log2(max_num_seqs)``
compilations, each once per process.

The block tables live in one persistent buffer, ``[rows, max_blocks_per_seq]``, filled each
step for the rows that decode. FlexAttention wants the mask's KV extent to cover the whole
cache, so the kernel sees that buffer through a strided view ``[rows, 1, 1, num_blocks]``
whose rows overlap; it only ever reads the first ``num_full`` entries of a row.
"""

from __future__ import annotations

import threading

import torch

#: the compiled call, shared by every engine and layer; dynamo keeps one kernel per
#: device, dtype and batch bucket under it
_COMPILED: list = []
_COMPILE_LOCK = threading.Lock()


def _bucket(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


class FlexDecode:
    """One engine's decode kernel: persistent metadata buffers and the compiled call."""

    def __init__(
        self, num_blocks: int, block_size: int, max_rows: int, max_blocks_per_seq: int, device
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_rows = _bucket(max_rows)
        self.width = max(max_blocks_per_seq, 1)
        self.device = torch.device(device)
        i32 = {"dtype": torch.int32, "device": self.device}
        # rows x width, plus num_blocks so the overlapping view stays inside the storage
        self._tables = torch.zeros(self.max_rows * self.width + num_blocks, **i32)
        self.full_idx = self._tables.as_strided(
            (self.max_rows, 1, 1, num_blocks), (self.width, self.width, self.width, 1)
        )
        self.full_num = torch.zeros(self.max_rows, 1, 1, **i32)
        self.last_block = torch.zeros(self.max_rows, 1, 1, 1, **i32)
        self.last_idx = self.last_block.expand(self.max_rows, 1, 1, num_blocks)
        self.last_num = torch.zeros(self.max_rows, 1, 1, **i32)
        self.fill = torch.zeros(self.max_rows, **i32)
        self._staging = torch.zeros(self.max_rows * (self.width + 4), dtype=torch.int32)
        if self.device.type == "cuda":
            self._staging = self._staging.pin_memory()
        self.rows = 0
        self.padded = 0
        self._masks: dict[int, object] = {}  # by padded batch: views of the buffers above
        fill = self.fill

        def last_block_fill(b, h, q_idx, kv_idx):
            return kv_idx % block_size < fill[b]

        self._mask_mod = last_block_fill

    def plan(self, tables: list[list[int]], lens: list[int]) -> None:
        """Fill the buffers for this step's decode rows (each row's context length after
        this step's token, and its block table)."""
        n = len(lens)
        if n > self.max_rows:
            raise ValueError(f"{n} decode rows; this kernel was sized for {self.max_rows}")
        bs, width = self.block_size, self.width
        padded = _bucket(n)
        # one flat host list, one copy to the device: the tables, then the small columns
        flat: list[int] = []
        full_counts, lasts, fills = [], [], []
        for table, total in zip(tables, lens, strict=True):
            used = -(-total // bs)
            row = table[: used - 1]
            flat.extend(row)
            flat.extend([0] * (width - len(row)))
            full_counts.append(used - 1)
            lasts.append(table[used - 1])
            fills.append(total - (used - 1) * bs)
        pad = padded - n
        zeros = [0] * pad
        flat.extend([0] * (width * pad))
        size = padded * width
        staging = self._staging[: size + 3 * padded]
        staging.copy_(
            torch.tensor(
                flat + full_counts + zeros + lasts + zeros + fills + zeros, dtype=torch.int32
            )
        )
        on_device = staging.to(self.device, non_blocking=True)
        self._tables[:size].copy_(on_device[:size])
        self.full_num[:padded].view(-1).copy_(on_device[size : size + padded])
        self.last_block[:padded].view(-1).copy_(on_device[size + padded : size + 2 * padded])
        self.fill[:padded].copy_(on_device[size + 2 * padded :])
        self.last_num[:n].fill_(1)
        self.last_num[n:padded].fill_(0)
        self.rows, self.padded = n, padded

    def _block_mask(self):
        from torch.nn.attention.flex_attention import BlockMask

        p = self.padded
        mask = self._masks.get(p)
        if mask is None:
            mask = self._masks[p] = BlockMask.from_kv_blocks(
                self.last_num[:p],
                self.last_idx[:p],
                self.full_num[:p],
                self.full_idx[:p],
                BLOCK_SIZE=(128, self.block_size),  # the q block: decoding kernels want 16+
                mask_mod=self._mask_mod,
                seq_lengths=(1, self.num_blocks * self.block_size),
                compute_q_blocks=False,
            )
        return mask

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """:meth:`.attention.PagedDecode.attend`: the planned rows' new tokens against one
        layer's cache, ``[rows, heads, head_dim]`` out."""
        rows, heads, head_dim = q.shape
        kv_heads = k_cache.shape[-2]
        qp = q.new_zeros(self.padded, heads, 1, head_dim)
        qp[:rows, :, 0] = q
        keys = k_cache.view(1, -1, kv_heads, head_dim).transpose(1, 2)
        values = v_cache.view(1, -1, kv_heads, head_dim).transpose(1, 2)
        out = _compiled()(
            qp,
            keys,
            values,
            block_mask=self._block_mask(),
            scale=scale,
            enable_gqa=heads != kv_heads,
        )
        return out[:rows, :, 0]


def _compiled():
    if not _COMPILED:
        with _COMPILE_LOCK:
            if not _COMPILED:
                from torch.nn.attention.flex_attention import flex_attention

                # one entry per batch bucket (and device, dtype), beyond dynamo's default of 8
                torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
                _COMPILED.append(torch.compile(flex_attention, dynamic=False))
    return _COMPILED[0]
