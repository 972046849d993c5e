"""The hand-off's pull client against a raw HTTP server: what it does when the prefill
worker's bytes trickle in."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvpool.worker.kv_transfer import TransferError, TransferHeader, pull_blocks_into

BLOCK = 64  # bytes a block, in this test's transfer


class Sink:
    def __init__(self) -> None:
        self.header: TransferHeader | None = None
        self.blocks: list[int] = []

    async def begin(self, header: TransferHeader) -> None:
        self.header = header

    async def write(self, first: int, data: bytearray) -> None:
        self.blocks += range(first, first + len(data) // BLOCK)


async def test_a_pull_that_trickles_in_ends_at_its_deadline_keeping_its_whole_blocks() -> None:
    """A peer that sends one byte every 50 ms never trips the per-read timeout (1 s); the
    whole pull still ends at its deadline, with the two blocks that came whole kept."""
    header = TransferHeader("r", "float32", [4, 4], "test", BLOCK, 16, 64, [1, 2, 3, 4])
    sent = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(header.encode()) + 4 * BLOCK}\r\n\r\n"
        writer.write(head.encode() + header.encode() + bytes(2 * BLOCK))
        try:
            for _ in range(2 * BLOCK):
                await asyncio.sleep(0.05)
                writer.write(b"\0")
                await writer.drain()
                sent.set()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sink = Sink()
    start = time.monotonic()
    try:
        with pytest.raises(TransferError, match=r"more than 0\.5 s"):
            await pull_blocks_into(
                f"http://127.0.0.1:{port}/kv/r", sink, timeout=1.0, deadline_s=0.5
            )
    finally:
        server.close()
    assert sent.is_set()  # it was trickling, not silent
    assert 0.5 <= time.monotonic() - start < 1.5
    assert sink.header == header and sink.blocks == [0, 1]
