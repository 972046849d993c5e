"""A stream's idle timeout with one timer (``router.relay.IdleWatch``): a worker that sends
steadily is never cut, whatever its rate against the checks; a client slow to take chunks
is not the worker's silence; a read that never ends is cut between one and one and a half
idle periods after it began."""

from __future__ import annotations

import asyncio
import time

from kvpool.router.proxy.relay import IdleWatch

IDLE = 0.4


async def read_all(gaps: list[float], hand_off: float = 0.0) -> tuple[int, float | None]:
    """Read chunks that come ``gaps`` apart as Relay.stream does, taking ``hand_off``
    seconds to pass each on; (chunks read, when the read that was cut began, or None)."""

    async def chunks():
        for gap in gaps:
            await asyncio.sleep(gap)
            yield b"x"

    watch, it, count, began = IdleWatch(IDLE), chunks(), 0, None
    try:
        while True:
            watch.reads += 1
            watch.reading = True
            began = time.monotonic()
            try:
                await anext(it)
            except StopAsyncIteration:
                return count, None
            except asyncio.CancelledError:
                assert watch.expired()
                return count, began
            watch.reading = False
            count += 1
            await asyncio.sleep(hand_off)  # a slow client: the send waits
    finally:
        watch.stop()


async def test_a_steady_worker_is_never_cut() -> None:
    # chunks half an idle period apart: every check finds a read under way, never the same
    assert await read_all([IDLE * 0.5] * 10) == (10, None)
    assert await read_all([0.01] * 200) == (200, None)


async def test_a_slow_client_is_not_the_workers_silence() -> None:
    assert await read_all([0.01] * 4, hand_off=IDLE * 2) == (4, None)


async def test_a_read_that_never_ends_is_cut_within_one_and_a_half_periods() -> None:
    started = time.monotonic()
    count, began = await read_all([0.01, 0.01, 60.0])
    assert count == 2 and began is not None
    waited = time.monotonic() - began
    assert IDLE <= waited < IDLE * 1.5 + 1.0, waited  # (the slack: a loaded machine)
    assert time.monotonic() - started < 5


async def test_a_cancellation_from_elsewhere_passes_through() -> None:
    async def reader() -> None:
        watch = IdleWatch(IDLE)
        try:
            watch.reads += 1
            watch.reading = True
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                assert not watch.expired()
                raise
        finally:
            watch.stop()

    task = asyncio.ensure_future(reader())
    await asyncio.sleep(0.05)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    else:
        raise AssertionError("the client's cancellation was swallowed")
