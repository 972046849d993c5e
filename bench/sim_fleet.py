"""A simulated fleet under open-loop load: 16 workers in one process at 200 requests/s,
measured time to first token against the timing model's own prediction.

``kvpool worker sim-fleet --count 16`` serves; load-generator processes (asyncio + aiohttp)
send streaming completions with a Poisson arrival process, round-robin over the workers:
prompts of a few hundred token ids (no tokenizing), ``max_tokens`` 16-32, ``ignore_eos``.
TTFT is measured at the client, from sending the request to its first content chunk.

The baseline is the prediction: the same requests at the same (actual) send times,
replayed worker by worker through ``SimEngine(virtual=True)`` with the fleet's own timing
model and engine configuration; a request's predicted TTFT is the virtual time of its
first content output less its arrival. Goals: 200 requests/s completed, and mean TTFT
within 10% of the prediction (``ttft_error_pct``).

To say where any gap comes from, the run also records the workers' own TTFT histograms
(server arrival to engine output), the fixed cost of the HTTP path (requests one at a
time on idle workers, before the load), the client's send lag, the CPU time of the fleet
process per thread (event loop, engine threads, helper threads) and of the clients, and
the fleet's garbage-collection pauses. ``--trace`` times each request at six points in
the worker; ``--what-ifs`` then reruns the same workload with the proposed fixes applied
by the benchmark's launcher (``gc.freeze()``, uvloop, two processes), nothing in the
worker's code changed.

Writes bench/results/sim_fleet.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import platform
import random
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
GOAL_RPS = 200.0
GOAL_ERROR_PCT = 10.0


# -- the load generator (a separate process) ----------------------------------------------------
def client_main(spec_path: str, out_path: str) -> None:
    """Send this client's share of the schedule; write one record per request.

    Prints ``ready`` once warmed up, then reads the start time (``time.monotonic()``,
    which is system-wide on Linux) from stdin."""
    spec = json.loads(Path(spec_path).read_text())
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    records = run(_client(spec))
    Path(out_path).write_text(json.dumps(records))


async def _client(spec: dict[str, Any]) -> dict[str, Any]:
    import aiohttp

    urls: list[str] = spec["urls"]
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(req: dict[str, Any], scheduled: float | None) -> dict[str, Any]:
            body = {
                "prompt": req["prompt"],
                "max_tokens": req["max_tokens"],
                "ignore_eos": True,
                "stream": True,
            }
            rec: dict[str, Any] = {"i": req["i"], "worker": req["worker"], "scheduled": scheduled}
            url = f"{urls[req['worker']]}/v1/completions"
            headers = {"x-request-id": f"bench{req['i']}"} if req["i"] >= 0 else None
            rec["sent"] = time.monotonic()
            try:
                async with session.post(url, json=body, headers=headers) as r:
                    if r.status != 200:
                        rec["error"] = f"HTTP {r.status}: {(await r.text())[:200]}"
                        return rec
                    chunks = 0
                    async for line in r.content:
                        if not line.startswith(b"data: "):
                            continue
                        if line.startswith(b"data: [DONE]"):
                            break
                        if chunks == 0:
                            rec["first"] = time.monotonic()
                        if b'"error"' in line:
                            rec["error"] = line.decode()[:200]
                        chunks += 1
                    rec["done"] = time.monotonic()
                    rec["chunks"] = chunks
            except Exception as exc:
                rec["error"] = repr(exc)
            return rec

        # warm up: connections and first-call costs, then let the fleet go idle
        warm = [{"i": -1, "worker": w, "prompt": [100] * 64, "max_tokens": 2} for w in spec["mine"]]
        for _ in range(2):
            await asyncio.gather(*(one(req, None) for req in warm))
        await asyncio.sleep(0.5)
        print("ready", flush=True)
        loop = asyncio.get_running_loop()
        start = float(await loop.run_in_executor(None, sys.stdin.readline))
        cpu0 = time.process_time()
        tasks = []
        for req in spec["requests"]:
            at = start + req["t"]
            delay = at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req, at)))
        records = await asyncio.gather(*tasks)
        return {"records": records, "cpu_s": time.process_time() - cpu0}


# -- the fleet -----------------------------------------------------------------------------------
def fleet_main(argv: list[str]) -> int:
    """``kvpool worker <argv>``, instrumented and optionally tuned through variables:

    * always: each engine thread is named ``engine`` at the OS level (Python does not
      name it there), so that its CPU time can be told apart;
    * ``KVPOOL_BENCH_GC_LOG``: a file that gets a line per garbage collection of 1 ms or
      more (monotonic start, generation, seconds): a full collection stops every thread;
    * ``KVPOOL_BENCH_TRACE``: a file that gets a line per request and stage (request id,
      stage, monotonic time): the handler starts (``job``), the request is prepared
      (``prepared``), it is queued for the engine thread (``queued``), the engine takes it
      (``submit``), the engine puts its first content output (``output``), the SSE body
      yields its first chunk (``sse``);
    * what-ifs, for the report's proposed fixes: ``KVPOOL_BENCH_UVLOOP=1`` runs the
      fleet's event loop on uvloop, ``KVPOOL_BENCH_GC_FREEZE=1`` moves what exists after
      the engines are built out of the collector's reach (``gc.freeze``), and
      ``KVPOOL_BENCH_SWITCH_INTERVAL`` sets the GIL switch interval (seconds).
    """
    import ctypes
    import gc

    from kvpool.worker import cli
    from kvpool.worker.engine_loop import EngineLoop
    from kvpool.worker.server import WorkerServer

    libc = ctypes.CDLL(None)
    run = EngineLoop._run

    def named_run(self: EngineLoop) -> None:
        libc.prctl(15, b"engine", 0, 0, 0)  # PR_SET_NAME
        run(self)

    EngineLoop._run = named_run  # type: ignore[method-assign]
    if path := os.environ.get("KVPOOL_BENCH_GC_LOG"):
        log = open(path, "a", buffering=1)  # open for the life of the process
        started = [0.0]

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                started[0] = time.monotonic()
            elif (took := time.monotonic() - started[0]) >= 0.001:
                log.write(f"{started[0]!r} {info['generation']} {took!r}\n")

        gc.callbacks.append(on_gc)
    if path := os.environ.get("KVPOOL_BENCH_TRACE"):
        trace_stages(open(path, "a", buffering=1))  # open for the life of the process
    if os.environ.get("KVPOOL_BENCH_GC_FREEZE"):
        load = WorkerServer._load

        async def load_then_freeze(self: WorkerServer) -> None:
            await load(self)
            gc.collect()
            gc.freeze()

        WorkerServer._load = load_then_freeze  # type: ignore[method-assign]
    if os.environ.get("KVPOOL_BENCH_UVLOOP"):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    if interval := os.environ.get("KVPOOL_BENCH_SWITCH_INTERVAL"):
        sys.setswitchinterval(float(interval))
    return cli.main(argv)


def trace_stages(out: Any) -> None:
    """Wrap four points of a request's way through a worker to log when it passes them."""
    from kvpool.worker.engine import EngineCore
    from kvpool.worker.engine_loop import EngineLoop, _LoopStream
    from kvpool.worker.server import WorkerServer

    def mark(rid: str, stage: str) -> None:
        out.write(f"{rid} {stage} {time.monotonic()!r}\n")

    job = WorkerServer._job

    async def traced_job(self: WorkerServer, request: Any, req: Any, kind: str) -> Any:
        if rid := request.headers.get("x-request-id"):
            mark(rid, "job")
        return await job(self, request, req, kind)

    prepare = WorkerServer._prepare

    def traced_prepare(self: WorkerServer, *args: Any, **kwargs: Any) -> Any:
        prepared = prepare(self, *args, **kwargs)
        mark(prepared.request_id, "prepared")
        return prepared

    generate = EngineLoop.generate

    async def traced_generate(self: EngineLoop, prepared: Any) -> Any:
        mark(prepared.request_id, "queued")
        async for item in generate(self, prepared):
            yield item

    submit = EngineCore.submit

    def traced_submit(self: EngineCore, prepared: Any, stream: Any) -> None:
        mark(prepared.request_id, "submit")
        submit(self, prepared, stream)

    put = _LoopStream.put

    def traced_put(self: _LoopStream, output: Any) -> None:
        if not getattr(self, "traced", False) and (output.new_text or output.finished):
            self.traced = True
            mark(self.request_id, "output")
        put(self, output)

    sse = WorkerServer._sse

    async def traced_sse(self: WorkerServer, job: Any) -> Any:
        first = True
        async for chunk in sse(self, job):
            if first:
                mark(job.id.split("-", 1)[1], "sse")
                first = False
            yield chunk

    WorkerServer._job = traced_job  # type: ignore[method-assign]
    WorkerServer._prepare = traced_prepare  # type: ignore[method-assign]
    EngineLoop.generate = traced_generate  # type: ignore[method-assign]
    EngineCore.submit = traced_submit  # type: ignore[method-assign]
    _LoopStream.put = traced_put  # type: ignore[method-assign]
    WorkerServer._sse = traced_sse  # type: ignore[method-assign]


def free_base_port(count: int) -> int:
    """``count`` consecutive free ports below the ephemeral range (where the clients'
    own connections could take one between this check and the fleet's bind)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10000, low - count)
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports")


async def wait_ready(urls: list[str], proc: subprocess.Popen[bytes], log: Path) -> None:
    import aiohttp

    deadline = time.monotonic() + 120
    pending = set(urls)
    async with aiohttp.ClientSession() as session:
        while pending and time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the fleet exited ({proc.returncode}):\n{log_tail(log)}")
            for url in list(pending):
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with session.get(f"{url}/health") as r:
                        if r.status == 200:
                            pending.discard(url)
            await asyncio.sleep(0.2)
    if pending:
        raise RuntimeError(f"{len(pending)} workers not ready in 120 s:\n{log_tail(log)}")


def log_tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


async def probe(urls: list[str], requests: list[dict[str, Any]]) -> list[float]:
    """TTFT of requests sent one at a time, each to an idle worker (seconds)."""
    import aiohttp

    out = []
    async with aiohttp.ClientSession() as session:
        for req in requests:
            body = {"prompt": req["prompt"], "max_tokens": req["max_tokens"]}
            body.update(ignore_eos=True, stream=True)
            sent = time.monotonic()
            first = None
            async with session.post(f"{urls[req['worker']]}/v1/completions", json=body) as r:
                async for line in r.content:
                    if first is None and line.startswith(b"data: "):
                        first = time.monotonic()
            out.append((first or float("nan")) - sent)
            await asyncio.sleep(0.02)
    return out


async def scrape_ttft(urls: list[str]) -> tuple[float, float]:
    """Sum and count of the workers' ``vllm:time_to_first_token_seconds``."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    total = count = 0.0
    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.get(f"{url}/metrics") as r:
                text = await r.text()
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name == "vllm:time_to_first_token_seconds_sum":
                        total += s.value
                    elif s.name == "vllm:time_to_first_token_seconds_count":
                        count += s.value
    return total, count


def thread_cpu(pid: int) -> dict[int, float]:
    import psutil

    return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}


# -- the prediction ------------------------------------------------------------------------------
def predict(model_dir: Path, settings: Any, requests: list[dict[str, Any]]) -> dict[int, float]:
    """Virtual time of each request's first content output, replayed per worker through
    ``SimEngine(virtual=True)``: a request joins when the virtual clock reaches its
    arrival, exactly as the engine thread takes commands between steps."""
    from kvpool.worker.config import ModelConfig
    from kvpool.worker.loader import load_tokenizer
    from kvpool.worker.sequence import SamplingParams
    from kvpool.worker.sim import SimEngine

    model_config = ModelConfig.from_dir(model_dir)
    tokenizer = load_tokenizer(model_dir)
    first: dict[int, float] = {}
    by_worker: dict[int, list[dict[str, Any]]] = {}
    for req in requests:
        by_worker.setdefault(req["worker"], []).append(req)
    for reqs in by_worker.values():
        reqs.sort(key=lambda r: r["arrival"])
        engine = SimEngine(
            tokenizer,
            settings.engine_config(),
            timing=settings.timing(),
            vocab_size=model_config.vocab_size,
            max_model_len=settings.max_model_len or model_config.max_position,
            eos_token_ids=model_config.eos_token_ids,
            virtual=True,
        )
        ids = {}
        at = 0
        while at < len(reqs) or engine.has_unfinished():
            if not engine.has_unfinished() and reqs[at]["arrival"] > engine.now:
                engine.now = reqs[at]["arrival"]  # idle until the next arrival
            while at < len(reqs) and reqs[at]["arrival"] <= engine.now:
                req = reqs[at]
                params = SamplingParams(max_tokens=req["max_tokens"], ignore_eos=True)
                stream = engine.add_request(req["prompt"], params, f"r{req['i']}")
                ids[stream.request_id] = req["i"]
                at += 1
            for out in engine.step():
                i = ids[out.request_id]
                if i not in first and (out.new_text or out.finished):
                    first[i] = engine.now
    return first


# -- the run -------------------------------------------------------------------------------------
def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def workload(args: argparse.Namespace, vocab: list[int]) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    lo, hi = args.prompt_tokens
    mlo, mhi = args.max_tokens
    requests, t, i = [], 0.0, 0
    while True:
        t += rng.expovariate(args.rate)
        if t >= args.duration:
            return requests
        requests.append(
            {
                "i": i,
                "t": t,
                "worker": i % args.count,
                "prompt": [rng.choice(vocab) for _ in range(rng.randint(lo, hi))],
                "max_tokens": rng.randint(mlo, mhi),
            }
        )
        i += 1


def run(args: argparse.Namespace, model_dir: Path, tmp: Path) -> dict[str, Any]:
    from kvpool.worker.loader import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    special = set(tokenizer.all_special_ids)
    vocab = [t for t in range(len(tokenizer)) if t not in special]
    requests = workload(args, vocab)
    base = free_base_port(args.count)
    urls = [f"http://127.0.0.1:{base + w}" for w in range(args.count)]
    env = {**os.environ, "KVPOOL_BENCH_GC_LOG": str(tmp / "gc.log")}
    if args.switch_interval:
        env["KVPOOL_BENCH_SWITCH_INTERVAL"] = str(args.switch_interval)
    if args.uvloop:
        env["KVPOOL_BENCH_UVLOOP"] = "1"
    if args.gc_freeze:
        env["KVPOOL_BENCH_GC_FREEZE"] = "1"
    if args.trace:
        env["KVPOOL_BENCH_TRACE"] = str(tmp / "trace.log")
    fleets: list[subprocess.Popen[bytes]] = []
    per = math.ceil(args.count / args.fleet_processes)
    clients: list[subprocess.Popen[str]] = []
    rng = random.Random(args.seed + 1)
    probes = [
        {
            "i": -1 - k,
            "worker": k % args.count,
            "prompt": [rng.choice(vocab) for _ in range(rng.randint(*args.prompt_tokens))],
            "max_tokens": 4,
        }
        for k in range(4 * args.count)
    ]
    try:
        for at in range(0, args.count, per):
            n = min(per, args.count - at)
            cmd = [sys.executable, ME, "--fleet", "sim-fleet", "--model", str(model_dir)]
            cmd += ["--count", str(n), "--base-port", str(base + at)]
            log_path = tmp / f"fleet{at}.log"
            with log_path.open("wb") as log:
                fleets.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
            asyncio.run(wait_ready(urls[at : at + n], fleets[-1], log_path))
        # the fixed cost of the HTTP path: one request at a time, idle workers (the first
        # round over the workers is their warm-up)
        probe_s = asyncio.run(probe(urls, probes))[args.count :]
        for k in range(args.clients):
            mine = [w for w in range(args.count) if w % args.clients == k]
            spec = {
                "urls": urls,
                "mine": mine,
                "requests": [r for r in requests if r["worker"] in mine],
            }
            (tmp / f"spec{k}.json").write_text(json.dumps(spec))
            cmd = [sys.executable, ME, "--client", str(tmp / f"spec{k}.json")]
            clients.append(
                subprocess.Popen(
                    [*cmd, str(tmp / f"out{k}.json")],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for c in clients:
            assert c.stdout is not None
            if c.stdout.readline().strip() != "ready":
                raise RuntimeError("a load generator failed to start")
        ttft0 = asyncio.run(scrape_ttft(urls))
        threads0 = {f.pid: thread_cpu(f.pid) for f in fleets}
        start = time.monotonic() + 0.5
        for c in clients:
            assert c.stdin is not None
            c.stdin.write(f"{start!r}\n")
            c.stdin.flush()
        for c in clients:
            if c.wait(args.duration + 180) != 0:
                raise RuntimeError(f"a load generator exited with {c.returncode}")
        wall_end = time.monotonic()
        threads1 = {f.pid: thread_cpu(f.pid) for f in fleets}
        ttft1 = asyncio.run(scrape_ttft(urls))
        names = {f.pid: thread_names(f.pid) for f in fleets}
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
        for fleet in fleets:
            fleet.terminate()
        for fleet in fleets:
            try:
                fleet.wait(15)
            except subprocess.TimeoutExpired:
                fleet.kill()
                fleet.wait()
    outs = [json.loads((tmp / f"out{k}.json").read_text()) for k in range(args.clients)]
    stages: dict[str, dict[str, float]] = {}
    if (tmp / "trace.log").exists():
        for line in (tmp / "trace.log").read_text().splitlines():
            rid, stage, t = line.split()
            # engine request ids are "<X-Request-Id>-<index>-<suffix>"
            stages.setdefault(rid.split("-")[0], {})[stage] = float(t)
    gc_log = tmp / "gc.log"
    pauses = (
        [
            (float(t), int(gen), float(took))
            for t, gen, took in (line.split() for line in gc_log.read_text().splitlines())
            if start <= float(t) <= wall_end
        ]
        if gc_log.exists()
        else []
    )
    records = sorted((r for o in outs for r in o["records"]), key=lambda r: r["i"])
    fleet_s = loop_s = engine_s = 0.0
    for pid, after in threads1.items():
        for tid, cpu in after.items():
            used = cpu - threads0[pid].get(tid, 0.0)
            fleet_s += used
            if tid == pid:  # the main thread, the event loop's
                loop_s += used
            elif names[pid].get(tid) == "engine":
                engine_s += used
    return {
        "requests": requests,
        "records": records,
        "start": start,
        "wall_end": wall_end,
        "server_ttft": ((ttft1[0] - ttft0[0]), (ttft1[1] - ttft0[1])),
        "gc_pauses": pauses,
        "stages": stages,
        "probes": [
            {**req, "ttft_s": t} for req, t in zip(probes[args.count :], probe_s, strict=True)
        ],
        "cpu": {
            "fleet_s": fleet_s,
            "fleet_event_loop_s": loop_s,
            "fleet_engine_threads_s": engine_s,
            "fleet_other_threads_s": fleet_s - loop_s - engine_s,
            "clients_s": [o["cpu_s"] for o in outs],
        },
    }


def thread_names(pid: int) -> dict[int, str]:
    names = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            names[int(task.name)] = (task / "comm").read_text().strip()
    return names


def stage_rows(
    stages: dict[str, dict[str, float]],
    ok: list[dict[str, Any]],
    engine_first: dict[int, float],
    start: float,
) -> list[str]:
    """Where a request's TTFT goes, stage by stage (from ``--trace``); ``engine_first``
    is the prediction replayed from the times the requests reached the engine's queue."""
    names = {
        "in": "client sends -> handler starts (HTTP in, body, routing)",
        "prepare": "handler starts -> prepared (body parsed; prepare in a thread)",
        "queue": "prepared -> queued for the engine thread (admit, response start, tasks)",
        "wait": "queued -> engine takes it (the running step ends: modelled)",
        "engine": "queued -> first content output (engine)",
        "predicted": "... predicted for requests queued at those times (virtual replay)",
        "back": "engine output -> first SSE chunk yielded (outbox, queues, tasks)",
        "out": "SSE chunk yielded -> client has it (send, loopback, client)",
    }
    keys = ("job", "prepared", "queued", "submit", "output", "sse")
    parts: dict[str, list[float]] = {k: [] for k in names}
    for r in ok:
        s = stages.get(f"bench{r['i']}", {})
        if not all(k in s for k in keys) or r["i"] not in engine_first:
            continue
        for name, seconds in (
            ("in", s["job"] - r["sent"]),
            ("prepare", s["prepared"] - s["job"]),
            ("queue", s["queued"] - s["prepared"]),
            ("wait", s["submit"] - s["queued"]),
            ("engine", s["output"] - s["queued"]),
            ("predicted", engine_first[r["i"]] - (s["queued"] - start)),
            ("back", s["sse"] - s["output"]),
            ("out", r["first"] - s["sse"]),
        ):
            parts[name].append(seconds * 1000)
    if not parts["in"]:
        return []
    return [
        "| Stage | ms: mean / p50 / p90 |",
        "|---|---|",
        *(
            f"| {names[k]} | {statistics.fmean(v):.2f} / {percentile(v, 50):.2f} / "
            f"{percentile(v, 90):.2f} |"
            for k, v in parts.items()
        ),
    ]


_BEST: dict[str, Any] = {"gc_freeze": True, "uvloop": True, "fleet_processes": 2}
WHAT_IFS: list[tuple[str, dict[str, Any]]] = [
    ("gc.freeze() after start-up", {"gc_freeze": True}),
    ("on uvloop", {"uvloop": True}),
    ("gc.freeze() + uvloop", {"gc_freeze": True, "uvloop": True}),
    ("gc.freeze() + uvloop, 2 processes of 8 workers", _BEST),
    ("as is, traced", {"trace": True}),
    ("gc.freeze() + uvloop, 2 processes, traced", {**_BEST, "trace": True}),
]


def stats(xs: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(xs),
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
    }


def met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def evaluate(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """One run of the fleet under load and its replay: the table rows and the figures."""
    from kvpool.worker.settings import WorkerSettings

    with tempfile.TemporaryDirectory() as tmpdir:
        res = run(args, model_dir, Path(tmpdir))
    # the fleet's own settings: `sim-fleet` with no flags but --model
    settings = WorkerSettings(model=str(model_dir), engine="sim")
    ok = [r for r in res["records"] if "error" not in r and "first" in r]
    arrivals = [
        {**req, "arrival": rec["sent"] - res["start"]}
        for req, rec in zip(res["requests"], res["records"], strict=True)
    ]
    started = time.perf_counter()
    first = predict(model_dir, settings, arrivals)
    replay_s = time.perf_counter() - started
    engine_first: dict[int, float] = {}
    if res["stages"]:  # the same replay, from the times the engine queue got them
        queued = {
            int(rid.removeprefix("bench")): st["queued"] - res["start"]
            for rid, st in res["stages"].items()
            if rid.startswith("bench") and "queued" in st
        }
        engine_first = predict(
            model_dir,
            settings,
            [{**a, "arrival": queued.get(a["i"], a["arrival"])} for a in arrivals],
        )
    alone = [{**req, "worker": req["i"], "arrival": 0.0} for req in res["probes"]]
    lone_first = predict(model_dir, settings, alone)
    fixed = [(req["ttft_s"] - lone_first[req["i"]]) * 1000 for req in res["probes"]]

    errors = [r for r in res["records"] if "error" in r or "first" not in r]
    measured = [(r["first"] - r["sent"]) * 1000 for r in ok]
    predicted = [(first[r["i"]] - (r["sent"] - res["start"])) * 1000 for r in ok]
    lag = [(r["sent"] - r["scheduled"]) * 1000 for r in res["records"]]
    wall = max(r["done"] for r in ok) - min(r["sent"] for r in res["records"])
    rps = len(ok) / wall
    offered = len(res["requests"]) / args.duration
    s_sum, s_count = res["server_ttft"]
    server_mean = s_sum / s_count * 1000 if s_count else float("nan")
    if args.dump:
        args.dump.write_text(
            json.dumps(
                [
                    {
                        "i": r["i"],
                        "worker": r["worker"],
                        "sent_s": r["sent"] - res["start"],
                        "measured_ms": a,
                        "predicted_ms": b,
                        "e2e_ms": (r["done"] - r["sent"]) * 1000,
                    }
                    for r, a, b in zip(ok, measured, predicted, strict=True)
                ]
            )
        )
    m, p = stats(measured), stats(predicted)
    err = 100 * abs(m["mean"] - p["mean"]) / p["mean"]
    err50 = 100 * abs(m["p50"] - p["p50"]) / p["p50"]
    excess = [a - b for a, b in zip(measured, predicted, strict=True)]
    cpu = res["cpu"]
    pauses = res["gc_pauses"]
    full = [x for x in pauses if x[1] == 2]
    run_s = res["wall_end"] - res["start"]
    rps_ok = rps >= GOAL_RPS * 0.98 and not errors

    def row(name: str, a: float, b: float) -> str:
        return f"| TTFT {name}, ms | {a:.1f} | {b:.1f} | {a / b:.2f}x | |"

    rows = [
        "| Figure | measured | predicted (virtual replay) | ratio | goal |",
        "|---|---|---|---|---|",
        f"| requests/s completed ({len(ok)} in {wall:.1f} s; offered {offered:.0f}/s) "
        f"| {rps:.1f} | {offered:.1f} | {rps / offered:.2f}x "
        f"| >= {GOAL_RPS:.0f}, no errors: {met(rps_ok)} |",
        f"| TTFT mean, ms | {m['mean']:.1f} | {p['mean']:.1f} | {m['mean'] / p['mean']:.2f}x "
        f"| error {err:.1f}% <= {GOAL_ERROR_PCT:.0f}%: {met(err <= GOAL_ERROR_PCT)} |",
        f"| TTFT p50, ms | {m['p50']:.1f} | {p['p50']:.1f} | {m['p50'] / p['p50']:.2f}x "
        f"| error {err50:.1f}% |",
        row("p90", m["p90"], p["p90"]),
        row("p99", m["p99"], p["p99"]),
        f"| TTFT mean seen by the workers (arrival to engine output), ms | {server_mean:.1f} "
        f"| {p['mean']:.1f} | {server_mean / p['mean']:.2f}x | |",
        f"| measured - predicted per request, ms: p50 / p90 / p99 "
        f"| {percentile(excess, 50):.1f} / {percentile(excess, 90):.1f} / "
        f"{percentile(excess, 99):.1f} | - | - | |",
        f"| fixed cost of the HTTP path: one request at a time on an idle worker, measured "
        f"- predicted TTFT, ms: p50 (p10-p90) | {percentile(fixed, 50):.2f} "
        f"({percentile(fixed, 10):.2f}-{percentile(fixed, 90):.2f}) | - | - | |",
        f"| errors | {len(errors)} | - | - | 0 |",
        f"| client send lag behind schedule, ms: p50 / p99 "
        f"| {percentile(lag, 50):.2f} / {percentile(lag, 99):.2f} | - | - | |",
        f"| fleet CPU, cores (event loop / engine threads / other threads) "
        f"| {cpu['fleet_s'] / run_s:.2f} ({cpu['fleet_event_loop_s'] / run_s:.2f} / "
        f"{cpu['fleet_engine_threads_s'] / run_s:.2f} / "
        f"{cpu['fleet_other_threads_s'] / run_s:.2f}) | - | - | |",
        f"| fleet stopped by garbage collection: full (gen 2) collections, total / longest ms "
        f"| {len(full)}, {sum(x[2] for x in full) * 1000:.0f} / "
        f"{max((x[2] for x in full), default=0) * 1000:.0f} | - | - | |",
        f"| ... all collections of >= 1 ms: count, total ms | {len(pauses)}, "
        f"{sum(x[2] for x in pauses) * 1000:.0f} | - | - | |",
        f"| load generators' CPU, cores | {sum(cpu['clients_s']) / run_s:.2f} "
        f"({args.clients} processes) | - | - | |",
    ]
    stage = stage_rows(res["stages"], ok, engine_first, res["start"]) if res["stages"] else []
    figures = {
        "requests_per_s": round(rps, 2),
        "ttft_error_pct": round(err, 2),
        "ttft_p50_error_pct": round(err50, 2),
        "ttft_measured_ms": {k: round(v, 2) for k, v in m.items()},
        "ttft_predicted_ms": {k: round(v, 2) for k, v in p.items()},
        "ttft_server_side_mean_ms": round(server_mean, 2),
        "errors": len(errors),
        "completed": len(ok),
        "offered_requests_per_s": round(offered, 2),
        "goal_met": rps_ok and err <= GOAL_ERROR_PCT,
    }
    detail = {
        "cpu_s": cpu,
        "run_s": run_s,
        "send_lag_ms": {"p50": percentile(lag, 50), "p99": percentile(lag, 99)},
        "excess_ms": {q: percentile(excess, q) for q in (10, 50, 90, 99)},
        "idle_path_overhead_ms": {q: percentile(fixed, q) for q in (10, 50, 90)},
        "error_samples": [r.get("error") for r in errors[:5]],
        "gc_full_collections": len(full),
        "gc_full_ms": [round(x[2] * 1000, 1) for x in full],
        "gc_pauses_over_1ms": len(pauses),
        "gc_pause_total_ms": round(sum(x[2] for x in pauses) * 1000, 1),
        "requests": len(res["requests"]),
        "replay_s": replay_s,
    }
    return {
        "figures": figures,
        "rows": rows,
        "stages": stage,
        "detail": detail,
        "full_gc": len(full),
    }


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=16, help="simulated workers")
    parser.add_argument("--rate", type=float, default=200.0, help="requests/s, all workers")
    parser.add_argument("--duration", type=float, default=25.0, help="seconds of arrivals")
    parser.add_argument("--clients", type=int, default=2, help="load-generator processes")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=[200, 400])
    parser.add_argument("--max-tokens", type=int, nargs=2, default=[16, 32])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fleet-processes",
        type=int,
        default=1,
        help="split the workers over this many sim-fleet processes (the goal is for 1)",
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="the fleet's GIL switch interval in seconds (Python's default: 0.005)",
    )
    parser.add_argument("--uvloop", action="store_true", help="what-if: the fleet on uvloop")
    parser.add_argument(
        "--gc-freeze", action="store_true", help="what-if: gc.freeze() once the engines are built"
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="log when each request passes four points in the worker, and add a row per stage",
    )
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    parser.add_argument("--dump", type=Path, default=None, help="write per-request records here")
    parser.add_argument(
        "--what-ifs",
        action="store_true",
        help="then run the proposed fixes one by one (same workload) and tabulate them",
    )
    parser.add_argument("--quick", action="store_true", help="8 s of arrivals")
    args = parser.parse_args()
    if args.quick:
        args.duration = 8.0

    import psutil

    from kvpool.worker.settings import WorkerSettings
    from kvpool.worker.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmpdir:
        model_dir = make_tiny_model(Path(tmpdir) / "tiny")
        main_run = evaluate(args, model_dir)
        settings = WorkerSettings(model=str(model_dir), engine="sim")
        what_ifs = []
        for name, changes in WHAT_IFS if args.what_ifs else []:
            variant = argparse.Namespace(**{**vars(args), **changes, "dump": None})
            print(f"what-if: {name}", file=sys.stderr)
            what_ifs.append((name, evaluate(variant, model_dir)))

    table = "\n".join(main_run["rows"])
    if main_run["stages"]:
        table += "\n\nWhere TTFT goes:\n\n" + "\n".join(main_run["stages"])
    if what_ifs:
        lines = [
            "| Variant | requests/s | TTFT mean: measured / predicted, ms | error | p50 error "
            "| p99 measured / predicted, ms | workers' own TTFT / predicted "
            "| full GCs: count, total ms |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, r in [("as is (the run above)", main_run), *what_ifs]:
            f = r["figures"]
            mm, pp = f["ttft_measured_ms"], f["ttft_predicted_ms"]
            lines.append(
                f"| {name} | {f['requests_per_s']:.1f} | {mm['mean']:.1f} / {pp['mean']:.1f} "
                f"| {f['ttft_error_pct']:.1f}% | {f['ttft_p50_error_pct']:.1f}% "
                f"| {mm['p99']:.0f} / {pp['p99']:.0f} "
                f"| {f['ttft_server_side_mean_ms'] / pp['mean']:.2f}x "
                f"| {r['full_gc']}, {sum(r['detail']['gc_full_ms']):.0f} |"
            )
        table += (
            "\n\nWhat-ifs (the proposed fixes, applied by the benchmark's launcher, same "
            "workload and seed):\n\n" + "\n".join(lines)
        )
        for name, r in what_ifs:
            if r["stages"]:
                table += f"\n\nWhere TTFT goes, {name}:\n\n" + "\n".join(r["stages"])
    t = settings.timing()
    where = "one process" if args.fleet_processes == 1 else f"{args.fleet_processes} processes"
    if args.switch_interval:
        where += f", GIL switch interval {args.switch_interval * 1000:g} ms"
    if args.uvloop:
        where += ", what-if: on uvloop"
    if args.gc_freeze:
        where += ", what-if: gc.freeze() after start-up"
    notes = (
        f"{args.count} simulated workers in {where} (`kvpool worker sim-fleet`, default "
        f"settings: block size {settings.block_size}, max_num_batched_tokens "
        f"{settings.max_num_batched_tokens}, max_num_seqs {settings.max_num_seqs}; timing "
        f"model a={t.a} b={t.b} c={t.c} d={t.d} e={t.e} f={t.f} ms). Load: Poisson arrivals "
        f"at {args.rate:.0f}/s for {args.duration:.0f} s "
        f"({main_run['detail']['requests']} requests), round-robin over the workers, from "
        f"{args.clients} aiohttp processes; streaming completions, prompts of "
        f"{args.prompt_tokens[0]}-{args.prompt_tokens[1]} token ids, max_tokens "
        f"{args.max_tokens[0]}-{args.max_tokens[1]}, ignore_eos. TTFT: from sending the "
        f"request to its first content chunk. Prediction: the same requests at their actual "
        f"send times through `SimEngine(virtual=True)` per worker. CPU: per thread over the "
        f"run, the engine threads told apart by an OS thread name that the benchmark's "
        f"launcher gives them. Garbage collections: timed by a `gc.callbacks` hook in the "
        f"fleet process."
    )
    print(table)
    print()
    print(notes)
    machine = f"{platform.machine()}, {psutil.cpu_count()} CPUs, Python {platform.python_version()}"
    out = args.results_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim_fleet.md").write_text(
        f"# Simulated fleet: throughput and TTFT against the timing model\n\n"
        f"{dt.date.today()}, {machine}\n\n{table}\n\n{notes}\n"
    )
    (out / "sim_fleet.json").write_text(
        json.dumps(
            {
                **main_run["figures"],
                "date": str(dt.date.today()),
                "machine": machine,
                "detail": {
                    "args": {
                        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                    },
                    **main_run["detail"],
                },
                "what_ifs": {name: {**r["figures"], "detail": r["detail"]} for name, r in what_ifs},
            },
            indent=2,
        )
        + "\n"
    )
    return main_run["figures"]


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--fleet":
        sys.exit(fleet_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        client_main(sys.argv[2], sys.argv[3])
        sys.exit(0)
    os.environ.setdefault("PYTHONSAFEPATH", "1")
    main()
