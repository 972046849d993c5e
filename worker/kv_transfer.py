"""Moving a finished prefill's KV blocks from a prefill worker to a decode worker over HTTP.

The prefill worker answers ``GET /kv/{request_id}`` with one streamed body::

    b"KVPB" | header length (4 bytes, big-endian) | header (JSON) | block 0 | block 1 | ...

The header says what the bytes are (``dtype``, ``block_shape``, ``layout``, ``block_bytes``)
and which prefix they hold (``block_hashes``: the 64-bit block keys of contract 1). The
decode worker checks every field against its own cache and the hashes against its own
hashing of the prompt before it stores anything: blocks from a different model, dtype,
block size or hash seed are refused, never stored under a wrong name.

The request carries the hand-off's one-time token (``Authorization: Bearer``, from the
signed ``kv_transfer_params``); without it the prefill worker answers 401 or 403. A pull,
whole or cut short, spends the token and frees the pin: the blocks go to one reader only.
"""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass

import httpx

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


async def pull_blocks(
    client: httpx.AsyncClient,
    url: str,
    *,
    timeout: float = 30.0,
    headers: dict[str, str] | None = None,
) -> tuple[TransferHeader, bytearray]:
    """Fetch a transfer; raises :class:`TransferError` on any failure, including a body cut
    short (the prefill worker died mid-transfer). ``headers``: the hand-off's token (in
    ``Authorization``); never part of an error message."""
    buf = bytearray()
    header: TransferHeader | None = None
    body_start = 0
    try:
        async with client.stream("GET", url, timeout=timeout, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                raise TransferError(f"{url} answered {response.status_code}: {response.text[:200]}")
            async for piece in response.aiter_raw():
                buf += piece
                if header is None:
                    parsed = _parse_header(buf)
                    if parsed is not None:
                        header, body_start = parsed
    except httpx.HTTPError as exc:
        raise TransferError(f"pulling {url} failed: {exc!r}") from None
    if header is None:
        raise TransferError(f"{url}: the transfer ended before its header ({len(buf)} bytes)")
    got = len(buf) - body_start
    if got != header.body_bytes:
        raise TransferError(f"{url}: the transfer ended at {got} of {header.body_bytes} bytes")
    del buf[:body_start]
    return header, buf
