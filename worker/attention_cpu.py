"""Decode attention that reads the paged cache in place on CPU: a small C kernel.

FlexAttention (:mod:`.attention_flex`) reads the cache in place on CUDA, through Triton. On
CPU it runs through inductor's C++ template, whose decode step grew far faster than the KV
bytes it reads (``bench/engine.py``: 33 ms at 4k tokens of context, 1.4 s at 16k, batch 16).
So the CPU's paged path is :file:`paged_decode.c`: each row's KV heads walk the row's block
table, one cache block at a time, with an online softmax, on OpenMP threads. A step reads
each row's K and V where they lie, once, and copies nothing of the context.

The kernel is built on first use with the system's C compiler (``$CC``, else ``cc``) into
a cache directory (``$KVPOOL_CACHE_DIR``, else ``~/.cache/kvpool``), one build per source,
compiler flags and CPU; later processes load that build. Without a compiler the worker says
so at start-up, and ``--attention gather`` needs none.

Per-step metadata lives in persistent buffers: the rows' block tables ``[rows, width]`` and
their context lengths, both int32, rewritten for the rows that decode.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

__all__ = ["CpuPagedDecode", "KernelUnavailable", "load_kernel"]

SOURCE = Path(__file__).with_name("paged_decode.c")
#: vectorised reductions need reassociation; no -ffast-math, which would assume no infinity
FLAGS = ("-O3", "-march=native", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")
FLAGS += ("-fopenmp", "-shared", "-fPIC", "-std=gnu11")
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_LIB: list[ctypes.CDLL] = []
_LOCK = threading.Lock()


class KernelUnavailable(RuntimeError):
    """The CPU kernel cannot be built or loaded here (no C compiler, say)."""


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("flags", "model name"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "".join(lines)


def _cache_dir() -> Path:
    root = os.environ.get("KVPOOL_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvpool"


def load_kernel() -> ctypes.CDLL:
    """The built kernel, compiled at the first call in this machine's cache directory."""
    if _LIB:
        return _LIB[0]
    with _LOCK:
        if not _LIB:
            _LIB.append(_load())
    return _LIB[0]


def _load() -> ctypes.CDLL:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelUnavailable(
            "the CPU paged-attention kernel needs a C compiler (cc or $CC) with OpenMP, and "
            "there is none: install gcc, or run with --attention gather"
        )
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, compiler.encode(), " ".join(FLAGS).encode(), _cpu_signature().encode()])
    )
    target = _cache_dir() / f"paged_decode-{key.hexdigest()[:16]}.so"
    if not target.is_file():
        try:
            _build(compiler, target)
        except (OSError, subprocess.SubprocessError) as exc:
            raise KernelUnavailable(
                f"the CPU paged-attention kernel does not build into {target.parent} with "
                f"{compiler}: {exc} (or run with --attention gather)"
            ) from None
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        raise KernelUnavailable(f"the CPU paged-attention kernel does not load: {exc}") from None
    fn = lib.kvpool_paged_decode
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [ptr, ptr, ptr, i32, ptr, ptr, ptr, *([i32] * 7), ctypes.c_float, i32]
    fn.restype = i32
    return lib


def _build(compiler: str, target: Path) -> None:
    """Compile the kernel beside its final name and rename it: processes starting together
    each build, and each finds a whole library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.part")
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", partial, "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise KernelUnavailable(
                f"the CPU paged-attention kernel does not build with {compiler}: "
                f"{done.stderr.strip()[-500:]} (or run with --attention gather)"
            )
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


_ERRORS = {
    -1: "the query heads do not divide into the KV heads",
    -2: "a row's context length is 0 or beyond its table",
    -3: "a block id is outside the cache",
    -4: "out of memory for the kernel's scratch",
}


class CpuPagedDecode:
    """One engine's CPU decode kernel: persistent metadata buffers and the C call (a
    :class:`.attention.PagedDecode`)."""

    def __init__(
        self, num_blocks: int, block_size: int, max_rows: int, max_blocks_per_seq: int, device
    ) -> None:
        if torch.device(device).type != "cpu":
            raise ValueError(f"the CPU paged-attention kernel runs on CPU, not {device}")
        self._fn = load_kernel().kvpool_paged_decode
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_rows = max(max_rows, 1)
        self.width = max(max_blocks_per_seq, 1)
        self.tables = torch.zeros(self.max_rows, self.width, dtype=torch.int32)
        self.lens = torch.zeros(self.max_rows, dtype=torch.int32)
        self.rows = 0

    def plan(self, tables: list[list[int]], lens: list[int]) -> None:
        """Fill the buffers for this step's decode rows (each row's context length after
        this step's token, and its block table)."""
        n = len(lens)
        if n > self.max_rows:
            raise ValueError(f"{n} decode rows; this kernel was sized for {self.max_rows}")
        bs = self.block_size
        used = [-(-total // bs) for total in lens]
        widest = max(used, default=0)
        if widest > self.width:
            raise ValueError(f"a row needs {widest} blocks; this kernel was sized for {self.width}")
        # one host list, one tensor: the rows' tables padded to the widest of them
        flat: list[int] = []
        for table, n_used in zip(tables, used, strict=True):
            if n_used > len(table):
                raise ValueError(f"a row needs {n_used} blocks; it has {len(table)}")
            flat += table[:n_used]
            flat += [0] * (widest - n_used)
        if n:
            self.tables[:n, :widest] = torch.tensor(flat, dtype=torch.int32).view(n, widest)
        self.lens[:n] = torch.tensor(lens, dtype=torch.int32)
        self.rows = n

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """:meth:`.attention.PagedDecode.attend`: the planned rows' new tokens against one
        layer's cache, ``[rows, heads, head_dim]`` out."""
        rows, heads, dim = q.shape
        if q.device.type != "cpu" or k_cache.device.type != "cpu":
            raise ValueError("the CPU paged-attention kernel reads tensors in CPU memory")
        if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
            raise ValueError(
                f"K and V caches of one shape expected, got {k_cache.shape} and {v_cache.shape}"
            )
        blocks, block_size, _kv_heads, cache_dim = k_cache.shape
        if block_size != self.block_size or cache_dim != dim or blocks < self.num_blocks:
            raise ValueError(
                f"a cache of {blocks} blocks of {block_size} tokens, head size {cache_dim}, for "
                f"a kernel planned on {self.num_blocks} blocks of {self.block_size} and "
                f"queries of head size {dim}"
            )
        kind = _KINDS.get(k_cache.dtype)
        if kind is None or v_cache.dtype != k_cache.dtype:
            raise TypeError(
                f"the CPU kernel reads float32, bfloat16 or float16, not {k_cache.dtype}"
            )
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the cache of a layer must be contiguous")
        if rows != self.rows:
            raise ValueError(f"{rows} query rows for a plan of {self.rows}")
        qf = q.to(torch.float32).contiguous()
        out = torch.empty(rows, heads, dim, dtype=torch.float32)
        rc = self._fn(
            qf.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            kind,
            self.tables.data_ptr(),
            self.lens.data_ptr(),
            out.data_ptr(),
            rows,
            heads,
            k_cache.shape[2],
            dim,
            self.block_size,
            self.width,
            k_cache.shape[0],
            scale,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"paged decode attention: {_ERRORS.get(rc, rc)}")
        return out if q.dtype == torch.float32 else out.to(q.dtype)
