"""What reading a worker's load costs the router, per worker and per scrape.

The router reads each worker's ``/metrics`` every ``scrape_interval_s`` (1 s by default)
for the few series its policy needs (``router.state.scrape.SCRAPED_SERIES``). A vLLM page is
hundreds of kilobytes, mostly histogram buckets. This measures, on a page the size of
vLLM's (40 histogram families of 30 buckets, two engines, the load series among them):

* **a scrape** (``scrape_cpu_ms_per_worker``): ``WorkerPool.scrape`` itself, the router's
  code, against a server in another process (HTTP GET on a kept connection, the body read,
  the five series found and applied): the router process's CPU time per scrape, and what
  that makes at 100 workers scraped every second;
* **finding the series** (``parse_ms``): ``parse_load`` on the page alone;
* **the full parse** (``full_parse_ms``): prometheus_client's text parser on the same
  page, the baseline the router used to pay.

Writes bench/results/scrape.{md,json}. ``--quick``: fewer scrapes.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
ME = str(Path(__file__).resolve())
ENV = {**os.environ, "PYTHONSAFEPATH": "1"}  # never import the repository's operator/
WORKERS = 100  # the fleet size the per-worker cost is scaled to


def vllm_metrics_page(engines: int = 2, families: int = 40) -> str:
    """A /metrics page the size of vLLM's: many histogram families of many buckets per
    engine, the load series among them, lookalike names and comments that name them."""
    from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    labels = ["engine", "model_name"]
    buckets = [0.001 * 2**i for i in range(30)]
    for f in range(families):
        h = Histogram(
            f"vllm:family_{f}_seconds", "a histogram", labels, registry=registry, buckets=buckets
        )
        for e in range(engines):
            h.labels(str(e), "m").observe(0.01 * (f + 1))
    itl = Histogram(
        "vllm:inter_token_latency_seconds", "itl", labels, registry=registry, buckets=buckets
    )
    gauges = {
        name: Gauge(name, f"{name} (not vllm:num_requests_waiting 99)", labels, registry=registry)
        for name in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:num_requests_waiting_by_reason",
        )
    }
    for e in range(engines):
        gauges["vllm:num_requests_running"].labels(str(e), "m").set(3 + e)
        gauges["vllm:num_requests_waiting"].labels(str(e), "m").set(2)
        gauges["vllm:kv_cache_usage_perc"].labels(str(e), "m").set(0.25 * (e + 1))
        gauges["vllm:num_requests_waiting_by_reason"].labels(str(e), "m").set(1000)
        for _ in range(10):
            itl.labels(str(e), "m").observe(0.02)
    return generate_latest(registry).decode()


def serve(port: int, page_file: str) -> None:
    """A worker's /metrics (any GET answers the page), keep-alive HTTP/1.1, until killed."""
    page = Path(page_file).read_bytes()
    answer = (
        f"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {len(page)}\r\n\r\n"
    ).encode() + page

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(client, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), 0.1):
            return True
    except OSError:
        return False


def timed(fn: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def scrapes(url: str, n: int) -> dict[str, Any]:
    """``WorkerPool.scrape`` of one worker, ``n`` times in a row: CPU and wall per scrape."""
    import aiohttp

    from kvpool.router.state.discovery import WorkerEndpoint
    from kvpool.router.state.index import BlockIndex
    from kvpool.router.state.pool import WorkerPool
    from kvpool.router.state.worker import PoolConfig, WorkerState

    async with aiohttp.ClientSession() as session:
        pool = WorkerPool(PoolConfig(block_size=16, hash_seed="0"), BlockIndex(), session)
        state = WorkerState(endpoint=WorkerEndpoint(id="w", url=url))
        state.status = "up"
        pool.workers["w"] = state
        for _ in range(20):  # the connection made, the code warm
            assert await pool.scrape(state), "the scrape failed"
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            assert await pool.scrape(state)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        assert state.running == 7 and state.kv_usage == 0.5  # the page's figures, applied
    return {"cpu_ms": cpu * 1000 / n, "wall_ms": wall * 1000 / n, "scrapes": n}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=2000)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--serve", nargs=2, metavar=("PORT", "PAGE"), help=argparse.SUPPRESS)
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.serve:
        serve(int(args.serve[0]), args.serve[1])
        return 0
    if args.quick:
        args.scrapes = 200
    from prometheus_client.parser import text_string_to_metric_families

    from kvpool.router.state.scrape import parse_load
    from kvpool.stack import free_port, wait_until

    page = vllm_metrics_page()
    parse = timed(lambda: parse_load(page), 500)
    full = timed(lambda: list(text_string_to_metric_families(page)), 20)
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(page)
        f.flush()
        port = free_port()
        server = subprocess.Popen([sys.executable, ME, "--serve", str(port), f.name], env=ENV)
        try:
            wait_until(lambda: _listening(port), server, "the /metrics server", timeout=30)
            scrape = asyncio.run(scrapes(f"http://127.0.0.1:{port}", args.scrapes))
        finally:
            server.kill()
            server.wait()
    per_worker = scrape["cpu_ms"]
    figures = {
        "page_bytes": len(page.encode()),
        "scrape_cpu_ms_per_worker": round(per_worker, 4),
        "scrape_wall_ms": round(scrape["wall_ms"], 4),
        "cores_at_100_workers_per_s": round(per_worker * WORKERS / 1000, 4),
        "parse_ms": round(statistics.median(parse), 4),
        "full_parse_ms": round(statistics.median(full), 3),
    }
    rows = [
        f"| a vLLM-size /metrics page ({figures['page_bytes'] / 1024:.0f} KiB) | ms |",
        "|---|---:|",
        f"| a scrape by the router (`WorkerPool.scrape`: GET, read, find, apply), CPU "
        f"| {per_worker:.3f} |",
        f"| ... its wall time (the worker's answer included) | {scrape['wall_ms']:.3f} |",
        f"| finding the five series (`parse_load`), median | {figures['parse_ms']:.3f} |",
        f"| prometheus_client's full parse of the page, median | {figures['full_parse_ms']:.1f} |",
        "",
        f"At {WORKERS} workers scraped every second: {figures['cores_at_100_workers_per_s']:.3f} "
        f"of a core for scraping (the full parse alone would take "
        f"{figures['full_parse_ms'] * WORKERS / 1000:.2f} cores).",
    ]
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    text = f"# Scraping cost ({dt.date.today()}, {machine})\n\n" + "\n".join(rows) + "\n"
    print(text)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "scrape.md").write_text(text)
    out = {**figures, "date": str(dt.date.today()), "machine": machine, "scrapes": scrape}
    (args.results_dir / "scrape.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
