"""KV hand-off throughput on loopback: a prefill worker's blocks pulled by a decode worker.

Two real worker servers (``kvpool worker serve``, one process each, role prefill and role
decode) on 127.0.0.1 serve a random Llama whose KV block is 1 MiB in float32 (8 layers,
8 KV heads of 128, block size 16), so a 2,048-token prompt hands off 128 MiB. Each repeat:

* pull: a fresh prefill leg (``do_remote_decode``, max_tokens 1) on the prefill worker,
  then ``GET /kv/{id}`` timed end to end with ``pull_blocks``, the decode worker's own
  client code; then the DELETE that releases the pin. Goal: >= 200 MB/s (median).
* baseline, same run: the same bytes, in the same transfer format, from a minimal asyncio
  server holding them in memory, read by the same ``pull_blocks`` (what the client and
  loopback cost with no server-side work).
* decode leg: a fresh prefill, then the decode worker's request with its
  ``kv_transfer_params``; its own ``kvpool_worker_kv_pull_seconds`` (pull + import) and
  received bytes from /metrics, split into its ``pull_blocks`` and ``import_blocks`` by
  timers the benchmark's launcher wraps around them, and the request's time to its one
  token, against recomputing a fresh prompt of the same length on the decode worker.

A breakdown (instrumented pull, ``read_blocks`` and ``import_blocks`` in this process, a
plain socket read of the same bytes) says where the time goes.

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


# -- the processes this benchmark starts -------------------------------------------------------
def worker_main(argv: list[str]) -> int:
    """``kvpool worker <argv>``; ``--chunk-blocks N`` first sets the transfer's chunk size
    (the proposed fix, measured beside the default). With ``KVPOOL_BENCH_KV_TRACE`` set
    to a file, the decode side's two halves of a hand-off are timed there: a line
    ``pull SECONDS BYTES`` per ``pull_blocks`` and ``import SECONDS`` per
    ``import_blocks``."""
    from kvpool.worker import cli, kv_transfer, server
    from kvpool.worker.engine import EngineCore

    if argv[:1] == ["--chunk-blocks"]:
        kv_transfer.CHUNK_BLOCKS = int(argv[1])
        argv = argv[2:]
    if path := os.environ.get("KVPOOL_BENCH_KV_TRACE"):
        out = open(path, "a", buffering=1)  # open for the life of the process
        pull, import_blocks = server.pull_blocks, EngineCore.import_blocks

        async def timed_pull(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            header, data = await pull(*args, **kwargs)
            out.write(f"pull {time.perf_counter() - start!r} {len(data)}\n")
            return header, data

        def timed_import(*args: Any, **kwargs: Any) -> int:
            start = time.perf_counter()
            stored = import_blocks(*args, **kwargs)
            out.write(f"import {time.perf_counter() - start!r}\n")
            return stored

        server.pull_blocks = timed_pull  # type: ignore[assignment]
        EngineCore.import_blocks = timed_import  # type: ignore[method-assign]
    return cli.main(argv)


def raw_server_main(port: int, header: bytes, body_bytes: int, chunk: int) -> None:
    """The baseline: an HTTP/1.1 server that answers every GET with ``header`` and
    ``body_bytes`` zero bytes, already in memory, written ``chunk`` bytes at a time."""
    payload = header + bytes(body_bytes)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while await reader.readline():
                while (await reader.readline()) not in (b"\r\n", b""):
                    pass
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
                    b"content-length: %d\r\n\r\n" % len(payload)
                )
                view = memoryview(payload)
                for start in range(0, len(payload), chunk):
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


def read_lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def log_tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


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


def scrape(text: str) -> dict[str, float]:
    """The decode worker's hand-off series, summed over label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvpool_worker_kv_pull_seconds_sum":
                out["pull_seconds"] = out.get("pull_seconds", 0.0) + s.value
            elif s.name == "kvpool_worker_kv_pull_seconds_count":
                out["pulls"] = out.get("pulls", 0.0) + s.value
            elif (
                s.name == "kvpool_worker_kv_transfer_bytes_total"
                and s.labels.get("direction") == "received"
            ):
                out["received"] = out.get("received", 0.0) + s.value
            elif s.name == "kvpool_worker_kv_transfer_fallbacks_total":
                out["fallbacks"] = out.get("fallbacks", 0.0) + s.value
    return out


async def instrumented_pull(client: Any, url: str) -> dict[str, float]:
    """The loop of ``pull_blocks``, timing each piece: time to first byte and to the
    parsed header, and the stalls (gaps over 2 ms between pieces, when the server is
    reading blocks rather than sending)."""
    from kvpool.worker.kv_transfer import _parse_header

    buf = bytearray()
    header = None
    start = time.perf_counter()
    first = header_at = None
    last = start
    stalls: list[float] = []
    pieces = 0
    async with client.stream("GET", url, timeout=120) as response:
        async for piece in response.aiter_raw():
            now = time.perf_counter()
            if first is None:
                first = now - start
            elif now - last > 0.002:
                stalls.append(now - last)
            last = now
            pieces += 1
            buf += piece
            if header is None and (parsed := _parse_header(buf)) is not None:
                header = parsed[0]
                header_at = now - start
    total = time.perf_counter() - start
    return {
        "total_s": total,
        "first_byte_s": first or 0.0,
        "header_s": header_at or 0.0,
        "stall_s": sum(stalls),
        "stalls": len(stalls),
        "longest_stall_s": max(stalls, default=0.0),
        "pieces": pieces,
        "mb_per_s": len(buf) / total / MB,
    }


def socket_read(port: int, nbytes: int) -> float:
    """A plain blocking socket reading the baseline server's body into one preallocated
    buffer: the loopback's own speed, without an HTTP client."""
    buf = bytearray(nbytes + 65536)
    view = memoryview(buf)
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /kv HTTP/1.1\r\nhost: x\r\n\r\n")
        got = 0
        head_end = -1
        total = None
        while total is None or got < total:
            n = s.recv_into(view[got:])
            if not n:
                break
            got += n
            if head_end < 0 and (head_end := bytes(buf[: min(got, 4096)]).find(b"\r\n\r\n")) >= 0:
                head = bytes(buf[:head_end]).decode().lower()
                length = int(head.split("content-length:")[1].split("\r\n")[0])
                total = head_end + 4 + length
    return time.perf_counter() - start


def in_process(model_dir: Path, num_tokens: int, small_chunk: int, repeats: int) -> dict[str, Any]:
    """``read_blocks`` of a whole prompt's blocks, chunk by chunk as ``stream_blocks``
    reads them (default chunk and ``small_chunk``), and ``import_blocks`` of them, on an
    engine in this process (no HTTP)."""
    from kvpool.worker.engine import EngineConfig, LLMEngine
    from kvpool.worker.kv_transfer import CHUNK_BLOCKS

    blocks = num_tokens // 16
    engine = LLMEngine.from_pretrained(
        model_dir,
        EngineConfig(num_blocks=blocks * (repeats + 2), device="cpu", dtype="float32"),
    )
    engine.runner.kv_cache.normal_()
    layout = engine.kv_layout
    rng = random.Random(7)
    vocab = engine.vocab_size
    ids = list(range(blocks))
    read_ms: dict[int, list[float]] = {CHUNK_BLOCKS: [], small_chunk: []}
    import_ms = []
    data = bytearray(layout.block_bytes * blocks)
    for _ in range(repeats):
        for size, times in read_ms.items():
            start = time.perf_counter()
            for at in range(0, blocks, size):
                engine.read_blocks(ids[at : at + size])
            times.append((time.perf_counter() - start) * 1000)
    for _ in range(repeats):
        prompt = [rng.randrange(8, vocab) for _ in range(num_tokens)]
        chain = engine.hasher.chain()
        chain.extend(prompt)
        start = time.perf_counter()
        stored = engine.import_blocks(prompt, chain.keys, data)
        import_ms.append((time.perf_counter() - start) * 1000)
        assert stored == blocks, stored
    return {
        "read_blocks_ms": read_ms[CHUNK_BLOCKS],
        "read_blocks_small_chunks_ms": read_ms[small_chunk],
        "import_blocks_ms": import_ms,
    }


async def run(args: argparse.Namespace, model_dir: Path, tmp: Path) -> dict[str, Any]:
    import httpx

    from kvpool.worker.engine import KVLayout
    from kvpool.worker.kv_transfer import CHUNK_BLOCKS, TransferHeader, pull_blocks

    me = ME
    num_blocks = str(args.tokens // 16 * 4 + 64)
    common = ["--model", str(model_dir), "--device", "cpu", "--dtype", "float32"]
    common += ["--num-blocks", num_blocks, "--drain-timeout-s", "1"]
    common += ["--max-num-batched-tokens", str(max(2048, args.tokens))]
    p_port, s_port, d_port, r_port = free_port(), free_port(), free_port(), free_port()
    prefill_url, decode_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    small_url = f"http://127.0.0.1:{s_port}"

    blocks = args.tokens // 16
    layout = KVLayout("float32", [SHAPE["num_hidden_layers"], 2, 16, 8, 128])
    fake = TransferHeader("raw", "float32", layout.block_shape, layout.layout,
                          layout.block_bytes, 16, args.tokens, list(range(blocks)))  # fmt: skip
    chunk = CHUNK_BLOCKS * layout.block_bytes
    raw = [me, "--raw-server", str(r_port), fake.encode().hex(), str(fake.body_bytes), str(chunk)]
    worker = [sys.executable, me, "--worker"]
    serve = ["serve", *common]
    small = ["--chunk-blocks", str(args.small_chunk_blocks)]
    kv_trace = tmp / "kv_trace.log"
    with (
        process([*worker, *serve, "--role", "prefill", "--port", str(p_port)], tmp / "p.log") as p,
        process(
            [*worker, *small, *serve, "--role", "prefill", "--port", str(s_port)], tmp / "s.log"
        ) as ps,
        process(
            [*worker, *serve, "--role", "decode", "--port", str(d_port)],
            tmp / "d.log",
            {**os.environ, "KVPOOL_BENCH_KV_TRACE": str(kv_trace)},
        ) as d,
        process([sys.executable, *raw], tmp / "r.log"),
    ):
        async with httpx.AsyncClient(timeout=300) as client:
            await wait_ready(client, f"{prefill_url}/health", p, tmp / "p.log")
            await wait_ready(client, f"{small_url}/health", ps, tmp / "s.log")
            await wait_ready(client, f"{decode_url}/health", d, tmp / "d.log")
            rng = random.Random(0)

            def prompt() -> list[int]:
                return [rng.randrange(8, 512) for _ in range(args.tokens)]

            async def pull(base: str) -> tuple[Any, int, float, float]:
                """A fresh prefill, then its pull; (header, bytes, prefill s, pull s)."""
                params, prefill_s = await prefill_leg(client, base, prompt())
                start = time.perf_counter()
                header, data = await pull_blocks(client, kv_url(params), timeout=120)
                pull_s = time.perf_counter() - start
                await client.delete(kv_url(params))
                return header, len(data), prefill_s, pull_s

            raw_url = f"http://127.0.0.1:{r_port}/kv/raw"
            # warm up: first-call costs of the workers, the client and the raw server
            await pull(prefill_url)
            await pull(small_url)
            params, _ = await prefill_leg(client, prefill_url, prompt())
            await completion(client, decode_url, prompt(), kv_transfer_params=params)
            await pull_blocks(client, raw_url)

            r: dict[str, list[float]] = {k: [] for k in (
                "pull_mb_s", "small_chunk_mb_s", "raw_mb_s", "prefill_s", "pull_s",
                "decode_leg_s", "decode_pull_s", "decode_pull_mb_s", "recompute_s",
                "decode_inner_pull_mb_s", "decode_import_ms",
                "cached_tokens",
            )}  # fmt: skip
            nbytes = 0
            for i in range(args.repeats):
                # 1. the pull, with the decode worker's client code
                header, nbytes, prefill_s, pull_s = await pull(prefill_url)
                r["prefill_s"].append(prefill_s)
                r["pull_s"].append(pull_s)
                r["pull_mb_s"].append(nbytes / pull_s / MB)
                # 2. the same from a prefill worker with smaller body chunks
                _, n, _, small_s = await pull(small_url)
                r["small_chunk_mb_s"].append(n / small_s / MB)
                # 3. the same bytes from the minimal server, same client
                start = time.perf_counter()
                _, data = await pull_blocks(client, raw_url, timeout=120)
                r["raw_mb_s"].append(len(data) / (time.perf_counter() - start) / MB)
                del data
                # 4. the decode leg, as a router would send it
                params, _ = await prefill_leg(client, prefill_url, p2 := prompt())
                before = scrape((await client.get(f"{decode_url}/metrics")).text)
                body, leg_s = await completion(client, decode_url, p2, kv_transfer_params=params)
                after = scrape((await client.get(f"{decode_url}/metrics")).text)
                if after.get("fallbacks", 0) > before.get("fallbacks", 0):
                    raise RuntimeError(f"the decode leg fell back to recomputing:\n{tail(tmp)}")
                got = after["received"] - before.get("received", 0.0)
                pulled = after["pull_seconds"] - before.get("pull_seconds", 0.0)
                r["decode_leg_s"].append(leg_s)
                r["decode_pull_s"].append(pulled)
                r["decode_pull_mb_s"].append(got / pulled / MB)
                lines = read_lines(kv_trace)
                pull_line = next(x for x in reversed(lines) if x.startswith("pull "))
                import_line = next(x for x in reversed(lines) if x.startswith("import "))
                _, inner_s, inner_bytes = pull_line.split()
                r["decode_inner_pull_mb_s"].append(int(inner_bytes) / float(inner_s) / MB)
                r["decode_import_ms"].append(float(import_line.split()[1]) * 1000)
                r["cached_tokens"].append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
                # 5. the alternative to a hand-off: compute the prefill on the decode worker
                _, recompute_s = await completion(client, decode_url, prompt())
                r["recompute_s"].append(recompute_s)
                print(
                    f"  repeat {i + 1}/{args.repeats}: pull {r['pull_mb_s'][-1]:.0f} MB/s, "
                    f"small chunks {r['small_chunk_mb_s'][-1]:.0f} MB/s, "
                    f"raw {r['raw_mb_s'][-1]:.0f} MB/s, decode leg {leg_s:.3f} s, "
                    f"recompute {recompute_s:.3f} s",
                    file=sys.stderr,
                )

            breakdown: list[dict[str, float]] = []
            for _ in range(args.breakdown_repeats):
                params, _ = await prefill_leg(client, prefill_url, prompt())
                breakdown.append(await instrumented_pull(client, kv_url(params)))
                await client.delete(kv_url(params))
            sock_s = [socket_read(r_port, len(fake.encode()) + fake.body_bytes) for _ in range(3)]
    r["socket_mb_s"] = [(len(fake.encode()) + fake.body_bytes) / s / MB for s in sock_s]
    return {"runs": r, "bytes": nbytes, "blocks": len(header.block_hashes), "pulls": breakdown}


def tail(tmp: Path) -> str:
    return "\n".join(f"{p.name}: {p.read_text()[-2000:]}" for p in sorted(tmp.glob("*.log")))


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length (x16 = blocks)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--breakdown-repeats", type=int, default=3)
    parser.add_argument(
        "--small-chunk-blocks",
        type=int,
        default=8,
        help="chunk size of the second prefill worker (the proposed CHUNK_BLOCKS)",
    )
    parser.add_argument("--quick", action="store_true", help="3 repeats, 1,024 tokens")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.tokens, args.breakdown_repeats = 3, 1024, 2
    args.tokens -= args.tokens % 16

    import psutil
    import torch
    from transformers.utils import logging as hf_logging

    from kvpool.worker.kv_transfer import CHUNK_BLOCKS
    from kvpool.worker.tiny import make_tiny_model

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        model_dir = make_tiny_model(tmp / "model", **SHAPE)
        res = asyncio.run(run(args, model_dir, tmp))
        local = in_process(model_dir, args.tokens, args.small_chunk_blocks, repeats=7)

    r = res["runs"]
    mb_s = statistics.median(r["pull_mb_s"])
    raw_mb_s = statistics.median(r["raw_mb_s"])
    leg, recompute = statistics.median(r["decode_leg_s"]), statistics.median(r["recompute_s"])
    pulls = res["pulls"]

    def met(ok: bool) -> str:
        return "met" if ok else "MISSED"

    def ms(xs: list[float]) -> str:
        return median_spread([x * 1000 for x in xs], ".0f")

    size = f"{res['bytes'] / 2**20:.0f} MiB"
    small_mb_s = statistics.median(r["small_chunk_mb_s"])
    read_ratio = statistics.median(local["read_blocks_small_chunks_ms"]) / statistics.median(
        local["read_blocks_ms"]
    )
    k = args.small_chunk_blocks
    rows = [
        "| Figure | kvpool | baseline | ratio | goal |",
        "|---|---|---|---|---|",
        f"| KV pull, GET /kv with `pull_blocks`, {size}, MB/s (median, range) "
        f"| {median_spread(r['pull_mb_s'], '.0f')} "
        f"| minimal server, same bytes and client: {median_spread(r['raw_mb_s'], '.0f')} "
        f"| {mb_s / raw_mb_s:.2f}x | >= {GOAL_MB_S:.0f} MB/s: {met(mb_s >= GOAL_MB_S)} |",
        f"| KV pull as above, prefill worker with `CHUNK_BLOCKS = {k}` (proposed), MB/s "
        f"| {median_spread(r['small_chunk_mb_s'], '.0f')} "
        f"| `CHUNK_BLOCKS = {CHUNK_BLOCKS}` (now): {median_spread(r['pull_mb_s'], '.0f')} "
        f"| {small_mb_s / mb_s:.2f}x | >= {GOAL_MB_S:.0f} MB/s: {met(small_mb_s >= GOAL_MB_S)} |",
        f"| decode worker's own pull + import (`kv_pull_seconds`), MB/s "
        f"| {median_spread(r['decode_pull_mb_s'], '.0f')} | - | - | - |",
        f"| ... of which `pull_blocks` in the decode worker, MB/s "
        f"| {median_spread(r['decode_inner_pull_mb_s'], '.0f')} "
        f"| the same client code in this process (row 1): {median_spread(r['pull_mb_s'], '.0f')} "
        f"| {statistics.median(r['decode_inner_pull_mb_s']) / mb_s:.2f}x | - |",
        f"| ... and `import_blocks` in the decode worker, ms "
        f"| {median_spread(r['decode_import_ms'], '.0f')} | - | - | - |",
        f"| decode leg with remote prefill, request time, ms | {ms(r['decode_leg_s'])} "
        f"| recompute the {args.tokens}-token prefill there: {ms(r['recompute_s'])} "
        f"| {leg / recompute:.2f}x | - |",
        f"| breakdown: time to the parsed header, ms | {ms([p['header_s'] for p in pulls])} "
        f"| - | - | - |",
        f"| breakdown: server stalls in a pull (gaps > 2 ms), ms "
        f"| {ms([p['stall_s'] for p in pulls])} | - | - | - |",
        f"| breakdown: `read_blocks` of {res['blocks']} blocks in {k}-block chunks, in "
        f"process, ms | {median_spread(local['read_blocks_small_chunks_ms'], '.0f')} "
        f"| in {CHUNK_BLOCKS}-block chunks (now): "
        f"{median_spread(local['read_blocks_ms'], '.0f')} "
        f"| {read_ratio:.2f}x | - |",
        f"| breakdown: `import_blocks` of {res['blocks']} blocks, in process, ms "
        f"| {median_spread(local['import_blocks_ms'], '.0f')} | - | - | - |",
        f"| loopback floor: plain socket into one buffer, MB/s "
        f"| - | {median_spread(r['socket_mb_s'], '.0f')} | - | - |",
    ]
    machine = f"{platform.machine()}, {psutil.cpu_count()} CPUs, torch {torch.__version__}, cpu"
    table = "\n".join(rows)
    notes = (
        f"Model: random Llama, {SHAPE['num_hidden_layers']} layers, 8 KV heads of 128, "
        f"float32: 1 MiB per 16-token block. Prompt {args.tokens} tokens = {res['blocks']} "
        f"blocks = {size} per hand-off. Workers: `kvpool worker serve`, one process each, "
        f"on 127.0.0.1; body chunks of {CHUNK_BLOCKS} blocks (the second prefill worker: the "
        f"same command with `kv_transfer.CHUNK_BLOCKS = {args.small_chunk_blocks}` set first). "
        f"Repeats: {args.repeats} "
        f"(a fresh prefill for each pull), {args.breakdown_repeats} instrumented pulls. "
        f"Decode legs used {statistics.median(r['cached_tokens']):.0f} cached prompt tokens "
        f"(the imported blocks). Prefill leg on the prefill worker: "
        f"{ms(r['prefill_s'])} ms."
    )
    print(table)
    print()
    print(notes)
    figures = {
        "mb_per_s": round(mb_s, 1),
        "mb_per_s_min": round(min(r["pull_mb_s"]), 1),
        "mb_per_s_max": round(max(r["pull_mb_s"]), 1),
        "raw_http_mb_per_s": round(raw_mb_s, 1),
        f"mb_per_s_chunk_{args.small_chunk_blocks}_blocks": round(small_mb_s, 1),
        "ratio_vs_raw_http": round(mb_s / raw_mb_s, 3),
        "decode_pull_mb_per_s": round(statistics.median(r["decode_pull_mb_s"]), 1),
        "decode_worker_pull_blocks_mb_per_s": round(
            statistics.median(r["decode_inner_pull_mb_s"]), 1
        ),
        "decode_worker_import_blocks_ms": round(statistics.median(r["decode_import_ms"]), 1),
        "decode_leg_ms": round(leg * 1000, 1),
        "recompute_ms": round(recompute * 1000, 1),
        "decode_leg_vs_recompute": round(leg / recompute, 3),
        "transfer_bytes": res["bytes"],
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
                "detail": {**r, "instrumented_pulls": pulls, "in_process": local},
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
