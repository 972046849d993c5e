"""Flow control under a flood: tenant isolation and priority, with the router's flow control
on and off, on the same simulated workers in the same run.

Four simulated workers (``kvpool worker sim-fleet``: the real scheduler, with the
8B-on-H100 timing model slowed ``--time-scale`` (8) times, as ``routing.py`` does, and at
most ``--max-num-seqs`` (8) sequences each, so that the pool has a real ceiling of a few
tens of requests per second that a flood can go past) serve every phase; a fresh
``kvpool router serve`` (tenants from a keys file, ``--saturation-ttft-s 0.5``) is started
for each phase, so that flow control on or off is its one flag.

Requests are streamed ``/v1/completions`` with prompts of 200-400 random token ids and
``max_tokens`` 16-32 (``ignore_eos``); TTFT is measured at the client, from sending a
request to its first ``data:`` chunk. Each tenant is its own client process (asyncio +
aiohttp, from its own loopback address), so that a flood's client cannot delay the
measured tenant's timestamps. Every request has a client timeout (``--client-timeout-s``,
30 s, for the whole request): one that runs out counts as failed, as does any answer but a
whole 200 stream.

Phases, in order:

1. **calibrate**: the pool's capacity, measured: a closed loop of 2 x (workers x
   max-num-seqs) concurrent requests through the router (flow control off) for
   ``--calibrate-s`` seconds; the capacity is the completions per second after the first
   quarter of the run. The rates below are fractions and multiples of it.
2. **solo**: tenant A alone, Poisson at ``--normal-share`` (25%) of the capacity, for
   ``--phase-s`` seconds (flow control on, the default; at this load it never engages).
3. **flood, no flow control** (``--flow-control false``, today's behaviour): A as in solo,
   plus tenant B (the same class) flooding, Poisson at ``--flood-factor`` (10) x the
   capacity, from ``--warm-s`` before A's first request until A's last has ended.
4. **flood, flow control**: the same with flow control on.
5. **priority**: tenant H (``priority: high``, ``ttft_slo_s: 1.0``) with A's schedule, and
   tenant L (``priority: low``, ``ttft_slo_s: 10``: a batch tenant that would rather hear
   503 at once than wait longer) flooding as B did, flow control on.

A and H send the same requests at the same times in every phase (one seed). B's and L's
requests still waiting when the measured tenant's last request has ended are cancelled
(and not counted either way). Between phases the router is stopped (closing its upstream
connections, which ends the workers' requests) and the workers are waited on until idle.

Goals (issue 20): with flow control A's TTFT p90 within 1.5x its solo value and no
request of A lost; H's TTFT p90 within its 1 s SLO while L absorbs the overload (L's
requests are shed: 429 or 503). Reported beside each: the same figure without flow
control. Without flow control the router ignores classes (every request goes to a worker
queue in arrival order), so A's figures in phase 3 are also what H would get there.

The router's own counters (``/metrics``: queue depth and wait by band, shed by reason and
band, tokens by tenant, saturation by reason) are read at the end of each phase and, for
the queue depth, every 0.5 s; they go into the JSON. Writes
``bench/results/flow_control.{md,json,png}`` (``--out`` elsewhere; ``--quick``: shorter
phases, written to a temporary folder unless ``--out`` says where).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import logging
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("flow_control")

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ME = str(Path(__file__).resolve())
KVPOOL = [sys.executable, "-c", "import sys; from kvpool.cli import main; sys.exit(main())"]
ENV = {**os.environ, "PYTHONSAFEPATH": "1"}  # never import the repository's operator/

#: the tenants file the router reads (keys are this benchmark's own, made up)
TENANTS: dict[str, dict[str, Any]] = {
    "tenant-a": {"key": "sk-bench-flow-tenant-a-0001", "priority": "normal"},
    "tenant-b": {"key": "sk-bench-flow-tenant-b-0002", "priority": "normal"},
    "tenant-h": {"key": "sk-bench-flow-tenant-h-0003", "priority": "high", "ttft_slo_s": 1.0},
    "tenant-l": {"key": "sk-bench-flow-tenant-l-0004", "priority": "low", "ttft_slo_s": 10.0},
}
#: each tenant's client connects from its own loopback address
SOURCES = {
    "tenant-a": "127.0.0.2",
    "tenant-b": "127.0.0.3",
    "tenant-h": "127.0.0.4",
    "tenant-l": "127.0.0.5",
}
PROMPT_TOKENS = (200, 400)
MAX_TOKENS = (16, 32)
#: the goals of issue 20
GOAL_A_RATIO = 1.5
GOAL_HIGH_P90_S = 1.0
SAMPLE_INTERVAL_S = 0.5
BANDS = ("high", "normal", "low")
#: the first seconds of a flood, left out of one extra figure: a fresh router's prefill
#: model has not learned the workers yet, and the flood's first second reaches them
ONSET_S = 10.0


# -- the load generator (one process per tenant) ---------------------------------------------
def client_main(spec_path: str, out_path: str) -> None:
    """Send one tenant's requests; write one record per request to ``out_path``.

    Prints ``ready`` once connected, then reads the start time (``time.monotonic()``, which
    is system-wide on Linux) from stdin; a later line ``stop`` cancels whatever is still in
    flight (a flood's leftovers, once the measured tenant is done)."""
    spec = json.loads(Path(spec_path).read_text())
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    result = run(_client(spec))
    Path(out_path).write_text(json.dumps(result))


def _body(rng: random.Random, vocab: int, model: str) -> dict[str, Any]:
    n = rng.randint(*PROMPT_TOKENS)
    return {
        "model": model,
        "prompt": [rng.randrange(2, vocab) for _ in range(n)],  # 0, 1: bos, eos/pad
        "max_tokens": rng.randint(*MAX_TOKENS),
        "ignore_eos": True,
        "stream": True,
    }


async def _client(spec: dict[str, Any]) -> dict[str, Any]:
    import aiohttp

    loop = asyncio.get_running_loop()
    url = spec["url"] + "/v1/completions"
    headers = {"Authorization": f"Bearer {spec['key']}"}
    connector = aiohttp.TCPConnector(limit=0, local_addr=(spec["source"], 0))
    timeout = aiohttp.ClientTimeout(total=spec["timeout_s"])
    tasks: set[asyncio.Task[dict[str, Any]]] = set()
    stopped = asyncio.Event()

    def on_stop() -> None:
        stopped.set()
        for task in tasks:
            task.cancel()

    def read_stop() -> None:  # a daemon thread: it must not keep the process alive
        if sys.stdin.readline().strip() == "stop":
            loop.call_soon_threadsafe(on_stop)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(i: int, body: dict[str, Any], at: float | None) -> dict[str, Any]:
            rec: dict[str, Any] = {"i": i, "at": at, "sent": time.monotonic()}
            try:
                return await send(rec, body)
            except TimeoutError:
                rec["error"] = "timeout"
            except asyncio.CancelledError:
                rec["error"] = "cancelled"  # the phase is over: neither success nor failure
            except Exception as exc:  # every failure is a record
                rec["error"] = f"{type(exc).__name__}: {exc}"[:200]
            finally:
                rec["done"] = time.monotonic()
            return rec

        async def send(rec: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
            async with session.post(url, json=body, headers=headers) as r:
                rec["status"] = r.status
                if r.status != 200:
                    rec["retry_after"] = r.headers.get("Retry-After")
                    text = await r.text()
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        rec["code"] = json.loads(text)["error"]["code"]
                    rec["error"] = f"HTTP {r.status}"
                    return rec
                async for line in r.content:
                    if not line.startswith(b"data: "):
                        continue
                    if line.startswith(b"data: [DONE]"):
                        rec["complete"] = True
                        break
                    if b'"error"' in line:
                        rec["error"] = "error event: " + line.decode(errors="replace")[6:200]
                    elif "first" not in rec:
                        rec["first"] = time.monotonic()
            return rec

        # one connection up before the start, so that the first request pays no setup
        with contextlib.suppress(aiohttp.ClientError, OSError):
            async with session.get(spec["url"] + "/health") as r:
                await r.read()
        print("ready", flush=True)
        start = float(await loop.run_in_executor(None, sys.stdin.readline))
        threading.Thread(target=read_stop, daemon=True).start()
        rng = random.Random(spec["seed"])
        records: list[dict[str, Any]] = []
        if spec.get("concurrency"):  # closed loop, for the calibration
            end = start + spec["duration_s"]
            delay = start - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)

            async def loop_one(k: int) -> None:
                j = 0
                while time.monotonic() < end and not stopped.is_set():
                    records.append(
                        await one(k * 1_000_000 + j, _body(rng, spec["vocab"], spec["model"]), None)
                    )
                    j += 1

            await asyncio.gather(*(loop_one(k) for k in range(spec["concurrency"])))
            return {"records": records}
        # open loop: Poisson arrivals at ``rate`` from ``offset_s`` for ``duration_s``
        t, i = 0.0, 0
        while t < spec["duration_s"] and not stopped.is_set():
            at = start + spec["offset_s"] + t
            body = _body(rng, spec["vocab"], spec["model"])
            delay = at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(i, body, at - start))
            tasks.add(task)
            i += 1
            t += rng.expovariate(spec["rate"])
        records = list(await asyncio.gather(*tasks))
    return {"records": records}


# -- processes -------------------------------------------------------------------------------
def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports free to listen on, below Linux's ephemeral
    range, which the clients' thousands of connections keep crowded."""
    import socket

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
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise SystemExit(f"found no {count} consecutive free ports")


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def wait_until(
    check: Callable[[], bool],
    proc: subprocess.Popen[bytes],
    what: str,
    log_path: Path,
    timeout: float = 120,
) -> None:
    from kvpool.stack import StackError, wait_until

    try:
        wait_until(check, proc, what, timeout)
    except StackError as exc:
        raise SystemExit(f"{exc}:\n{tail(log_path)}") from None


def get(url: str, timeout: float = 2.0) -> Any:
    import httpx

    try:
        r = httpx.get(url, timeout=timeout)
    except httpx.HTTPError:
        return None
    return r if r.status_code == 200 else None


def parse_metrics(text: str, prefixes: tuple[str, ...]) -> dict[str, float]:
    """``{'name{label="v",...}': value}`` for the samples whose name starts with one of
    ``prefixes`` (``_created`` samples left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith(prefixes) or s.name.endswith("_created"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def pick(metrics: dict[str, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


@dataclass
class Fleet:
    workers: list[str]
    proc: subprocess.Popen[bytes]
    log: Path
    model: str = ""
    vocab: int = 0


def start_fleet(args: argparse.Namespace, model_dir: Path, tmp: Path) -> Fleet:
    base = free_ports(args.workers)
    argv = [*KVPOOL, "worker", "sim-fleet", "--model", str(model_dir)]
    argv += ["--count", str(args.workers), "--base-port", str(base), "--processes", "1"]
    argv += ["--sim-time-scale", str(args.time_scale), "--max-num-seqs", str(args.max_num_seqs)]
    argv += ["--max-waiting-tokens", "100000000"]  # a worker queue without a cap of its own
    log_path = tmp / "fleet.log"
    proc = subprocess.Popen(argv, env=ENV, stdout=subprocess.DEVNULL, stderr=log_path.open("wb"))
    workers = [f"http://127.0.0.1:{base + i}" for i in range(args.workers)]
    for w in workers:
        wait_until(lambda w=w: get(w + "/health") is not None, proc, "the fleet", log_path)
    fleet = Fleet(workers, proc, log_path)
    fleet.model = get(workers[0] + "/v1/models").json()["data"][0]["id"]
    fleet.vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return fleet


def fleet_load(fleet: Fleet) -> float:
    """Requests running or waiting on the workers now (their own gauges)."""
    total = 0.0
    for w in fleet.workers:
        r = get(w + "/metrics")
        if r is None:
            return math.inf
        m = parse_metrics(r.text, ("vllm:num_requests_",))
        total += pick(m, "vllm:num_requests_running") + pick(m, "vllm:num_requests_waiting")
    return total


def wait_idle(fleet: Fleet, timeout: float = 90.0) -> float:
    """Until the workers hold no request; the seconds it took."""
    t0 = time.monotonic()
    while (load := fleet_load(fleet)) > 0:
        if time.monotonic() - t0 > timeout:
            log.warning("the workers still hold %g requests after %.0f s", load, timeout)
            break
        time.sleep(0.25)
    return time.monotonic() - t0


def write_tenants(path: Path) -> None:
    import yaml

    tenants = []
    for name, t in TENANTS.items():
        entry = {"name": name, "keys": [t["key"]], "priority": t["priority"]}
        if "ttft_slo_s" in t:
            entry["ttft_slo_s"] = t["ttft_slo_s"]
        tenants.append(entry)
    path.write_text(yaml.safe_dump({"tenants": tenants}, sort_keys=False))


def router_argv(
    args: argparse.Namespace,
    model_dir: Path,
    fleet: Fleet,
    port: int,
    tenants: Path,
    flow_control: bool,
) -> list[str]:
    argv = [*KVPOOL, "router", *(["-v"] if args.router_verbose else []), "serve"]
    argv += ["--model", str(model_dir), "--port", str(port)]
    argv += ["--api-keys-file", str(tenants), "--flow-control", str(flow_control).lower()]
    argv += ["--saturation-ttft-s", str(args.saturation_ttft_s)]
    argv += ["--drain-timeout-s", "0"]  # stopped between phases: nothing to wait for
    argv += args.router_args.split()
    for w in fleet.workers:
        argv += ["--worker", w]
    return argv


# -- one phase -------------------------------------------------------------------------------
@dataclass
class Load:
    tenant: str
    rate: float = 0.0  # open loop, requests/s
    duration_s: float = 0.0
    offset_s: float = 0.0
    seed: str = ""
    concurrency: int = 0  # closed loop instead
    measured: bool = True  # the phase ends when its measured loads have ended


@dataclass
class Phase:
    name: str
    flow_control: bool
    loads: list[Load]
    records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    depth: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    wall_s: float = 0.0
    idle_wait_s: float = 0.0


class Sampler(threading.Thread):
    """Every :data:`SAMPLE_INTERVAL_S`: the router's queue depth by band, and the requests
    waiting in the workers' own queues (``vllm:num_requests_waiting``, all workers): where
    the waiting happens, in the router or at the workers."""

    def __init__(self, url: str, workers: list[str], start: float) -> None:
        super().__init__(daemon=True)
        self.url, self.workers, self.start_at = url, workers, start
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(SAMPLE_INTERVAL_S):
            r = get(self.url + "/metrics")
            if r is None:
                continue
            m = parse_metrics(r.text, ("kvpool_router_queue_depth",))
            row = {b: pick(m, "kvpool_router_queue_depth", band=b) for b in BANDS}
            row["workers_waiting"] = 0.0
            for w in self.workers:
                if (wr := get(w + "/metrics")) is not None:
                    wm = parse_metrics(wr.text, ("vllm:num_requests_waiting",))
                    row["workers_waiting"] += pick(wm, "vllm:num_requests_waiting")
            self.samples.append((time.monotonic() - self.start_at, row))


def run_phase(
    args: argparse.Namespace, phase: Phase, model_dir: Path, fleet: Fleet, tenants: Path, tmp: Path
) -> Phase:
    port = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    router_log = tmp / f"router-{phase.name}.log"
    argv = router_argv(args, model_dir, fleet, port, tenants, phase.flow_control)
    router = subprocess.Popen(argv, env=ENV, stdout=router_log.open("wb"), stderr=subprocess.STDOUT)
    n = len(fleet.workers)

    def ready() -> bool:
        r = get(url + "/health")
        return r is not None and r.json().get("workers_up", 0) == n

    wait_until(ready, router, f"the router ({phase.name})", router_log, timeout=60)
    clients: list[tuple[Load, subprocess.Popen[str], Path]] = []
    try:
        for k, load in enumerate(phase.loads):
            spec = {
                "url": url,
                "key": TENANTS[load.tenant]["key"],
                "source": SOURCES[load.tenant],
                "timeout_s": args.client_timeout_s,
                "rate": load.rate,
                "duration_s": load.duration_s,
                "offset_s": load.offset_s,
                "seed": load.seed or f"{phase.name}-{load.tenant}",
                "concurrency": load.concurrency,
                "model": fleet.model,
                "vocab": fleet.vocab,
            }
            spec_path, out = tmp / f"{phase.name}-{k}.spec.json", tmp / f"{phase.name}-{k}.out.json"
            spec_path.write_text(json.dumps(spec))
            out.unlink(missing_ok=True)
            proc = subprocess.Popen(
                [sys.executable, ME, "--client", str(spec_path), str(out)],
                env=ENV,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            clients.append((load, proc, out))
        for load, proc, _ in clients:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise SystemExit(f"the {load.tenant} client did not start")
        start = time.monotonic() + 0.3
        sampler = Sampler(url, fleet.workers, start)
        sampler.start()
        for _, proc, _ in clients:
            assert proc.stdin is not None
            proc.stdin.write(f"{start!r}\n")
            proc.stdin.flush()
        longest = max(x.offset_s + x.duration_s for x in phase.loads) + args.client_timeout_s + 60
        for load, proc, _ in clients:
            if load.measured:
                proc.wait(timeout=longest)
        for load, proc, _ in clients:  # the flood's leftovers
            if not load.measured:
                assert proc.stdin is not None
                with contextlib.suppress(BrokenPipeError):
                    proc.stdin.write("stop\n")
                    proc.stdin.flush()
                proc.wait(timeout=60)
        phase.wall_s = time.monotonic() - start
        sampler.halt.set()
        sampler.join()
        phase.depth = sampler.samples
        r = get(url + "/metrics")
        if r is not None:
            phase.metrics = parse_metrics(r.text, ("kvpool_router_",))
        for load, proc, out in clients:
            if proc.returncode != 0 or not out.exists():
                raise SystemExit(f"the {load.tenant} client failed ({proc.returncode})")
            phase.records[load.tenant] = json.loads(out.read_text())["records"]
    finally:
        for _, proc, _ in clients:
            if proc.poll() is None:
                proc.kill()
        from kvpool.stack import stop_process

        stop_process(router, timeout=15)
    phase.idle_wait_s = wait_idle(fleet)
    return phase


# -- figures ---------------------------------------------------------------------------------
def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (``inf`` where a failed request ranks)."""
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def summarize(
    records: list[dict[str, Any]], timeout: float, *, timeline: bool = False
) -> dict[str, Any]:
    """Outcomes and TTFT of one tenant's requests in one phase; requests cancelled at the
    end of the phase (a flood's leftovers) count neither way. In the percentiles a failed
    request counts as taking the client ``timeout`` (a lower bound: it never got a first
    token), and ``p90_on_failure`` says where the p90 is one of them. ``timeline``: also
    every request's ``[sent at, TTFT or None, outcome]`` (seconds into the phase)."""
    counted = [r for r in records if r.get("error") != "cancelled"]
    ok = [
        r
        for r in counted
        if r.get("status") == 200 and r.get("complete") and "error" not in r and "first" in r
    ]
    ttft = [r["first"] - r["sent"] for r in ok]
    ok_ids = {id(r) for r in ok}
    failed = [r for r in counted if id(r) not in ok_ids]
    kinds: dict[str, int] = {}
    for r in failed:
        kind = kind_of(r)
        kinds[kind] = kinds.get(kind, 0) + 1
    every = ttft + [timeout] * len(failed)  # no first token: at least the timeout
    shed = sum(1 for r in counted if r.get("status") in (429, 503))
    out: dict[str, Any] = {}
    if timeline:
        out["timeline"] = [
            [
                round(r["at"], 3),
                round(r["first"] - r["sent"], 4) if id(r) in ok_ids else None,
                "ok" if id(r) in ok_ids else kind_of(r),
            ]
            for r in sorted(counted, key=lambda r: r["at"])
        ]
    return out | {
        "sent": len(records),
        "counted": len(counted),
        "cancelled_at_end": len(records) - len(counted),
        "ok": len(ok),
        "failed": len(failed),
        "shed_429_503": shed,
        "failures": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "ttft_p50_s": finite(percentile(every, 50)),
        "ttft_p90_s": finite(percentile(every, 90)),
        "p90_on_failure": len(failed) > 0 and percentile(every, 90) >= timeout,
        "ttft_p99_s": finite(percentile(every, 99)),
        "ok_ttft_p50_s": finite(percentile(ttft, 50)),
        "ok_ttft_p90_s": finite(percentile(ttft, 90)),
        "ok_ttft_max_s": finite(max(ttft, default=math.nan)),
        "ttft_s": sorted(round(x, 4) for x in ttft),
    }


def kind_of(r: dict[str, Any]) -> str:
    """How a failed request failed: ``429 <code>``, ``timeout``, ..."""
    if "status" not in r or r["status"] == 200:
        return str(r.get("error"))
    return f"{r['status']} {r.get('code')}"


def late_p90(x: dict[str, Any], after_s: float, timeout: float) -> float | None:
    """TTFT p90 of the requests sent ``after_s`` or later into the phase (a failed one
    counts as the client ``timeout``)."""
    late = [t if t is not None else timeout for at, t, _ in x["timeline"] if at >= after_s]
    return finite(percentile(late, 90)) if late else None


def finite(x: float) -> float | None:
    """JSON has no infinity: None where a percentile falls on failed requests."""
    return x if math.isfinite(x) else None


def capacity(records: list[dict[str, Any]], duration: float) -> tuple[float, int]:
    """Completions per second over the last three quarters of a closed-loop run."""
    t0 = min(r["sent"] for r in records)
    skip = duration / 4
    done = [
        r
        for r in records
        if r.get("complete") and r["done"] - t0 >= skip and r["done"] - t0 <= duration
    ]
    return len(done) / (duration - skip), len(done)


def p90_cell(x: dict[str, Any]) -> str:
    """A TTFT p90 for the table; where it falls on a failed request (counted as the client
    timeout), a lower bound, with the p90 of those served."""
    if not x["p90_on_failure"]:
        return f"{x['ttft_p90_s']:.3f} s"
    served = x["ok_ttft_p90_s"]
    of_served = f"; p90 of the {x['ok']} served: {served:.2f} s" if served is not None else ""
    return f">= {x['ttft_p90_s']:.1f} s ({x['failed']} of {x['counted']} failed{of_served})"


def secs(x: float | None, timeout: float) -> str:
    if x is None:
        return "-"
    return f">= {timeout:g} s (failures)" if x >= timeout else f"{x:.3f} s"


def ratio_cell(a: dict[str, Any], b: dict[str, Any]) -> str:
    """``a``'s p90 over ``b``'s, marked where either is a lower bound."""
    r = a["ttft_p90_s"] / b["ttft_p90_s"]
    if a["p90_on_failure"] and not b["p90_on_failure"]:
        return f">= {r:.2f}x"
    if b["p90_on_failure"] and not a["p90_on_failure"]:
        return f"<= {r:.2f}x"
    return "-" if a["p90_on_failure"] else f"{r:.2f}x"


def outcome_cell(x: dict[str, Any]) -> str:
    """Served / shed (429, 503) / failed otherwise (timeouts, mostly) / still open when the
    phase ended (cancelled, not counted)."""
    other = x["failed"] - x["shed_429_503"]
    return f"{x['ok']} / {x['shed_429_503']} / {other} / {x['cancelled_at_end']}"


def waiting_cell(p: Phase, key: str) -> str:
    values = [row[key] for _, row in p.depth]
    if not values:
        return "-"
    return f"{max(values):.0f} / {sum(values) / len(values):.0f}"


def render(meta: dict[str, Any], s: dict[str, Any], phases: dict[str, Phase]) -> tuple[str, dict]:
    """The markdown table and the JSON figures."""
    timeout = meta["client_timeout_s"]
    onset = meta["warm_s"] + ONSET_S
    solo, nofc, fc = s["solo"]["a"], s["flood_no_fc"]["a"], s["flood_fc"]["a"]
    h, low = s["priority"]["h"], s["priority"]["l"]
    a_vs_solo = fc["ttft_p90_s"] / solo["ttft_p90_s"]
    goals = {
        "tenant_a_p90_vs_solo_le_1_5": a_vs_solo is not None and a_vs_solo <= GOAL_A_RATIO,
        "tenant_a_lost_none": fc["failed"] == 0,
        "high_priority_p90_le_1s": h["ttft_p90_s"] <= GOAL_HIGH_P90_S,
        "high_priority_lost_none": h["failed"] == 0,
        "low_priority_shed": low["shed_429_503"] > 0,
    }
    met = {name: "met" if ok else "**MISSED**" for name, ok in goals.items()}
    pfc, pno = phases["flood_fc"], phases["flood_no_fc"]
    flood = f"{meta['flood_rate']:.0f} req/s"
    rows = [
        "| Figure | kvpool, flow control on | baseline, same run | ratio | goal |",
        "|---|---|---|---|---|",
        f"| pool capacity, req/s (closed loop, {meta['calibrate_concurrency']} concurrent) "
        f"| {meta['capacity_rps']:.1f} | - | - | measured |",
        f"| A's TTFT p90 ({meta['a_rate']:.1f} req/s) under B's flood ({flood}), against A alone "
        f"| {p90_cell(fc)} | A alone: {p90_cell(solo)} "
        f"| {ratio_cell(fc, solo)} "
        f"| <= {GOAL_A_RATIO}x: {met['tenant_a_p90_vs_solo_le_1_5']} |",
        f"| A's TTFT p90 under B's flood, against no flow control | {p90_cell(fc)} "
        f"| no flow control: {p90_cell(nofc)} | {ratio_cell(fc, nofc)} "
        "| - |",
        f"| ... A's requests sent {ONSET_S:g} s or more into the flood (its onset left out) "
        f"| {secs(late_p90(fc, onset, timeout), timeout)} "
        f"| no flow control: {secs(late_p90(nofc, onset, timeout), timeout)} | - | - |",
        f"| A's requests failed under B's flood | {fc['failed']} of {fc['counted']} "
        f"| no flow control: {nofc['failed']} of {nofc['counted']} | - "
        f"| 0: {met['tenant_a_lost_none']} |",
        f"| H's TTFT p90 (high, `ttft_slo_s` 1) under L's flood ({flood}, low) | {p90_cell(h)} "
        f"| no flow control (classes ignored; A in B's flood): {p90_cell(nofc)} "
        f"| {ratio_cell(h, nofc)} "
        f"| <= {GOAL_HIGH_P90_S:g} s: {met['high_priority_p90_le_1s']} |",
        f"| H's requests failed | {h['failed']} of {h['counted']} "
        f"| no flow control (A): {nofc['failed']} of {nofc['counted']} | - "
        f"| 0: {met['high_priority_lost_none']} |",
        f"| L's requests shed with 429/503 | {low['shed_429_503']} of {low['counted']} "
        f"| no flow control (B): {s['flood_no_fc']['b']['shed_429_503']} of "
        f"{s['flood_no_fc']['b']['counted']} | - | L absorbs the overload: "
        f"{met['low_priority_shed']} |",
        "| the flood's requests: served / shed 429, 503 / failed otherwise / open at the end "
        f"(cancelled) | B: "
        f"{outcome_cell(s['flood_fc']['b'])}; L: {outcome_cell(low)} "
        f"| no flow control, B: {outcome_cell(s['flood_no_fc']['b'])} | - | - |",
        f"| requests waiting in the workers' queues during B's flood, most / mean "
        f"| {waiting_cell(pfc, 'workers_waiting')} | no flow control: "
        f"{waiting_cell(pno, 'workers_waiting')} | - | - |",
        f"| requests waiting in the router during B's flood, most / mean "
        f"| {waiting_cell(pfc, 'normal')} | no flow control: {waiting_cell(pno, 'normal')} "
        "| - | - |",
    ]
    figures = {
        "tenant_a_p90_vs_solo": a_vs_solo,
        "tenant_a_p90_vs_solo_is_lower_bound": fc["p90_on_failure"],
        "tenant_a_failed": fc["failed"],
        "high_priority_p90_s": h["ttft_p90_s"],
        "high_priority_p90_is_lower_bound": h["p90_on_failure"],
        "low_priority_shed": low["shed_429_503"],
        "goals": goals,
        "capacity_rps": meta["capacity_rps"],
        "tenant_a_solo_p90_s": solo["ttft_p90_s"],
        "tenant_a_flood_fc_p90_s": fc["ttft_p90_s"],
        "tenant_a_flood_no_fc_p90_s": nofc["ttft_p90_s"],
        "tenant_a_flood_no_fc_served_p90_s": nofc["ok_ttft_p90_s"],
        "tenant_a_flood_no_fc_p90_is_lower_bound": nofc["p90_on_failure"],
        "tenant_a_failed_no_fc": nofc["failed"],
        "tenant_a_flood_fc_p90_after_onset_s": late_p90(fc, onset, timeout),
        "tenant_a_sent": fc["counted"],
        "high_priority_served_p90_s": h["ok_ttft_p90_s"],
        "high_priority_failed": h["failed"],
        "high_priority_sent": h["counted"],
        "low_priority_sent": low["counted"],
        "low_priority_served": low["ok"],
    }
    return "\n".join(rows), figures


def plot(summaries: dict[str, Any], phases: dict[str, Phase], path: Path, timeout: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for label, (phase, tenant) in {
        "A alone": ("solo", "a"),
        "A, B flooding, flow control": ("flood_fc", "a"),
        "A, B flooding, no flow control": ("flood_no_fc", "a"),
        "H (high), L flooding, flow control": ("priority", "h"),
    }.items():
        s = summaries[phase][tenant]
        xs, n = s["ttft_s"], s["counted"]
        if xs:
            ys = [(i + 1) / n for i in range(len(xs))]
            left.step(xs, ys, where="post", label=f"{label} ({s['failed']} of {n} failed)")
    left.set_xscale("log")
    left.set_xlabel("TTFT at the client, s (failed requests never reach the top)")
    left.set_ylabel("fraction of requests")
    left.axvline(GOAL_HIGH_P90_S, color="grey", lw=0.8, ls=":")
    left.axhline(0.9, color="grey", lw=0.8, ls=":")
    left.legend(fontsize=8, loc="upper left")
    for name, key, label in (
        ("flood_no_fc", "workers_waiting", "no flow control: at the workers"),
        ("flood_fc", "workers_waiting", "flow control: at the workers"),
        ("flood_fc", "normal", "flow control: in the router"),
        ("priority", "workers_waiting", "priority: at the workers"),
        ("priority", "low", "priority: in the router, low band"),
    ):
        samples = phases[name].depth
        if samples:
            right.plot([t for t, _ in samples], [d[key] for _, d in samples], label=label)
    right.set_xlabel("seconds into the phase")
    right.set_ylabel("requests waiting")
    right.set_yscale("symlog", linthresh=10)
    right.legend(fontsize=8)
    fig.suptitle(f"Flow control under a 10x flood (client timeout {timeout:g} s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main ------------------------------------------------------------------------------------
def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=".cache/tiny-model", help="its tokenizer is used")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=8, help="per worker")
    parser.add_argument("--time-scale", type=float, default=8.0, help="the timing model slowed")
    parser.add_argument("--calibrate-s", type=float, default=16.0)
    parser.add_argument("--phase-s", type=float, default=25.0, help="seconds of A's (H's) arrivals")
    parser.add_argument("--warm-s", type=float, default=3.0, help="the flood alone, before A")
    parser.add_argument("--normal-share", type=float, default=0.25, help="A's rate / capacity")
    parser.add_argument("--flood-factor", type=float, default=10.0, help="B's rate / capacity")
    parser.add_argument("--client-timeout-s", type=float, default=30.0)
    parser.add_argument("--saturation-ttft-s", type=float, default=0.5)
    parser.add_argument("--router-args", default="", help="more `kvpool router serve` flags")
    parser.add_argument("--router-verbose", action="store_true", help="routers with -v (logs kept)")
    parser.add_argument("--quick", action="store_true", help="short phases; a temporary --out")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the logs' folder")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.quick:
        args.calibrate_s, args.phase_s = min(args.calibrate_s, 8.0), min(args.phase_s, 8.0)
    out = args.out or (Path(tempfile.mkdtemp(prefix="flow-control-")) if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model)
    if not (model_dir / "config.json").exists():
        subprocess.run([*KVPOOL, "worker", "make-tiny-model", str(model_dir)], env=ENV, check=True)
    began = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="flow-control-logs-"))
    tenants = tmp / "tenants.yaml"
    write_tenants(tenants)
    fleet = start_fleet(args, model_dir, tmp)
    phases: dict[str, Phase] = {}
    try:
        conc = 2 * args.workers * args.max_num_seqs
        log.info("calibrate: %d concurrent for %.0f s", conc, args.calibrate_s)
        closed = Load("tenant-a", duration_s=args.calibrate_s, concurrency=conc)
        cal = run_phase(args, Phase("calibrate", False, [closed]), model_dir, fleet, tenants, tmp)
        cap, n_cal = capacity(cal.records["tenant-a"], args.calibrate_s)
        phases["calibrate"] = cal
        a_rate, flood = args.normal_share * cap, args.flood_factor * cap
        log.info("capacity %.1f req/s: A at %.1f, floods at %.0f req/s", cap, a_rate, flood)
        a = Load("tenant-a", a_rate, args.phase_s, args.warm_s, seed="tenant-a")
        b = Load("tenant-b", flood, args.warm_s + args.phase_s, seed="tenant-b", measured=False)
        h = Load("tenant-h", a_rate, args.phase_s, args.warm_s, seed="tenant-a")  # A's schedule
        low = Load("tenant-l", flood, args.warm_s + args.phase_s, seed="tenant-b", measured=False)
        plan = [
            Phase("solo", True, [a]),
            Phase("flood_no_fc", False, [a, b]),
            Phase("flood_fc", True, [a, b]),
            Phase("priority", True, [h, low]),
        ]
        for phase in plan:
            log.info(
                "phase %s (flow control %s)", phase.name, "on" if phase.flow_control else "off"
            )
            phases[phase.name] = run_phase(args, phase, model_dir, fleet, tenants, tmp)
            p = phases[phase.name]
            for tenant, recs in p.records.items():
                sm = summarize(recs, args.client_timeout_s)
                log.info(
                    "  %s: %d ok, %d failed %s, p90 %s, %d cancelled at the end",
                    tenant,
                    sm["ok"],
                    sm["failed"],
                    sm["failures"],
                    sm["ttft_p90_s"],
                    sm["cancelled_at_end"],
                )
    finally:
        from kvpool.stack import stop_process

        stop_process(fleet.proc, timeout=15)
    wall = time.monotonic() - began
    measured = {(p.name, x.tenant) for p in phases.values() for x in p.loads if x.measured}
    summaries = {
        name: {
            t.split("-")[1]: summarize(recs, args.client_timeout_s, timeline=(name, t) in measured)
            for t, recs in p.records.items()
        }
        for name, p in phases.items()
        if name != "calibrate"
    }
    cores = os.cpu_count()
    machine = f"{platform.machine()}, {cores} CPUs, Python {platform.python_version()}"
    meta = {
        "date": str(dt.date.today()),
        "machine": machine,
        "wall_s": round(wall, 1),
        "workers": args.workers,
        "max_num_seqs": args.max_num_seqs,
        "time_scale": args.time_scale,
        "saturation_ttft_s": args.saturation_ttft_s,
        "client_timeout_s": args.client_timeout_s,
        "phase_s": args.phase_s,
        "warm_s": args.warm_s,
        "calibrate_s": args.calibrate_s,
        "calibrate_concurrency": 2 * args.workers * args.max_num_seqs,
        "calibrate_completions": n_cal,
        "capacity_rps": cap,
        "a_rate": a_rate,
        "flood_rate": flood,
        "prompt_tokens": PROMPT_TOKENS,
        "max_tokens": MAX_TOKENS,
        "tenants": {k: {x: y for x, y in v.items() if x != "key"} for k, v in TENANTS.items()},
        "router_args": args.router_args,
        "quick": args.quick,
    }
    table, figures = render(meta, summaries, phases)
    router_metrics = {}
    for name, p in phases.items():
        m = p.metrics
        router_metrics[name] = {
            "shed": {k: v for k, v in m.items() if k.startswith("kvpool_router_shed_total") and v},
            "saturated": {
                k: v for k, v in m.items() if k.startswith("kvpool_router_saturated_total")
            },
            "queue_wait": {
                k: v
                for k, v in m.items()
                if k.startswith("kvpool_router_queue_wait_seconds_")
                and not k.startswith("kvpool_router_queue_wait_seconds_bucket")
            },
            "tenant_tokens": {
                k: v for k, v in m.items() if k.startswith("kvpool_router_tenant_tokens_total")
            },
            "tenant_requests": {
                k: v for k, v in m.items() if k.startswith("kvpool_router_tenant_requests_total")
            },
            "requests": {
                k: v for k, v in m.items() if k.startswith("kvpool_router_requests_total")
            },
            "queue_depth_max": {b: max((d[b] for _, d in p.depth), default=0) for b in BANDS},
            "workers_waiting_max": max((d["workers_waiting"] for _, d in p.depth), default=0),
            "depth_samples": [[round(t, 2), d] for t, d in p.depth],
            "wall_s": round(p.wall_s, 1),
            "idle_wait_s": round(p.idle_wait_s, 1),
        }
    notes = notes_text(meta, summaries, router_metrics)
    md = (
        f"# Flow control under a flood\n\n{meta['date']}, {machine}; the whole run took "
        f"{wall / 60:.1f} min.\n\n{table}\n\n{notes}\n"
    )
    print(table)
    print()
    print(notes)
    result = {**figures, "meta": meta, "phases": summaries, "router_metrics": router_metrics}
    (out / "flow_control.md").write_text(md)
    (out / "flow_control.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(summaries, phases, out / "flow_control.png", args.client_timeout_s)
    if args.keep:
        log.info("logs kept in %s", tmp)
    else:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    log.info("wrote %s/flow_control.{md,json,png} in %.1f min", out, wall / 60)
    return result


def where(rm: dict[str, Any]) -> str:
    parts = []
    for name, label in (
        ("flood_no_fc", "no flow control"),
        ("flood_fc", "flow control"),
        ("priority", "priority"),
    ):
        samples = [d for _, d in rm.get(name, {}).get("depth_samples", [])]
        if not samples:
            continue
        workers = [d["workers_waiting"] for d in samples]
        router = [d["high"] + d["normal"] + d["low"] for d in samples]
        parts.append(
            f"{label}: in the workers' queues {max(workers):.0f} / "
            f"{sum(workers) / len(workers):.0f}, in the router {max(router):.0f} / "
            f"{sum(router) / len(router):.0f}"
        )
    return "; ".join(parts)


def notes_text(meta: dict[str, Any], s: dict[str, Any], rm: dict[str, Any]) -> str:
    """What the table rests on: the set-up, and the router's own counters."""
    lines = [
        f"Set-up: {meta['workers']} simulated workers (`kvpool worker sim-fleet`, the timing "
        f"model slowed {meta['time_scale']:g}x, at most {meta['max_num_seqs']} sequences "
        "each); a fresh `kvpool router serve` per phase with `--saturation-ttft-s "
        f"{meta['saturation_ttft_s']:g}` (flow control's trigger; the default is 2 s) and "
        "`--flow-control` on or off; streamed completions of "
        f"{PROMPT_TOKENS[0]}-{PROMPT_TOKENS[1]} random prompt tokens and "
        f"{MAX_TOKENS[0]}-{MAX_TOKENS[1]} output tokens; a client timeout of "
        f"{meta['client_timeout_s']:g} s per request. Capacity measured: "
        f"{meta['capacity_rps']:.1f} req/s; A (and H, the same schedule) at "
        f"{meta['a_rate']:.1f} req/s for {meta['phase_s']:g} s; B (and L) at "
        f"{meta['flood_rate']:.0f} req/s from {meta['warm_s']:g} s before A's first request "
        "until A's last has ended, when the flood's requests still open are cancelled (not "
        "counted). H: `priority: high`, `ttft_slo_s: 1`; L: `priority: low`, "
        "`ttft_slo_s: 10`; A and B: `normal`, no SLO. Each tenant's client is its own "
        "process and loopback address; the routers run with kvpool's defaults (connections "
        "in service never count against an address's limit).",
        "",
        "Where the flood waited (requests, sampled every "
        f"{SAMPLE_INTERVAL_S:g} s; most / mean): {where(rm)}. Flow control does its job when "
        "the workers' own queues stay at a few requests and the router holds the rest: only "
        "there can a later, more deserving request go first.",
        "",
        "The router's counters at the end of each phase (`/metrics`):",
        "",
    ]
    for name in ("flood_no_fc", "flood_fc", "priority"):
        m = rm.get(name, {})
        waits = m.get("queue_wait", {})
        mean = {}
        for band in BANDS:
            n = waits.get(f'kvpool_router_queue_wait_seconds_count{{band="{band}"}}', 0)
            if n:
                total = waits[f'kvpool_router_queue_wait_seconds_sum{{band="{band}"}}']
                mean[band] = f"{int(n)} waited, mean {total / n:.2f} s"
        shed = {k.split("{")[1].rstrip("}"): int(v) for k, v in m.get("shed", {}).items()}
        sat = {k.split("{")[1].rstrip("}"): int(v) for k, v in m.get("saturated", {}).items() if v}
        lines.append(
            f"- {name}: queue {mean or 'never used'}; shed {shed or 'none'}; "
            f"saturated {sat or 'never'}; most waiting in the router at once "
            f"{m.get('queue_depth_max')}."
        )
    failures = {name: {t: x["failures"] for t, x in v.items()} for name, v in s.items()}
    lines += ["", f"Failures by kind: `{json.dumps(failures)}`"]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--client":
        client_main(sys.argv[2], sys.argv[3])
    else:
        main()
