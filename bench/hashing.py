"""How long block hashing takes for one prompt, whole (router) and incremental (worker).

Prints a markdown table of milliseconds for prompts of 1k, 8k and 32k tokens at block size
16, with the incremental chain as the baseline, and writes bench/results/hashing.{md,json}.
The goal: a 32k-token prompt in <= 20 ms on the 2-core CI machine.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import random
import statistics
import time
from pathlib import Path

from kvpool.hashing import BlockHasher

SIZES = {"1k": 1024, "8k": 8192, "32k": 32768}
REPEATS = 15
GOAL_MS_32K = 20.0
RESULTS = Path(__file__).parent / "results"


def _time_ms(fn, repeats: int = REPEATS) -> list[float]:
    fn()  # warm up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def main() -> dict:
    rng = random.Random(0)
    hasher = BlockHasher(block_size=16)
    rows, figures = [], {}
    for name, n in SIZES.items():
        tokens = [rng.randrange(128_000) for _ in range(n)]
        whole = _time_ms(lambda t=tokens: hasher.hash_prompt(t))

        def incremental(t=tokens) -> None:
            chain = hasher.chain()
            for i in range(0, len(t), 64):  # as prefill chunks arrive
                chain.extend(t[i : i + 64])

        inc = _time_ms(incremental)
        med_w, med_i = statistics.median(whole), statistics.median(inc)
        figures[f"ms_{name}"] = round(med_w, 3)
        figures[f"ms_{name}_incremental"] = round(med_i, 3)
        rows.append(
            f"| {n:,} | {med_w:.2f} ({min(whole):.2f}-{max(whole):.2f}) "
            f"| {med_i:.2f} ({min(inc):.2f}-{max(inc):.2f}) | {med_w / med_i:.2f} |"
        )
    machine = (
        f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}"
    )
    goal = "met" if figures["ms_32k"] <= GOAL_MS_32K else "MISSED"
    table = "\n".join(
        [
            f"# Block hashing, block size 16 ({machine}, {dt.date.today().isoformat()})",
            "",
            "| tokens | whole prompt, ms: median (min-max) | incremental, 64-token chunks, ms "
            "(baseline) | ratio |",
            "|---:|---:|---:|---:|",
            *rows,
            "",
            f"Goal: 32k tokens in <= {GOAL_MS_32K:.0f} ms: {goal} ({figures['ms_32k']:.2f} ms). "
            f"{REPEATS} repeats each.",
        ]
    )
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hashing.md").write_text(table + "\n")
    figures.update(machine=machine, date=dt.date.today().isoformat(), repeats=REPEATS)
    (RESULTS / "hashing.json").write_text(json.dumps(figures, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    main()
