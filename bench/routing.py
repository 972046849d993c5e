"""Routing quality: kvpool's default policy beside the cache-blind baselines, a cache-only
policy and the SGLang router, on the same simulated workers in the same run.

Eight simulated workers (``kvpool worker sim-fleet`` in two processes: the real scheduler,
block pool and prefix cache, with the 8B-on-H100 timing model slowed ``--time-scale`` (8)
times, so that the workers' time and not this 2-core machine's makes the latencies) serve
every workload through each router in turn:

* ``kvpool`` (the default, session affinity on), ``round-robin``, ``least-loaded``,
  ``prefix-only``: ``kvpool router serve --policy ...``; ``kvpool-no-affinity``: the
  default with ``--affinity-weight 0`` (only when named: ``--affinity``, ``--policies``);
* today's peer routers, each with the settings its project recommends for prefix reuse
  (:data:`PEERS`): ``sglang-router``, ``python -m sglang_router.launch_router --policy
  cache_aware`` (sglang-router 0.3.2, January 2026); ``smg``, its successor the Shepherd
  Model Gateway 1.13, ``smg launch --policy cache_aware`` (over HTTP workers it keeps a
  prefix tree of the texts it routed); ``vllm-router``, vLLM's router 0.1.17, ``--policy
  kv_aware`` fed every worker's KV events and replay socket (``--kv-event-source``,
  ``--kv-event-replay-source``; it reads only the map encoding, which the fleet publishes
  for every router: kvpool's reads both) and asking the workers' ``/tokenize``.

Every router talks to the workers directly (SGLang's router adds fields of its own to
every body, ``no_stop_trim``, ``return_hidden_states`` and others, which kvpool workers
accept with the values it sends). Requests are streamed ``/v1/completions`` with a text
prompt, for every policy: the SGLang router's cache-aware policy keys on the prompt text,
and a prompt string is exactly what both routers see. Before every run the workers' prefix
caches are emptied and the router is started afresh; the runs of one workload and rate
follow each other. A run starts once the router's ``/health`` says every worker is up,
which for kvpool's router means its index has replayed the workers' KV event history
(their replay buffers grow with every run: applied during a run, it slowed its first
seconds).

Prompts are made of words that are one token each in the model's tokenizer, so n words are
n tokens, and every workload is deterministic. Arrivals are Poisson at the rate asked for;
``--duration`` (12 s) of them per run.

* ``groups``: 32 groups, each with a system prompt of its own (1,000-3,000 tokens), a short
  question (20-150 tokens) after it; the group is drawn uniformly for each request.
* ``multi-turn``: conversations whose every turn is the previous prompt + the answer + a new
  question (16-256 tokens), opening with 1,000-3,000 tokens (a document, a long context).
  Arrival i is the next turn of conversation slot i mod C, C = rate x 3 s (each
  conversation asks about every 3 s); a turn waits for its conversation's previous answer;
  a conversation of 2-6 turns that has had its last is replaced by a new one. The answer in
  the transcript is a stand-in text as long as the generated one, so that the workload does
  not depend on what a worker generated (with the real answer, a little more would hit).
  Every turn carries the header ``x-session-id: <the conversation's id>``, by which
  kvpool's router keeps a conversation on the worker its last turn went to (a soft
  ``affinity`` score; the other routers ignore the header).
* ``mooncake``: the Mooncake synthetic trace (``bench/data``, 3,993 requests over 17 min,
  lengths in tokens, ``hash_ids`` over 512-token blocks), rescaled to fit 8 workers and a
  few seconds: (1) the requests of one prefix tree in 24 (first hash id divisible by 24):
  193 requests, keeping every prefix they share, an unlimited cache would hit 66% of their
  tokens (the whole trace: 65%); (2) every length divided by 8: a hash id becomes 64 tokens
  of text fixed by the id (equal ids, equal text), the last, partial block its share of
  the rest, outputs output_length / 8 (at least 1), which keeps a request's prefill and
  decode time in about the full-size trace's proportion on the timing model (prefill 45% of
  decode, full size 40%); prompts average 1,770 tokens (the longest 8,350); (3) the
  trace's arrival times
  compressed so that the sample's mean rate is the rate asked for (the run's length
  follows: 193 / rate seconds).
* ``one-system-prompt``: every request starts with the same 2,000-token system prompt,
  then a user part of 100-800 tokens, one in ten a long document of 2,000-4,000.
* ``agentic``: agent sessions sharing a 1,500-token system prompt with tool schemas, each
  a task (1,000-3,000 tokens) then 4-10 steps appending the last action and a tool result
  (50-400 tokens) to one growing context; three steps in ten, after the first, are a burst
  of 2-4 requests on that context sent together (:func:`agentic`). Every request of a
  session carries its ``x-session-id``.

Beside every hit ratio, its share of the bound: the most any router could hit on the same
requests, offline (:func:`hit_bounds`: one cache of the fleet's capacity with optimal
eviction, and an unlimited one).

Reported per workload x policy x rate: the token-weighted prefix hit ratio measured at the
workers (``vllm:prefix_cache_hits`` over ``vllm:prefix_cache_queries``, deltas over the
run), TTFT p50/p90/p99 at the client (from sending a request to its first text chunk),
output throughput (generated tokens of completed requests over the run's wall time), and
load imbalance, max/mean busy time over the workers. The workers export no busy time, so
it is sampled from their own gauges: a worker is busy while ``vllm:num_requests_running``
+ ``vllm:num_requests_waiting`` > 0, read every 0.25 s. The JSON has more per run: errors,
requests and prefill tokens per worker, CPU cores per process, kvpool's decisions by
reason, and the client's TTFT less the workers' own (what the router and HTTP add).
Writes ``bench/results/routing.{md,json,png}`` (TTFT p90 against rate).

``--affinity`` measures session affinity alone: only ``multi-turn``, through ``kvpool``,
``kvpool-no-affinity`` and ``sglang-router``, at the same rates (``--rates``, ``--quick``
apply), written to ``bench/results/affinity.{md,json,png}`` in the same nesting and row
format (workload, policy, rate), with a table of affinity on against off; routing.* are
left as they are.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import heapq
import itertools
import json
import math
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TRACE = HERE / "data" / "mooncake_synthetic_trace.jsonl"
KVPOOL = [sys.executable, "-c", "import sys; from kvpool.cli import main; sys.exit(main())"]
ENV = {**os.environ, "PYTHONSAFEPATH": "1"}  # never import the repository's operator/
#: kvpool's policies by their name here: the ``kvpool router serve`` flags that make each
KVPOOL_POLICIES: dict[str, tuple[str, ...]] = {
    "kvpool": ("--policy", "kvpool"),  # the default, session affinity on (weight 0.3)
    "round-robin": ("--policy", "round-robin"),
    "least-loaded": ("--policy", "least-loaded"),
    "prefix-only": ("--policy", "prefix-only"),
    "kvpool-no-affinity": ("--policy", "kvpool", "--affinity-weight", "0"),
}
#: two kvpool routers (the default policy) in front of the same workers, each sent every
#: other request, as a Service in front of a two-replica router Deployment would; they
#: share their load and speculative entries (router/state/peers.py: --peer-bind, --peer)
REPLICAS = "kvpool-2-replicas"
#: today's peer routers (see the module's text for how each is started)
PEERS = ("sglang-router", "smg", "vllm-router")
POLICIES = (*KVPOOL_POLICIES, *PEERS, REPLICAS)
#: what a run without ``--policies`` compares (kvpool-no-affinity only in ``--affinity``)
DEFAULT_POLICIES = ("kvpool", "round-robin", "least-loaded", "prefix-only", *PEERS)
#: ``--affinity``: session affinity on and off, beside the SGLang router, on the workload
#: made of conversations
AFFINITY_WORKLOAD = "multi-turn"
AFFINITY_POLICIES = ("kvpool", "kvpool-no-affinity", "sglang-router")
#: ``--ingress``: kvpool as a user starts it, beside the SGLang router
INGRESS_POLICIES = ("kvpool", "sglang-router")
#: ``--replicas``: the workloads (at their two highest rates) and what is compared
REPLICA_WORKLOADS = ("groups", "one-system-prompt")
REPLICA_POLICIES = ("kvpool", REPLICAS, "sglang-router")
GOAL_REPLICAS = 0.10  # two replicas' TTFT p90 and hit ratio within this of one router's
#: the header kvpool's router reads a conversation's id from (``--session-header``'s default)
SESSION_HEADER = "x-session-id"

#: request rates (req/s) per workload: from light load to where the cache-blind baselines
#: saturate (at 32 req/s their TTFT p90 is several times what it is at 8, and grows through
#: the run). Higher rates would measure this machine more than the policies: the workers'
#: simulation, the client and the router share its two cores.
RATES: dict[str, tuple[float, ...]] = {
    "groups": (8.0, 16.0, 24.0, 32.0),
    "multi-turn": (8.0, 16.0, 24.0, 32.0),
    "mooncake": (8.0, 16.0, 24.0, 32.0),
    "one-system-prompt": (8.0, 16.0, 24.0, 32.0),
    "agentic": (8.0, 16.0, 24.0, 32.0),
}
#: what the issues ask of kvpool's default policy: a TTFT p90 this many times lower than the
#: best peer router's (:data:`PEERS`, the lowest p90 of those in the run) at the two highest
#: rates, and a hit ratio at least the best peer's there; and a hit ratio of at least this
#: share of the bound (hit_bounds) at every rate
GOAL_VS_PEERS = dict.fromkeys(
    ("groups", "multi-turn", "mooncake", "one-system-prompt", "agentic"), 1.3
)
GOAL_SHARE_OF_BOUND = 0.95
#: run-to-run spread of one configuration on this machine (bench/README.md): differences
#: within it are not told apart by one run
NOISE_TTFT = 0.10  # relative
NOISE_HIT = 0.02  # absolute
BUSY_INTERVAL_S = 0.25

# -- prompts ---------------------------------------------------------------------------------


class Words:
    """Text whose token count is known: words that are one token each (with their leading
    space) in the model's tokenizer, so ``n`` words are ``n`` tokens and texts concatenate
    without merging across words (a byte-level BPE never merges across a space)."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        words = []
        for piece, token in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
            word = " " + piece[1:]
            if piece.startswith("\u0120") and piece[1:].isalpha() and len(piece) > 2:
                if tok.encode(word, add_special_tokens=False).ids == [token]:
                    words.append(word)
        if len(words) < 32:
            raise SystemExit(f"{model_dir}: only {len(words)} one-token words in the tokenizer")
        self.words = words
        self.tokenizer = tok

    def text(self, key: str, n: int) -> str:
        """``n`` tokens of text fixed by ``key`` (a shorter text is a prefix of a longer)."""
        return "".join(random.Random(key).choices(self.words, k=n))

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)


@dataclass(frozen=True)
class Session:
    """One conversation: turn k is due at ``at[k]`` seconds into the run, and is sent then
    or when the answer to turn k-1 has ended, whichever is later. A single-turn session is
    one open-loop request."""

    at: tuple[float, ...]
    prompts: tuple[str, ...]
    max_tokens: tuple[int, ...]
    #: the conversation's id, sent with its every turn (a multi-turn session's only)
    session_id: str | None = None
    #: per turn, sibling requests (prompt, max_tokens) sent at the same moment as the turn
    #: (an agent's parallel tool calls on one context); the next turn waits for them all
    fanout: tuple[tuple[tuple[str, int], ...], ...] = ()

    def requests(self) -> list[tuple[float, str]]:
        """(due time, prompt) of its every request, siblings included."""
        out = []
        for k, (at, prompt) in enumerate(zip(self.at, self.prompts, strict=True)):
            out.append((at, prompt))
            out.extend((at, sibling) for sibling, _ in self.turn_siblings(k))
        return out

    def turn_siblings(self, k: int) -> tuple[tuple[str, int], ...]:
        return self.fanout[k] if k < len(self.fanout) else ()

    def headers(self) -> dict[str, str]:
        """What each of its requests carries besides the body: the session header, which
        kvpool's router keeps a conversation on its worker by (other routers ignore it)."""
        return {SESSION_HEADER: self.session_id} if self.session_id is not None else {}


def _arrivals(key: str, rate: float, n: int) -> list[float]:
    rng = random.Random(key)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def groups(words: Words, rate: float, duration: float) -> list[Session]:
    n = max(1, round(rate * duration))
    rng = random.Random("groups")
    systems = [
        words.text(f"group{g}", random.Random(f"group-length{g}").randint(1000, 3000))
        for g in range(GROUPS)
    ]
    out = []
    for i, at in enumerate(_arrivals("groups-arrivals", rate, n)):
        system = systems[rng.randrange(len(systems))]
        question = words.text(f"groups-question{i}", rng.randint(20, 150))
        out.append(Session((at,), (system + question,), (rng.randint(8, 48),)))
    return out


def one_system_prompt(words: Words, rate: float, duration: float) -> list[Session]:
    n = max(1, round(rate * duration))
    rng = random.Random("one-system-prompt")
    system = words.text("system", 2000)
    out = []
    for i, at in enumerate(_arrivals("one-system-prompt-arrivals", rate, n)):
        length = rng.randint(2000, 4000) if rng.random() < 1 / 10 else rng.randint(100, 800)
        question = words.text(f"osp-question{i}", length)
        out.append(Session((at,), (system + question,), (rng.randint(8, 48),)))
    return out


GROUPS = 32
TURN_PERIOD_S = 3.0  # a conversation asks its next question about this often


def multi_turn(words: Words, rate: float, duration: float) -> list[Session]:
    """Open-loop arrivals at ``rate``; arrival i is the next turn of conversation slot
    i mod C, with C = rate x TURN_PERIOD_S slots, so each conversation asks about every
    3 s. A conversation of 2-6 turns that has had its last is replaced by a new one."""
    n = max(1, round(rate * duration))
    slots = max(1, round(rate * TURN_PERIOD_S))
    arrivals = _arrivals("multi-turn-arrivals", rate, n)
    rng = random.Random("multi-turn")
    out: list[Session] = []
    for slot in range(slots):
        times = arrivals[slot::slots]
        while times:
            s = len(out)
            turns = min(rng.randint(2, 6), len(times))
            prompts, max_tokens = [], []
            prompt = words.text(f"mt{s}-opening", rng.randint(1000, 3000))
            for k in range(turns):
                if k:
                    answer = words.text(f"mt{s}-answer{k - 1}", max_tokens[-1])
                    prompt += answer + words.text(f"mt{s}-question{k}", rng.randint(16, 256))
                prompts.append(prompt)
                max_tokens.append(rng.randint(8, 48))
            session = Session(tuple(times[:turns]), tuple(prompts), tuple(max_tokens), f"mt{s}")
            out.append(session)
            times = times[turns:]
    return sorted(out, key=lambda x: x.at[0])


AGENT_PERIOD_S = 2.0  # an agent takes its next step about this often
AGENT_TOOLS_TOKENS = 1500  # the agent's system prompt and tool schemas, shared by all


def agentic(words: Words, rate: float, duration: float) -> list[Session]:
    """Agent sessions: a shared system prompt with tool schemas, a task (1,000-3,000
    tokens), then 4-10 steps, each appending the agent's last action (the answer's length)
    and a short tool result (50-400 tokens) to the growing context. Three steps in ten
    (after the first) are a burst of 2-4 parallel requests on the same context: the step
    itself and siblings that each add a short sub-task (20-80 tokens), sent at the same
    moment. Arrival i is the next request of session slot i mod C, C = rate x 2 s (a burst
    takes as many arrivals as it sends); a step waits for the previous one's answers."""
    n = max(1, round(rate * duration))
    slots = max(1, round(rate * AGENT_PERIOD_S))
    arrivals = _arrivals("agentic-arrivals", rate, n)
    rng = random.Random("agentic")
    tools = words.text("agent-tools", AGENT_TOOLS_TOKENS)
    out: list[Session] = []
    for slot in range(slots):
        times = arrivals[slot::slots]
        while times:
            s = len(out)
            context = tools + words.text(f"ag{s}-task", rng.randint(1000, 3000))
            steps = rng.randint(4, 10)
            at: list[float] = []
            prompts: list[str] = []
            max_tokens: list[int] = []
            fanout: list[tuple[tuple[str, int], ...]] = []
            while times and len(at) < steps:
                k = len(at)
                burst = rng.randint(2, 4) if k and rng.random() < 0.3 else 1
                burst = min(burst, len(times))
                at.append(times[0])
                times = times[burst:]
                if k:
                    context += words.text(f"ag{s}-action{k - 1}", max_tokens[-1])
                    context += words.text(f"ag{s}-tool{k - 1}", rng.randint(50, 400))
                prompts.append(context)
                max_tokens.append(rng.randint(8, 32))
                fanout.append(
                    tuple(
                        (context + words.text(f"ag{s}-sub{k}-{j}", rng.randint(20, 80)),
                         rng.randint(8, 32))
                        for j in range(burst - 1)
                    )
                )  # fmt: skip
            out.append(
                Session(tuple(at), tuple(prompts), tuple(max_tokens), f"ag{s}", tuple(fanout))
            )
    return sorted(out, key=lambda x: x.at[0])


MOONCAKE_BLOCK = 512  # tokens per hash id in the trace
MOONCAKE_SCALE = 8  # every length divided by this
MOONCAKE_SAMPLE = 24  # keep the prefix trees whose first id is divisible by this


def mooncake_rows(path: Path = TRACE) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["hash_ids"] and r["hash_ids"][0] % MOONCAKE_SAMPLE == 0]


def mooncake(words: Words, rate: float, duration: float) -> list[Session]:
    """The rescaled trace sample (its length is fixed: ``duration`` is not used)."""
    rows = mooncake_rows()
    t0 = rows[0]["timestamp"]
    span_s = (rows[-1]["timestamp"] - t0) / 1000
    stretch = (len(rows) / span_s) / rate  # seconds of run per second of trace
    tokens = MOONCAKE_BLOCK // MOONCAKE_SCALE
    out = []
    for r in rows:
        ids = r["hash_ids"]
        head = "".join(words.text(f"mooncake{h}", tokens) for h in ids[:-1])
        rest = -(-(r["input_length"] - MOONCAKE_BLOCK * (len(ids) - 1)) // MOONCAKE_SCALE)
        prompt = head + words.text(f"mooncake{ids[-1]}", max(1, rest))
        at = (r["timestamp"] - t0) / 1000 * stretch
        out.append(Session((at,), (prompt,), (max(1, round(r["output_length"] / MOONCAKE_SCALE)),)))
    return out


WORKLOADS: dict[str, Callable[[Words, float, float], list[Session]]] = {
    "groups": groups,
    "multi-turn": multi_turn,
    "mooncake": mooncake,
    "one-system-prompt": one_system_prompt,
    "agentic": agentic,
}


def hit_bounds(words: Words, sessions: list[Session], capacity: int, block: int = 16) -> dict:
    """The most any router could hit on these requests, computed offline (the workers, like
    vLLM, never count a prompt's last token as a hit; a block hits only after every block
    before it):

    * ``unlimited``: one cache that saw every request, in order, and never evicts;
    * ``pooled``: one cache of the fleet's capacity (``capacity`` blocks, every worker's
      together) with optimal eviction (Belady's: the block used again furthest in the
      future goes first). No placement over the workers can hit more: a block a router
      puts on two workers takes two places, and the workers' own eviction is not optimal.
    """
    requests = sorted(r for s in sessions for r in s.requests())
    chains: list[list[int]] = []
    lengths: list[int] = []
    for _, prompt in requests:
        ids = words.tokenizer.encode(prompt, add_special_tokens=False).ids
        keys, h = [], 0
        for i in range(len(ids) // block):
            h = hash((h, *ids[i * block : (i + 1) * block]))
            keys.append(h)
        chains.append(keys)
        lengths.append(len(ids))
    total = sum(lengths)

    def hits(held: Callable[[int], bool], keys: list[int], length: int) -> int:
        matched = 0
        for key in keys:
            if not held(key):
                break
            matched += 1
        return min(matched * block, length - 1)

    seen: set[int] = set()
    unlimited = 0
    for keys, length in zip(chains, lengths, strict=True):
        unlimited += hits(seen.__contains__, keys, length)
        seen.update(keys)
    # Belady: every key's uses, in request order; evict the one whose next use is furthest
    uses: dict[int, list[int]] = {}
    for i, keys in enumerate(chains):
        for key in keys:
            uses.setdefault(key, []).append(i)
    at = dict.fromkeys(uses, 0)  # each key's next entry in its uses
    never = len(chains)
    cache: set[int] = set()
    heap: list[tuple[int, int]] = []  # (-next use, key); stale entries are skipped

    def next_use(key: int) -> int:
        k = at[key]
        return uses[key][k] if k < len(uses[key]) else never

    pooled = 0
    for keys, length in zip(chains, lengths, strict=True):
        pooled += hits(cache.__contains__, keys, length)
        for key in keys:
            at[key] += 1
            cache.add(key)
            heapq.heappush(heap, (-next_use(key), key))
        while len(cache) > capacity:
            negative, key = heapq.heappop(heap)
            if key in cache and next_use(key) == -negative:
                cache.remove(key)
    return {
        "unlimited": unlimited / total if total else 0.0,
        "pooled": pooled / total if total else 0.0,
        "capacity_blocks": capacity,
    }


# -- processes -------------------------------------------------------------------------------


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports free to listen on, below Linux's ephemeral
    range (32768-60999), which the clients' thousands of short connections keep crowded."""
    import socket

    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32768 - count)
        for port in range(base, base + count):
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    break
        else:
            return base
    raise SystemExit(f"found no {count} consecutive free ports")


def stop(proc: subprocess.Popen[bytes]) -> None:
    from kvpool.stack import stop_process

    stop_process(proc, timeout=15)


def get_json(url: str, timeout: float = 2.0) -> Any:
    import httpx

    try:
        r = httpx.get(url, timeout=timeout)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    with contextlib.suppress(ValueError):
        return r.json()
    return None


def wait_until(check: Callable[[], bool], proc: subprocess.Popen[bytes], what: str, log: Path,
               timeout: float = 120) -> None:  # fmt: skip
    """kvpool.stack's wait, ending the benchmark with the process's log when it fails."""
    from kvpool.stack import StackError, wait_until

    try:
        wait_until(check, proc, what, timeout)
    except StackError as exc:
        raise SystemExit(f"{exc}:\n{tail(log)}") from None


def tail(log: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass
class Fleet:
    workers: list[str]
    procs: list[subprocess.Popen[bytes]]
    #: each worker's KV event publisher and replay socket (``tcp://127.0.0.1:PORT``)
    events: list[str] = field(default_factory=list)
    replays: list[str] = field(default_factory=list)
    block_size: int = 16


def start_fleet(args: argparse.Namespace, model: Path, tmp: Path) -> Fleet:
    n = args.workers
    base = free_ports(3 * n)  # one range for the HTTP, event and replay ports (events + n)
    events = base + n
    argv = [*KVPOOL, "worker", "sim-fleet", "--model", str(model), "--count", str(n)]
    argv += ["--base-port", str(base), "--kv-events-base-port", str(events)]
    argv += ["--processes", str(args.fleet_processes), "--max-model-len", "65536"]
    argv += ["--sim-time-scale", str(args.time_scale), "--max-waiting-tokens", "10000000"]
    argv += ["--kv-events-encoding", "map"]  # the one vllm-router reads; kvpool's reads both
    log = tmp / "fleet.log"
    fleet = subprocess.Popen(argv, env=ENV, stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    workers = [f"http://127.0.0.1:{base + i}" for i in range(n)]
    for w in workers:
        wait_until(lambda w=w: get_json(w + "/health") is not None, fleet, "the fleet", log)
    from kvpool.hashing import DEFAULT_BLOCK_SIZE

    return Fleet(
        workers,
        [fleet],
        [f"tcp://127.0.0.1:{events + i}" for i in range(n)],
        [f"tcp://127.0.0.1:{events + n + i}" for i in range(n)],  # sim-fleet's replay default
        DEFAULT_BLOCK_SIZE,
    )


def cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system) of these processes and all their descendants (Linux)."""
    ticks = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent, seconds)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks)
    total, todo = 0.0, list(pids)
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0.0))[1]
        todo += [child for child, (parent, _) in stats.items() if parent == pid]
    return total


def reset_caches(workers: list[str]) -> None:
    import httpx

    for w in workers:
        deadline = time.monotonic() + 60
        while True:
            r = httpx.post(w + "/reset_prefix_cache", timeout=10)
            if r.status_code == 200:
                break
            if r.status_code != 409 or time.monotonic() > deadline:  # 409: still busy
                raise SystemExit(f"{w}: cannot reset the prefix cache: {r.status_code} {r.text}")
            time.sleep(0.2)


def kvpool_router_argv(
    policy: str, model: Path, port: int, workers: list[str], extra: list[str]
) -> list[str]:
    """``kvpool router serve`` for one of :data:`KVPOOL_POLICIES`; the policy's own flags
    come after ``extra``, so that a variant stays what its name says (the last flag wins)."""
    # kvpool's defaults: the load generator is one address standing for every user, as an
    # ingress in front of the router is
    argv = [*KVPOOL, "router", "serve", "--model", str(model), "--port", str(port)]
    argv += [*extra, *KVPOOL_POLICIES[policy]]
    for w in workers:
        argv += ["--worker", w]
    return argv


def start_router(
    policy: str, model: Path, fleet: Fleet, tmp: Path, extra: list[str]
) -> tuple[list[Any], list[str]]:
    """The router(s) for ``policy``, their workers all up; ``extra``: more ``kvpool router
    serve`` flags (trials of policy settings). Two for :data:`REPLICAS`."""
    if policy == REPLICAS:  # each binds its peer port and subscribes to the other's
        base = free_ports(2)
        peers = [f"tcp://127.0.0.1:{base + i}" for i in range(2)]
        routers = [
            start_one_router(
                "kvpool", model, fleet, tmp, [*extra, "--peer-bind", me, "--peer", other], i
            )
            for i, (me, other) in enumerate([(peers[0], peers[1]), (peers[1], peers[0])])
        ]
        return [r[0] for r in routers], [r[1] for r in routers]
    proc, url = start_one_router(policy, model, fleet, tmp, extra)
    return [proc], [url]


def start_one_router(
    policy: str, model: Path, fleet: Fleet, tmp: Path, extra: list[str], replica: int = 0
) -> tuple[Any, str]:
    port = free_ports(2)  # the router's, and the SGLang router's metrics port
    url = f"http://127.0.0.1:{port}"
    log = tmp / f"router-{policy}-{replica}.log"
    n = len(fleet.workers)
    if policy in PEERS:
        argv, ready = peer_router(policy, port, fleet, model.name)
    else:
        argv = kvpool_router_argv(policy, model, port, fleet.workers, extra)

        def ready() -> bool:
            health = get_json(url + "/health")
            return isinstance(health, dict) and health.get("workers_up", 0) == n

    proc = subprocess.Popen(argv, env=ENV, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    wait_until(ready, proc, f"the {policy} router", log, timeout=60)
    return proc, url


def peer_router(
    name: str, port: int, fleet: Fleet, model: str
) -> tuple[list[str], Callable[[], bool]]:
    """The command line of one of :data:`PEERS` in front of ``fleet`` on ``port`` (and its
    metrics on ``port + 1``), and when it is ready: every worker healthy (SGLang's routers
    list them), or an answer through it (vLLM's router, once its event streams are up)."""
    url = f"http://127.0.0.1:{port}"
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if name == "sglang-router":
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--policy", "cache_aware"]
        argv += [*host, "--log-level", "warn", "--prometheus-port", str(port + 1)]
    elif name == "smg":
        # its module, not the `smg` script, which sglang-router 0.3.2 installs too
        argv = [sys.executable, "-c", "import sys; from smg.cli import main; sys.exit(main())"]
        argv += ["launch", "--policy", "cache_aware", *host, "--log-level", "warn"]
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(port + 1)]
    elif name == "vllm-router":
        argv = [sys.executable, "-m", "vllm_router.launch_router", "--policy", "kv_aware"]
        argv += [*host, "--log-level", "warning"]  # it takes no "warn"
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(port + 1)]
        argv += ["--kv-event-block-size", str(fleet.block_size), "--kv-event-model", model]
        if fleet.events:  # workers that publish none: it routes without them
            for worker, events in zip(fleet.workers, fleet.events, strict=True):
                argv += ["--kv-event-source", f"{worker}={events}"]
            for worker, replay in zip(fleet.workers, fleet.replays, strict=False):
                argv += ["--kv-event-replay-source", f"{worker}={replay}"]
    else:
        raise ValueError(f"{name!r} is not one of the peer routers {PEERS}")
    argv += ["--worker-urls", *fleet.workers]

    def listed() -> bool:
        listing = get_json(url + "/workers")
        if not isinstance(listing, dict):
            return False
        up = [w for w in listing.get("workers", []) if w.get("is_healthy")]
        return len(up) == len(fleet.workers)

    def answers() -> bool:
        import httpx

        try:
            body = {"model": model, "prompt": "ready", "max_tokens": 1}
            return httpx.post(url + "/v1/completions", json=body, timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    return argv, answers if name == "vllm-router" else listed


# -- one run ---------------------------------------------------------------------------------

_SAMPLE = re.compile(rb"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? ([-+0-9.eEinfNa]+)", re.M)
COUNTERS = (
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
)


def parse_metrics(text: bytes) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, value in _SAMPLE.findall(text):
        key = name.decode()
        out[key] = out.get(key, 0.0) + float(value)
    return out


async def scrape(http: Any, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as r:
        return parse_metrics(await r.read())


async def drive(urls: list[str], model: str, sessions: list[Session], workers: list[str]) -> dict:
    """Replay the sessions against ``urls`` (each request to the next in turn); sample the
    workers' busy gauges meanwhile."""
    import aiohttp

    loop = asyncio.get_running_loop()
    turns = itertools.count()
    records: list[tuple[float | None, int, float]] = []  # (ttft, output tokens, end)
    errors: list[str] = []
    refused = 0  # answered 429 or 503: the router (or a worker) would not take it
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=900)
    async with (
        aiohttp.ClientSession(connector=connector, timeout=timeout) as http,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as metrics_http,
    ):
        before = await asyncio.gather(*(scrape(metrics_http, w) for w in workers))
        done = asyncio.Event()
        busy = [0.0] * len(workers)

        async def sample() -> None:
            last = loop.time()
            while not done.is_set():
                gauges = await asyncio.gather(*(scrape(metrics_http, w) for w in workers))
                now = loop.time()
                for i, g in enumerate(gauges):
                    load = g.get("vllm:num_requests_running", 0) + g.get(
                        "vllm:num_requests_waiting", 0
                    )
                    if load > 0:
                        busy[i] += now - last
                last = now
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), BUSY_INTERVAL_S)

        async def one(prompt: str, max_tokens: int, headers: dict[str, str]) -> bool:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "stream": True,
                "ignore_eos": True,
            }
            sent = loop.time()
            first = None
            finished = False
            url = urls[next(turns) % len(urls)]
            nonlocal refused
            try:
                async with http.post(url + "/v1/completions", json=body, headers=headers) as resp:
                    refused += resp.status in (429, 503)
                    if resp.status != 200:
                        errors.append(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                        return False
                    async for line in resp.content:
                        if not line.startswith(b"data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            errors.append(f"stream error: {chunk['error']}")
                            return False
                        for choice in chunk.get("choices") or ():
                            if first is None and choice.get("text"):
                                first = loop.time() - sent
                            if choice.get("finish_reason"):
                                finished = True
            except (aiohttp.ClientError, TimeoutError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                return False
            if not finished or first is None:
                errors.append("the stream ended without a finish reason")
                return False
            records.append((first, max_tokens, loop.time()))
            return True

        async def session(s: Session, t0: float) -> None:
            turns = zip(s.at, s.prompts, s.max_tokens, strict=True)
            for k, (at, prompt, max_tokens) in enumerate(turns):
                await asyncio.sleep(max(0.0, t0 + at - loop.time()))
                sent = [(prompt, max_tokens), *s.turn_siblings(k)]
                answers = await asyncio.gather(*(one(p, m, s.headers()) for p, m in sent))
                if not all(answers):
                    return  # a failed turn ends the conversation

        t0 = loop.time()
        sampler = asyncio.create_task(sample())
        await asyncio.gather(*(session(s, t0) for s in sessions))
        elapsed = loop.time() - t0
        done.set()
        await sampler
        after = await asyncio.gather(*(scrape(metrics_http, w) for w in workers))

    def delta(name: str, i: int) -> float:
        return after[i].get(name, 0.0) - before[i].get(name, 0.0)

    n = len(workers)
    hits = sum(delta("vllm:prefix_cache_hits_total", i) for i in range(n))
    queries = sum(delta("vllm:prefix_cache_queries_total", i) for i in range(n))
    requests = [delta("vllm:request_success_total", i) for i in range(n)]
    computed = [
        delta("vllm:prompt_tokens_total", i) - delta("vllm:prefix_cache_hits_total", i)
        for i in range(n)
    ]
    worker_ttft = sum(delta("vllm:time_to_first_token_seconds_sum", i) for i in range(n))
    worker_count = sum(delta("vllm:time_to_first_token_seconds_count", i) for i in range(n))
    ttfts = sorted(r[0] for r in records if r[0] is not None)

    def q(p: float) -> float:
        return ttfts[max(0, math.ceil(p * len(ttfts)) - 1)] if ttfts else float("nan")

    def max_over_mean(xs: list[float]) -> float:
        mean = sum(xs) / len(xs) if xs else 0.0
        return max(xs) / mean if mean > 0 else float("nan")

    total = sum(len(s.requests()) for s in sessions)
    return {
        "hit_ratio": hits / queries if queries else 0.0,
        "ttft_p50": q(0.50),
        "ttft_p90": q(0.90),
        "ttft_p99": q(0.99),
        "throughput": sum(r[1] for r in records) / elapsed,
        "imbalance": max_over_mean(busy),
        # -- more, for the curious
        "requests": total,
        "completed": len(records),
        "errors": total - len(records),  # failed, and turns never sent after a failure
        "refused": refused,
        "first_errors": errors[:3],
        "seconds": elapsed,
        "requests_per_s": len(records) / elapsed,
        "busy_s": busy,
        "requests_per_worker": requests,
        "computed_prompt_tokens_per_worker": computed,
        "imbalance_requests": max_over_mean(requests),
        "imbalance_computed_tokens": max_over_mean(computed),
        # client TTFT - worker TTFT (arrival at the worker to its first output): the
        # router, HTTP and the client, as a share of what the client saw
        "path_overhead_ms": (
            (sum(ttfts) / len(ttfts) - worker_ttft / worker_count) * 1000
            if ttfts and worker_count
            else float("nan")
        ),
    }


_DECISION = re.compile(r"^kvpool_router_routing_decisions_total\{([^}]*)\} ([0-9.e+]+)", re.M)


def router_decisions(url: str) -> dict[str, float]:
    """kvpool's routing decisions by reason (prefix, spill, ttft, ...), over the run."""
    import httpx

    out: dict[str, float] = {}
    with contextlib.suppress(httpx.HTTPError):
        for labels, value in _DECISION.findall(httpx.get(url + "/metrics", timeout=10).text):
            reason = re.search(r'reason="([^"]*)"', labels)
            key = reason.group(1) if reason else "?"
            out[key] = out.get(key, 0.0) + float(value)
    return out


def run_one(
    policy: str, sessions: list[Session], model: Path, fleet: Fleet, tmp: Path, extra: list[str]
) -> dict:
    reset_caches(fleet.workers)
    routers, urls = start_router(policy, model, fleet, tmp, extra)
    try:
        run = asyncio.run
        with contextlib.suppress(ImportError):
            import uvloop

            run = uvloop.run
        pids = {
            "router": [r.pid for r in routers],
            "fleet": [fleet.procs[0].pid],
        }
        cpu = {k: cpu_seconds(v) for k, v in pids.items()}
        cpu["client"] = time.process_time()
        result = run(drive(urls, model.name, sessions, fleet.workers))
        cpu["client"] = time.process_time() - cpu["client"]
        if policy in KVPOOL_POLICIES or policy == REPLICAS:
            result["decisions"] = router_decisions(urls[0])
        for k, v in pids.items():
            cpu[k] = cpu_seconds(v) - cpu[k]
        # CPU cores each part used while the run lasted (this machine has os.cpu_count())
        result["cpu_cores"] = {k: v / result["seconds"] for k, v in cpu.items()}
        return result
    finally:
        for router in routers:
            stop(router)


# -- report ----------------------------------------------------------------------------------


def _ms(x: float) -> str:
    return f"{x * 1000:,.0f}" if math.isfinite(x) else "-"


def table(workload: str, rows: dict[str, dict[str, dict[str, Any]]], note: str) -> str:
    rates = list(next(iter(rows.values())))
    lines = [
        f"### {workload}",
        "",
        note,
        "",
        "| rate req/s | policy | hit ratio | share of the bound | TTFT p50 ms | TTFT p90 ms "
        "| TTFT p99 ms | output tok/s | imbalance | p90 / kvpool's | refused |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rate in rates:
        ours = rows.get("kvpool", {}).get(rate)
        for policy, by_rate in rows.items():
            r = by_rate[rate]
            ratio = r["ttft_p90"] / ours["ttft_p90"] if ours else float("nan")
            errors = f" ({r['errors']} errors)" if r.get("errors") else ""
            share = r.get("hit_share_of_bound", float("nan"))
            shown = f"{share:.1%}" if math.isfinite(share) else "-"
            lines.append(
                f"| {rate} | {policy}{errors} | {r['hit_ratio']:.1%} | {shown} "
                f"| {_ms(r['ttft_p50'])} "
                f"| {_ms(r['ttft_p90'])} | {_ms(r['ttft_p99'])} | {r['throughput']:,.0f} "
                f"| {r['imbalance']:.2f} | {ratio:.2f}x | {r.get('refused', '-')} |"
            )
    return "\n".join(lines)


def goals(workload: str, rows: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each goal of the issue for one workload: held or not, and where it was missed."""
    if "kvpool" not in rows:
        return []
    ours = rows["kvpool"]
    out = []
    for metric, better in (("ttft_p90", "lower"), ("hit_ratio", "higher")):
        misses = []
        for policy, by_rate in rows.items():
            if policy == "kvpool":
                continue
            for rate, r in by_rate.items():
                a, b = ours[rate][metric], r[metric]
                worse = a > b if better == "lower" else a < b
                if worse:
                    beyond = a > b * (1 + NOISE_TTFT) if better == "lower" else a < b - NOISE_HIT
                    misses.append(
                        {"policy": policy, "rate": rate, "kvpool": a, "other": b, "beyond": beyond}
                    )
        out.append(
            {
                "goal": f"{'TTFT p90' if metric == 'ttft_p90' else 'hit ratio'} at least as "
                "good as every other policy's",
                "held": not misses,
                "held_within_noise": not any(m["beyond"] for m in misses),
                "misses": misses,
            }
        )
    shares = {rate: r.get("hit_share_of_bound") for rate, r in ours.items()}
    if all(isinstance(x, float) and math.isfinite(x) for x in shares.values()):
        out.append(
            {
                "goal": f"hit ratio >= {GOAL_SHARE_OF_BOUND:.0%} of the bound",
                "held": all(x >= GOAL_SHARE_OF_BOUND for x in shares.values()),
                "held_within_noise": all(
                    ours[rate]["hit_ratio"]
                    >= GOAL_SHARE_OF_BOUND * ours[rate]["hit_bound"] - NOISE_HIT
                    for rate in ours
                ),
                "ratios": {rate: f"{x:.1%}" for rate, x in shares.items()},
            }
        )
    peers = [p for p in PEERS if p in rows]
    if workload in GOAL_VS_PEERS and peers:
        want = GOAL_VS_PEERS[workload]
        top = sorted(ours, key=float)[-2:]  # the two highest rates
        best = {rate: min(peers, key=lambda p: rows[p][rate]["ttft_p90"]) for rate in top}
        ratios = {rate: rows[best[rate]][rate]["ttft_p90"] / ours[rate]["ttft_p90"] for rate in top}
        out.append(
            {
                "goal": f"TTFT p90 >= {want}x lower than the best peer router's at the two "
                "highest rates",
                "held": all(x >= want for x in ratios.values()),
                "held_within_noise": all(x >= want * (1 - NOISE_TTFT) for x in ratios.values()),
                "ratios": ratios,
                "best_peer": best,
            }
        )
        hits = {rate: max(rows[p][rate]["hit_ratio"] for p in peers) for rate in top}
        out.append(
            {
                "goal": "hit ratio at least the best peer router's at the two highest rates",
                "held": all(ours[rate]["hit_ratio"] >= hits[rate] for rate in top),
                "held_within_noise": all(
                    ours[rate]["hit_ratio"] >= hits[rate] - NOISE_HIT for rate in top
                ),
                "ratios": {
                    rate: f"{ours[rate]['hit_ratio']:.1%} vs {hits[rate]:.1%}" for rate in top
                },
            }
        )
    return out


def describe_goal(g: dict[str, Any]) -> str:
    status = "**held**" if g["held"] else "**missed**"
    if "ratios" in g:
        detail = ", ".join(
            f"{rate} req/s: {x if isinstance(x, str) else f'{x:.2f}x'}"
            for rate, x in g["ratios"].items()
        )
    elif g["misses"]:
        parts = []
        for m in g["misses"]:
            ours, theirs = m["kvpool"], m["other"]
            if "hit" in g["goal"]:
                gap = f"{ours:.1%} vs {theirs:.1%}, {(ours - theirs) * 100:+.1f} points"
            else:
                gap = f"{ours * 1000:,.0f} vs {theirs * 1000:,.0f} ms, {ours / theirs - 1:+.0%}"
            parts.append(
                f"{m['policy']} at {m['rate']} req/s ({gap}"
                + (")" if m["beyond"] else ", within noise)")
            )
        detail = "kvpool worse than " + "; ".join(parts)
    else:
        detail = "at every rate"
    return f"- {g['goal']}: {status} ({detail})"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    names = list(results)
    cols = 2 if len(names) > 1 else 1
    rows_n = -(-len(names) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(6 * cols, 4.2 * rows_n), squeeze=False)
    for ax, workload in zip(axes.flat, names, strict=False):
        for policy, by_rate in results[workload].items():
            rates = [float(r) for r in by_rate]
            p90 = [by_rate[r]["ttft_p90"] * 1000 for r in by_rate]
            style = {"linewidth": 2.5} if policy == "kvpool" else {"linestyle": "--"}
            ax.plot(rates, p90, marker="o", label=policy, **style)
        ax.set_title(workload)
        ax.set_xlabel("request rate, req/s")
        values = [r["ttft_p90"] for by_rate in results[workload].values() for r in by_rate.values()]
        if max(values) > 8 * min(values):  # a log scale, with ticks labelled at 1, 2 and 5
            ax.set_yscale("log")
            ax.set_ylabel("TTFT p90, ms (log scale)")
            label = ticker.FuncFormatter(lambda y, _: f"{y:,.0f}" if f"{y:.0e}"[0] in "125" else "")
            ax.yaxis.set_major_formatter(label)
            ax.yaxis.set_minor_formatter(label)
        else:
            ax.set_ylabel("TTFT p90, ms")
            ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: f"{y:,.0f}"))
        ax.set_xticks(sorted({float(r) for by_rate in results[workload].values() for r in by_rate}))
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    axes.flat[0].legend()
    fig.suptitle("TTFT p90 against request rate, 8 simulated workers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def affinity_table(rows: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Session affinity on (``kvpool``) against off (``kvpool-no-affinity``), rate by rate:
    what keeping a conversation on its worker buys in hit ratio and TTFT."""
    lines = [
        "| rate req/s | hit ratio, affinity on / off | TTFT p90 ms, on / off | p90 off / on "
        "| TTFT p99 ms, on / off | imbalance, on / off |",
        "|---|---|---|---|---|---|",
    ]
    on, off = rows["kvpool"], rows["kvpool-no-affinity"]
    for rate in on:
        a, b = on[rate], off[rate]
        lines.append(
            f"| {rate} | {a['hit_ratio']:.1%} / {b['hit_ratio']:.1%} "
            f"({(a['hit_ratio'] - b['hit_ratio']) * 100:+.1f} points) "
            f"| {_ms(a['ttft_p90'])} / {_ms(b['ttft_p90'])} | {b['ttft_p90'] / a['ttft_p90']:.2f}x "
            f"| {_ms(a['ttft_p99'])} / {_ms(b['ttft_p99'])} "
            f"| {a['imbalance']:.2f} / {b['imbalance']:.2f} |"
        )
    return "\n".join(lines)


MOONCAKE_NOTE = " (the Mooncake sample: its own arrival times, compressed to the rate)"


def replica_figures(results: dict[str, Any]) -> dict[str, Any]:
    """Two replicas against one router, per workload and rate: TTFT p90 and hit ratio as
    ratios (two / one), the worst of each, and the goal (within :data:`GOAL_REPLICAS`)."""
    rows = []
    for workload, by_policy in results.items():
        for rate, one in by_policy["kvpool"].items():
            two = by_policy[REPLICAS][rate]
            hit = two["hit_ratio"] / one["hit_ratio"] if one["hit_ratio"] else float("nan")
            rows.append((workload, rate, two["ttft_p90"] / one["ttft_p90"], hit))
    goal_list = []
    for workload in results:
        mine = [r for r in rows if r[0] == workload]
        p90 = {rate: x for _, rate, x, _ in mine}
        hit = {rate: y for _, rate, _, y in mine}
        goal_list.append(
            {
                "workload": workload,
                "goal": f"two replicas' TTFT p90 and hit ratio within {GOAL_REPLICAS:.0%} of "
                "one router's",
                "held": all(x <= 1 + GOAL_REPLICAS for x in p90.values())
                and all(y >= 1 - GOAL_REPLICAS for y in hit.values()),
                "held_within_noise": all(x <= 1 + GOAL_REPLICAS + NOISE_TTFT for x in p90.values())
                and all(y >= 1 - GOAL_REPLICAS - NOISE_HIT for y in hit.values()),
                "ratios": {
                    rate: f"p90 {p90[rate]:.2f}x, hit ratio {hit[rate]:.2f}x" for rate in p90
                },
            }
        )
    return {
        "p90_ratio_max": max(r[2] for r in rows),
        "hit_ratio_ratio_min": min(r[3] for r in rows),
        "by_run": [
            {"workload": w, "rate": rate, "p90_ratio": x, "hit_ratio_ratio": y}
            for w, rate, x, y in rows
        ],
        "goals": goal_list,
    }


def write_results(out: Path, results: dict[str, Any], meta: dict[str, Any]) -> None:
    """The tables (printed, and ``<name>.md``), ``<name>.json`` and the plot, from the results
    and what the run recorded (``meta``; its ``name``: ``routing``, or ``affinity`` for
    ``--affinity``); ``--render`` calls it on an earlier run's JSON."""
    name = meta.get("name", "routing")
    workloads = list(results)
    notes = meta["notes"]
    replicas = replica_figures(results) if name == "replicas" else None
    all_goals = {w: goals(w, results[w]) for w in workloads}
    if replicas is not None:
        all_goals = {w: [g for g in replicas["goals"] if g["workload"] == w] for w in workloads}

    def median_overhead(router: str) -> float:
        xs = sorted(
            r["path_overhead_ms"]
            for w in results.values()
            for policy, by_rate in w.items()
            for r in by_rate.values()
            if (policy if policy in PEERS else "kvpool") == router
            and math.isfinite(r["path_overhead_ms"])
        )
        return xs[len(xs) // 2] if xs else float("nan")

    overhead = {router: median_overhead(router) for router in ("kvpool", *PEERS)}

    def yes(held: bool) -> str:
        return "yes" if held else "**no**"

    summary = [
        "| workload | goal | held | held within run-to-run noise |",
        "|---|---|---|---|",
        *(
            f"| {w} | {g['goal']} | {yes(g['held'])} | {yes(g['held_within_noise'])} |"
            for w in workloads
            for g in all_goals[w]
        ),
    ]
    load_before, load_after = meta["load_average"]
    title = {
        "affinity": "Session affinity",
        "replicas": "Two router replicas",
        "ingress": "kvpool's defaults behind one client address",
    }.get(name, "Routing quality")
    refused: dict[str, int] = {}
    for by_policy in results.values():
        for policy, by_rate in by_policy.items():
            n = sum(r.get("refused", 0) for r in by_rate.values())
            refused[policy] = refused.get(policy, 0) + n
    header = (
        f"# {title} ({meta['date']}, {meta['machine'].split(', ')[0]}, "
        f"{meta['machine'].split(', ')[1]}, Python {meta['python']})\n\n"
        f"`{meta['command']}`: {meta['workers']} simulated workers "
        f"(`kvpool worker sim-fleet`, {meta['fleet_processes']} processes, timing model slowed "
        f"{meta['time_scale']:g}x) behind each router in turn, the same workers for all, prefix "
        f"caches emptied and the router restarted before every run; streamed "
        f"`/v1/completions`, TTFT at the client; {meta['duration_s']:g} s of Poisson arrivals "
        f"per run{MOONCAKE_NOTE if 'mooncake' in results else ''}. Whole "
        f"benchmark {meta['wall_s'] / 60:.1f} min; load average {load_before:.2f} before, "
        f"{load_after:.2f} after (other processes share this machine's cores).\n\n"
        + "".join(
            f"Run again after it, their rows replacing the whole run's: "
            f"{', '.join(r['workloads'])} ({r['date']}, {r['wall_s'] / 60:.1f} min): {r['why']}\n\n"
            for r in meta.get("reruns", ())
        )
        + (
            "Every request comes from one address (the load generator), as through an "
            "ingress; kvpool runs with its defaults, no flag but `--model`, `--port`, "
            "`--worker`. Requests refused (429 or 503) in the whole run: "
            + ", ".join(f"{p} {n}" for p, n in refused.items())
            + ".\n\n"
            if name == "ingress"
            else ""
        )
        + "Hit ratio: `vllm:prefix_cache_hits` / `vllm:prefix_cache_queries` at the workers. "
        "Imbalance: max/mean over the workers of busy time (running + waiting requests > 0, "
        "sampled from the workers' gauges every 0.25 s). p90 / kvpool's: a policy's TTFT p90 "
        "over kvpool's at the same rate (above 1: kvpool's is lower). What the path adds to "
        "TTFT (client TTFT less the workers' own: router, HTTP, client), median over "
        "the runs: "
        + ", ".join(f"{r} {ms:.0f} ms" for r, ms in overhead.items() if math.isfinite(ms))
        + ".\n\n"
        + "The issue's goals for kvpool's default policy. Held: no worse figure at any rate. "
        f"Held within noise: none worse by more than one configuration's run-to-run spread "
        f"on this machine ({NOISE_TTFT:.0%} of TTFT p90, {NOISE_HIT * 100:.0f} points of hit "
        "ratio; bench/README.md). The misses and their sizes are under each table.\n\n"
        + "\n".join(summary)
        + "\n"
    )
    rows = results.get(AFFINITY_WORKLOAD, {})
    if "kvpool" in rows and "kvpool-no-affinity" in rows:
        header += (
            f"\n## Session affinity on and off ({AFFINITY_WORKLOAD})\n\n"
            f"Every turn of a conversation carries `{SESSION_HEADER}: <its id>`. `kvpool`: "
            "the default policy, whose `affinity` score (weight 0.3 unless `--router-args` "
            "said otherwise: see the command) keeps a conversation on the worker its last turn "
            "went to; `kvpool-no-affinity`: the same with "
            "`--affinity-weight 0`. p90 off / on above 1: affinity lowers the p90.\n\n"
            + affinity_table(rows)
            + "\n"
        )
    sections = []
    for workload in workloads:
        section = table(workload, results[workload], notes[workload])
        lines = [describe_goal(g) for g in all_goals[workload]]
        sections.append(section + ("\n\nGoals:\n\n" + "\n".join(lines) if lines else ""))
    text = header + "\n" + "\n\n".join(sections) + "\n"
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text)
    meta = {
        **meta,
        "goals": all_goals,
        "path_overhead_ms_median": overhead,
        "units": "ttft_* in seconds, throughput in output tokens/s, hit_ratio 0..1",
    }
    routing_json = out / "routing.json"
    earlier = json.loads(routing_json.read_text()) if routing_json.is_file() else {}
    if replicas is not None:
        meta["replicas"] = replicas
        if earlier:  # the figures the issue names, beside the routing run's own
            earlier["replicas"] = {k: v for k, v in replicas.items() if k != "goals"}
            earlier["replicas"]["date"] = str(dt.date.today())  # its own run, not this file's
            routing_json.write_text(json.dumps(earlier, indent=2) + "\n")
    elif name == "routing" and "replicas" in earlier:  # kept until the next --replicas run
        results = {**results, "replicas": earlier["replicas"]}
    (out / f"{name}.json").write_text(json.dumps({**results, "meta": meta}, indent=2) + "\n")
    plot({k: v for k, v in results.items() if k != "replicas"}, out / f"{name}.png")


# -- main ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=".cache/tiny-model", help="its tokenizer is used")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--fleet-processes", type=int, default=2)
    parser.add_argument("--time-scale", type=float, default=8.0, help="slow the timing model")
    parser.add_argument("--duration", type=float, default=12.0, help="seconds of arrivals")
    parser.add_argument("--workloads", default=None, help=f"default {','.join(WORKLOADS)}")
    parser.add_argument(
        "--policies",
        default=None,
        help=f"default {','.join(DEFAULT_POLICIES)}; also kvpool-no-affinity",
    )
    parser.add_argument("--rates", default=None, help="the same rates for every workload")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument(
        "--affinity",
        action="store_true",
        help=f"session affinity on and off: only {AFFINITY_WORKLOAD}, policies "
        f"{', '.join(AFFINITY_POLICIES)}; writes affinity.{{md,json,png}}",
    )
    parser.add_argument(
        "--replicas",
        action="store_true",
        help=f"one kvpool router against two ({REPLICAS}) on {', '.join(REPLICA_WORKLOADS)} "
        "at their two highest rates; writes replicas.{md,json,png} and the figures into "
        "routing.json's 'replicas'",
    )
    parser.add_argument(
        "--ingress",
        action="store_true",
        help="kvpool with its defaults beside the SGLang router on every workload, the load "
        "generator one client address as an ingress is: requests refused counted; writes "
        "ingress.{md,json,png}",
    )
    parser.add_argument(
        "--router-args", default="", help="more `kvpool router serve` flags, for trials"
    )
    parser.add_argument("--out", type=Path, default=None, help="default bench/results")
    parser.add_argument(
        "--render", type=Path, default=None, help="only write the tables again from a routing.json"
    )
    return parser


@dataclass(frozen=True)
class Plan:
    """What a run measures and where it writes, from the command line."""

    name: str  # the results' file names: routing or affinity
    workloads: list[str]
    policies: list[str]
    rates: dict[str, tuple[float, ...]]
    duration: float
    out: Path


def plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Plan:
    if (args.affinity or args.replicas or args.ingress) and (args.workloads or args.policies):
        parser.error("--affinity, --replicas and --ingress choose their workloads and policies")
    if args.affinity + args.replicas + args.ingress > 1:
        parser.error("one of --affinity, --replicas and --ingress")
    if args.ingress and args.router_args:
        parser.error("--ingress runs kvpool's defaults: no --router-args")
    if args.ingress:
        workloads, policies = list(WORKLOADS), list(INGRESS_POLICIES)
    elif args.affinity:
        workloads, policies = [AFFINITY_WORKLOAD], list(AFFINITY_POLICIES)
    elif args.replicas:
        workloads, policies = list(REPLICA_WORKLOADS), list(REPLICA_POLICIES)
    else:
        workloads = (args.workloads or ",".join(WORKLOADS)).split(",")
        policies = (args.policies or ",".join(DEFAULT_POLICIES)).split(",")
    for name in workloads:
        if name not in WORKLOADS:
            parser.error(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    for name in policies:
        if name not in POLICIES:
            parser.error(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    rates = {w: RATES[w] for w in workloads}
    if args.replicas:
        rates = {w: RATES[w][-2:] for w in workloads}
    if args.rates:
        rates = {w: tuple(float(x) for x in args.rates.split(",")) for w in workloads}
    duration = args.duration
    if args.quick:
        rates = {w: (r[len(r) // 2],) for w, r in rates.items()}
        duration = min(duration, 4.0)
    out = args.out or (
        Path(tempfile.gettempdir()) / "kvpool-bench-routing-quick" if args.quick else RESULTS
    )
    name = (
        "affinity"
        if args.affinity
        else "replicas"
        if args.replicas
        else "ingress"
        if args.ingress
        else "routing"
    )
    return Plan(name, workloads, policies, rates, duration, out)


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    if args.render is not None:
        earlier = json.loads(args.render.read_text())
        meta = earlier.pop("meta")
        earlier.pop("replicas", None)
        write_results(args.out or args.render.parent, earlier, meta)
        return 0
    run = plan(args, parser)
    workloads, policies, rates, out = run.workloads, run.policies, run.rates, run.out
    args.duration = run.duration
    # SIGTERM unwinds like Ctrl-C, so that the fleet and a router are stopped too.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    started = time.monotonic()
    model = Path(args.model)
    if not (model / "config.json").is_file():
        subprocess.run([*KVPOOL, "worker", "make-tiny-model", str(model)], env=ENV, check=True)
    words = Words(model)
    load_before = os.getloadavg()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    notes: dict[str, str] = {}
    from kvpool.worker.sim import DEFAULT_SIM_BLOCKS  # each simulated worker's KV blocks

    bounds: dict[str, dict[str, dict[str, Any]]] = {}
    capacity = args.workers * DEFAULT_SIM_BLOCKS
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-routing-") as tmp_name:
        tmp = Path(tmp_name)
        fleet = start_fleet(args, model, tmp)
        try:
            for workload in workloads:
                results[workload] = {p: {} for p in policies}
                for rate in rates[workload]:
                    key = f"{rate:g}"
                    sessions = WORKLOADS[workload](words, rate, args.duration)
                    bound = hit_bounds(words, sessions, capacity)
                    bounds.setdefault(workload, {})[key] = bound
                    for policy in policies:
                        kvpool = policy in KVPOOL_POLICIES or policy == REPLICAS
                        extra = args.router_args.split() if kvpool else []
                        r = run_one(policy, sessions, model, fleet, tmp, extra)
                        r["hit_bound"] = bound["pooled"]
                        r["hit_share_of_bound"] = (
                            r["hit_ratio"] / bound["pooled"] if bound["pooled"] else float("nan")
                        )
                        results[workload][policy][key] = r
                        print(
                            f"[{time.monotonic() - started:6.0f} s] {workload} {key} req/s "
                            f"{policy:>18}: hit {r['hit_ratio']:.1%} "
                            f"({r['hit_share_of_bound']:.0%} of the bound) p50/p90/p99 "
                            f"{_ms(r['ttft_p50'])}/{_ms(r['ttft_p90'])}/{_ms(r['ttft_p99'])} ms, "
                            f"{r['throughput']:,.0f} tok/s, imbalance {r['imbalance']:.2f}, "
                            f"{r['completed']}/{r['requests']} done in {r['seconds']:.1f} s, "
                            f"path {r['path_overhead_ms']:.1f} ms, "
                            f"decisions {r.get('decisions', '-')}, cores "
                            + " ".join(f"{k} {v:.2f}" for k, v in r["cpu_cores"].items()),
                            file=sys.stderr,
                            flush=True,
                        )
        finally:
            for proc in fleet.procs:
                stop(proc)
    wall = time.monotonic() - started
    load_after = os.getloadavg()
    for workload in workloads:
        sample = WORKLOADS[workload](words, max(rates[workload]), args.duration)
        n = sum(len(s.requests()) for s in sample)
        tokens = sum(words.count(p) for s in sample for _, p in s.requests()) / n
        top = bounds[workload][f"{max(rates[workload]):g}"]
        notes[workload] = (
            f"{n} requests at {max(rates[workload]):g} req/s, {tokens:,.0f} prompt tokens on "
            f"average. The bound (the most any router could hit, offline: one cache of the "
            f"fleet's {top['capacity_blocks']:,} blocks with optimal eviction) is "
            f"{top['pooled']:.1%} at that rate; an unlimited cache, {top['unlimited']:.1%}."
        )
        decisions = results[workload].get("kvpool", {}).get(f"{max(rates[workload]):g}", {})
        if decisions.get("decisions"):
            counts = ", ".join(f"{k} {v:.0f}" for k, v in sorted(decisions["decisions"].items()))
            notes[workload] += f" kvpool's decisions at that rate, by reason: {counts}."
    meta = {
        "name": run.name,
        "date": str(dt.date.today()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "python": platform.python_version(),
        "command": " ".join(["bench/routing.py", *sys.argv[1:]]),
        "workers": args.workers,
        "fleet_processes": args.fleet_processes,
        "time_scale": args.time_scale,
        "duration_s": args.duration,
        "wall_s": wall,
        "load_average": [load_before[0], load_after[0]],
        "hit_bounds": bounds,
        "notes": notes,
    }
    write_results(out, results, meta)
    print(f"wrote {out}/{run.name}.{{md,json,png}} in {wall / 60:.1f} min", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
