"""Routing quality: the router's default policy beside the cache-blind and load-blind
baselines, on the same simulated workers in the same run.

Four simulated workers (``kvpool worker sim-fleet``, the 8B-on-H100 timing model slowed
three times so that the workers' time, not this machine's, makes the latencies) serve the
same workloads through ``kvpool router serve`` with each policy in turn; the workers' prefix
caches are emptied before each run. Workloads (chat requests, streamed, Poisson arrivals):

* ``groups``: 24 groups, each a long system prompt of its own, short questions;
* ``hot``: one system prompt shared by every request, questions mostly short and one in
  twelve a long document, so requests differ in prefill work far more than in number.

Reported per policy: the token-weighted prefix hit ratio measured at the workers
(``vllm:prefix_cache_hits`` over ``vllm:prefix_cache_queries``), TTFT p50/p90/p99 at the
client, completed requests per second, and the imbalance of requests over workers
(max/mean). Writes ``bench/results/routing.{md,json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from kvpool.stack import free_port, free_port_range, wait_healthy

RESULTS = Path(__file__).parent / "results"
KVPOOL = [sys.executable, "-c", "import sys; from kvpool.cli import main; sys.exit(main())"]
POLICIES = ("kvpool", "round-robin", "least-loaded", "prefix-only")
ENV = {**os.environ, "PYTHONSAFEPATH": "1"}


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- workloads ---------------------------------------------------------------------------------


def _words(prefix: str, n: int, rng: random.Random) -> str:
    return " ".join(f"{prefix}{rng.randint(0, 999)}" for _ in range(n))


def groups_workload(n: int, seed: int = 1) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    systems = [
        f"You answer for team {g}. " + _words(f"g{g}rule", 260, random.Random(g)) for g in range(24)
    ]
    out = []
    for i in range(n):
        system = systems[rng.randrange(len(systems))]
        question = f"Question {i}: " + _words("q", rng.randint(3, 12), rng)
        out.append({"system": system, "question": question, "max_tokens": rng.randint(16, 48)})
    return out


def hot_workload(n: int, seed: int = 2) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    system = "Shared rules. " + _words("rule", 300, random.Random(0))
    out = []
    for i in range(n):
        words = rng.randint(300, 450) if rng.random() < 0.08 else rng.randint(4, 40)
        question = f"Question {i}: " + _words("w", words, rng)
        out.append({"system": system, "question": question, "max_tokens": rng.randint(16, 64)})
    return out


WORKLOADS = {"groups": groups_workload, "hot": hot_workload}


# -- one run -------------------------------------------------------------------------------


def counters(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def drive(
    url: str, model: str, requests: list[dict[str, Any]], rate: float, workers: list[str]
) -> dict:
    rng = random.Random(7)
    ttfts: list[float] = []
    per_worker: Counter[str] = Counter()
    errors = 0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def one(r: dict[str, Any]) -> None:
            nonlocal errors
            body = {
                "model": model,
                "messages": [
                    {"role": "system", "content": r["system"]},
                    {"role": "user", "content": r["question"]},
                ],
                "max_tokens": r["max_tokens"],
                "stream": True,
            }
            start = time.perf_counter()
            first = None
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    errors += 1
                    await resp.aread()
                    return
                per_worker[resp.headers.get("x-kvpool-worker", "?")] += 1
                async for line in resp.aiter_lines():
                    if first is None and line.startswith("data: {") and '"content": "' in line:
                        if '"content": ""' not in line:
                            first = time.perf_counter() - start
            if first is not None:
                ttfts.append(first)

        started = time.perf_counter()
        tasks = []
        for r in requests:
            tasks.append(asyncio.create_task(one(r)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
    ttfts.sort()

    def q(p: float) -> float:
        return ttfts[min(int(p * len(ttfts)), len(ttfts) - 1)] if ttfts else float("nan")

    # Every worker counts, those that got nothing too.
    counts = [per_worker.get(w.removeprefix("http://"), 0) for w in workers]
    return {
        "ttft_p50": q(0.5),
        "ttft_p90": q(0.9),
        "ttft_p99": q(0.99),
        "throughput": len(ttfts) / elapsed,
        "imbalance": max(counts) / (sum(counts) / len(counts)) if counts else float("nan"),
        "errors": errors,
    }


def run_policy(
    policy: str,
    model: Path,
    workers: list[str],
    workload: str,
    n: int,
    rate: float,
    extra: list[str] = (),  # type: ignore[assignment]
) -> dict[str, Any]:
    for w in workers:  # the same cold start for every policy
        httpx.post(w + "/reset_prefix_cache", timeout=10).raise_for_status()
    port = free_port()
    argv = [*KVPOOL, "router", "serve", "--model", str(model), "--port", str(port)]
    argv += ["--policy", policy, *extra]
    for w in workers:
        argv += ["--worker", w]
    router = subprocess.Popen(argv, env=ENV, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, router)
        while httpx.get(url + "/health", timeout=5).json().get("workers_up", 0) < len(workers):
            time.sleep(0.2)
        before = [counters(w) for w in workers]
        requests = WORKLOADS[workload](n)
        result = asyncio.run(drive(url, model.name, requests, rate, workers))
        after = [counters(w) for w in workers]
    finally:
        stop(router)
    hits = sum(
        a.get("vllm:prefix_cache_hits_total", 0) - b.get("vllm:prefix_cache_hits_total", 0)
        for a, b in zip(after, before, strict=True)
    )
    queries = sum(
        a.get("vllm:prefix_cache_queries_total", 0) - b.get("vllm:prefix_cache_queries_total", 0)
        for a, b in zip(after, before, strict=True)
    )
    result["hit_ratio"] = hits / queries if queries else 0.0
    return result


# -- report --------------------------------------------------------------------------------


def table(workload: str, rows: dict[str, dict[str, Any]]) -> str:
    ours = rows["kvpool"]
    lines = [
        f"### {workload}",
        "",
        "| policy | hit ratio | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | req/s | imbalance "
        "| p90 vs kvpool |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for policy, r in rows.items():
        lines.append(
            f"| {policy} | {r['hit_ratio']:.1%} | {r['ttft_p50'] * 1000:.0f} | "
            f"{r['ttft_p90'] * 1000:.0f} | {r['ttft_p99'] * 1000:.0f} | {r['throughput']:.1f} "
            f"| {r['imbalance']:.2f} | {r['ttft_p90'] / ours['ttft_p90']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=".cache/tiny-model")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--time-scale", type=float, default=3.0)
    parser.add_argument("--workloads", default="groups,hot")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--router-args", default="", help="more router flags, for trials")
    args = parser.parse_args()
    model = Path(args.model)
    if not (model / "config.json").is_file():
        subprocess.run([*KVPOOL, "worker", "make-tiny-model", str(model)], env=ENV, check=True)
    base, events = free_port_range(args.workers), free_port_range(args.workers)
    fleet_argv = [*KVPOOL, "worker", "sim-fleet", "--model", str(model)]
    fleet_argv += ["--count", str(args.workers), "--base-port", str(base), "--processes", "2"]
    fleet_argv += ["--kv-events-base-port", str(events)]
    fleet_argv += ["--max-model-len", "8192", "--num-blocks", "8192"]
    fleet_argv += ["--sim-time-scale", str(args.time_scale), "--max-waiting-tokens", "400000"]
    fleet = subprocess.Popen(fleet_argv, env=ENV, stdout=subprocess.DEVNULL)
    workers = [f"http://127.0.0.1:{base + i}" for i in range(args.workers)]
    results: dict[str, dict[str, dict[str, Any]]] = {}
    try:
        for w in workers:
            wait_healthy(w, fleet)
        for workload in args.workloads.split(","):
            results[workload] = {}
            for policy in args.policies.split(","):
                r = run_policy(
                    policy,
                    model,
                    workers,
                    workload,
                    args.requests,
                    args.rate,
                    args.router_args.split(),
                )
                results[workload][policy] = r
                print(f"{workload} {policy}: {json.dumps(r)}", file=sys.stderr, flush=True)
    finally:
        stop(fleet)
    header = (
        f"# Routing quality ({dt.date.today()}, {platform.machine()}, {os.cpu_count()} cores)\n\n"
        f"{args.workers} simulated workers (time scale {args.time_scale}), {args.requests} "
        f"chat requests per run at {args.rate:g} req/s, streamed; TTFT at the client.\n"
    )
    text = header + "\n" + "\n\n".join(table(w, rows) for w, rows in results.items()) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "routing.md").write_text(text)
    (RESULTS / "routing.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
