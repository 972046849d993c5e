"""The router's own CPU per streamed chunk: ``router.proxy.relay.Relay.stream`` passing a worker's
SSE stream on, event by event, with the router's real metrics and SSE parsing, fed from
memory (no sockets: what is measured is the router's Python per chunk, not the network).

Two relays in the same run:

* **kvpool** (``router_cpu_us_per_chunk``): today's ``Relay.stream``, whose idle timeout is
  one timer for the whole stream (``router.proxy.relay.IdleWatch``);
* **before** (``baseline_cpu_us_per_chunk``): the relay as it was before issue 43's first
  steps: an ``asyncio.timeout`` around every read, and every chunk parsed event by event
  (``SSEWatch.feed_events``; today's ``feed`` passes a whole delta event on as it is).

Each stream is 500 chat chunks of one token (as a 500-token answer streams), then the
finish and ``[DONE]``. Writes bench/results/relay_chunks.{md,json}. ``--quick``: fewer.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import platform
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
TOKENS = 500
IDLE_S = 60.0


def sse_chunks(tokens: int) -> list[bytes]:
    def event(delta: dict[str, Any], finish: str | None) -> bytes:
        body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
                "model": "m", "choices": [{"index": 0, "delta": delta,
                                           "finish_reason": finish}]}  # fmt: skip
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    out = [event({"role": "assistant", "content": ""}, None)]
    out += [event({"content": f" t{i}"}, None) for i in range(tokens)]
    out.append(event({}, "stop") + b"data: [DONE]\n\n")
    return out


class _Response:
    """What the relay reads: the worker's body, chunk by chunk, from memory."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def _iter(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk

    def iter_any(self) -> AsyncIterator[bytes]:
        return self._iter()

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Breaker:
    def on_success(self) -> None:
        pass

    def on_failure(self, now: float) -> None:
        pass


class _Worker:
    """The relay's worker entry: its load bookkeeping, as the pool's does it, at no cost."""

    id = "w"
    breaker = _Breaker()

    def first_token(self, ticket: Any, now: float) -> None:
        pass

    def observe_itl(self, gap: float) -> None:
        pass

    def end(self, ticket: Any) -> None:
        pass


def relay_class(per_read_timer: bool) -> type:
    from kvpool.router.proxy.relay import Relay, sse_error

    if not per_read_timer:
        return Relay

    class PerReadTimer(Relay):  # the stream loop before IdleWatch: a timer per read
        async def stream(self) -> AsyncIterator[bytes]:
            events, metrics, idle = self.events, self.metrics, self.idle_timeout_s
            feed = events.feed_events  # and every chunk split into events
            try:
                if self.head:
                    yield self.head
                while not events.done:
                    try:
                        async with asyncio.timeout(idle):
                            chunk = await anext(self._chunks)
                    except StopAsyncIteration:
                        break
                    out, outputs = feed(chunk)
                    if outputs:
                        now = time.monotonic()
                        if self.last_token is not None:
                            gap = now - self.last_token
                            metrics.itl.observe(gap)
                            self.state.observe_itl(gap / outputs)
                        self.last_token = now
                    if out:
                        yield out
                self.outcome = "success"
            except TimeoutError:
                yield sse_error("idle", "timeout")
            finally:
                await self.close()

    return PerReadTimer


async def one_stream(cls: type, chunks: list[bytes], metrics: Any) -> int:
    from kvpool.router.proxy.sse import SSEWatch

    relay = cls(_Worker(), None, "r", _Response(chunks), time.monotonic(), SSEWatch(),
                metrics, IDLE_S, on_close=lambda relay: None)  # fmt: skip
    await relay.first_output(time.monotonic() + 10)
    sent = 0
    async for out in relay.stream():
        sent += len(out)
    assert relay.outcome == "success", relay.outcome
    return sent


async def measure(streams: int) -> dict[str, Any]:
    from kvpool.router.admin.metrics import RouterMetrics

    metrics = RouterMetrics(lambda: [], lambda worker: 0)
    chunks = sse_chunks(TOKENS)
    out: dict[str, Any] = {}
    for name, per_read in (("kvpool", False), ("before", True)):
        cls = relay_class(per_read)
        for _ in range(3):  # warm
            await one_stream(cls, chunks, metrics)
        samples = []
        for _ in range(streams):
            t0 = time.process_time()
            await one_stream(cls, chunks, metrics)
            samples.append((time.process_time() - t0) / len(chunks) * 1e6)
        out[name] = {"cpu_us_per_chunk": statistics.median(samples), "streams": streams}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    found = asyncio.run(measure(40 if args.quick else 200))
    ours = found["kvpool"]["cpu_us_per_chunk"]
    base = found["before"]["cpu_us_per_chunk"]
    result = {
        "router_cpu_us_per_chunk": round(ours, 3),
        "baseline_cpu_us_per_chunk": round(base, 3),
        "speedup": round(base / ours, 2),
        "tokens_per_stream": TOKENS,
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.machine()}, Python {platform.python_version()}",
        "runs": found,
    }
    table = (
        "| relay | router CPU per streamed chunk (µs, median of streams) |\n"
        "|---|---|\n"
        f"| kvpool (one idle timer per stream; a delta event passed on whole) | {ours:.2f} |\n"
        f"| before (a timer per read; every chunk split into events) | {base:.2f} |\n"
    )
    print(table)
    print(f"{base / ours:.2f}x less CPU per chunk; goal (issue 43): at most 2 µs")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "relay_chunks.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "relay_chunks.md").write_text(
        f"# Router CPU per streamed chunk ({result['date']}, {result['machine']})\n\n"
        f"{TOKENS}-token chat streams relayed from memory by `Relay.stream`.\n\n{table}"
    )


if __name__ == "__main__":
    main()
