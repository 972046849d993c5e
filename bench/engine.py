"""The worker engine on CPU against Hugging Face ``generate``, on the same tiny model.

Four figures, each from one run on this machine:

* ragged batch: 32 requests (prompts 32-512 tokens, max_tokens 16-256), all submitted at
  once; useful output tokens per second, ours (continuous batching, no padding) against
  HF ``generate`` on the same batch left-padded (it decodes until the longest is done).
  Goal: >= 1.5x.
* prefix cache: time to first token of a 1024-token shared prefix + 16-token suffix when
  the prefix is cached (hit) against when it is not (miss). Goal: hit <= 0.2x miss.
* scheduler: time of one ``Scheduler.schedule()`` call with 256 running requests. Goal:
  <= 1 ms.
* memory: resident set size after 1,000 sequential requests against after 10. Goal: no
  growth (within 5 MB of allocator noise).
* decode step: one engine step of 16 decoding requests at contexts of 256, 1k, 4k and 16k
  tokens, on the gather path (each context copied into a padded batch), the paged path
  (reading the cache in place: FlexAttention through Triton on CUDA, the C kernel on CPU,
  with FlexAttention through inductor timed beside it on CPU) and Hugging Face with its KV
  cache (a ``DynamicCache`` of the same length). Goal: the paged step grows no faster than
  the KV bytes it reads.
* decode throughput: output tokens/s at batch 1, 32 and 128 (128-token prompts, 128 new
  tokens each), both paths against HF ``generate``.

Writes bench/results/engine.{md,json}. ``--device cuda --dtype bfloat16 --shape
llama-3.2-1b`` runs the same figures on a GPU (HF side in the same dtype) with a random model
of Llama-3.2-1B's shape, since nothing can be downloaded; results go to
``engine_cuda_bfloat16.{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import torch

from kvpool.hashing import BlockHasher
from kvpool.worker.block_pool import BlockPool
from kvpool.worker.engine import EngineConfig, LLMEngine
from kvpool.worker.loader import load_model, load_tokenizer
from kvpool.worker.scheduler import Scheduler, SchedulerConfig
from kvpool.worker.sequence import SamplingParams, Sequence
from kvpool.worker.tiny import make_tiny_model

RESULTS = Path(__file__).parent / "results"
GOALS = {"ragged": 1.5, "prefix": 0.2, "scheduler_ms": 1.0, "rss_mb": 5.0}
CONTEXTS = {"256": 256, "1k": 1024, "4k": 4096, "16k": 16384}
SHAPES = {
    # the tiny model, with room for the 16k-token contexts of the decode table
    "tiny": {"max_position_embeddings": 16384 + 512},
    # Llama-3.2-1B's config (random weights: nothing is downloaded)
    "llama-3.2-1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
    },
}
SECTIONS = ("ragged", "prefix", "scheduler", "memory", "decode", "throughput")


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _load_hf(model_dir: Path, device: str, dtype: str):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    hf = hf.to(device).eval()
    hf.generation_config.eos_token_id = None
    return hf


def decode_steps(model, tokenizer, hf, device: str, batch: int, steps: int) -> dict:
    """Median time of one decode step of ``batch`` requests at each context, per path."""
    rng = random.Random(4)
    c = model.config
    paths = _paths(device)
    out: dict[str, dict[str, list[float]]] = {p: {} for p in (*paths, "hf")}
    for label, ctx in CONTEXTS.items():
        prompts = [[rng.randrange(3, c.vocab_size) for _ in range(ctx)] for _ in range(batch)]
        # early requests decode while later ones prefill: room for those tokens too
        max_tokens = steps + 4 + batch * ctx // 8192
        blocks = batch * -(-(ctx + max_tokens + 16) // 16) + 16
        for path in paths:
            try:
                out[path][label] = _engine_decode_steps(
                    model, tokenizer, device, path, batch, blocks, prompts, max_tokens, steps
                )
            except Exception as e:  # a path that cannot run here is a row's finding
                print(f"{path} at {label}: {e!r}", flush=True)
                out[path][label] = [float("nan")]
            gc.collect()
        out["hf"][label] = hf_decode_steps(hf, c, device, batch, ctx, steps)
    return out


def _paths(device: str) -> tuple[str, ...]:
    """The engine's decode paths to time: on CPU the paged path is the C kernel, and
    FlexAttention (what the paged path is on CUDA) is timed beside it, the measurement
    that chose it."""
    return ("gather", "paged") if device.startswith("cuda") else ("gather", "paged", "flex")


def _engine_decode_steps(
    model, tokenizer, device, path, batch, blocks, prompts, max_tokens, steps
) -> list[float]:
    """One path's decode steps: prefill every request, then time whole steps."""
    config = EngineConfig(
        num_blocks=blocks,
        device=device,
        attention=path,
        max_num_seqs=batch,
        max_num_batched_tokens=8192,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(model, tokenizer, config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    streams = [engine.add_request(p, params) for p in prompts]
    first = set()
    while len(first) < batch:  # prefill, to every request's first token
        first.update(o.request_id for o in engine.step())
        if not engine.has_unfinished():
            raise RuntimeError(f"the {path} path failed (logged above)")
    for _ in range(2):  # the first decode steps compile (paged) and warm caches
        engine.step()
    times = []
    for _ in range(steps - 2):
        _sync(device)
        start = time.perf_counter()
        done = engine.step()
        times.append((time.perf_counter() - start) * 1000)
        assert len(done) == batch, (len(done), path)
    for stream in streams:
        engine.abort(stream.request_id)
    return times


def hf_decode_steps(hf, c, device: str, batch: int, ctx: int, steps: int) -> list[float]:
    """HF's decode step over a ``DynamicCache`` already ``ctx`` tokens long (random keys
    and values: the step's cost does not depend on them)."""
    from transformers import DynamicCache

    dtype = next(hf.parameters()).dtype
    cache = DynamicCache()
    for layer in range(c.num_layers):
        shape = (batch, c.num_kv_heads, ctx, c.head_dim)
        cache.update(
            torch.randn(shape, dtype=dtype, device=device),
            torch.randn(shape, dtype=dtype, device=device),
            layer,
        )
    ids = torch.randint(3, c.vocab_size, (batch, 1), device=device)
    times = []
    with torch.inference_mode():
        for i in range(steps):
            position = torch.full((batch, 1), ctx + i, device=device)
            _sync(device)
            start = time.perf_counter()
            logits = hf(
                input_ids=ids, position_ids=position, past_key_values=cache, use_cache=True
            ).logits
            ids = logits[:, -1:].argmax(-1)
            _sync(device)
            if i >= 2:
                times.append((time.perf_counter() - start) * 1000)
    del cache
    gc.collect()
    return times


def decode_throughput(model, tokenizer, hf, device: str, batches, new_tokens: int) -> dict:
    """Output tokens/s of ``batch`` requests (128-token prompts) decoded together."""
    rng = random.Random(5)
    vocab = model.config.vocab_size
    out: dict[str, dict[str, float]] = {"gather": {}, "paged": {}, "hf": {}}
    for batch in batches:
        prompts = [[rng.randrange(3, vocab) for _ in range(128)] for _ in range(batch)]
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        blocks = batch * -(-(128 + new_tokens) // 16) + 16
        for path in ("gather", "paged"):
            config = EngineConfig(
                num_blocks=blocks, device=device, attention=path, max_num_seqs=max(batch, 2)
            )
            engine = LLMEngine(model, tokenizer, config)
            engine.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # compile
            _sync(device)
            start = time.perf_counter()
            done = engine.generate(prompts, params)
            rate = batch * new_tokens / (time.perf_counter() - start)
            failed = any(d.finish_reason == "error" for d in done)
            out[path][str(batch)] = float("nan") if failed else rate
            del engine
        ids = torch.tensor(prompts, device=device)
        with torch.inference_mode():
            hf.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
            _sync(device)
            start = time.perf_counter()
            hf.generate(
                ids,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            _sync(device)
        out["hf"][str(batch)] = batch * new_tokens / (time.perf_counter() - start)
    return out


def median_spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3g} ({min(xs):.3g}-{max(xs):.3g})"


def ragged(model, tokenizer, model_dir: Path, device: str, dtype: str, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    rng = random.Random(0)
    vocab = model.config.vocab_size
    reqs = [
        ([rng.randrange(3, vocab) for _ in range(rng.randint(32, 512))], rng.randint(16, 256))
        for _ in range(32)
    ]
    useful = sum(m for _, m in reqs)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in reqs]
    ours, outputs = [], None
    warm = LLMEngine(model, tokenizer, EngineConfig(num_blocks=64, device=device))
    warm.generate([reqs[0][0][:64]], SamplingParams(max_tokens=4))  # first-call costs
    for _ in range(repeats):
        engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=2048, device=device))
        start = time.perf_counter()
        done = engine.generate([p for p, _ in reqs], params)
        ours.append(useful / (time.perf_counter() - start))
        outputs = [d.token_ids for d in done]

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    hf = hf.to(device).eval()
    hf.generation_config.eos_token_id = None
    pad = tokenizer.pad_token_id
    width = max(len(p) for p, _ in reqs)
    ids = torch.full((len(reqs), width), pad)
    mask = torch.zeros(len(reqs), width, dtype=torch.long)
    for i, (p, _) in enumerate(reqs):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    theirs, agree = [], 0
    with torch.inference_mode():  # first-call costs, as on our side
        hf.generate(ids[:1, -64:], max_new_tokens=4, do_sample=False, pad_token_id=pad)
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(m for _, m in reqs),
                do_sample=False,
                pad_token_id=pad,
            )
        theirs.append(useful / (time.perf_counter() - start))
        agree = sum(
            out[i, width : width + m].tolist() == outputs[i] for i, (_, m) in enumerate(reqs)
        )
    return {
        "ours": ours,
        "hf": theirs,
        "speedup": statistics.median(ours) / statistics.median(theirs),
        "useful_tokens": useful,
        "outputs_equal": agree,
    }


def prefix(model, tokenizer, device: str, trials: int) -> dict:
    engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=1024, device=device))
    rng = random.Random(1)
    vocab = model.config.vocab_size
    one = SamplingParams(max_tokens=1, temperature=0)

    def ttft(prompt: list[int]) -> float:
        start = time.perf_counter()
        engine.generate([prompt], one)
        return time.perf_counter() - start

    ttft([rng.randrange(3, vocab) for _ in range(1040)])  # warm up
    miss, hit = [], []
    for _ in range(trials):
        shared = [rng.randrange(3, vocab) for _ in range(1024)]
        miss.append(ttft(shared + [rng.randrange(3, vocab) for _ in range(16)]))
        hit.append(ttft(shared + [rng.randrange(3, vocab) for _ in range(16)]))
    stats = engine.stats
    return {
        "miss_ms": [x * 1000 for x in miss],
        "hit_ms": [x * 1000 for x in hit],
        "ratio": statistics.median(hit) / statistics.median(miss),
        "hit_tokens": stats.prefix_cache_hits,
    }


def scheduler(steps: int) -> dict:
    """256 decoding requests; the engine's bookkeeping runs outside the timed call."""
    block = 16
    hasher = BlockHasher(block_size=block)
    pool = BlockPool(256 * 40, block)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=65536, max_num_seqs=256), pool)
    rng = random.Random(2)
    for i in range(256):
        prompt = [rng.randrange(3, 32000) for _ in range(rng.randint(32, 200))]
        chain = hasher.chain()
        chain.extend(prompt)
        sched.add(Sequence(f"r{i}", prompt, len(prompt), SamplingParams(max_tokens=10**6), chain))
    times = []
    for step in range(steps + 1):
        start = time.perf_counter()
        batch = sched.schedule()
        elapsed = time.perf_counter() - start
        if step:  # the first call admits 256 prefills, not a steady step
            times.append(elapsed * 1000)
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            seq.num_computed_tokens += n
            seq.append_token(rng.randrange(3, 32000))
    assert len(sched.running) == 256
    return {"ms": times}


def memory(model, tokenizer, device: str, total: int) -> dict:
    engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=256, device=device))
    rng = random.Random(3)
    vocab = model.config.vocab_size
    params = SamplingParams(max_tokens=8, temperature=0.8)
    process = psutil.Process()
    marks = {}
    for i in range(1, total + 1):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(16, 96))]
        engine.generate([prompt], params)
        if i in (10, total):
            gc.collect()
            marks[i] = process.memory_info().rss / 2**20
    return {
        "rss_10_mb": marks[10],
        f"rss_{total}_mb": marks[total],
        "growth_mb": marks[total] - marks[10],
    }


def _ms(xs: list[float]) -> float:
    return round(statistics.median(xs), 3)


def decode_rows(d: dict, c, dtype: str, batch: int) -> tuple[list[str], dict]:
    """The decode-step table, and whether the paged step grows no faster than its bytes."""
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * itemsize
    flex = "flex" in d
    kernel = "C kernel" if flex else "FlexAttention"
    rows = [
        f"| context | KV read per step | gather, ms | paged ({kernel}), ms "
        + ("| FlexAttention (inductor), ms " if flex else "")
        + "| HF + KV cache, ms | paged / gather | paged / HF |",
        "|---|---|---|---|---|---|---|" + ("---|" if flex else ""),
    ]
    for label, ctx in CONTEXTS.items():
        g, p, h = (_ms(d[k][label]) for k in ("gather", "paged", "hf"))
        f = f" {_ms(d['flex'][label])} |" if flex else ""
        mib = batch * ctx * per_token / 2**20
        rows.append(
            f"| {label} | {mib:,.1f} MiB | {g} | {p} |{f} {h} | {p / g:.2f} | {p / h:.2f} |"
        )
    first, last = "256", "16k"
    growth = _ms(d["paged"][last]) / _ms(d["paged"][first])
    bytes_growth = CONTEXTS[last] / CONTEXTS[first]
    return rows, {"paged_growth": round(growth, 2), "bytes_growth": bytes_growth}


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=1000, help="for the memory figure")
    parser.add_argument("--batch", type=int, default=16, help="for the decode-step table")
    parser.add_argument("--throughput-batches", default="1,32,128")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    if unknown := sections - set(SECTIONS):
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    figures: dict = {}
    detail: dict = {}
    rows = [
        "| Figure | kvpool | baseline | ratio | goal |",
        "|---|---|---|---|---|",
    ]
    extra: list[str] = []
    notes: list[str] = []

    def met(ok: bool) -> str:
        return "met" if ok else "MISSED"

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", **SHAPES[args.shape])
        model = load_model(model_dir, dtype=args.dtype, device=args.device)
        tokenizer = load_tokenizer(model_dir)
        if "ragged" in sections:
            r = ragged(model, tokenizer, model_dir, args.device, args.dtype, args.repeats)
            detail["ragged"] = r
            figures["ragged_speedup_vs_hf"] = round(r["speedup"], 3)
            rows.append(
                f"| ragged batch of 32, useful tokens/s (median, range) "
                f"| {median_spread(r['ours'])} | HF generate, padded: {median_spread(r['hf'])} "
                f"| {r['speedup']:.2f}x | >= {GOALS['ragged']}x: "
                f"{met(r['speedup'] >= GOALS['ragged'])} |"
            )
            notes.append(
                f"Ragged batch: {r['useful_tokens']} useful output tokens; greedy outputs "
                f"identical to HF for {r['outputs_equal']}/32 requests; {args.repeats} repeats."
            )
        hf = None
        if sections & {"decode", "throughput"}:
            hf = _load_hf(model_dir, args.device, args.dtype)
        if "decode" in sections:
            d = decode_steps(model, tokenizer, hf, args.device, args.batch, steps=12)
            detail["decode_steps_ms"] = d
            figures["decode_step_ms"] = {
                path: {label: _ms(d[path][label]) for label in CONTEXTS} for path in d
            }
            table, growth = decode_rows(d, model.config, args.dtype, args.batch)
            figures["decode_paged_growth_256_to_16k"] = growth["paged_growth"]
            print("\n".join(table), flush=True)
            ok = growth["paged_growth"] <= growth["bytes_growth"]
            extra += [
                f"Decode step, batch {args.batch} (median of 10 steps):",
                "",
                *table,
                "",
                f"Paged step time grows {growth['paged_growth']}x from 256 to 16k tokens of "
                f"context, against {growth['bytes_growth']:.0f}x the KV bytes: "
                f"{met(ok)}.",
                "",
            ]
        if "throughput" in sections:
            batches = [int(b) for b in args.throughput_batches.split(",")]
            t = decode_throughput(model, tokenizer, hf, args.device, batches, new_tokens=128)
            detail["decode_tokens_per_s"] = t
            print(json.dumps(t), flush=True)
            figures["decode_tokens_per_s"] = {
                path: {b: round(v, 1) for b, v in t[path].items()} for path in t
            }
            extra += [
                "Decode throughput, output tokens/s (128-token prompts, 128 new tokens each):",
                "",
                "| batch | gather | paged | HF generate | paged / HF |",
                "|---|---|---|---|---|",
                *(
                    f"| {b} | {t['gather'][b]:,.0f} | {t['paged'][b]:,.0f} | {t['hf'][b]:,.0f} "
                    f"| {t['paged'][b] / t['hf'][b]:.2f}x |"
                    for b in t["hf"]
                ),
                "",
            ]
        del hf
    if "prefix" in sections:
        p = prefix(model, tokenizer, args.device, trials=5)
        detail["prefix"] = p
        figures["prefix_hit_ttft_ratio"] = round(p["ratio"], 4)
        rows.append(
            f"| TTFT, 1024-token prefix + 16, ms | hit: {median_spread(p['hit_ms'])} "
            f"| miss: {median_spread(p['miss_ms'])} | {p['ratio']:.3f} "
            f"| <= {GOALS['prefix']}: {met(p['ratio'] <= GOALS['prefix'])} |"
        )
    if "scheduler" in sections:
        sc = scheduler(steps=300)
        detail["scheduler_ms"] = sc["ms"]
        sched_ms = statistics.median(sc["ms"])
        figures["scheduler_step_ms_256"] = round(sched_ms, 4)
        rows.append(
            f"| scheduler step, 256 running, ms | {median_spread(sc['ms'])} | - | - "
            f"| <= {GOALS['scheduler_ms']} ms: {met(sched_ms <= GOALS['scheduler_ms'])} |"
        )
    if "memory" in sections:
        m = memory(model, tokenizer, args.device, args.requests)
        detail["memory"] = m
        figures["rss_growth_mb"] = round(m["growth_mb"], 2)
        rows.append(
            f"| RSS after {args.requests} requests vs after 10, MiB "
            f"| {m[f'rss_{args.requests}_mb']:.1f} | {m['rss_10_mb']:.1f} "
            f"| {m['growth_mb']:+.2f} MiB | no growth (<= {GOALS['rss_mb']}): "
            f"{met(m['growth_mb'] <= GOALS['rss_mb'])} |"
        )

    c = model.config
    shape = (
        f"{c.num_layers} layers, hidden {c.hidden_size}, {c.num_heads} heads / "
        f"{c.num_kv_heads} KV heads, head dim {c.head_dim}, vocab {c.vocab_size}"
    )
    device = args.device if args.device != "cuda" else torch.cuda.get_device_name()
    machine = (
        f"{platform.machine()}, {psutil.cpu_count()} CPUs, torch {torch.__version__}, "
        f"device {device}, {args.dtype}"
    )
    model_name = (
        "the tiny random Llama of `kvpool worker make-tiny-model`"
        if args.shape == "tiny"
        else f"a random model of {args.shape}'s shape"
    )
    text = "\n".join(
        [*(rows if len(rows) > 2 else []), "", *extra, f"Model: {model_name} ({shape}).", *notes]
    )
    print(text)
    RESULTS.mkdir(exist_ok=True)
    suffix = "" if args.device == "cpu" else f"_{args.device}_{args.dtype}"
    (RESULTS / f"engine{suffix}.md").write_text(
        f"# Worker engine\n\n{dt.date.today()}, {machine}\n\n{text}\n"
    )
    (RESULTS / f"engine{suffix}.json").write_text(
        json.dumps(
            {**figures, "date": str(dt.date.today()), "machine": machine, "detail": detail},
            indent=2,
        )
        + "\n"
    )
    return figures


if __name__ == "__main__":
    main()
