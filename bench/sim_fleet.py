"""A simulated fleet under open-loop load: 16 workers at 200 requests/s, measured time
to first token against the timing model's own prediction, with the fleet in one process
and spread over two.

``kvpool worker sim-fleet --count 16 --processes N`` serves, once for each N of
``--fleet-processes`` (default 1, then 2); load-generator processes (asyncio + aiohttp)
send streaming completions with a Poisson arrival process, round-robin over the workers:
prompts of a few hundred token ids (no tokenizing), ``max_tokens`` 16-32, ``ignore_eos``.
TTFT is measured at the client, from sending the request to its first content chunk.

The baseline is the prediction: the same requests at the same (actual) send times,
replayed worker by worker through ``SimEngine(virtual=True)`` with the fleet's own timing
model and engine configuration; a request's predicted TTFT is the virtual time of its
first content output less its arrival. Goals: 200 requests/s completed, and mean TTFT
within 10% of the prediction (``ttft_error_pct``). The headline is the configuration
with the fewest processes that meets both, or the first one when none does.

To say where any gap comes from, each run also records the workers' own TTFT histograms
(server arrival to first output), the fixed cost of the HTTP path (requests one at a
time on idle workers, before the load), the client's send lag, the CPU time of the fleet
per thread (event loops, engine threads, helper threads) and of the clients, and the
fleet's garbage-collection pauses. ``--trace`` also times each request at six points in
the worker. These instruments are the benchmark's own (see :func:`install_hooks`); the
worker's code is run as it is.

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
#: How the fleet is started: the ``kvpool`` command, as ``sim-fleet`` starts its children.
KVPOOL = [sys.executable, "-c", "import sys; from kvpool.cli import main; sys.exit(main())"]
#: Put on the fleet's PYTHONPATH, so that every process of the fleet (the CLI's children
#: too, which inherit the environment) runs :func:`install_hooks` as it starts.
SITECUSTOMIZE = """\
# Written by bench/sim_fleet.py: its instruments, in every process of the fleet.
import importlib.util

spec = importlib.util.spec_from_file_location("_kvpool_bench_sim_fleet", {path!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.install_hooks()
"""


# -- the fleet's instruments ---------------------------------------------------------------------
def install_hooks() -> None:
    """The benchmark's instruments in a fleet process, set up through variables:

    * always: each engine thread is named ``engine`` at the OS level (Python does not
      name it there), so that its CPU time can be told apart;
    * ``KVPOOL_BENCH_GC_LOG``: a file that gets a line per garbage collection of 1 ms or
      more (monotonic start, generation, seconds): a collection stops its whole process;
    * ``KVPOOL_BENCH_TRACE``: a file that gets a line per request and stage (see
      :func:`trace_stages`);
    * ``KVPOOL_BENCH_SWITCH_INTERVAL``: the GIL switch interval (seconds).
    """
    import ctypes
    import gc

    from kvpool.worker.engine_loop import EngineLoop

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
    if interval := os.environ.get("KVPOOL_BENCH_SWITCH_INTERVAL"):
        sys.setswitchinterval(float(interval))


#: The points :func:`trace_stages` marks, in the order a request passes them.
STAGES = ("handler", "prepared", "queued", "taken", "output", "sse")


def trace_stages(out: Any) -> None:
    """Wrap six points of a request's way through a worker to log when it passes them
    (a line ``REQUEST-ID STAGE MONOTONIC-TIME``): the completions handler starts
    (``handler``), the request is prepared (``prepared``), it is queued for the engine
    thread (``queued``), the engine takes it (``taken``), the engine hands its first
    content output over to the event loop (``output``, the time the output is stamped
    with), the SSE body yields its first chunk (``sse``)."""
    from kvpool.worker.engine import EngineCore
    from kvpool.worker.engine_loop import EngineLoop
    from kvpool.worker.server import WorkerServer

    def mark(rid: str, stage: str, at: float | None = None) -> None:
        out.write(f"{rid} {stage} {at or time.monotonic()!r}\n")

    completions = WorkerServer.completions

    async def traced_completions(self: WorkerServer, request: Any) -> Any:
        if rid := request.headers.get("x-request-id"):
            mark(rid, "handler")
        return await completions(self, request)

    prepare = WorkerServer._prepare

    def traced_prepare(self: WorkerServer, *args: Any, **kwargs: Any) -> Any:
        prepared = prepare(self, *args, **kwargs)
        mark(prepared.request_id, "prepared")
        return prepared

    loop_submit = EngineLoop.submit

    def traced_loop_submit(self: EngineLoop, prepared: Any, *args: Any, **kwargs: Any) -> None:
        mark(prepared.request_id, "queued")
        loop_submit(self, prepared, *args, **kwargs)

    engine_submit = EngineCore.submit

    def traced_engine_submit(self: EngineCore, prepared: Any, stream: Any) -> None:
        mark(prepared.request_id, "taken")
        engine_submit(self, prepared, stream)

    outputs = WorkerServer._outputs

    async def traced_outputs(self: WorkerServer, job: Any) -> Any:
        first = True
        async with contextlib.aclosing(outputs(self, job)) as inner:
            async for i, item in inner:
                if first and (item.output.new_text or item.output.finished):
                    mark(job.id.split("-", 1)[1], "output", item.time)
                    first = False
                yield i, item

    sse = WorkerServer._sse

    async def traced_sse(self: WorkerServer, job: Any) -> Any:
        first = True
        async with contextlib.aclosing(sse(self, job)) as inner:
            async for chunk in inner:
                if first:
                    mark(job.id.split("-", 1)[1], "sse")
                    first = False
                yield chunk

    WorkerServer.completions = traced_completions  # type: ignore[method-assign]
    WorkerServer._prepare = traced_prepare  # type: ignore[method-assign]
    EngineLoop.submit = traced_loop_submit  # type: ignore[method-assign]
    EngineCore.submit = traced_engine_submit  # type: ignore[method-assign]
    WorkerServer._outputs = traced_outputs  # type: ignore[method-assign]
    WorkerServer._sse = traced_sse  # type: ignore[method-assign]


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


def run(args: argparse.Namespace, processes: int, model_dir: Path, tmp: Path) -> dict[str, Any]:
    """One run: the fleet in ``processes`` processes under the load, and the readings."""
    import psutil

    from kvpool.worker.loader import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    special = set(tokenizer.all_special_ids)
    vocab = [t for t in range(len(tokenizer)) if t not in special]
    requests = workload(args, vocab)
    base = free_base_port(args.count)
    urls = [f"http://127.0.0.1:{base + w}" for w in range(args.count)]
    hooks = tmp / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE.format(path=ME))
    path = os.pathsep.join(p for p in (str(hooks), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "KVPOOL_BENCH_GC_LOG": str(tmp / "gc.log")}
    if args.switch_interval:
        env["KVPOOL_BENCH_SWITCH_INTERVAL"] = str(args.switch_interval)
    if args.trace:
        env["KVPOOL_BENCH_TRACE"] = str(tmp / "trace.log")
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
    cmd = [*KVPOOL, "worker", "sim-fleet", "--model", str(model_dir), "--count", str(args.count)]
    cmd += ["--base-port", str(base), "--processes", str(processes)]
    log_path = tmp / "fleet.log"
    with log_path.open("wb") as log:
        fleet = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    parts: list[psutil.Process] = []
    clients: list[subprocess.Popen[str]] = []
    try:
        asyncio.run(wait_ready(urls, fleet, log_path))
        parts = [psutil.Process(fleet.pid), *psutil.Process(fleet.pid).children(recursive=True)]
        if len(parts) != processes:
            raise RuntimeError(f"the fleet runs in {len(parts)} processes, not {processes}")
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
            spec_path, out_path = str(tmp / f"spec{k}.json"), str(tmp / f"out{k}.json")
            Path(spec_path).write_text(json.dumps(spec))
            clients.append(
                subprocess.Popen(
                    [sys.executable, ME, "--client", spec_path, out_path],
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
        threads0 = {p.pid: thread_cpu(p.pid) for p in parts}
        start = time.monotonic() + 0.5
        for c in clients:
            assert c.stdin is not None
            c.stdin.write(f"{start!r}\n")
            c.stdin.flush()
        for c in clients:
            if c.wait(args.duration + 180) != 0:
                raise RuntimeError(f"a load generator exited with {c.returncode}")
        wall_end = time.monotonic()
        threads1 = {p.pid: thread_cpu(p.pid) for p in parts}
        ttft1 = asyncio.run(scrape_ttft(urls))
        names = {p.pid: thread_names(p.pid) for p in parts}
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
        fleet.terminate()  # the parent stops its children
        try:
            fleet.wait(45)
        except subprocess.TimeoutExpired:
            fleet.kill()
            fleet.wait()
        for part in parts[1:]:
            with contextlib.suppress(psutil.NoSuchProcess):
                part.kill()
    engines = sum(list(n.values()).count("engine") for n in names.values())
    if engines != args.count:
        raise RuntimeError(
            f"{engines} engine threads named, for {args.count} workers: the benchmark's "
            f"instruments did not load in every fleet process\n{log_tail(log_path)}"
        )
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
            "fleet_event_loops_s": loop_s,
            "fleet_engine_threads_s": engine_s,
            "fleet_other_threads_s": max(0.0, fleet_s - loop_s - engine_s),
            "clients_s": [o["cpu_s"] for o in outs],
        },
    }


def thread_names(pid: int) -> dict[int, str]:
    names = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            names[int(task.name)] = (task / "comm").read_text().strip()
    return names


def stage_parts(
    stages: dict[str, dict[str, float]],
    ok: list[dict[str, Any]],
    engine_first: dict[int, float],
    start: float,
) -> dict[str, list[float]]:
    """Where each request's TTFT goes, stage by stage (from ``--trace``), in ms;
    ``engine_first`` is the prediction replayed from the times the requests were queued
    for the engine thread."""
    parts: dict[str, list[float]] = {k: [] for k in STAGE_NAMES}
    for r in ok:
        s = stages.get(f"bench{r['i']}", {})
        if not all(k in s for k in STAGES) or r["i"] not in engine_first:
            continue
        for name, seconds in (
            ("in", s["handler"] - r["sent"]),
            ("prepare", s["prepared"] - s["handler"]),
            ("queue", s["queued"] - s["prepared"]),
            ("wait", s["taken"] - s["queued"]),
            ("engine", s["output"] - s["queued"]),
            ("predicted", engine_first[r["i"]] - (s["queued"] - start)),
            ("back", s["sse"] - s["output"]),
            ("out", r["first"] - s["sse"]),
        ):
            parts[name].append(seconds * 1000)
    return parts


STAGE_NAMES = {
    "in": "client sends -> handler starts (connection, HTTP in, routing)",
    "prepare": "handler starts -> prepared (body read and parsed, prompt hashed)",
    "queue": "prepared -> queued for the engine thread (admission)",
    "wait": "queued -> the engine thread takes it (the running step ends: modelled)",
    "engine": "queued -> first output handed over (engine)",
    "predicted": "... predicted for requests queued at those times (virtual replay)",
    "back": "handed over -> first SSE chunk yielded (loop wake-up, queue, tasks)",
    "out": "SSE chunk yielded -> client has it (send, loopback, client)",
}


def stats(xs: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(xs),
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
    }


def met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def evaluate(args: argparse.Namespace, processes: int, model_dir: Path) -> dict[str, Any]:
    """One run of the fleet under load and its replay: the table's cells and the figures."""
    from kvpool.worker.settings import WorkerSettings

    with tempfile.TemporaryDirectory() as tmpdir:
        res = run(args, processes, model_dir, Path(tmpdir))
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
        args.dump.mkdir(parents=True, exist_ok=True)
        (args.dump / f"sim_fleet_requests_{processes}proc.json").write_text(
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

    def vs(q: str) -> str:
        return f"{m[q]:.1f} / {p[q]:.1f} ({m[q] / p[q]:.2f}x)"

    cells = [
        f"{rps:.1f} ({len(ok)} in {wall:.1f} s): {met(rps_ok)}",
        f"{vs('mean')}, error {err:.1f}%: {met(err <= GOAL_ERROR_PCT)}",
        f"{vs('p50')}, error {err50:.1f}%",
        vs("p90"),
        vs("p99"),
        f"{server_mean:.1f} / {p['mean']:.1f} ({server_mean / p['mean']:.2f}x)",
        f"{percentile(excess, 50):.1f} / {percentile(excess, 90):.1f} / "
        f"{percentile(excess, 99):.1f}",
        f"{percentile(fixed, 50):.2f} ({percentile(fixed, 10):.2f}-{percentile(fixed, 90):.2f})",
        str(len(errors)),
        f"{percentile(lag, 50):.2f} / {percentile(lag, 99):.2f}",
        f"{cpu['fleet_s'] / run_s:.2f} ({cpu['fleet_event_loops_s'] / run_s:.2f} / "
        f"{cpu['fleet_engine_threads_s'] / run_s:.2f} / "
        f"{cpu['fleet_other_threads_s'] / run_s:.2f})",
        f"{len(full)}, {sum(x[2] for x in full) * 1000:.0f} / "
        f"{max((x[2] for x in full), default=0) * 1000:.0f}",
        f"{len(pauses)}, {sum(x[2] for x in pauses) * 1000:.0f}",
        f"{sum(cpu['clients_s']) / run_s:.2f}",
    ]
    parts = stage_parts(res["stages"], ok, engine_first, res["start"]) if res["stages"] else {}
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
        "processes": processes,
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
    if parts.get("in"):
        detail["stages_ms"] = {k: stats(v) for k, v in parts.items()}
    return {"figures": figures, "cells": cells, "detail": detail}


ROWS = [
    ("requests/s completed", f">= {GOAL_RPS:.0f} (2% slack), no errors"),
    ("TTFT mean, ms: measured / predicted", f"error <= {GOAL_ERROR_PCT:.0f}%"),
    ("TTFT p50, ms: measured / predicted", ""),
    ("TTFT p90, ms: measured / predicted", ""),
    ("TTFT p99, ms: measured / predicted", ""),
    ("TTFT mean seen by the workers (arrival to first output) / predicted, ms", ""),
    ("measured - predicted per request, ms: p50 / p90 / p99", ""),
    (
        "fixed cost of the HTTP path: one request at a time on an idle worker, measured "
        "- predicted TTFT, ms: p50 (p10-p90)",
        "",
    ),
    ("errors", "0"),
    ("client send lag behind schedule, ms: p50 / p99", ""),
    ("fleet CPU, cores (event loops / engine threads / other threads)", ""),
    ("garbage collection, full (gen 2): count, total / longest ms", ""),
    ("... all collections of >= 1 ms: count, total ms", ""),
    ("load generators' CPU, cores", ""),
]


def where(n: int) -> str:
    return "1 process" if n == 1 else f"{n} processes"


def json_key(n: int) -> str:
    return {1: "one_process", 2: "two_processes"}.get(n, f"processes_{n}")


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
        nargs="+",
        default=[1, 2],
        help="one run per value: the fleet's `sim-fleet --processes` (the workers spread "
        "over this many processes)",
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="the fleet's GIL switch interval in seconds (Python's default: 0.005)",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="log when each request passes six points in the worker, and add a table of stages",
    )
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    parser.add_argument(
        "--dump", type=Path, default=None, help="write per-request records in this folder"
    )
    parser.add_argument("--quick", action="store_true", help="8 s of arrivals")
    args = parser.parse_args()
    if args.quick:
        args.duration = 8.0
    configs = sorted(set(args.fleet_processes))

    import psutil

    from kvpool.worker.settings import WorkerSettings
    from kvpool.worker.tiny import make_tiny_model

    runs: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmpdir:
        model_dir = make_tiny_model(Path(tmpdir) / "tiny")
        settings = WorkerSettings(model=str(model_dir), engine="sim")
        for n in configs:
            print(f"the fleet in {where(n)}", file=sys.stderr)
            runs[n] = evaluate(args, n, model_dir)
    meeting = [n for n in configs if runs[n]["figures"]["goal_met"]]
    headline = meeting[0] if meeting else configs[0]
    head = runs[headline]

    rows = [
        "| Figure | " + " | ".join(where(n) for n in configs) + " | goal |",
        "|---|" + "---|" * len(configs) + "---|",
    ]
    for k, (name, goal) in enumerate(ROWS):
        cells = " | ".join(runs[n]["cells"][k] for n in configs)
        rows.append(f"| {name} | {cells} | {goal} |")
    table = "\n".join(rows)
    traced = [n for n in configs if "stages_ms" in runs[n]["detail"]]
    if traced:
        lines = [
            "| Stage, ms: mean / p50 / p90 | " + " | ".join(where(n) for n in traced) + " |",
            "|---|" + "---|" * len(traced),
        ]
        for key, name in STAGE_NAMES.items():
            cells = " | ".join(
                "{mean:.2f} / {p50:.2f} / {p90:.2f}".format(**runs[n]["detail"]["stages_ms"][key])
                for n in traced
            )
            lines.append(f"| {name} | {cells} |")
        table += "\n\nWhere TTFT goes (`--trace`):\n\n" + "\n".join(lines)

    cores = psutil.cpu_count()
    why = (
        f"One column per `--processes N`. One process is one GIL: the {args.count} workers' "
        f"event loops and engine threads in one process run Python one thread at a time, "
        f"on at most one core, while this machine has {cores} (shared with the load "
        f"generators); spread over more processes, the fleet can use them all. "
        f"Headline (`requests_per_s` and `ttft_error_pct` at the top of sim_fleet.json): "
        f"the fleet in {where(headline)}"
    )
    if not meeting:
        why += ", the fewest processes, as no configuration meets both goals."
    elif headline == configs[0]:
        why += ", the fewest processes, and it meets both goals."
    else:
        missed = ", ".join(where(n) for n in configs if n < headline)
        why += f", the fewest processes that meet both goals ({missed}: missed)."
    t = settings.timing()
    gil = ""
    if args.switch_interval:
        gil = f", GIL switch interval {args.switch_interval * 1000:g} ms"
    notes = (
        f"{args.count} simulated workers (`kvpool worker sim-fleet --count {args.count} "
        f"--processes N`, on uvloop{gil}; default settings: block size {settings.block_size}, "
        f"max_num_batched_tokens {settings.max_num_batched_tokens}, max_num_seqs "
        f"{settings.max_num_seqs}; timing model a={t.a} b={t.b} c={t.c} d={t.d} e={t.e} "
        f"f={t.f} ms). Load: Poisson arrivals at {args.rate:.0f}/s for {args.duration:.0f} s "
        f"({head['detail']['requests']} requests, the same in every run), round-robin over "
        f"the workers, from {args.clients} aiohttp processes; streaming completions, prompts "
        f"of {args.prompt_tokens[0]}-{args.prompt_tokens[1]} token ids, max_tokens "
        f"{args.max_tokens[0]}-{args.max_tokens[1]}, ignore_eos. TTFT: from sending the "
        f"request to its first content chunk. Prediction: the same requests at their actual "
        f"send times through `SimEngine(virtual=True)` per worker. CPU: per thread over the "
        f"run, over all the fleet's processes, the engine threads told apart by an OS thread "
        f"name the benchmark gives them. Garbage collections: timed by a `gc.callbacks` hook "
        f"in each fleet process (a collection stops its own process only)."
    )
    print(table)
    print()
    print(why)
    print()
    print(notes)
    machine = f"{platform.machine()}, {cores} CPUs, Python {platform.python_version()}"
    out = args.results_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim_fleet.md").write_text(
        f"# Simulated fleet: throughput and TTFT against the timing model\n\n"
        f"{dt.date.today()}, {machine}\n\n{table}\n\n{why}\n\n{notes}\n"
    )
    (out / "sim_fleet.json").write_text(
        json.dumps(
            {
                **head["figures"],
                "headline": json_key(headline),
                "headline_processes": headline,
                "date": str(dt.date.today()),
                "machine": machine,
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                **{json_key(n): {**r["figures"], "detail": r["detail"]} for n, r in runs.items()},
            },
            indent=2,
        )
        + "\n"
    )
    return head["figures"]


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        client_main(sys.argv[2], sys.argv[3])
        sys.exit(0)
    os.environ.setdefault("PYTHONSAFEPATH", "1")
    main()
