"""KV hand-off throughput on loopback: a prefill worker's blocks pulled by a decode worker.

Two real worker servers (``kvpool worker serve``, one process each, role prefill and role
decode) on 127.0.0.1 serve a random Llama whose KV block is 1 MiB in float32 (8 layers,
8 KV heads of 128, block size 16), so a 2,048-token prompt hands off 128 MiB, sent in
chunks of ``kv_transfer.CHUNK_BYTES`` (8 MiB: 8 blocks). Each repeat:

* pull: a fresh prefill leg (``do_remote_decode``, max_tokens 1) on the prefill worker,
  then ``GET /kv/{id}`` timed end to end with ``pull_blocks``, the decode worker's own
  client code, presenting the hand-off's one-time token (``kvpool_token``); the pull uses
  the token up and releases the pin. Goal: >= 200 MB/s (median).
* baseline, same run: the same bytes, in the same transfer format and chunks, from a
  minimal asyncio server holding them in memory, read by the same ``pull_blocks`` (what
  the client and loopback cost with no server-side work).
* decode leg: a fresh prefill, then the decode worker's request with its
  ``kv_transfer_params``; its own ``kvpool_worker_kv_pull_seconds`` (the streamed pull,
  each run of blocks copied into the cache as it arrives) and received bytes from
  /metrics, and the request's time to its one token, against recomputing a fresh prompt of
  the same length on the decode worker.
* busy workers: pulls from a prefill worker while it decodes ``--streams`` streams (the
  blocks are read beside its steps, not one chunk per step); and the inter-token latency
  of as many streams on the decode worker, alone and while it takes ``--pulls`` decode
  legs back to back (each imports a whole prompt's blocks beside its steps). Goal: the
  streams' p90 during hand-offs at most 2x their p90 alone (a pull costs them at most
  about a step).

A breakdown says where the time goes: the time to the parsed header of a pull, and
``read_blocks`` (chunk by chunk, as the prefill worker reads them) and ``import_blocks``
of a whole prompt's blocks on an engine in this process, without HTTP.

Both workers share a pool secret (``KVPOOL_POOL_SECRET``, random per run): without one a
prefill worker refuses ``do_remote_decode`` and a decode worker honours no
``kv_transfer_params``, since it signs and verifies the hand-off.

Writes bench/results/kv_transfer.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import random
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
GOAL_MB_S = 200.0
#: the decode side's inter-token latency p90 during hand-offs, against none: a pull may
#: cost the streams beside it at most about one step (the copy runs beside the steps)
ITL_GOAL = 2.0
#: 8 layers x 2 x 16 tokens x 8 KV heads x 128 x 4 bytes = 1 MiB per block in float32
SHAPE = {
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "hidden_size": 512,
    "head_dim": 128,
    "intermediate_size": 1024,
}
MB = 1e6
ME = str(Path(__file__).resolve())


def median_spread(xs: list[float], fmt: str = ".3g") -> str:
    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})"


def chunk_blocks(block_bytes: int) -> int:
    """Blocks per chunk of a transfer's body, as ``stream_blocks`` cuts it."""
    from kvpool.worker.kv_transfer import CHUNK_BYTES

    return max(1, CHUNK_BYTES // block_bytes)


# -- the processes this benchmark starts -------------------------------------------------------
def worker_main(argv: list[str]) -> int:
    """``kvpool worker <argv>``."""
    from kvpool.worker import cli

    return cli.main(argv)


def raw_server_main(port: int, header: bytes, body_bytes: int, chunk: int) -> None:
    """The baseline: an HTTP/1.1 server that answers every GET with ``header`` and
    ``body_bytes`` zero bytes, already in memory, written ``chunk`` bytes at a time."""
    body = bytes(body_bytes)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while await reader.readline():
                while (await reader.readline()) not in (b"\r\n", b""):
                    pass
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
                    b"content-length: %d\r\n\r\n" % (len(header) + body_bytes)
                )
                writer.write(header)
                view = memoryview(body)
                for start in range(0, body_bytes, chunk):
                    writer.write(view[start : start + chunk])
                    await writer.drain()
        writer.close()

    async def serve() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def process(
    args: list[str], log_path: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    with log_path.open("wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def wait_ready(client: Any, url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited ({proc.returncode}):\n{log_tail(log)}")
        with contextlib.suppress(Exception):
            if (await client.get(url, timeout=2)).status_code == 200:
                return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} was not ready within 120 s:\n{log_tail(log)}")


def log_tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


def logs_tail(tmp: Path) -> str:
    return "\n".join(f"{p.name}: {log_tail(p)}" for p in sorted(tmp.glob("*.log")))


# -- measurements ------------------------------------------------------------------------------
async def completion(client: Any, base: str, prompt: list[int], **extra: Any) -> tuple[dict, float]:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    start = time.perf_counter()
    r = await client.post(f"{base}/v1/completions", json=body, timeout=300)
    elapsed = time.perf_counter() - start
    if r.status_code != 200:
        raise RuntimeError(f"{base}: {r.status_code} {r.text[:500]}")
    return r.json(), elapsed


async def prefill_leg(client: Any, base: str, prompt: list[int]) -> tuple[dict, float]:
    body, elapsed = await completion(
        client, base, prompt, kv_transfer_params={"do_remote_decode": True}
    )
    params = body.get("kv_transfer_params")
    if not params:
        raise RuntimeError(f"the prefill leg returned no kv_transfer_params: {body}")
    return params, elapsed


def kv_url(params: dict) -> str:
    return (
        f"http://{params['remote_host']}:{params['remote_port']}/kv/{params['remote_request_id']}"
    )


def kv_auth(params: dict) -> dict[str, str]:
    """The hand-off's one-time token, as a pull presents it (a raw GET uses it up: the
    same params cannot then be given to a decode worker)."""
    return {"Authorization": f"Bearer {params['kvpool_token']}"}


def scrape(text: str) -> dict[str, float]:
    """The decode worker's hand-off series, summed over label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvpool_worker_kv_pull_seconds_sum":
                out["pull_seconds"] = out.get("pull_seconds", 0.0) + s.value
            elif (
                s.name == "kvpool_worker_kv_transfer_bytes_total"
                and s.labels.get("direction") == "received"
            ):
                out["received"] = out.get("received", 0.0) + s.value
            elif s.name == "kvpool_worker_kv_transfer_fallbacks_total":
                out["fallbacks"] = out.get("fallbacks", 0.0) + s.value
    return out


async def time_to_header(client: Any, url: str, headers: dict[str, str]) -> float:
    """Seconds from sending ``GET /kv`` to a parsed transfer header (the body is read to
    its end, as a pull would)."""
    from kvpool.worker.kv_transfer import _parse_header

    buf = bytearray()
    start = time.perf_counter()
    header_at = None
    async with client.stream("GET", url, timeout=120, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code}")
        async for piece in response.aiter_raw():
            if header_at is None:
                buf += piece
                if _parse_header(buf) is not None:
                    header_at = time.perf_counter() - start
    if header_at is None:
        raise RuntimeError(f"{url}: no transfer header")
    return header_at


async def stream_gaps(
    client: Any, base: str, prompt: list[int], max_tokens: int
) -> list[tuple[float, float]]:
    """A streamed completion's gaps between chunks, each as (start, end) in perf_counter
    seconds: the inter-token latency its client sees."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    gaps: list[tuple[float, float]] = []
    last = None
    async with client.stream(
        "POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=300
    ) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{base}: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append((last, now))
                last = now
    return gaps


def p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[-1]


async def busy(
    client: Any, prefill_url: str, decode_url: str, prompt: Any, args: argparse.Namespace
) -> dict[str, Any]:
    """Hand-offs against a worker that is busy decoding. (1) Pulls from a prefill worker
    while it decodes ``--busy-streams`` streams; (2) the inter-token latency of as many
    streams on the decode worker, alone and while it takes back-to-back decode legs (each
    pulls and imports a whole prompt's blocks)."""
    from kvpool.worker.kv_transfer import pull_blocks

    rng = random.Random(1)

    def short() -> list[int]:
        return [rng.randrange(8, 512) for _ in range(64)]

    def load(base: str) -> asyncio.Future[list[list[tuple[float, float]]]]:
        return asyncio.gather(
            *(stream_gaps(client, base, short(), args.busy_tokens) for _ in range(args.streams))
        )

    # (1) pulls from a busy prefill worker: its blocks are pinned first, then it decodes
    pins = [(await prefill_leg(client, prefill_url, prompt()))[0] for _ in range(args.pulls)]
    running = asyncio.ensure_future(load(prefill_url))
    await asyncio.sleep(1.0)  # the streams are decoding
    busy_mb_s = []
    for params in pins:
        start = time.perf_counter()
        _, data = await pull_blocks(kv_url(params), timeout=120, headers=kv_auth(params))
        busy_mb_s.append(len(data) / (time.perf_counter() - start) / MB)
        if running.done():
            raise RuntimeError(
                "the prefill worker's streams ended before the pulls: raise --busy-tokens"
            )
    prefill_steps = [e - s for g in await running for s, e in g]
    # (2) the decode worker's streams, alone and during decode legs
    alone = [e - s for g in await load(decode_url) for s, e in g]
    legs = []
    for _ in range(args.pulls):
        leg_prompt = prompt()
        legs.append((leg_prompt, (await prefill_leg(client, prefill_url, leg_prompt))[0]))
    pulls: list[tuple[float, float]] = []
    before = scrape((await client.get(f"{decode_url}/metrics")).text)
    running = asyncio.ensure_future(load(decode_url))
    await asyncio.sleep(0.5)
    for p, params in legs:
        start = time.perf_counter()
        await completion(client, decode_url, p, kv_transfer_params=params)
        pulls.append((start, time.perf_counter()))
    if running.done():
        raise RuntimeError("the decode worker's streams ended before the legs: raise --busy-tokens")
    gaps = [gap for g in await running for gap in g]
    after = scrape((await client.get(f"{decode_url}/metrics")).text)
    if after.get("fallbacks", 0) > before.get("fallbacks", 0):
        raise RuntimeError("a decode leg recomputed its prefill")
    during = [e - s for s, e in gaps if any(s < b and e > a for a, b in pulls)]
    return {
        "busy_pull_mb_s": busy_mb_s,
        "prefill_step_ms": statistics.median(prefill_steps) * 1000,
        "itl_alone_s": alone,
        "itl_during_pull_s": during,
        "pull_s": [b - a for a, b in pulls],
    }


def in_process(model_dir: Path, num_tokens: int, repeats: int) -> dict[str, Any]:
    """``read_blocks`` of a whole prompt's blocks, chunk by chunk as ``stream_blocks``
    reads them, and ``import_blocks`` of them, on an engine in this process (no HTTP)."""
    from kvpool.worker.engine import EngineConfig, LLMEngine

    blocks = num_tokens // 16
    engine = LLMEngine.from_pretrained(
        model_dir,
        EngineConfig(num_blocks=blocks * (repeats + 2), device="cpu", dtype="float32"),
    )
    engine.runner.kv_cache.normal_()
    step = chunk_blocks(engine.kv_layout.block_bytes)
    rng = random.Random(7)
    ids = list(range(blocks))
    read_ms, import_ms = [], []
    data = bytearray(engine.kv_layout.block_bytes * blocks)
    for _ in range(repeats):
        start = time.perf_counter()
        for at in range(0, blocks, step):
            engine.read_blocks(ids[at : at + step])
        read_ms.append((time.perf_counter() - start) * 1000)
    for _ in range(repeats):
        prompt = [rng.randrange(8, engine.vocab_size) for _ in range(num_tokens)]
        chain = engine.hasher.chain()
        chain.extend(prompt)
        start = time.perf_counter()
        stored = engine.import_blocks(prompt, chain.keys, data)
        import_ms.append((time.perf_counter() - start) * 1000)
        assert stored == blocks, stored
    return {"read_blocks_ms": read_ms, "import_blocks_ms": import_ms}


async def run(args: argparse.Namespace, model_dir: Path, tmp: Path) -> dict[str, Any]:
    import httpx

    from kvpool.worker.engine import KVLayout
    from kvpool.worker.kv_transfer import TransferHeader, pull_blocks

    common = ["--model", str(model_dir), "--device", "cpu", "--dtype", "float32"]
    # room for --pulls pinned or imported prompts besides the streams'
    common += ["--num-blocks", str(args.tokens // 16 * (args.pulls + 3) + 256)]
    common += ["--drain-timeout-s", "1"]
    common += ["--max-num-batched-tokens", str(max(2048, args.tokens))]
    p_port, d_port, r_port = free_port(), free_port(), free_port()
    prefill_url, decode_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    raw_url = f"http://127.0.0.1:{r_port}/kv/raw"

    blocks = args.tokens // 16
    layout = KVLayout("float32", [SHAPE["num_hidden_layers"], 2, 16, 8, 128])
    fake = TransferHeader("raw", "float32", layout.block_shape, layout.layout,
                          layout.block_bytes, 16, args.tokens, list(range(blocks)))  # fmt: skip
    chunk = chunk_blocks(layout.block_bytes) * layout.block_bytes
    raw = [ME, "--raw-server", str(r_port), fake.encode().hex(), str(fake.body_bytes), str(chunk)]
    serve = [sys.executable, ME, "--worker", "serve", *common]
    # the pool's secret: the workers sign and verify hand-offs with it (never on a command line)
    env = {**os.environ, "KVPOOL_POOL_SECRET": secrets.token_hex(16)}
    with (
        process([*serve, "--role", "prefill", "--port", str(p_port)], tmp / "p.log", env) as p,
        process([*serve, "--role", "decode", "--port", str(d_port)], tmp / "d.log", env) as d,
        process([sys.executable, *raw], tmp / "r.log"),
    ):
        async with httpx.AsyncClient(timeout=300) as client:
            await wait_ready(client, f"{prefill_url}/health", p, tmp / "p.log")
            await wait_ready(client, f"{decode_url}/health", d, tmp / "d.log")
            rng = random.Random(0)

            def prompt() -> list[int]:
                return [rng.randrange(8, 512) for _ in range(args.tokens)]

            async def pull() -> tuple[Any, int, float, float]:
                """A fresh prefill, then its pull; (header, bytes, prefill s, pull s)."""
                params, prefill_s = await prefill_leg(client, prefill_url, prompt())
                start = time.perf_counter()
                header, data = await pull_blocks(
                    kv_url(params), timeout=120, headers=kv_auth(params)
                )
                pull_s = time.perf_counter() - start
                return header, len(data), prefill_s, pull_s  # the pull released the pin

            # warm up: first-call costs of the workers, the client and the raw server
            await pull()
            params, _ = await prefill_leg(client, prefill_url, prompt())
            await completion(client, decode_url, prompt(), kv_transfer_params=params)
            await pull_blocks(raw_url)

            r: dict[str, list[float]] = {k: [] for k in (
                "pull_mb_s", "raw_mb_s", "prefill_s", "pull_s", "decode_leg_s",
                "decode_pull_s", "decode_pull_mb_s", "recompute_s", "cached_tokens",
            )}  # fmt: skip
            nbytes = 0
            for i in range(args.repeats):
                # 1. the pull, with the decode worker's client code
                header, nbytes, prefill_s, pull_s = await pull()
                r["prefill_s"].append(prefill_s)
                r["pull_s"].append(pull_s)
                r["pull_mb_s"].append(nbytes / pull_s / MB)
                # 2. the same bytes from the minimal server, same client
                start = time.perf_counter()
                _, data = await pull_blocks(raw_url, timeout=120)
                r["raw_mb_s"].append(len(data) / (time.perf_counter() - start) / MB)
                del data
                # 3. the decode leg, as a router would send it
                params, _ = await prefill_leg(client, prefill_url, p2 := prompt())
                before = scrape((await client.get(f"{decode_url}/metrics")).text)
                body, leg_s = await completion(client, decode_url, p2, kv_transfer_params=params)
                after = scrape((await client.get(f"{decode_url}/metrics")).text)
                if after.get("fallbacks", 0) > before.get("fallbacks", 0):
                    raise RuntimeError(f"the decode leg recomputed its prefill:\n{logs_tail(tmp)}")
                got = after["received"] - before.get("received", 0.0)
                pulled = after["pull_seconds"] - before.get("pull_seconds", 0.0)
                r["decode_leg_s"].append(leg_s)
                r["decode_pull_s"].append(pulled)
                r["decode_pull_mb_s"].append(got / pulled / MB)
                r["cached_tokens"].append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
                # 4. the alternative to a hand-off: compute the prefill on the decode worker
                _, recompute_s = await completion(client, decode_url, prompt())
                r["recompute_s"].append(recompute_s)
                print(
                    f"  repeat {i + 1}/{args.repeats}: pull {r['pull_mb_s'][-1]:.0f} MB/s, "
                    f"raw {r['raw_mb_s'][-1]:.0f} MB/s, decode pull + import "
                    f"{r['decode_pull_mb_s'][-1]:.0f} MB/s, decode leg {leg_s:.3f} s, "
                    f"recompute {recompute_s:.3f} s",
                    file=sys.stderr,
                )

            header_s = []
            for _ in range(args.breakdown_repeats):
                params, _ = await prefill_leg(client, prefill_url, prompt())
                header_s.append(await time_to_header(client, kv_url(params), kv_auth(params)))
            busy_figures = await busy(client, prefill_url, decode_url, prompt, args)
    return {
        "runs": r,
        "bytes": nbytes,
        "blocks": len(header.block_hashes),
        "header_s": header_s,
        "busy": busy_figures,
    }


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length (x16 = blocks)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--breakdown-repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8, help="streams that keep a worker busy")
    parser.add_argument("--busy-tokens", type=int, default=400, help="tokens per busy stream")
    parser.add_argument("--pulls", type=int, default=5, help="hand-offs against a busy worker")
    parser.add_argument("--quick", action="store_true", help="3 repeats, 1,024 tokens")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.tokens, args.breakdown_repeats = 3, 1024, 2
        args.pulls, args.busy_tokens = 3, 200
    args.tokens -= args.tokens % 16

    import psutil
    import torch
    from transformers.utils import logging as hf_logging

    from kvpool.worker.kv_transfer import CHUNK_BYTES
    from kvpool.worker.tiny import make_tiny_model

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        model_dir = make_tiny_model(tmp / "model", **SHAPE)
        res = asyncio.run(run(args, model_dir, tmp))
        local = in_process(model_dir, args.tokens, repeats=7)

    r = res["runs"]
    mb_s = statistics.median(r["pull_mb_s"])
    raw_mb_s = statistics.median(r["raw_mb_s"])
    decode_mb_s = statistics.median(r["decode_pull_mb_s"])
    local_import_ms = statistics.median(local["import_blocks_ms"])
    b = res["busy"]
    busy_mb_s = statistics.median(b["busy_pull_mb_s"])
    itl_alone, itl_during = p90(b["itl_alone_s"]), p90(b["itl_during_pull_s"])
    itl_ratio = itl_during / itl_alone
    leg, recompute = statistics.median(r["decode_leg_s"]), statistics.median(r["recompute_s"])

    def met(ok: bool) -> str:
        return "met" if ok else "MISSED"

    def ms(xs: list[float]) -> str:
        return median_spread([x * 1000 for x in xs], ".0f")

    def spread(xs: list[float]) -> str:
        return median_spread(xs, ".0f")

    size = f"{res['bytes'] / 2**20:.0f} MiB"
    n = res["blocks"]
    step = chunk_blocks(res["bytes"] // n)
    rows = [
        "| Figure | kvpool | baseline | ratio | goal |",
        "|---|---|---|---|---|",
        f"| KV pull, GET /kv with `pull_blocks`, {size}, MB/s (median, range) "
        f"| {spread(r['pull_mb_s'])} "
        f"| minimal server, same bytes and client: {spread(r['raw_mb_s'])} "
        f"| {mb_s / raw_mb_s:.2f}x | >= {GOAL_MB_S:.0f} MB/s: {met(mb_s >= GOAL_MB_S)} |",
        f"| decode worker's own pull + import (`kv_pull_seconds`), MB/s "
        f"| {spread(r['decode_pull_mb_s'])} | the pull alone (row 1): {spread(r['pull_mb_s'])} "
        f"| {decode_mb_s / mb_s:.2f}x | - |",
        f"| KV pull from a prefill worker decoding {args.streams} streams "
        f"(its step {b['prefill_step_ms']:.0f} ms), MB/s | {spread(b['busy_pull_mb_s'])} "
        f"| the same worker idle (row 1): {spread(r['pull_mb_s'])} "
        f"| {busy_mb_s / mb_s:.2f}x | - |",
        f"| decode worker: inter-token latency p90 of {args.streams} streams during "
        f"back-to-back decode legs ({args.pulls} hand-offs of {size}), ms "
        f"| {itl_during * 1000:.1f} | the same streams, no hand-off: {itl_alone * 1000:.1f} "
        f"| {itl_ratio:.2f}x | <= {ITL_GOAL:g}x (a step's worth): {met(itl_ratio <= ITL_GOAL)} |",
        f"| decode leg with remote prefill, request time, ms | {ms(r['decode_leg_s'])} "
        f"| recompute the {args.tokens}-token prefill there: {ms(r['recompute_s'])} "
        f"| {leg / recompute:.2f}x | - |",
        f"| breakdown: time to the parsed header of a pull, ms | {ms(res['header_s'])} "
        f"| - | - | - |",
        f"| breakdown: `read_blocks` of {n} blocks in {step}-block chunks, in process, ms "
        f"| {spread(local['read_blocks_ms'])} | - | - | - |",
    ]
    machine = f"{platform.machine()}, {psutil.cpu_count()} CPUs, torch {torch.__version__}, cpu"
    table = "\n".join(rows)
    notes = (
        f"Model: random Llama, {SHAPE['num_hidden_layers']} layers, 8 KV heads of 128, "
        f"float32: 1 MiB per 16-token block. Prompt {args.tokens} tokens = {n} blocks = "
        f"{size} per hand-off. Workers: `kvpool worker serve`, one process each, on "
        f"127.0.0.1; body chunks of `CHUNK_BYTES` = {CHUNK_BYTES / 2**20:g} MiB ({step} "
        f"blocks), the minimal server's too. Repeats: {args.repeats} (a fresh prefill for "
        f"each pull), {args.breakdown_repeats} pulls timed to their header. Decode legs used "
        f"{statistics.median(r['cached_tokens']):.0f} cached prompt tokens (the imported "
        f"blocks). Prefill leg on the prefill worker: {ms(r['prefill_s'])} ms."
    )
    print(table)
    print()
    print(notes)
    figures = {
        "mb_per_s": round(mb_s, 1),
        "mb_per_s_min": round(min(r["pull_mb_s"]), 1),
        "mb_per_s_max": round(max(r["pull_mb_s"]), 1),
        "raw_http_mb_per_s": round(raw_mb_s, 1),
        "ratio_vs_raw_http": round(mb_s / raw_mb_s, 3),
        "decode_pull_mb_per_s": round(decode_mb_s, 1),
        "kv_pull_busy_mb_s": round(busy_mb_s, 1),
        "decode_itl_p90_during_pull_ratio": round(itl_ratio, 3),
        "decode_itl_p90_ms": round(itl_alone * 1000, 2),
        "decode_itl_p90_during_pull_ms": round(itl_during * 1000, 2),
        "decode_leg_ms": round(leg * 1000, 1),
        "recompute_ms": round(recompute * 1000, 1),
        "decode_leg_vs_recompute": round(leg / recompute, 3),
        "read_blocks_ms": round(statistics.median(local["read_blocks_ms"]), 1),
        "import_blocks_ms": round(local_import_ms, 1),
        "transfer_bytes": res["bytes"],
        "chunk_bytes": CHUNK_BYTES,
        "prompt_tokens": args.tokens,
        "goal_met": mb_s >= GOAL_MB_S,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kv_transfer.md").write_text(
        f"# KV hand-off throughput (loopback)\n\n{dt.date.today()}, {machine}\n\n"
        f"{table}\n\n{notes}\n"
    )
    (RESULTS / "kv_transfer.json").write_text(
        json.dumps(
            {
                **figures,
                "date": str(dt.date.today()),
                "machine": machine,
                "detail": {
                    **r,
                    "header_s": res["header_s"],
                    "in_process": local,
                    "busy": {k: v for k, v in b.items() if not k.startswith("itl_")},
                },
            },
            indent=2,
        )
        + "\n"
    )
    return figures


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "--raw-server":
        port, header, size, chunk = sys.argv[2:6]
        raw_server_main(int(port), bytes.fromhex(header), int(size), int(chunk))
        sys.exit(0)
    os.environ.setdefault("PYTHONSAFEPATH", "1")
    main()
