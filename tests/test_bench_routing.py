"""bench/routing.py's own parts: its workloads are deterministic and mean what its docstring
says, its proxy only drops the SGLang router's neutral fields, and a tiny run writes the
results in the nesting the issue names."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "routing.py"


@pytest.fixture(scope="module")
def routing() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_routing", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_routing"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def words(routing: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from kvpool.worker.tiny import write_tokenizer

    model = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(model)
    return routing.Words(model)


def test_a_text_of_n_words_is_n_tokens_and_texts_concatenate(words: Any) -> None:
    a, b = words.text("a", 37), words.text("b", 200)
    assert words.count(a) == 37
    assert words.count(b) == 200
    assert words.count(a + b) == 237
    assert words.text("b", 50) == b[: len(words.text("b", 50))]  # shorter is a prefix
    assert b.startswith(words.text("b", 50))


@pytest.mark.parametrize("name", ["groups", "multi-turn", "mooncake", "one-system-prompt"])
def test_every_workload_is_the_same_each_time_it_is_built(
    routing: ModuleType, words: Any, name: str
) -> None:
    make = routing.WORKLOADS[name]
    assert make(words, 6.0, 3.0) == make(words, 6.0, 3.0)


@pytest.mark.parametrize("name", ["groups", "one-system-prompt"])
def test_a_lower_rate_sends_the_first_requests_of_a_higher_one(
    routing: ModuleType, words: Any, name: str
) -> None:
    low, high = routing.WORKLOADS[name](words, 4.0, 5.0), routing.WORKLOADS[name](words, 8.0, 5.0)
    assert len(low) == 20 and len(high) == 40
    assert [s.prompts for s in low] == [s.prompts for s in high[:20]]
    assert low[-1].at[0] > high[19].at[0]  # the same requests, further apart


def test_every_turn_extends_the_previous_prompt(routing: ModuleType, words: Any) -> None:
    sessions = routing.multi_turn(words, 8.0, 10.0)
    turns = sorted(t for s in sessions for t in s.at)
    assert len(turns) == 80  # the rate asked for, open loop
    assert turns == routing._arrivals("multi-turn-arrivals", 8.0, 80)
    assert sum(len(s.prompts) >= 2 for s in sessions) > len(sessions) / 2
    for s in sessions:
        assert 1 <= len(s.prompts) <= 6  # cut short by the end of the run
        assert list(s.at) == sorted(s.at)
        # about one turn every TURN_PERIOD_S (its conversation slot's share of arrivals)
        gaps = [b - a for a, b in zip(s.at, s.at[1:], strict=False)]
        assert all(0 < g < 6 * routing.TURN_PERIOD_S for g in gaps)
        for k in range(1, len(s.prompts)):
            previous, prompt = s.prompts[k - 1], s.prompts[k]
            assert prompt.startswith(previous)
            # the answer (as long as the generated one) and a question of 16-256 tokens
            added = words.count(prompt[len(previous) :])
            assert s.max_tokens[k - 1] + 16 <= added <= s.max_tokens[k - 1] + 256


def test_mooncake_prompts_share_exactly_the_blocks_their_hash_ids_share(
    routing: ModuleType, words: Any
) -> None:
    rows = routing.mooncake_rows()
    sessions = routing.mooncake(words, 20.0, 0.0)
    assert len(sessions) == len(rows) > 100
    assert all(r["hash_ids"][0] % routing.MOONCAKE_SAMPLE == 0 for r in rows)
    block = routing.MOONCAKE_BLOCK // routing.MOONCAKE_SCALE
    # two requests of one prefix tree: their prompts agree for the shared ids, then differ
    pairs = [
        (i, j)
        for i in range(40)
        for j in range(i + 1, 40)
        if rows[i]["hash_ids"][0] == rows[j]["hash_ids"][0]
        and rows[i]["hash_ids"] != rows[j]["hash_ids"]
    ]
    assert pairs
    for i, j in pairs[:5]:
        a, b = rows[i]["hash_ids"], rows[j]["hash_ids"]
        shared = next(k for k in range(min(len(a), len(b)) + 1) if k == len(a) or a[k] != b[k])
        pa, pb = sessions[i].prompts[0], sessions[j].prompts[0]
        common = next(
            k for k in range(len(pa) + 1) if k == len(pa) or pa[k : k + 1] != pb[k : k + 1]
        )
        assert words.count(pa[:common]) // block == min(shared, len(a) - 1, len(b) - 1)
    first, scale = rows[0], routing.MOONCAKE_SCALE
    assert words.count(sessions[0].prompts[0]) == -(-first["input_length"] // scale)
    assert sessions[0].max_tokens[0] == max(1, round(first["output_length"] / scale))
    # arrivals compressed to the rate asked for
    assert sessions[-1].at[0] == pytest.approx(len(rows) / 20.0, rel=0.05)


@pytest.mark.slow
def test_a_tiny_run_writes_results_in_the_issues_nesting(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    argv = [sys.executable, str(SCRIPT), "--workloads", "one-system-prompt"]
    argv += ["--policies", "kvpool,sglang-router", "--rates", "4", "--duration", "1.5"]
    argv += ["--time-scale", "1", "--out", str(tmp_path)]
    subprocess.run(argv, env=env, cwd=ROOT, check=True, capture_output=True, timeout=240)
    results = json.loads((tmp_path / "routing.json").read_text())
    by_rate = results["one-system-prompt"]
    assert set(by_rate) == {"kvpool", "sglang-router"}
    for policy in by_rate.values():
        r = policy["4"]
        keys = {"hit_ratio", "ttft_p50", "ttft_p90", "ttft_p99", "throughput", "imbalance"}
        assert keys <= set(r)
        assert r["errors"] == 0 and r["completed"] == r["requests"] == 6
        assert 0 < r["ttft_p50"] <= r["ttft_p90"] <= r["ttft_p99"]
    assert "meta" in results
    assert (tmp_path / "routing.md").read_text().startswith("# Routing quality")
    assert (tmp_path / "routing.png").stat().st_size > 0
    # the tables can be written again from the JSON alone, the same as the run wrote them
    first = (tmp_path / "routing.md").read_text()
    (tmp_path / "routing.md").unlink()
    subprocess.run(
        [sys.executable, str(SCRIPT), "--render", str(tmp_path / "routing.json")],
        env=env,
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert (tmp_path / "routing.md").read_text() == first


def test_goals_tell_misses_within_run_to_run_noise_from_real_ones(routing: ModuleType) -> None:
    def run(p90: float, hit: float) -> dict[str, float]:
        return {"ttft_p90": p90, "hit_ratio": hit}

    rows = {
        "kvpool": {"8": run(1.05, 0.60), "16": run(1.30, 0.50)},
        "round-robin": {"8": run(1.00, 0.61), "16": run(1.00, 0.40)},
    }
    ttft, hit = routing.goals("groups", rows)
    assert not ttft["held"] and not ttft["held_within_noise"]  # 30% worse at 16 req/s
    assert [(m["rate"], m["beyond"]) for m in ttft["misses"]] == [("8", False), ("16", True)]
    assert not hit["held"] and hit["held_within_noise"]  # one point under, at 8 req/s
    assert "within noise" in routing.describe_goal(hit)
