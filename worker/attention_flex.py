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

Inductor starts child Pythons (its CPU's SIMD probe, its compile workers) with the
parent's ``sys.path`` as their ``PYTHONPATH``. Run from a checkout of this repository with
the checkout on ``sys.path`` (``python -m ...`` there), that path holds the top-level
``operator/`` folder, which shadows the standard library's ``operator`` in those children:
they die at start-up, inductor concludes that this CPU has no SIMD, and FlexAttention's
CPU template, which asks only whether the hardware has AVX2, goes on with vectorised code
compiled without it (``remainder_integral expects integral scalar T``). So the children
get a path without such folders; and a CPU where inductor still finds no SIMD is refused
when the kernel is made, with a message, rather than at its first step with a C++ error.
"""

from __future__ import annotations

import logging
import os
import site
import sys
import sysconfig
import threading

import torch

log = logging.getLogger(__name__)

#: the compiled call, shared by every engine and layer; dynamo keeps one kernel per
#: device, dtype and batch bucket under it
_COMPILED: list = []
_COMPILE_LOCK = threading.Lock()
#: inductor reads the child Pythons' path from here when it is set (else from sys.path)
_CHILD_PATH_VAR = "TORCH_CUSTOM_PYTHONPATH"


class FlexUnavailable(RuntimeError):
    """FlexAttention cannot be compiled for this device here."""


def _installed_dirs() -> set[str]:
    """The standard library's and the installations' folders: whatever they hold is
    meant to be imported."""
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    dirs.update(site.getsitepackages())
    dirs.add(site.getusersitepackages())
    return {os.path.realpath(d) for d in dirs}


def _shadows_stdlib(entry: str, installed: set[str] | None = None) -> bool:
    """Whether a ``sys.path`` entry, other than the standard library's and the
    installations' folders, holds a module or package named as a standard-library one (a
    checkout's ``operator/``): a Python started with it on its path imports that instead."""
    folder = os.path.realpath(entry or os.curdir)
    if folder in (_installed_dirs() if installed is None else installed):
        return False
    try:
        names = os.listdir(folder)
    except OSError:  # gone, not a folder, or a zip archive
        return False
    for name in names:
        stem, ext = os.path.splitext(name)
        if ext == ".py" and stem in sys.stdlib_module_names:
            return True
        if (
            not ext
            and name in sys.stdlib_module_names
            and os.path.isfile(os.path.join(folder, name, "__init__.py"))
        ):
            return True
    return False


def _keep_shadowing_folders_from_inductor_children() -> None:
    """Give inductor's child Pythons this process's path without the folders that would
    shadow the standard library in them (see the module's docstring); a path the user
    set for them stays."""
    if _CHILD_PATH_VAR in os.environ:
        return
    installed = _installed_dirs()
    shadowing = [p for p in sys.path if _shadows_stdlib(p, installed)]
    if shadowing:
        os.environ[_CHILD_PATH_VAR] = os.pathsep.join(p for p in sys.path if p not in shadowing)
        log.info(
            "inductor's child processes run without %s on their path: a module there "
            "shadows the standard library's",
            ", ".join(os.path.realpath(p or os.curdir) for p in shadowing),
        )


def _require_cpu_simd() -> None:
    """FlexAttention's CPU template is vectorised C++: without a SIMD instruction set that
    inductor can build for, it does not compile."""
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:  # another torch: its own errors will have to do
        return
    if not cpu_vec_isa.pick_vec_isa():
        raise FlexUnavailable(
            "FlexAttention on CPU compiles vectorised C++ through torch inductor, and inductor "
            "finds no SIMD instruction set it can build for here (no C++ compiler, a CPU "
            "without AVX2, or ATEN_CPU_CAPABILITY=default): use --attention paged (the C "
            "kernel) or gather"
        )


def _bucket(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


class FlexDecode:
    """One engine's decode kernel: persistent metadata buffers and the compiled call."""

    def __init__(
        self, num_blocks: int, block_size: int, max_rows: int, max_blocks_per_seq: int, device
    ) -> None:
        self.device = torch.device(device)
        with _COMPILE_LOCK:
            _keep_shadowing_folders_from_inductor_children()
        if self.device.type == "cpu":
            _require_cpu_simd()
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_rows = _bucket(max_rows)
        self.width = max(max_blocks_per_seq, 1)
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
