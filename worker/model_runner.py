"""Owns the model and the KV tensor; turns a scheduled batch into one forward pass.

The batch is flattened: every scheduled sequence contributes its new tokens (a prompt
chunk, or one token when decoding) to one list, with their positions and cache slots,
and only the last position of each sequence that is due a new token is projected to
logits.
"""

from __future__ import annotations

import logging

import torch

from .attention import AttentionMetadata, PagedDecode
from .model import LlamaModel
from .scheduler import ScheduledBatch

log = logging.getLogger(__name__)


def kv_block_bytes(model: LlamaModel, block_size: int, dtype: torch.dtype) -> int:
    c = model.config
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return c.num_layers * 2 * block_size * c.num_kv_heads * c.head_dim * itemsize


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def blocks_for_memory(
    model: LlamaModel, block_size: int, dtype: torch.dtype, device: torch.device, fraction: float
) -> int:
    """How many blocks fit in ``fraction`` of the device's free memory now."""
    if not 0 < fraction <= 1:
        raise ValueError(f"kv_cache_memory_fraction={fraction} must be in (0, 1]")
    return int(free_memory_bytes(device) * fraction) // kv_block_bytes(model, block_size, dtype)


#: the decode attention paths ModelRunner can take: ``paged`` is the device's kernel that
#: reads the cache in place, ``flex`` is FlexAttention on any device
ATTENTION_PATHS = ("gather", "paged", "flex")


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        num_blocks: int,
        block_size: int,
        *,
        attention: str = "gather",
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
    ) -> None:
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention={attention!r} is not one of {', '.join(ATTENTION_PATHS)}")
        self.model = model
        self.block_size = block_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        c = model.config
        #: the paged path's kernel: FlexAttention on CUDA, the C kernel on CPU (measured in
        #: bench/engine.py: inductor's CPU FlexAttention grows far faster than the context)
        self.paged: PagedDecode | None = None
        if attention != "gather":
            longest = max_model_len or c.max_position
            if attention == "flex" or self.device.type == "cuda":
                from .attention_flex import FlexDecode

                kernel: type[PagedDecode] = FlexDecode
            else:
                from .attention_cpu import CpuPagedDecode

                kernel = CpuPagedDecode
            self.paged = kernel(
                num_blocks, block_size, max_num_seqs, -(-longest // block_size), self.device
            )
        # zeros, not empty: padded decode rows read slot 0, and NaN * 0 would still be NaN
        self.kv_cache = torch.zeros(
            c.num_layers,
            2,
            num_blocks,
            block_size,
            c.num_kv_heads,
            c.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        log.info(
            "KV cache: %d blocks of %d tokens, %.1f MiB on %s",
            num_blocks,
            block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**20,
            self.device,
        )

    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Run the batch; returns logits ``[S, vocab]`` for the ``S`` sequences that reach
        their last known token this step, and their indexes in ``batch.seqs``."""
        ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        last_rows: list[int] = []
        sampled: list[int] = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens, strict=True)):
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            seq_lens.append(start + n)
            if start + n == seq.num_tokens:
                last_rows.append(len(ids) - 1)
                sampled.append(i)
        meta = AttentionMetadata.build(
            batch.num_tokens,
            seq_lens,
            [seq.block_ids for seq in batch.seqs],
            self.block_size,
            self.device,
            paged=self.paged,
        )
        rows = torch.tensor(last_rows, dtype=torch.long, device=self.device)  # before the
        # forward pass is queued: copying it after would make the host wait for the GPU
        hidden = self.model(
            torch.tensor(ids, device=self.device),
            torch.tensor(positions, device=self.device),
            self.kv_cache,
            meta,
        )
        if not sampled:
            return hidden.new_empty(0, self.model.config.vocab_size, dtype=torch.float32), sampled
        return self.model.compute_logits(hidden[rows]), sampled
