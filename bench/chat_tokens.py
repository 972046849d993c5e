"""The router's CPU for a short chat's prompt: its template rendered, tokenized and hashed
(``router.routing.tokens.PromptKeys.of``), on the event loop as kvpool does it today, and through
``asyncio.to_thread`` as it did before (the baseline), in the same run.

The chat: a system prompt of about 1,200 characters and a user question, with the tiny
model's chat template and tokenizer (``kvpool worker make-tiny-model``, written under a
temporary directory), the router's prefix token cache and block hasher. CPU is the
process's (the thread's work included), per chat, the median of rounds of 200.

Writes bench/results/chat_tokens.{md,json}. ``--quick``: fewer rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
PER_ROUND = 200
SYSTEM = (
    "You are the support assistant of a team that runs LLM inference on Kubernetes. "
    "Answer briefly, name the commands to run, and say what to check afterwards. "
) * 8


async def rounds(keys: Any, fields: Any, n: int, thread: bool) -> list[float]:
    from kvpool.router.routing import tokens

    saved = tokens.INLINE_PROMPT_SIZE
    if thread:
        tokens.INLINE_PROMPT_SIZE = -1  # every chat through a thread, as before
    try:
        out = []
        for _ in range(n):
            t0 = time.process_time()
            for _ in range(PER_ROUND):
                await keys.of(fields, None, None)
            out.append((time.process_time() - t0) / PER_ROUND * 1e6)
        return out
    finally:
        tokens.INLINE_PROMPT_SIZE = saved


async def measure(n: int) -> dict[str, Any]:
    from kvpool.hashing import BlockHasher
    from kvpool.router.proxy.request import read_fields
    from kvpool.router.routing.tokens import PromptKeys
    from kvpool.tokenization import PrefixTokenCache, load_tokenizer
    from kvpool.worker.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny")
        tokenizer = load_tokenizer(model)
    keys = PromptKeys(tokenizer, PrefixTokenCache(tokenizer), BlockHasher(block_size=16))
    body = {"model": "tiny", "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "How do I add a second decode worker to my pool?"},
    ]}  # fmt: skip
    fields = read_fields(body, "chat")
    found = await keys.of(fields, None, None)
    out: dict[str, Any] = {"prompt_tokens": found.num_tokens}
    for name, thread in (("inline", False), ("thread", True), ("inline_again", False)):
        await rounds(keys, fields, 1, thread)  # warm
        out[name] = statistics.median(await rounds(keys, fields, n, thread))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    found = asyncio.run(measure(3 if args.quick else 10))
    ours = min(found["inline"], found["inline_again"])  # before and after the baseline
    base = found["thread"]
    result = {
        "router_cpu_us_per_chat": round(ours, 1),
        "baseline_cpu_us_per_chat": round(base, 1),
        "saved": round(1 - ours / base, 3),
        "prompt_tokens": found["prompt_tokens"],
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.machine()}, Python {platform.python_version()}",
        "runs": found,
    }
    table = (
        f"| a short chat ({found['prompt_tokens']} prompt tokens): render, tokenize, hash "
        "| router CPU per chat (µs) |\n|---|---:|\n"
        f"| kvpool: on the event loop | {ours:.0f} |\n"
        f"| before: through asyncio.to_thread | {base:.0f} |\n"
    )
    print(table)
    print(f"{1 - ours / base:.0%} less CPU per short chat")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "chat_tokens.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "chat_tokens.md").write_text(
        f"# Router CPU per short chat's prompt ({result['date']}, {result['machine']})\n\n{table}"
    )


if __name__ == "__main__":
    main()
