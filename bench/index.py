"""The router's block index (``router/state/index.py``) beside the one before issue 21, same run.

The baseline is the index as it was at ``BASELINE_REV`` (read with ``git show`` and loaded
by path), so both run on the same machine, in the same run, on the same workloads. Every
figure comes from a fresh child process per index, so that one build's memory and garbage
do not weigh on the other's.

* **Memory** (``index_bytes_per_entry``): the child's resident set before and after
  building the index, over the (block, worker) entries: 100 workers with 500,000 blocks
  each, stored 16 keys a call as KV events bring them. Distinct blocks on every worker is
  the worst case; the second figure has half of each worker's blocks shared by its group of
  8 workers (a system prompt, a document). The same build also gives the longest single
  ``store()`` call (a dict rebuilding itself as it grows) and the time of a full garbage
  collection with the index in memory (what Python's own collector costs the event loop,
  now and then, whatever it is doing). The collector is paused while the other figures are
  timed, so that they are the index's own work, in both indexes.
* **Events** (``event_apply_blocks_per_s``): ``apply()`` on ``EventBatch`` objects at a
  steady size (16 workers, each batch a ``BlockStored`` of 16 new blocks and a
  ``BlockRemoved`` of its 16 oldest), blocks stored and removed per second.
* **The stall of a clear** (``index_max_stall_ms``): a worker with 1M blocks (a quarter of
  them shared with the 15 other workers, 250k blocks each) is cleared while the request path
  goes on: ``clear_worker()`` and then every ``sweep()`` step (default ``max_keys``) are
  timed, with a ``match()`` between steps; the figure is the longest single call (the
  median of 3 runs: a maximum on a shared machine catches its neighbours too; the call's
  CPU time beside it tells the index's own part). The baseline's is its
  ``clear_worker()``, which walks the worker's blocks at once; the new index's cost of the
  same all-at-once work (``clear_worker()`` + ``sweep(10**9)``) is shown too.
* **Decision time** (``decision_p99_ms``): ``match()`` of 512-block chains (8k-token prompts
  at block size 16) over 64 workers and 1M (block, worker) entries: 64 shared prefixes of
  16-384 blocks (Zipf popularity, the most popular cached on 32 workers), conversations of
  512 blocks on them (a tenth cached on 2-4 workers), and prompts mixing new questions on a
  shared prefix (35%: a run of holders, then a miss), follow-ups of a cached conversation
  (30%: one to four workers hold 448-508 blocks), the same prompt again at once (10%: held
  by a speculative entry) and cold prompts (25%: a miss at the first block). The router's
  own flow goes on between lookups: the chosen worker gets speculative entries, its events
  confirm them 8 decisions later and evict its oldest blocks, 5 ms of the index's clock
  pass per decision.

Writes bench/results/index.{md,json}. ``--quick``: scaled-down sizes, under a minute.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import importlib.util
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
ME = str(Path(__file__).resolve())
REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONSAFEPATH": "1"}  # never import the repository's operator/
BASELINE_REV = "09c0ca2"  # the last commit of router/state/index.py before issue 21
GOAL_STALL_MS = 5.0
STALL_RUNS = 3
GOAL_DECISION_P99_MS = 1.0

FULL = {
    "mem_workers": 100,
    "mem_blocks": 500_000,
    "ev_workers": 16,
    "ev_blocks": 250_000,
    "ev_batches": 40_000,
    "stall_big": 1_000_000,
    "stall_others": 15,
    "stall_other_blocks": 250_000,
    "dec_workers": 64,
    "dec_entries": 1_000_000,
    "dec_queries": 20_000,
}
QUICK = {
    "mem_workers": 100,
    "mem_blocks": 20_000,
    "ev_workers": 8,
    "ev_blocks": 50_000,
    "ev_batches": 10_000,
    "stall_big": 300_000,
    "stall_others": 7,
    "stall_other_blocks": 50_000,
    "dec_workers": 64,
    "dec_entries": 250_000,
    "dec_queries": 4_000,
}


def load_index(path: str) -> Any:
    """The ``BlockIndex`` class: this tree's (``path`` "new") or the file at ``path``."""
    if path == "new":
        from kvpool.router.state.index import BlockIndex

        return BlockIndex
    spec = importlib.util.spec_from_file_location("kvpool_index_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BlockIndex


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def quantiles(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {
        "p50": s[len(s) // 2],
        "p99": s[min(int(0.99 * len(s)), len(s) - 1)],
        "max": s[-1],
        "n": len(s),
    }


# -- the measurements, each run in a child process --------------------------------------------


def child_memory(index_cls: Any, p: dict[str, Any]) -> dict[str, Any]:
    """Build 100 workers x 500k blocks, 16 keys a store; RSS growth per entry."""
    workers, blocks, shared = p["mem_workers"], p["mem_blocks"], p["case"] == "shared"
    gc.collect()
    before = rss_bytes()
    index = index_cls()
    for w in range(workers):
        index.add_worker(f"w{w}")
    rng = random.Random(1)
    longest = longest_cpu = 0.0  # wall, and CPU: wall time less preemption
    over = 0  # calls over 5 ms of CPU
    gc.disable()  # a collection's pause is measured apart, below
    t0 = time.perf_counter()
    for w in range(workers):
        wid = f"w{w}"
        sources = [(rng, blocks)]
        if shared:  # half the blocks are the group's: the same keys on 8 workers
            sources = [(random.Random(1_000 + w // 8), blocks // 2), (rng, blocks - blocks // 2)]
        for source, n in sources:
            bits = source.getrandbits
            for _ in range(n // 16):
                keys = [bits(64) for _ in range(16)]
                start, cpu = time.perf_counter(), time.process_time()
                index.store(wid, keys)
                took, took_cpu = time.perf_counter() - start, time.process_time() - cpu
                if took > longest:
                    longest = took
                if took_cpu > longest_cpu:
                    longest_cpu = took_cpu
                if took_cpu > 0.005:
                    over += 1
    build_s = time.perf_counter() - t0
    gc.enable()
    gc.collect()
    after = rss_bytes()
    start = time.perf_counter()
    gc.collect()
    gc_ms = (time.perf_counter() - start) * 1000
    entries = index.num_entries()
    return {
        "entries": entries,
        "rss_growth_bytes": after - before,
        "bytes_per_entry": (after - before) / entries,
        "max_store_ms": longest * 1000,
        "max_store_cpu_ms": longest_cpu * 1000,
        "stores_over_5ms_cpu": over,
        "gc_full_ms": gc_ms,
        "build_s": build_s,
    }


def child_events(index_cls: Any, p: dict[str, Any]) -> dict[str, Any]:
    """Steady-state apply(): each batch stores 16 new blocks and removes the 16 oldest."""
    from kvpool.kv_events import BlockRemoved, BlockStored, EventBatch

    workers, blocks = p["ev_workers"], p["ev_blocks"]
    rng = random.Random(2)
    index = index_cls()
    held: list[deque[list[int]]] = []
    for w in range(workers):
        index.add_worker(f"w{w}")
        chunks: deque[list[int]] = deque()
        for _ in range(blocks // 16):
            keys = [rng.getrandbits(64) for _ in range(16)]
            index.store(f"w{w}", keys)
            chunks.append(keys)
        held.append(chunks)
    tokens = list(range(16 * 16))
    batches = []
    for i in range(p["ev_batches"]):
        w = i % workers
        keys = [rng.getrandbits(64) for _ in range(16)]
        held[w].append(keys)
        old = held[w].popleft()
        stored = BlockStored(
            block_hashes=keys, parent_block_hash=None, token_ids=tokens, block_size=16
        )
        batches.append((f"w{w}", EventBatch(events=[stored, BlockRemoved(old)], ts=0.0)))
    rounds = 3
    per_round = len(batches) // rounds
    rates = []
    for r in range(rounds):
        part = batches[r * per_round : (r + 1) * per_round]
        start = time.perf_counter()
        for wid, batch in part:
            index.apply(wid, batch)
        rates.append(len(part) * 32 / (time.perf_counter() - start))
    return {"blocks_per_s": statistics.median(rates), "rounds": rates}


def child_stall(index_cls: Any, p: dict[str, Any]) -> dict[str, Any]:
    """Clear a worker with 1M blocks while lookups go on; time every index call."""
    rng = random.Random(3)
    big, others, per_other = p["stall_big"], p["stall_others"], p["stall_other_blocks"]
    index = index_cls()
    ids = [f"w{i}" for i in range(others)]
    for wid in ["big", "big2", *ids]:
        index.add_worker(wid)
    chains: list[list[int]] = []
    pool: list[int] = []
    for wid in ids:
        own = [rng.getrandbits(64) for _ in range(per_other)]
        for i in range(0, len(own), 16):
            index.store(wid, own[i : i + 16])
        chains.extend(own[i : i + 512] for i in range(0, len(own) - 512, 4096))
        pool += own
    for wid in ["big", "big2"]:  # two alike: one cleared in slices, one all at once
        keys = rng.sample(pool, big // 4) + [rng.getrandbits(64) for _ in range(big - big // 4)]
        rng.shuffle(keys)  # a quarter shared with the others
        for i in range(0, len(keys), 16):
            index.store(wid, keys[i : i + 16])
    del pool
    gc.collect()

    cpu_ms: list[float] = []  # the same calls' CPU time: wall time less preemption

    def timed(fn: Callable[[], Any]) -> float:
        start, cpu = time.perf_counter(), time.process_time()
        fn()
        wall = (time.perf_counter() - start) * 1000
        cpu_ms.append((time.process_time() - cpu) * 1000)
        return wall

    gc.disable()  # the index's own work: a collection's pause is the memory child's figure
    match_ms = [timed(lambda c=c: index.match(c)) for c in chains[:200]]  # before
    clear_ms = timed(lambda: index.clear_worker("big"))
    sweep_ms: list[float] = []
    during_ms: list[float] = []
    sweep = getattr(index, "sweep", None)
    q = 0
    while sweep is not None and index.pending_sweep():
        sweep_ms.append(timed(sweep))
        chain = chains[q % len(chains)]
        during_ms.append(timed(lambda c=chain: index.match(c)))
        q += 1
    during_ms += [timed(lambda c=c: index.match(c)) for c in chains[:200]]
    out: dict[str, Any] = {
        "clear_ms": clear_ms,
        "sweep_steps": len(sweep_ms),
        "sweep_step_ms": quantiles(sweep_ms) if sweep_ms else None,
        "sweep_total_ms": sum(sweep_ms),
        "match_before_ms": quantiles(match_ms),
        "match_during_ms": quantiles(during_ms),
        "max_stall_ms": max([clear_ms, *sweep_ms, *during_ms]),
        "max_stall_cpu_ms": max(cpu_ms[len(match_ms) :]),
    }
    if sweep is not None:  # the same work at once, as the old clear did it
        out["all_at_once_ms"] = timed(lambda: (index.clear_worker("big2"), sweep(10**9)))
    gc.enable()
    return out


def child_decision(index_cls: Any, p: dict[str, Any]) -> dict[str, Any]:
    """match() of 512-block chains over 64 workers and 1M entries, the router's flow between."""
    rng = random.Random(4)
    n_workers, per_worker, chain_len = p["dec_workers"], p["dec_entries"] // p["dec_workers"], 512
    clock = [1000.0]
    index = index_cls(clock=lambda: clock[0])
    ids = [f"worker-{i:02d}" for i in range(n_workers)]
    for wid in ids:
        index.add_worker(wid)

    def fresh(n: int) -> list[int]:
        return [rng.getrandbits(64) for _ in range(n)]

    prefixes = [fresh(rng.randint(16, 384)) for _ in range(64)]
    popularity = [1 / (s + 1) for s in range(64)]
    holders: dict[str, list[int]] = {wid: [] for wid in ids}
    for s in range(64):
        for wid in rng.sample(ids, max(1, round(32 * popularity[s]))):
            holders[wid].append(s)
    conversations: list[tuple[list[int], list[str]]] = []  # chain, the workers holding it
    evictable: dict[str, deque[list[int]]] = {wid: deque() for wid in ids}

    def cache(wid: str, chain: list[int], own_from: int) -> None:
        index.store(wid, chain)
        evictable[wid].append(chain[own_from:])
        while evictable[wid] and index.num_blocks(wid) - len(evictable[wid][0]) >= per_worker:
            index.remove(wid, evictable[wid].popleft())

    for wid in ids:
        mine = holders[wid] or [rng.randrange(64)]
        while index.num_blocks(wid) < per_worker:
            prefix = prefixes[rng.choice(mine)]
            chain = prefix + fresh(chain_len - len(prefix))
            where = [wid]
            if rng.random() < 0.1:  # routed to a few workers over time
                where += rng.sample([x for x in ids if x != wid], rng.randint(1, 3))
            for x in where:
                cache(x, chain, len(prefix))
            conversations.append((chain, where))

    def query(q: int, last: list[int]) -> list[int]:
        kind = rng.random()
        if kind < 0.35:  # a new question on a shared prefix
            prefix = prefixes[rng.choices(range(64), popularity)[0]]
            return prefix + fresh(chain_len - len(prefix))
        if kind < 0.65:  # a follow-up of a cached conversation
            chain = rng.choice(conversations)[0]
            keep = rng.randint(448, 508)
            return chain[:keep] + fresh(chain_len - keep)
        if kind < 0.75 and last:  # the same prompt again (n > 1, a retry)
            return last
        return fresh(chain_len)  # cold

    match_ms, spec_ms, depth = [], [], []
    routed: deque[tuple[str, list[int], int]] = deque()
    last: list[int] = []
    gc.collect()
    gc.disable()  # as in child_stall
    for q in range(p["dec_queries"]):
        chain = query(q, last)
        start = time.perf_counter()
        matched = index.match(chain)
        mid = time.perf_counter()
        best = max(matched.values(), default=0)
        wid = rng.choice([w for w, d in matched.items() if d == best] if best else ids)
        index.speculate(wid, chain)
        end = time.perf_counter()
        match_ms.append((mid - start) * 1000)
        spec_ms.append((end - mid) * 1000)
        depth.append(best)
        routed.append((wid, chain, matched.get(wid, 0)))
        if len(routed) > 8:  # its events confirm it a little later; it evicts to make room
            w, c, had = routed.popleft()
            cache(w, c, had)
        clock[0] += 0.005
        last = chain
    gc.enable()
    return {
        "workers": n_workers,
        "entries": index.num_entries(),
        "queries": len(match_ms),
        "matched_blocks_mean": statistics.mean(depth),
        "full_chain_share": sum(1 for d in depth if d >= 448) / len(depth),
        "match_ms": quantiles(match_ms),
        "speculate_ms": quantiles(spec_ms),
    }


CHILDREN = {
    "memory": child_memory,
    "events": child_events,
    "stall": child_stall,
    "decision": child_decision,
}


def run_child(name: str, impl: str, params: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, ME, "--child", name, "--impl", impl, "--params", json.dumps(params)]
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{name} ({impl}) failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def baseline_file(rev: str, folder: str) -> str | None:
    """The baseline index's source at ``rev``, written to ``folder``; None without git."""
    try:
        source = subprocess.run(
            ["git", "show", f"{rev}:router/state/index.py"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"no baseline: git show {rev}:router/state/index.py failed ({e})", file=sys.stderr)
        return None
    path = os.path.join(folder, "index_baseline.py")
    Path(path).write_text(source)
    return path


# -- the table ---------------------------------------------------------------------------------


def fmt(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "-"
    if abs(x) >= 10_000:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def spread(xs: list[float] | None) -> str:
    return "-" if not xs else f"{min(xs):.2f}-{max(xs):.2f}"


def ratio(new: float | None, old: float | None) -> str:
    if new is None or old is None or old == 0:
        return "-"
    return f"{new / old:.2f}x"


def report(
    res: dict[str, Any], p: dict[str, Any], args: argparse.Namespace
) -> tuple[str, dict[str, Any]]:
    new, old = res["new"], res.get("old", {})

    def o(*keys: str) -> Any:
        x: Any = old
        for k in keys:
            if not isinstance(x, dict) or k not in x:
                return None
            x = x[k]
        return x

    mem, mem_s = new["memory_distinct"], new["memory_shared"]
    stall, dec, ev = new["stall"], new["decision"], new["events"]
    entries_goal = 100 * 500_000
    gib = mem["bytes_per_entry"] * entries_goal / 2**30
    stall_goal = "met" if stall["max_stall_ms"] <= GOAL_STALL_MS else "MISSED"
    dec_goal = "met" if dec["match_ms"]["p99"] <= GOAL_DECISION_P99_MS else "MISSED"
    big = f"{p['stall_big'] / 1e6:g}M"
    size = f"{p['mem_workers']} workers x {p['mem_blocks'] / 1000:g}k blocks"
    rows = [
        (
            f"bytes per (block, worker) entry, RSS, {size}, distinct blocks",
            fmt(mem["bytes_per_entry"]),
            fmt(o("memory_distinct", "bytes_per_entry")),
            ratio(mem["bytes_per_entry"], o("memory_distinct", "bytes_per_entry")),
            f"100 x 500k distinct: {gib:.1f} GiB",
        ),
        (
            "... half of each worker's blocks shared by its 8-worker group",
            fmt(mem_s["bytes_per_entry"]),
            fmt(o("memory_shared", "bytes_per_entry")),
            ratio(mem_s["bytes_per_entry"], o("memory_shared", "bytes_per_entry")),
            "-",
        ),
        (
            "longest single store() call in that build (dict rebuilds), ms: wall (CPU); "
            "calls over 5 ms of CPU",
            f"{fmt(mem['max_store_ms'], 2)} ({fmt(mem['max_store_cpu_ms'], 2)}); "
            f"{mem['stores_over_5ms_cpu']}",
            f"{fmt(o('memory_distinct', 'max_store_ms'), 2)} "
            f"({fmt(o('memory_distinct', 'max_store_cpu_ms'), 2)}); "
            f"{o('memory_distinct', 'stores_over_5ms_cpu')}",
            ratio(mem["max_store_ms"], o("memory_distinct", "max_store_ms")),
            f"<= {GOAL_STALL_MS:g} ms",
        ),
        (
            "a full garbage collection with that index in memory, ms",
            fmt(mem["gc_full_ms"]),
            fmt(o("memory_distinct", "gc_full_ms")),
            ratio(mem["gc_full_ms"], o("memory_distinct", "gc_full_ms")),
            "-",
        ),
        (
            f"apply(): blocks stored + removed per second ({p['ev_workers']} workers x "
            f"{p['ev_blocks'] / 1000:g}k blocks, median of 3)",
            fmt(ev["blocks_per_s"]),
            fmt(o("events", "blocks_per_s")),
            ratio(ev["blocks_per_s"], o("events", "blocks_per_s")),
            "-",
        ),
        (
            f"**clearing a worker with {big} blocks: longest index call on the request path, "
            f"ms: wall (CPU), median of {STALL_RUNS} runs; their range**",
            f"{fmt(stall['max_stall_ms'], 2)} ({fmt(stall['max_stall_cpu_ms'], 2)}); "
            f"runs {spread(stall['max_stall_ms_runs'])}",
            f"{fmt(o('stall', 'max_stall_ms'), 2)} ({fmt(o('stall', 'max_stall_cpu_ms'), 2)}); "
            f"runs {spread(o('stall', 'max_stall_ms_runs'))}",
            ratio(stall["max_stall_ms"], o("stall", "max_stall_ms")),
            f"<= {GOAL_STALL_MS:g} ms: {stall_goal}",
        ),
        (
            "... clear_worker() itself, ms",
            fmt(stall["clear_ms"], 3),
            fmt(o("stall", "clear_ms"), 1),
            ratio(stall["clear_ms"], o("stall", "clear_ms")),
            "-",
        ),
        (
            "... sweep() steps (default max_keys): count, p50 / max ms, total ms",
            f"{stall['sweep_steps']}, {fmt(stall['sweep_step_ms']['p50'], 2)} / "
            f"{fmt(stall['sweep_step_ms']['max'], 2)}, {fmt(stall['sweep_total_ms'])}",
            "-",
            "-",
            "-",
        ),
        (
            "... the same work at once (clear_worker + sweep(10**9)): the old cost, ms",
            fmt(stall["all_at_once_ms"]),
            fmt(o("stall", "clear_ms")),
            ratio(stall["all_at_once_ms"], o("stall", "clear_ms")),
            "-",
        ),
        (
            "... match() p99 while sweeps are pending / before the clear, ms",
            f"{fmt(stall['match_during_ms']['p99'], 3)} / "
            f"{fmt(stall['match_before_ms']['p99'], 3)}",
            f"{fmt(o('stall', 'match_during_ms', 'p99'), 3)} / "
            f"{fmt(o('stall', 'match_before_ms', 'p99'), 3)}",
            "-",
            "-",
        ),
        (
            f"**match() of a 512-block chain, {dec['workers']} workers, "
            f"{dec['entries'] / 1e6:.2f}M entries: p99, ms**",
            fmt(dec["match_ms"]["p99"], 3),
            fmt(o("decision", "match_ms", "p99"), 3),
            ratio(dec["match_ms"]["p99"], o("decision", "match_ms", "p99")),
            f"<= {GOAL_DECISION_P99_MS:g} ms: {dec_goal}",
        ),
        (
            "... p50 / max, ms",
            f"{fmt(dec['match_ms']['p50'], 3)} / {fmt(dec['match_ms']['max'], 3)}",
            f"{fmt(o('decision', 'match_ms', 'p50'), 3)} / "
            f"{fmt(o('decision', 'match_ms', 'max'), 3)}",
            ratio(dec["match_ms"]["p50"], o("decision", "match_ms", "p50")),
            "-",
        ),
        (
            "... speculate() after it: p50 / p99, ms",
            f"{fmt(dec['speculate_ms']['p50'], 3)} / {fmt(dec['speculate_ms']['p99'], 3)}",
            f"{fmt(o('decision', 'speculate_ms', 'p50'), 3)} / "
            f"{fmt(o('decision', 'speculate_ms', 'p99'), 3)}",
            ratio(dec["speculate_ms"]["p99"], o("decision", "speculate_ms", "p99")),
            "-",
        ),
    ]
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    today = dt.date.today().isoformat()
    lines = [
        f"# Block index ({machine}, {today}{', --quick' if args.quick else ''})",
        "",
        f"| figure | this tree | before ({BASELINE_REV}), same run | ratio | goal |",
        "|---|---:|---:|---:|---|",
        *(f"| {' | '.join(r)} |" for r in rows),
        "",
        f"Decision workload: {dec['queries']:,} prompts, {dec['matched_blocks_mean']:.0f} "
        f"blocks matched on average, {dec['full_chain_share']:.0%} matched 448 blocks or more.",
    ]
    table = "\n".join(lines)
    print(table)
    figures: dict[str, Any] = {
        "index_bytes_per_entry": mem["bytes_per_entry"],
        "index_bytes_per_entry_shared": mem_s["bytes_per_entry"],
        "event_apply_blocks_per_s": ev["blocks_per_s"],
        "index_max_stall_ms": stall["max_stall_ms"],
        "decision_p99_ms": dec["match_ms"]["p99"],
        "baseline": {
            "rev": BASELINE_REV,
            "index_bytes_per_entry": o("memory_distinct", "bytes_per_entry"),
            "index_bytes_per_entry_shared": o("memory_shared", "bytes_per_entry"),
            "event_apply_blocks_per_s": o("events", "blocks_per_s"),
            "index_max_stall_ms": o("stall", "max_stall_ms"),
            "decision_p99_ms": o("decision", "match_ms", "p99"),
        },
        "goals": {
            "index_max_stall": stall_goal == "met",
            "decision_p99": dec_goal == "met",
            "memory_gib_at_100x500k_distinct": round(gib, 2),
        },
        "details": res,
        "params": p,
        "machine": machine,
        "date": today,
        "quick": args.quick,
    }
    return table, figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="scaled-down sizes (under a minute)")
    ap.add_argument("--baseline-rev", default=BASELINE_REV, help="git revision of the baseline")
    ap.add_argument("--no-baseline", action="store_true", help="measure this tree's index only")
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--impl", default="new", help=argparse.SUPPRESS)
    ap.add_argument("--params", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        out = CHILDREN[args.child](load_index(args.impl), json.loads(args.params))
        print(json.dumps(out))
        return

    p = dict(QUICK if args.quick else FULL)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as folder:
        impls = {"new": "new"}
        if not args.no_baseline and (path := baseline_file(args.baseline_rev, folder)):
            impls["old"] = path
        res: dict[str, dict[str, Any]] = {name: {} for name in impls}
        jobs = [
            ("memory_distinct", "memory", {"case": "distinct"}),
            ("memory_shared", "memory", {"case": "shared"}),
            ("events", "events", {}),
            ("stall", "stall", {}),
            ("decision", "decision", {}),
        ]
        for key, child, extra in jobs:
            for name, impl in impls.items():
                t0 = time.monotonic()
                if child == "stall":  # a maximum: the median of 3 runs, and their spread
                    runs = [run_child(child, impl, {**p, **extra}) for _ in range(STALL_RUNS)]
                    runs.sort(key=lambda r: r["max_stall_ms"])
                    res[name][key] = {
                        **runs[len(runs) // 2],
                        "max_stall_ms_runs": [r["max_stall_ms"] for r in runs],
                    }
                else:
                    res[name][key] = run_child(child, impl, {**p, **extra})
                print(f"{key} ({name}): {time.monotonic() - t0:.0f} s", file=sys.stderr)
    table, figures = report(res, p, args)
    figures["run_time_s"] = round(time.monotonic() - started)
    print(f"\n{figures['run_time_s']} s in all", file=sys.stderr)
    if args.quick:
        print("(--quick: results not written)", file=sys.stderr)
    else:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "index.md").write_text(table + "\n")
        (RESULTS / "index.json").write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
