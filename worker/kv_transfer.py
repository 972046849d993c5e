"""Moving a finished prefill's KV blocks from a prefill worker to a decode worker over HTTP.

The prefill worker answers ``GET /kv/{request_id}`` with one streamed body::

    b"KVPB" | header length (4 bytes, big-endian) | header (JSON) | block 0 | block 1 | ...

The header says what the bytes are (``dtype``, ``block_shape``, ``layout``, ``block_bytes``)
and which prefix they hold (``block_hashes``: the 64-bit block keys of contract 1). The
decode worker checks every field against its own cache and the hashes against its own
hashing of the prompt before it stores anything: blocks from a different model, dtype,
block size or hash seed are refused, never stored under a wrong name.

Both ends stream: the prefill worker reads ``CHUNK_BYTES`` of blocks at a time beside its
engine's steps (:func:`stream_blocks`), and the decode worker hands each run of whole
blocks to a :class:`BlockSink` as it arrives (:func:`pull_blocks_into`); its
:class:`ImportSink` copies them into the cache (see :mod:`.handoff`), so the body is never
held whole.

The request carries the hand-off's one-time token (``Authorization: Bearer``, from the
signed ``kv_transfer_params``); without it the prefill worker answers 401 or 403. A pull,
whole or cut short, spends the token and frees the pin: the blocks go to one reader only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import struct
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

MAGIC = b"KVPB"
VERSION = 1
_LEN = struct.Struct(">I")
MAX_HEADER_BYTES = 16 * 2**20
#: bytes read per chunk of the body: big enough for throughput, small enough that the
#: buffers are reused by the allocator and sending starts early
CHUNK_BYTES = 8 * 2**20


class TransferError(RuntimeError):
    """The blocks could not be fetched or do not fit this worker (the caller falls back to
    computing the prefill itself)."""


@dataclass
class TransferHeader:
    request_id: str
    dtype: str
    block_shape: list[int]
    layout: str
    block_bytes: int
    block_size: int
    num_prompt_tokens: int
    block_hashes: list[int]
    version: int = VERSION

    def encode(self) -> bytes:
        raw = json.dumps(asdict(self), separators=(",", ":")).encode()
        return MAGIC + _LEN.pack(len(raw)) + raw

    @property
    def body_bytes(self) -> int:
        return self.block_bytes * len(self.block_hashes)


async def stream_blocks(
    header: TransferHeader,
    block_ids: Sequence[int],
    read: Callable[[Sequence[int]], Awaitable[bytes | memoryview]],
) -> AsyncIterator[bytes | memoryview]:
    """The body of a transfer: the header, then the blocks' bytes a chunk at a time."""
    yield header.encode()
    step = max(1, CHUNK_BYTES // max(1, header.block_bytes))
    for start in range(0, len(block_ids), step):
        yield await read(block_ids[start : start + step])


def _parse_header(buf: bytes | bytearray) -> tuple[TransferHeader, int] | None:
    """The header and where the blocks start, or None while more bytes are needed."""
    if len(buf) < len(MAGIC) + _LEN.size:
        return None
    if buf[: len(MAGIC)] != MAGIC:
        raise TransferError("the response is not a KV block transfer (bad magic)")
    (n,) = _LEN.unpack_from(buf, len(MAGIC))
    if n > MAX_HEADER_BYTES:
        raise TransferError(f"the transfer header claims {n} bytes")
    start = len(MAGIC) + _LEN.size
    if len(buf) < start + n:
        return None
    try:
        fields = json.loads(bytes(buf[start : start + n]))
        header = TransferHeader(**fields)
    except (ValueError, TypeError) as exc:
        raise TransferError(f"the transfer header does not parse: {exc}") from None
    if header.version != VERSION:
        raise TransferError(f"transfer version {header.version}, this worker reads {VERSION}")
    return header, start + n


class BlockSink(Protocol):
    """Where a streamed transfer's blocks go: :meth:`begin` once the header is read (it
    raises :class:`TransferError` or ``ValueError`` to refuse the transfer), then
    :meth:`write` for each run of whole blocks, in order, as they arrive."""

    async def begin(self, header: TransferHeader) -> None: ...

    async def write(self, first: int, data: bytearray) -> None: ...


#: bytes asked of the socket per read: big reads keep the event loop's work per byte small,
#: and so its hold on the GIL, which the engine's thread needs between its kernels (reads of
#: 64 KiB, httpx's, cost the decode streams beside a pull a third more time per token)
READ_BYTES = 1 << 20


class _Waits:
    """How long the next wait of a pull may take: ``timeout`` for each (connecting, each
    read), and never past ``deadline_s`` from the start for the whole pull, so that a peer
    that sends a few bytes just in time forever cannot hold the request."""

    def __init__(self, timeout: float, deadline_s: float | None) -> None:
        self.timeout, self.deadline_s = timeout, deadline_s
        loop = asyncio.get_running_loop()
        self._time = loop.time
        self._end = None if deadline_s is None else loop.time() + deadline_s

    def next(self) -> float:
        if self._end is None:
            return self.timeout
        left = self._end - self._time()
        if left <= 0:
            raise TimeoutError(self.why())
        return min(self.timeout, left)

    def why(self) -> str:
        """What a wait that timed out says."""
        if self._end is not None and self._time() >= self._end:
            return f"the whole pull took more than {self.deadline_s:g} s"
        return f"nothing came for {self.timeout:g} s"


async def _get(
    url: str, headers: dict[str, str] | None, waits: _Waits
) -> tuple[int, int, asyncio.StreamReader, asyncio.StreamWriter]:
    """``GET url`` over a fresh HTTP/1.1 connection: the status, the body's length, and the
    connection, read up to the body (a prefill worker's ``/kv`` always sends a length)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise TransferError(f"cannot pull from {url!r}: not an http:// URL")
    port = parts.port or 80
    async with asyncio.timeout(waits.next()):
        reader, writer = await asyncio.open_connection(parts.hostname, port, limit=READ_BYTES)
    try:
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        lines = [f"GET {target} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
        for name, value in (headers or {}).items():
            if any(c in f"{name}{value}" for c in "\r\n"):
                raise TransferError(f"a header of the pull of {url} holds a line break")
            lines.append(f"{name}: {value}")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        async with asyncio.timeout(waits.next()):
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        status_line, *field_lines = head.split("\r\n")
        status = int(status_line.split(" ", 2)[1])
        fields = dict(
            (name.strip().lower(), value.strip())
            for name, _, value in (x.partition(":") for x in field_lines if x)
        )
        length = int(fields["content-length"])
        if length < 0:
            raise ValueError(f"Content-Length {length}")
        return status, length, reader, writer
    except (ValueError, IndexError, KeyError, asyncio.LimitOverrunError) as exc:
        writer.close()
        raise TransferError(f"{url} answered no HTTP/1.1 response with a length: {exc!r}") from None
    except BaseException:
        writer.close()
        raise


async def pull_blocks_into(
    url: str,
    sink: BlockSink,
    *,
    timeout: float = 30.0,
    deadline_s: float | None = None,
    headers: dict[str, str] | None = None,
) -> TransferHeader:
    """Stream a transfer into ``sink``, ``CHUNK_BYTES`` of whole blocks at a time (the
    body is never held whole). Raises :class:`TransferError` on any failure, a body cut
    short included (the prefill worker died mid-transfer), once the sink has every run of
    whole blocks that arrived. ``timeout``: for connecting and for each read;
    ``deadline_s``: for the whole pull (None: none). ``headers``: the hand-off's token (in
    ``Authorization``); never part of an error message."""
    buf = bytearray()
    header: TransferHeader | None = None
    first = 0  # the first block still in buf
    error: TransferError | None = None
    writer: asyncio.StreamWriter | None = None
    waits = _Waits(timeout, deadline_s)
    try:
        status, length, reader, writer = await _get(url, headers, waits)
        if status != 200:
            async with asyncio.timeout(waits.next()):
                text = (await reader.read(min(length, 4096))).decode(errors="replace")
            raise TransferError(f"{url} answered {status}: {text[:200]}")
        left = length
        while left:
            async with asyncio.timeout(waits.next()):
                piece = await reader.read(min(READ_BYTES, left))
            if not piece:
                raise ConnectionError(f"the body ended {left} bytes short")
            left -= len(piece)
            buf += piece
            if header is None:
                parsed = _parse_header(buf)
                if parsed is None:
                    continue
                header, start = parsed
                del buf[:start]
                await sink.begin(header)
                step = max(1, CHUNK_BYTES // max(1, header.block_bytes)) * header.block_bytes
            if header.block_bytes and len(buf) >= step:
                first, buf = await _write_whole(sink, header, first, buf, url)
    except TimeoutError:
        error = TransferError(f"pulling {url} failed: {waits.why()}")
    except (OSError, asyncio.IncompleteReadError) as exc:
        error = TransferError(f"pulling {url} failed: {exc!r}")
    finally:
        if writer is not None:
            writer.close()
    if header is None:
        raise error or TransferError(f"{url}: the transfer ended before its header")
    got = first * header.block_bytes + len(buf)
    if error is None and got != header.body_bytes:
        error = TransferError(f"{url}: the transfer ended at {got} of {header.body_bytes} bytes")
    if buf and got <= header.body_bytes:  # what came whole is good, even if the rest did not
        first, buf = await _write_whole(sink, header, first, buf, url)
    if error is not None:
        raise error
    return header


async def _write_whole(
    sink: BlockSink, header: TransferHeader, first: int, buf: bytearray, url: str
) -> tuple[int, bytearray]:
    """Hand the whole blocks at the front of ``buf`` (blocks ``first ..``) to the sink;
    returns the next block's index and what is left of ``buf`` (the chunk itself is not
    copied: the sink gets ``buf``, cut to its whole blocks, and the short tail moves)."""
    whole = len(buf) - len(buf) % header.block_bytes if header.block_bytes else 0
    if not whole:
        return first, buf
    if first * header.block_bytes + whole > header.body_bytes:
        raise TransferError(f"{url}: the transfer is longer than its header says")
    rest = buf[whole:]
    del buf[whole:]
    await sink.write(first, buf)
    return first + whole // header.block_bytes, rest


class _Collect:
    """A sink that keeps the bytes (:func:`pull_blocks`)."""

    def __init__(self) -> None:
        self.data = bytearray()

    async def begin(self, header: TransferHeader) -> None:
        pass

    async def write(self, first: int, data: bytearray) -> None:
        self.data += data


async def pull_blocks(
    url: str, *, timeout: float = 30.0, headers: dict[str, str] | None = None
) -> tuple[TransferHeader, bytearray]:
    """Fetch a whole transfer into memory (see :func:`pull_blocks_into`)."""
    sink = _Collect()
    header = await pull_blocks_into(url, sink, timeout=timeout, headers=headers)
    return header, sink.data


class ImportSink:
    """A decode worker's sink: the request's blocks are allocated when the header arrives
    (on the engine thread), each run of blocks is copied into the cache as it arrives (on
    a thread of its own, alongside the engine's steps), and :meth:`finish` hands what came
    whole to the request. ``engine``: an ``EngineCore``; ``loop``: its ``EngineLoop``."""

    def __init__(self, engine: Any, loop: Any, prepared: Any) -> None:
        self.engine, self.loop, self.prepared = engine, loop, prepared
        self.plan: Any = None
        self._begun: asyncio.Future[Any] | None = None
        self._writing: concurrent.futures.Future[None] | None = None

    async def begin(self, header: TransferHeader) -> None:
        engine, seq = self.engine, self.prepared.seq
        mine = engine.kv_layout
        theirs = (header.dtype, header.block_shape, header.layout, header.block_size)
        ours = (mine.dtype, mine.block_shape, mine.layout, engine.pool.block_size)
        if theirs != ours:
            raise TransferError(f"the blocks are {theirs}, this cache holds {ours}")
        self._begun = self.loop.call(
            lambda: engine.begin_import(
                self.prepared.prompt_token_ids,
                header.block_hashes,
                digests=seq.hash_chain.digests,  # hashed already, off the engine
                hold_for=seq,  # nobody evicts them before it is admitted
            )
        )
        # shielded: if this pull is cancelled meanwhile, the allocation still arrives and
        # abort() gives it back
        self.plan = await asyncio.shield(self._begun)

    async def write(self, first: int, data: bytearray) -> None:
        self._writing = _COPIES.submit(self.engine.write_import, self.plan, first, data)
        await asyncio.wrap_future(self._writing)

    async def finish(self, *, complete: bool) -> int:
        """Cache what arrived (everything, if ``complete``); how many blocks are in place."""
        if self.plan is None:
            return 0
        await self._written()
        return await self.loop.call(lambda: self.engine.finish_import(self.plan, complete=complete))

    async def _written(self) -> None:
        if self._writing is not None:
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(self._writing)

    def abort(self) -> None:
        """Give the blocks back (the request was cancelled), once no copy into them runs,
        and once they are allocated if that is still under way. Idempotent."""
        begun = self._begun
        if self.plan is None and begun is not None:
            if not begun.done():
                begun.add_done_callback(lambda _: self.abort())
                return
            if not begun.cancelled() and begun.exception() is None:
                self.plan = begun.result()
        if self.plan is None:
            return
        plan, writing = self.plan, self._writing

        def give_back(_: object = None) -> None:
            self.loop.call_soon(self.engine.abort_import, plan)

        if writing is not None and not writing.done():
            writing.add_done_callback(give_back)
        else:
            give_back()


#: the threads that copy hand-off bytes into the cache (a few: the copies are memory-bound)
_COPIES = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-import")
