"""The simulated engine: the real scheduler, pool, events and server over a timing model."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpool.stack import free_port_range
from kvpool.worker.engine import EngineConfig
from kvpool.worker.scheduler import ScheduledBatch
from kvpool.worker.sequence import SamplingParams
from kvpool.worker.sim import SimEngine, TimingModel

from conftest import TEST_POOL_SECRET


@pytest.fixture
def sim(tiny_model: tuple[Any, Any]) -> SimEngine:
    _, tokenizer = tiny_model
    return SimEngine(
        tokenizer,
        EngineConfig(num_blocks=64),
        vocab_size=len(tokenizer),
        max_model_len=1024,
        eos_token_ids=[tokenizer.eos_token_id],
        virtual=True,
    )


def run_until_first_token(engine: SimEngine, stream: Any) -> float:
    start = engine.now
    while not stream._queue.qsize():
        engine.step()
    return engine.now - start


def test_a_lone_prefill_takes_the_timing_model_s_time(sim: SimEngine) -> None:
    t = TimingModel()
    prompt = list(range(10, 310))  # 300 tokens, nothing cached
    ttft = run_until_first_token(sim, sim.add_request(prompt, SamplingParams(max_tokens=4)))
    assert ttft == pytest.approx((t.a + t.b * 300 + t.c * 300**2 + t.f * 300) / 1000)
    # Decode steps then cost d + e*B and each row's context: read (f), attended (c).
    before = sim.now
    sim.step()
    assert sim.now - before == pytest.approx((t.d + t.e + t.c * 601 + t.f * 301) / 1000)


def test_a_cached_prefix_shortens_the_simulated_prefill(sim: SimEngine) -> None:
    prompt = list(range(10, 310))
    first = run_until_first_token(sim, sim.add_request(prompt, SamplingParams(max_tokens=1)))
    again = run_until_first_token(sim, sim.add_request(prompt, SamplingParams(max_tokens=1)))
    t = TimingModel()
    # 18 blocks were cached: 12 tokens are computed, attending to the 288 before them
    assert again == pytest.approx(t.prefill_ms([300 - 288], [288]) / 1000)
    assert again < first


def test_a_chunk_pays_for_the_cached_context_it_attends_to() -> None:
    """2,048 new tokens after 30k cached ones attend to all of them: for an 8B model on an
    H100 that is more than half the work of the rest of the step, so it costs about 1.6
    times a cold chunk (it cost the same before)."""
    t = TimingModel()
    cold, warm = t.prefill_ms([2048]), t.prefill_ms([2048], [30_000])
    assert warm == pytest.approx(cold + t.c * 2 * 2048 * 30_000 + t.f * 30_000)
    assert 1.4 < warm / cold < 2.0


def test_a_mixed_step_is_one_step_not_a_prefill_and_a_decode() -> None:
    """Prefill and decode rows share one pass over the weights: one overhead, not two."""
    t = TimingModel()
    mixed = t.step_ms([(500, 0)], [1000, 2000])
    assert mixed == pytest.approx(t.prefill_ms([500]) + t.decode_ms([1000, 2000]) - t.d)


def test_recomputing_a_preempted_request_is_priced_as_prefill(sim: SimEngine) -> None:
    """A preempted request recomputes its prompt and its output so far: every chunk of that
    is prefill work, not one decode token (as the chunk past the prompt used to be)."""
    t = TimingModel(time_scale=1.0)
    sim.add_request(list(range(10, 110)), SamplingParams(max_tokens=60))
    sim.step()
    running = sim.scheduler.running[0]
    while len(running.token_ids) < 150:  # 100 prompt, 50 output tokens
        sim.step()
    assert running.num_prompt_tokens == 100
    running.num_computed_tokens = 0  # as preemption leaves it
    whole = ScheduledBatch([running], [150])
    assert t.step_seconds(whole) == pytest.approx(t.prefill_ms([150]) / 1000)
    running.num_computed_tokens = 120  # a chunk that starts past the prompt
    tail = ScheduledBatch([running], [30])
    assert t.step_seconds(tail) == pytest.approx(t.prefill_ms([30], [120]) / 1000)
    running.num_computed_tokens = 149  # and its next token is a decode again
    assert t.step_seconds(ScheduledBatch([running], [1])) == pytest.approx(
        t.decode_ms([149]) / 1000
    )


def test_simulated_tokens_are_deterministic_and_never_end_early(sim: SimEngine) -> None:
    params = SamplingParams(max_tokens=40)
    a, b = sim.generate([[5, 6, 7, 8], [5, 6, 7, 8]], params)
    c = sim.generate([[5, 6, 7, 9]], params)[0]
    seeded = sim.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=40, seed=3))[0]
    assert a.token_ids == b.token_ids != c.token_ids
    assert seeded.token_ids != a.token_ids
    assert len(a.token_ids) == 40 and a.finish_reason == "length"
    assert not set(a.token_ids) & sim.eos_token_ids


def test_every_simulated_token_is_text_the_client_sees(sim: SimEngine) -> None:
    """The tiny tokenizer's end-of-turn and role tokens are special without being in
    ``all_special_ids``; drawn, the detokenizer drops them, so an answer of one token would
    be empty and a stream's first text would come a step late (a wrong TTFT)."""
    tokenizer = sim.tokenizer
    for token in sim._tokens:
        assert tokenizer.decode([token], skip_special_tokens=True), token
    outs = sim.generate([[7, 8, 9, p] for p in range(10, 410)], SamplingParams(max_tokens=1))
    assert all(o.text for o in outs)


def test_the_timing_model_rejects_negative_coefficients() -> None:
    with pytest.raises(ValueError, match="time_scale"):
        TimingModel(time_scale=-1)


def test_a_simulated_worker_serves_the_openai_api_and_hands_off_blocks(start_worker: Any) -> None:
    fast = {"engine": "sim", "sim_time_scale": 0.01}
    both = start_worker(**fast)
    client = both.openai()
    r = client.completions.create(model=None, prompt="A router in front", max_tokens=8)
    assert r.usage.completion_tokens == 8 and r.choices[0].text
    streamed = client.completions.create(
        model=None, prompt="A router in front", max_tokens=8, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    assert httpx.get(both.url + "/kvpool/info").json()["engine"] == "sim"
    assert both.metric("vllm:generation_tokens_total") == 16

    secret = {"pool_secret": TEST_POOL_SECRET}  # the hand-off is signed with it
    p = start_worker(role="prefill", **fast, **secret)
    d = start_worker(role="decode", **fast, **secret)
    prompt = list(range(10, 110))
    leg = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    params = httpx.post(p.url + "/v1/completions", json=leg).json()["kv_transfer_params"]
    done = httpx.post(
        d.url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": 4, "kv_transfer_params": params},
    ).json()
    assert done["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    assert d.metric("kvpool_worker_kv_transfer_blocks_total", direction="received") == 6


def test_a_simulated_hand_off_takes_its_bytes_over_the_link(start_worker: Any) -> None:
    """96 tokens of an 8B model's KV (12.6 MB) over a 20 MB/s link: the decode worker
    waits 0.63 s for them, outside its engine steps."""
    link = {"engine": "sim", "pool_secret": TEST_POOL_SECRET, "sim_transfer_gb_s": 0.02}
    p = start_worker(role="prefill", **link)
    d = start_worker(role="decode", **link)
    prompt = list(range(10, 110))
    leg = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    params = httpx.post(p.url + "/v1/completions", json=leg).json()["kv_transfer_params"]
    expected = TimingModel(transfer_gb_s=0.02).transfer_seconds(96)
    assert expected == pytest.approx(96 * 131_072 / 0.02e9)
    start = time.monotonic()
    done = httpx.post(
        d.url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": 1, "kv_transfer_params": params},
        timeout=30,
    ).json()
    assert done["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    assert time.monotonic() - start >= expected
    assert d.metric("kvpool_worker_kv_pull_seconds_sum") >= expected


def start_fleet(
    llama_dir: Path, count: int, *flags: str, events: bool = False
) -> tuple[subprocess.Popen[str], list[dict[str, Any]]]:
    """``kvpool worker sim-fleet`` with ``count`` workers from a free port on, and the line
    it prints for each worker, once every worker answers its health check. ``events``: KV
    events (and replay, its default) on the ports after the workers' (one free range for
    all three, so that no other test's port falls in between)."""
    base = free_port_range(3 * count if events else count)
    if events:
        flags = (*flags, "--kv-events-base-port", str(base + count))
    kvpool = str(Path(sys.executable).with_name("kvpool"))
    proc = subprocess.Popen(
        [
            kvpool,
            "worker",
            "sim-fleet",
            "--model",
            str(llama_dir),
            "--count",
            str(count),
            "--base-port",
            str(base),
            "--sim-time-scale",
            "0.01",
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
        start_new_session=True,  # its --processes children go with it (killpg)
    )
    assert proc.stdout is not None
    lines = [json.loads(proc.stdout.readline()) for _ in range(count)]
    assert [x["url"] for x in lines] == [f"http://127.0.0.1:{base + i}" for i in range(count)]
    deadline = time.monotonic() + 60
    for line in lines:
        while True:
            try:
                if httpx.get(line["url"] + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                # the whole group: a child still holding the pipe would block the read
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                raise AssertionError(f"{line['url']} did not start:\n{proc.stdout.read()}")
            time.sleep(0.05)
    return proc, lines


def test_a_sim_fleet_hosts_many_workers_in_one_or_more_processes(llama_dir: Path) -> None:
    proc, lines = start_fleet(llama_dir, 4, "--processes", "2")
    try:
        for line in lines:
            r = httpx.post(
                line["url"] + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()


def test_a_router_started_after_a_sim_fleet_learns_what_it_already_holds(
    llama_dir: Path, start_router: Any
) -> None:
    """Each simulated worker serves replay (on the ports after the event ports), says so
    in /kvpool/info, and a router that comes later asks it for the blocks it holds."""
    count = 3
    proc, lines = start_fleet(llama_dir, count, "--processes", "2", events=True)
    events = int(lines[0]["kv_events_endpoint"].rsplit(":", 1)[1])
    try:
        for i, line in enumerate(lines):
            replay = f"tcp://127.0.0.1:{events + count + i}"
            assert line["kv_events_replay_endpoint"] == replay
            info = httpx.get(line["url"] + "/kvpool/info").json()
            assert info["kv_events"]["replay_endpoint"] == replay
        prompt = list(range(20, 20 + 16 * 12))  # 12 full blocks
        for line in lines[1:]:  # held before any router runs; the first worker holds none
            r = httpx.post(
                line["url"] + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}
            )
            assert r.status_code == 200, r.text
        router = start_router(worker=[f"{x['url']},id=w{i}" for i, x in enumerate(lines)])
        router.wait_for(
            lambda: all(router.workers()[f"w{i}"]["indexed_blocks"] >= 12 for i in (1, 2)),
            timeout=30,
        )
        assert router.workers()["w0"]["indexed_blocks"] == 0
        assert router.route({"prompt": prompt, "max_tokens": 1})["worker"] in ("w1", "w2")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        finally:
            proc.kill()
            proc.wait()


def test_the_default_timing_model_predicts_the_published_measurements() -> None:
    """Every published point ``bench/sim_calibration.py`` sets beside the model (vLLM's CI
    latency and a third party's TTFT, which calibrated nothing, among them) is predicted
    within 10%: a change of a coefficient that breaks the calibration fails here."""
    import importlib.util

    script = Path(__file__).resolve().parent.parent / "bench" / "sim_calibration.py"
    spec = importlib.util.spec_from_file_location("bench_sim_calibration", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_sim_calibration"] = module
    spec.loader.exec_module(module)
    t = TimingModel()
    for point in module.POINTS:
        predicted = point.predict(t)
        assert abs(predicted - point.measured) / point.measured < 0.10, point.name
    unfitted = [p for p in module.POINTS if not p.fitted]
    assert len(unfitted) >= 2
