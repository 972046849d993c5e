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

Writes bench/results/engine.{md,json}. ``--device cuda --dtype bfloat16`` runs the same
figures on a GPU (HF side in the same dtype).
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


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=1000, help="for the memory figure")
    args = parser.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "tiny")
        model = load_model(model_dir, dtype=args.dtype, device=args.device)
        tokenizer = load_tokenizer(model_dir)
        r = ragged(model, tokenizer, model_dir, args.device, args.dtype, args.repeats)
    p = prefix(model, tokenizer, args.device, trials=5)
    s = scheduler(steps=300)
    m = memory(model, tokenizer, args.device, args.requests)

    sched_ms = statistics.median(s["ms"])
    figures = {
        "ragged_speedup_vs_hf": round(r["speedup"], 3),
        "prefix_hit_ttft_ratio": round(p["ratio"], 4),
        "scheduler_step_ms_256": round(sched_ms, 4),
        "rss_growth_mb": round(m["growth_mb"], 2),
    }

    def met(ok: bool) -> str:
        return "met" if ok else "MISSED"

    c = model.config
    shape = (
        f"{c.num_layers} layers, hidden {c.hidden_size}, {c.num_heads} heads / "
        f"{c.num_kv_heads} KV heads, vocab {c.vocab_size}"
    )
    rows = [
        "| Figure | kvpool | baseline | ratio | goal |",
        "|---|---|---|---|---|",
        f"| ragged batch of 32, useful tokens/s (median, range) | {median_spread(r['ours'])} "
        f"| HF generate, padded: {median_spread(r['hf'])} | {r['speedup']:.2f}x "
        f"| >= {GOALS['ragged']}x: {met(r['speedup'] >= GOALS['ragged'])} |",
        f"| TTFT, 1024-token prefix + 16, ms | hit: {median_spread(p['hit_ms'])} "
        f"| miss: {median_spread(p['miss_ms'])} | {p['ratio']:.3f} "
        f"| <= {GOALS['prefix']}: {met(p['ratio'] <= GOALS['prefix'])} |",
        f"| scheduler step, 256 running, ms | {median_spread(s['ms'])} | - | - "
        f"| <= {GOALS['scheduler_ms']} ms: {met(sched_ms <= GOALS['scheduler_ms'])} |",
        f"| RSS after {args.requests} requests vs after 10, MiB "
        f"| {m[f'rss_{args.requests}_mb']:.1f} | {m['rss_10_mb']:.1f} "
        f"| {m['growth_mb']:+.2f} MiB | no growth (<= {GOALS['rss_mb']}): "
        f"{met(m['growth_mb'] <= GOALS['rss_mb'])} |",
    ]
    device = args.device if args.device != "cuda" else torch.cuda.get_device_name()
    machine = (
        f"{platform.machine()}, {psutil.cpu_count()} CPUs, torch {torch.__version__}, "
        f"device {device}, {args.dtype}"
    )
    table = "\n".join(rows)
    notes = (
        f"Model: the tiny random Llama of `kvpool worker make-tiny-model` ({shape}). "
        f"Ragged batch: {r['useful_tokens']} useful output tokens; greedy outputs identical "
        f"to HF for {r['outputs_equal']}/32 requests. Repeats: {args.repeats} (ragged), "
        f"5 (prefix), {len(s['ms'])} steps (scheduler)."
    )
    print(table)
    print()
    print(notes)
    RESULTS.mkdir(exist_ok=True)
    suffix = "" if args.device == "cpu" else f"_{args.device}_{args.dtype}"
    (RESULTS / f"engine{suffix}.md").write_text(
        f"# Worker engine\n\n{dt.date.today()}, {machine}\n\n{table}\n\n{notes}\n"
    )
    (RESULTS / f"engine{suffix}.json").write_text(
        json.dumps(
            {
                **figures,
                "date": str(dt.date.today()),
                "machine": machine,
                "detail": {"ragged": r, "prefix": p, "scheduler_ms": s["ms"], "memory": m},
            },
            indent=2,
        )
        + "\n"
    )
    return figures


if __name__ == "__main__":
    main()
