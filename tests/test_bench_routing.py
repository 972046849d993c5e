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


@pytest.mark.parametrize(
    "name", ["groups", "multi-turn", "mooncake", "one-system-prompt", "agentic"]
)
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


def test_agent_steps_grow_one_context_and_bursts_share_it(routing: ModuleType, words: Any) -> None:
    sessions = routing.agentic(words, 8.0, 10.0)
    requests = sorted(r for s in sessions for r in s.requests())
    assert len(requests) == 80  # every arrival is one request, a burst's siblings too
    tools = words.text("agent-tools", routing.AGENT_TOOLS_TOKENS)
    bursts = 0
    for s in sessions:
        assert s.session_id is not None and 1 <= len(s.prompts) <= 10
        for k, prompt in enumerate(s.prompts):
            assert prompt.startswith(tools)  # one system prompt for every agent
            if k:
                previous = s.prompts[k - 1]
                assert prompt.startswith(previous)
                # the last action (as long as its answer) and a tool result of 50-400
                added = words.count(prompt[len(previous) :])
                assert s.max_tokens[k - 1] + 50 <= added <= s.max_tokens[k - 1] + 400
            for sibling, max_tokens in s.turn_siblings(k):
                bursts += 1
                assert (
                    sibling.startswith(prompt) and 20 <= words.count(sibling[len(prompt) :]) <= 80
                )
                assert 8 <= max_tokens <= 32
    assert bursts >= 5


def test_the_bound_is_what_an_unlimited_or_an_optimally_evicted_pooled_cache_hits(
    routing: ModuleType, words: Any
) -> None:
    block = 16
    a, b, c = (words.text(k, 4 * block) for k in "abc")

    def request(at: float, prompt: str) -> Any:
        return routing.Session((at,), (prompt,), (1,))

    # a, b, a, c, a, b: 4 blocks each; the last token is never a hit
    order = [a, b, a, c, a, b]
    sessions = [request(i, p) for i, p in enumerate(order)]
    total = 6 * 4 * block
    hit = 4 * block - 1
    unlimited = routing.hit_bounds(words, sessions, capacity=10**6)
    assert unlimited["unlimited"] == unlimited["pooled"] == pytest.approx(3 * hit / total)
    # room for 8 blocks (two prompts): Belady keeps a (used again soonest) over c and b
    # where LRU would have lost the last b
    tight = routing.hit_bounds(words, sessions, capacity=8)
    assert tight["unlimited"] == pytest.approx(3 * hit / total)
    assert tight["pooled"] == pytest.approx(3 * hit / total)  # b survives: c is never used again
    # room for one prompt: only back-to-back repeats could hit, and there are none but a's
    one = routing.hit_bounds(words, sessions, capacity=4)
    assert one["pooled"] < tight["pooled"]


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
    # every peer router: vllm-router reads the fleet's KV events (map encoding) and replay
    policies = "kvpool,sglang-router,smg,vllm-router"
    argv += ["--policies", policies, "--rates", "4", "--duration", "1.5"]
    argv += ["--time-scale", "1", "--out", str(tmp_path)]
    subprocess.run(argv, env=env, cwd=ROOT, check=True, capture_output=True, timeout=240)
    results = json.loads((tmp_path / "routing.json").read_text())
    by_rate = results["one-system-prompt"]
    assert set(by_rate) == set(policies.split(","))
    for policy in by_rate.values():
        r = policy["4"]
        keys = {"hit_ratio", "ttft_p50", "ttft_p90", "ttft_p99", "throughput", "imbalance"}
        assert keys <= set(r)
        assert r["errors"] == 0 and r["completed"] == r["requests"] == 6
        assert r["refused"] == 0
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
    ttft, hit = routing.goals("groups", rows)[:2]
    assert not ttft["held"] and not ttft["held_within_noise"]  # 30% worse at 16 req/s
    assert [(m["rate"], m["beyond"]) for m in ttft["misses"]] == [("8", False), ("16", True)]
    assert not hit["held"] and hit["held_within_noise"]  # one point under, at 8 req/s
    assert "within noise" in routing.describe_goal(hit)


def test_the_goal_against_the_peers_is_against_the_best_of_them_at_each_rate(
    routing: ModuleType,
) -> None:
    def run(p90: float, hit: float) -> dict[str, float]:
        return {"ttft_p90": p90, "hit_ratio": hit}

    rows = {
        "kvpool": {"8": run(1.0, 0.5), "16": run(1.0, 0.7), "24": run(1.0, 0.8)},
        # the best peer differs by rate: smg at 16, vllm-router at 24
        "smg": {"8": run(9.0, 0.1), "16": run(1.2, 0.6), "24": run(3.0, 0.6)},
        "vllm-router": {"8": run(9.0, 0.1), "16": run(4.0, 0.6), "24": run(1.5, 0.82)},
        "round-robin": {"8": run(0.5, 0.9), "16": run(0.5, 0.9), "24": run(0.5, 0.9)},
    }
    by_goal = {g["goal"]: g for g in routing.goals("groups", rows)}
    ttft = by_goal["TTFT p90 >= 1.3x lower than the best peer router's at the two highest rates"]
    assert ttft["ratios"] == {"16": pytest.approx(1.2), "24": pytest.approx(1.5)}
    assert ttft["best_peer"] == {"16": "smg", "24": "vllm-router"}
    assert not ttft["held"] and ttft["held_within_noise"]  # 1.2 is within 10% of 1.3
    hit = by_goal["hit ratio at least the best peer router's at the two highest rates"]
    assert not hit["held"] and hit["held_within_noise"]  # 80% against 82%: two points
    # a baseline is no peer: round-robin's better figures count only in the first goals
    assert "round-robin" not in str(ttft) + str(hit)


def test_a_peer_router_is_started_with_its_projects_settings(
    routing: ModuleType, tmp_path: Path
) -> None:
    fleet = routing.Fleet(
        ["http://127.0.0.1:1", "http://127.0.0.1:2"],
        [],
        ["tcp://127.0.0.1:11", "tcp://127.0.0.1:12"],
        ["tcp://127.0.0.1:21", "tcp://127.0.0.1:22"],
        16,
    )
    argv, _ = routing.peer_router("vllm-router", 9000, fleet, "tiny")
    assert argv[argv.index("--policy") + 1] == "kv_aware"
    # every worker's event stream and replay socket, the block size and the model
    pairs = [argv[i + 1] for i, a in enumerate(argv) if a == "--kv-event-source"]
    assert pairs == [
        "http://127.0.0.1:1=tcp://127.0.0.1:11",
        "http://127.0.0.1:2=tcp://127.0.0.1:12",
    ]
    replays = [argv[i + 1] for i, a in enumerate(argv) if a == "--kv-event-replay-source"]
    assert replays == [
        "http://127.0.0.1:1=tcp://127.0.0.1:21",
        "http://127.0.0.1:2=tcp://127.0.0.1:22",
    ]
    assert argv[argv.index("--kv-event-block-size") + 1] == "16"
    assert argv[argv.index("--kv-event-model") + 1] == "tiny"
    for name in ("smg", "sglang-router"):
        argv, _ = routing.peer_router(name, 9000, fleet, "tiny")
        assert argv[argv.index("--policy") + 1] == "cache_aware"
        assert argv[argv.index("--worker-urls") + 1 :] == fleet.workers
    with pytest.raises(ValueError, match="peer routers"):
        routing.peer_router("kvpool", 9000, fleet, "tiny")


def test_every_conversation_carries_one_session_id_of_its_own(
    routing: ModuleType, words: Any
) -> None:
    sessions = routing.multi_turn(words, 8.0, 10.0)
    ids = [s.session_id for s in sessions]
    assert None not in ids and len(set(ids)) == len(sessions)  # one per conversation
    assert ids == [s.session_id for s in routing.multi_turn(words, 8.0, 10.0)]  # stable
    for s in sessions:
        assert s.headers() == {"x-session-id": s.session_id}  # sent with its every turn
    # the single-request workloads send none
    assert all(s.headers() == {} for s in routing.groups(words, 8.0, 2.0))


async def test_every_request_of_a_turn_sends_its_sessions_header(
    routing: ModuleType,
) -> None:
    from aiohttp import web

    seen: list[str | None] = []

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 0\n")

    async def completions(request: web.Request) -> web.Response:
        seen.append(request.headers.get("x-session-id"))
        chunks = [{"choices": [{"text": " a"}]}, {"choices": [{"finish_reason": "length"}]}]
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return web.Response(text=body, content_type="text/event-stream")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        sessions = [
            routing.Session((0.0, 0.01), ("a", "a b"), (1, 1), "mt7"),
            routing.Session((0.0,), ("c",), (1,)),
        ]
        result = await routing.drive([url], "m", sessions, [url])
    finally:
        await runner.cleanup()
    assert result["errors"] == 0 and result["completed"] == 3
    assert seen.count("mt7") == 2 and seen.count(None) == 1  # both turns; none for the other


def test_the_affinity_run_compares_affinity_on_and_off_beside_the_sglang_router(
    routing: ModuleType,
) -> None:
    parser = routing.build_parser()
    plan = routing.plan(parser.parse_args(["--affinity"]), parser)
    assert plan.name == "affinity"
    assert plan.workloads == ["multi-turn"]
    assert plan.policies == ["kvpool", "kvpool-no-affinity", "sglang-router"]
    assert plan.rates == {"multi-turn": routing.RATES["multi-turn"]}
    assert plan.out == routing.RESULTS
    quick = routing.plan(parser.parse_args(["--affinity", "--quick"]), parser)
    assert len(quick.rates["multi-turn"]) == 1 and quick.out != routing.RESULTS
    # the whole benchmark is what it was: no variant unless named, written to routing.*
    default = routing.plan(parser.parse_args([]), parser)
    assert default.name == "routing"
    baselines = ["round-robin", "least-loaded", "prefix-only"]
    assert default.policies == ["kvpool", *baselines, "sglang-router", "smg", "vllm-router"]
    with pytest.raises(SystemExit):
        routing.plan(parser.parse_args(["--affinity", "--policies", "kvpool"]), parser)


def test_the_ingress_run_starts_kvpool_with_its_defaults_beside_the_sglang_router(
    routing: ModuleType, tmp_path: Path
) -> None:
    parser = routing.build_parser()
    plan = routing.plan(parser.parse_args(["--ingress"]), parser)
    assert plan.name == "ingress"
    assert plan.workloads == list(routing.WORKLOADS)
    assert plan.policies == ["kvpool", "sglang-router"]
    for argv in (
        ["--ingress", "--router-args", "--policy round-robin"],
        ["--ingress", "--affinity"],
    ):
        with pytest.raises(SystemExit):
            routing.plan(parser.parse_args(argv), parser)
    # kvpool's router as a user starts it: no flag but what says where things are
    fleet = routing.Fleet(["http://127.0.0.1:1", "http://127.0.0.1:2"], [])
    argv = routing.kvpool_router_argv("kvpool", tmp_path, 8080, fleet.workers, [])
    flags = [a for a in argv if a.startswith("--")]
    assert sorted(set(flags)) == ["--model", "--policy", "--port", "--worker"]
    assert argv[argv.index("--policy") + 1] == "kvpool"  # the default policy, named


def test_kvpool_no_affinity_is_the_default_policy_with_affinity_weight_zero(
    routing: ModuleType, tmp_path: Path
) -> None:
    (tmp_path / "config.json").write_text("{}")  # what the router's settings ask of a model

    def flags(policy: str, extra: list[str]) -> list[str]:
        argv = routing.kvpool_router_argv(policy, tmp_path, 9, ["http://w"], extra)
        return argv[argv.index("serve") + 1 :]

    assert flags("kvpool", []) == [
        *("--model", str(tmp_path), "--port", "9"),
        *("--policy", "kvpool", "--worker", "http://w"),  # nothing else: kvpool's defaults
    ]
    off = flags("kvpool-no-affinity", ["--affinity-weight", "0.5"])
    assert off[off.index("--policy") :] == [
        *("--policy", "kvpool", "--affinity-weight", "0", "--worker", "http://w")
    ]  # after --router-args: the variant stays what its name says
    from kvpool.router.cli import build_parser
    from kvpool.router.settings import RouterSettings
    from kvpool.settings_cli import build_settings, settings_values

    if "affinity_weight" not in RouterSettings.model_fields:
        pytest.skip("the router has no --affinity-weight yet")
    args = build_parser().parse_args(["serve", *flags("kvpool-no-affinity", [])])
    settings = build_settings(RouterSettings, settings_values(args, RouterSettings, "KVPOOL_X_"))
    assert settings.policy == "kvpool" and settings.affinity_weight == 0
    scorers = [name for name, _ in settings.policy_config().scorers]
    assert "affinity" not in scorers
    on = build_settings(RouterSettings, {"model": str(tmp_path), "worker": ["http://w"]})
    assert "affinity" in [name for name, _ in on.policy_config().scorers]  # kvpool: on


def test_an_affinity_run_writes_affinity_files_and_leaves_routing_alone(
    routing: ModuleType, tmp_path: Path
) -> None:
    def row(p90: float, hit: float) -> dict[str, Any]:
        return {
            "hit_ratio": hit,
            "ttft_p50": p90 / 2,
            "ttft_p90": p90,
            "ttft_p99": p90 * 2,
            "throughput": 100.0,
            "imbalance": 1.1,
            "path_overhead_ms": 5.0,
        }

    results = {
        "multi-turn": {
            "kvpool": {"8": row(1.0, 0.62)},
            "kvpool-no-affinity": {"8": row(1.2, 0.55)},
            "sglang-router": {"8": row(1.1, 0.62)},
        }
    }
    meta = {
        "name": "affinity",
        "date": "2026-11-23",
        "machine": "x86_64, 2 cores, Linux",
        "python": "3.11",
        "command": "bench/routing.py --affinity",
        "workers": 8,
        "fleet_processes": 2,
        "time_scale": 8.0,
        "duration_s": 12.0,
        "wall_s": 60.0,
        "load_average": [1.0, 1.0],
        "notes": {"multi-turn": "a note"},
    }
    routing.write_results(tmp_path, results, meta)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "affinity.json",
        "affinity.md",
        "affinity.png",
    ]
    text = (tmp_path / "affinity.md").read_text()
    assert text.startswith("# Session affinity")
    assert "| 8 | 62.0% / 55.0% (+7.0 points) | 1,000 / 1,200 | 1.20x |" in text
    written = json.loads((tmp_path / "affinity.json").read_text())
    assert written["multi-turn"]["kvpool-no-affinity"]["8"]["ttft_p90"] == 1.2
    assert written["meta"]["name"] == "affinity"
