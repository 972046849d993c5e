"""The simulated engine's timing model beside published measurements of real engines.

Each point is a measurement someone published of Llama-3-8B (or a model of its
architecture) in bf16 on one H100, with tensor parallelism 1, and the scenario that
reproduces it: which steps the engine ran, each priced by :class:`TimingModel` with its
defaults (what every simulated worker and ``bench/routing.py`` use). The table gives the
model's prediction, the measurement and the relative error; ``sim_calibration_max_error``
in ``bench/results/sim_calibration.json`` is the largest.

What a published figure measured beyond the engine's steps (HTTP, tokenizing, the API
server's own Python) is not modelled, so a prediction below the measurement is expected
where the figure is an end-to-end one. The sources, and how each scenario was derived from
them, are in :data:`POINTS`. Pure arithmetic: runs in well under a second.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvpool.worker.sim import TimingModel

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Point:
    name: str
    source: str  # where the figure is published
    conditions: str
    measured: float
    unit: str
    predict: Callable[[TimingModel], float]
    note: str = ""
    fitted: str = ""  # the coefficient this point set, if any (the others test the model)


def vllm_ci_latency(t: TimingModel) -> float:
    """8 prompts of 32 tokens prefilled in one step, then 127 decode steps of 8 rows whose
    contexts grow from 32 to 158: the whole batch's latency, ms."""
    rows = 8
    ms = t.step_ms([(32, 0)] * rows, [])
    for k in range(127):
        ms += t.step_ms([], [32 + k] * rows)
    return ms


def lambda_ttft(t: TimingModel) -> float:
    """10 prompts, 1,369 tokens in all, arriving at once: one prefill step (~137 each)."""
    sizes = [137] * 9 + [1369 - 9 * 137]
    return t.step_ms([(n, 0) for n in sizes], [])


def lambda_tpot(t: TimingModel) -> float:
    """A decode step of the same 10 requests, mid-answer (~137 prompt + ~64 output)."""
    return t.step_ms([], [201] * 10)


def sglang_prefill_rate(t: TimingModel) -> float:
    """Prefill at saturation, ~4,065-token prompts, two to a step of 8,192 tokens: the
    input tokens per second."""
    step_ms = t.step_ms([(4065, 0), (4065, 0)], [])
    return 2 * 4065 / (step_ms / 1000)


POINTS = [
    Point(
        "vLLM CI: batch 8, 32 in, 128 out",
        "vLLM nightly performance benchmark (buildkite.com/vllm/performance-benchmark, build "
        "9555), test latency_llama8B_tp1",
        "Llama-3.1-8B, H100, TP1, batch 8, input 32, output 128; mean end-to-end latency",
        997.542,
        "ms",
        vllm_ci_latency,
        "end to end (one prefill step, 127 decode steps)",
    ),
    Point(
        "Lambda: TTFT, 10 prompts at once",
        "LambdaLabsML/vllm-benchmark, results/prompt_10/1xH100-80GB-SXM/"
        "Meta-Llama-3-8B-Instruct_tp1_len2048.json (2024-09-07)",
        "Llama-3-8B-Instruct, bf16, H100 SXM, TP1, vLLM 0.6, 10 ShareGPT prompts "
        "(1,369 input tokens in all) sent at once; mean TTFT",
        62.43,
        "ms",
        lambda_ttft,
        "includes the API server's HTTP and tokenizing",
    ),
    Point(
        "Lambda: time per output token, batch 10",
        "same file as above",
        "the same run; median TPOT",
        7.56,
        "ms",
        lambda_tpot,
        fitted="d",
    ),
    Point(
        "SGLang: prefill throughput, ~4k prompts",
        "sgl-project/sglang pull request 1060 (its benchmark in the description)",
        "Llama-3.1-8B-Instruct, 1,000 random prompts of ~4,065 tokens (4,064,944 in all), "
        "output <= 8; input tokens per second (H100 implied by the pull request, not stated)",
        27_670.26,
        "tokens/s",
        sglang_prefill_rate,
        "the GPU is the least certain of the four",
        fitted="b",
    ),
]


def main() -> dict:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    t = TimingModel()
    rows, points = [], []
    for p in POINTS:
        predicted = p.predict(t)
        error = (predicted - p.measured) / p.measured
        points.append(
            {
                "name": p.name,
                "source": p.source,
                "conditions": p.conditions,
                "measured": p.measured,
                "predicted": round(predicted, 3),
                "unit": p.unit,
                "relative_error": round(error, 4),
                "fitted": p.fitted or None,
            }
        )
        rows.append(
            f"| {p.name} | {p.measured:,.2f} {p.unit} | {predicted:,.2f} {p.unit} "
            f"| {error:+.1%} | {p.fitted or '-'} | {p.note} |"
        )
    worst = max(abs(x["relative_error"]) for x in points)
    coefficients = {k: getattr(t, k) for k in ("a", "b", "c", "d", "e", "f")}
    table = "\n".join(
        [
            f"# Simulator calibration ({dt.date.today().isoformat()})",
            "",
            "| published point | measured | the timing model | error | sets | note |",
            "|---|---:|---:|---:|---|---|",
            *rows,
            "",
            f"Largest error: {worst:.1%}. A point that sets a coefficient (b or d) was used "
            "to calibrate it; the others test the model. Coefficients (ms): "
            + ", ".join(f"{k} = {v:g}" for k, v in coefficients.items())
            + ".",
            "",
            "Sources:",
            *(f"- {p.name}: {p.source}. {p.conditions}." for p in POINTS),
        ]
    )
    print(table)
    figures = {
        "date": dt.date.today().isoformat(),
        "coefficients_ms": coefficients,
        "points": points,
        "sim_calibration_max_error": worst,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sim_calibration.md").write_text(table + "\n")
    (RESULTS / "sim_calibration.json").write_text(json.dumps(figures, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    main()
