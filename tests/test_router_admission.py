"""The router's admission, end to end over HTTP: API keys, tenants' limits, flow control.

A real router (in-process uvicorn on 127.0.0.1) in front of a recording worker; the
tenants file is written to a temporary directory as a mounted Secret would be. The pure
parts (the key store, the buckets, the fair queue) have their own tests
(test_router_tenants.py, test_router_flow.py); these show what a client sees.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import yaml

from conftest import RunningRouter
from recording_worker import RecordingWorker

KEY_A = "sk-tenant-a-0123456789abcdef"
KEY_B = "sk-tenant-b-0123456789abcdef"
KEY_ADMIN = "sk-admin-key-0123456789abcdef"
WRONG = "sk-wrong-DISTINCTIVE-9f8e7d6c5b4a"


async def admitted(gate: Any, p: Any, routed: Any, *, max_tokens: int) -> None:
    """A slot now, or a place in the queue awaited, as the router takes one."""
    wait = gate.admit_now(p, routed, {}, max_tokens=max_tokens, size=400)
    if wait is not None:
        await wait


@pytest.fixture
def recording(
    start_router: Callable[..., RunningRouter],
) -> Iterator[Callable[..., RecordingWorker]]:
    """Recording workers, stopped before the routers."""
    started: list[RecordingWorker] = []

    def start(name: str) -> RecordingWorker:
        worker = RecordingWorker(name=name)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.gate.set()
        worker.stop()


def write_tenants(path: Path, tenants: list[dict[str, Any]]) -> Path:
    # As a Secret volume does it: a new file swapped in whole, never written in place.
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump({"tenants": tenants}))
    os.replace(tmp, path)
    return path


TENANTS: list[dict[str, Any]] = [
    {"name": "team-a", "keys": [KEY_A]},
    {"name": "batch", "keys": [KEY_B], "priority": "low"},
    {"name": "ops", "keys": [KEY_ADMIN], "admin": True},
]


def router_with(
    tmp_path: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
    llama_dir: Path,
    tenants: list[dict[str, Any]] | None = None,
    **settings: Any,
) -> tuple[RecordingWorker, RunningRouter]:
    worker = recording(llama_dir.name)
    if tenants is not None:
        if not any(t.get("admin") for t in tenants):  # the fixture reads /debug/workers
            tenants = [*tenants, {"name": "ops", "keys": [KEY_ADMIN], "admin": True}]
        settings["api_keys_file"] = str(write_tenants(tmp_path / "tenants.yaml", tenants))
    router = start_router(worker=[worker.spec("a")], **settings)
    if tenants is not None:
        router.debug_headers = bearer(KEY_ADMIN)
    router.wait_workers_up(1)
    return worker, router


def body(llama_dir: Path, **extra: Any) -> dict[str, Any]:
    return {"model": llama_dir.name, "prompt": "hello there world", "max_tokens": 8, **extra}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# -- keys -------------------------------------------------------------------------------------


def test_requests_without_a_valid_key_get_401_and_the_key_is_never_logged(
    tmp_path: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
    llama_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    worker, router = router_with(tmp_path, recording, start_router, llama_dir, TENANTS)
    url = router.url + "/v1/completions"

    missing = httpx.post(url, json=body(llama_dir))
    wrong = httpx.post(url, json=body(llama_dir), headers=bearer(WRONG))
    other_scheme = httpx.post(url, json=body(llama_dir), headers={"Authorization": "Basic eDp5"})
    models = httpx.get(router.url + "/v1/models", headers=bearer(WRONG))
    for resp in (missing, wrong, other_scheme, models):
        assert resp.status_code == 401, resp.text
        error = resp.json()["error"]
        assert error["code"] == "invalid_api_key"
        assert error["type"] == "invalid_request_error"
        assert "DISTINCTIVE" not in resp.text
    assert worker.generation_requests() == []  # nothing reached a worker

    ok = httpx.post(url, json=body(llama_dir), headers=bearer(KEY_A))
    assert ok.status_code == 200, ok.text
    # The tenant's key is the router's business: the worker never sees it.
    (sent,) = worker.generation_requests()
    assert "authorization" not in sent.headers
    assert router.metric("kvpool_router_requests_total", outcome="unauthorized") == 4
    assert router.metric("kvpool_router_tenant_requests_total", tenant="team-a", outcome="success")
    for key in (WRONG, KEY_A):
        assert key not in caplog.text
        assert "DISTINCTIVE" not in caplog.text
    # Health checks and scrapes need no key.
    assert httpx.get(router.url + "/health").status_code == 200
    assert httpx.get(router.url + "/metrics").status_code == 200


def test_debug_endpoints_need_an_admin_key(
    tmp_path: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
    llama_dir: Path,
) -> None:
    _, router = router_with(tmp_path, recording, start_router, llama_dir, TENANTS)
    for path in ("/debug/workers", "/debug/index"):
        assert httpx.get(router.url + path).status_code == 401
        refused = httpx.get(router.url + path, headers=bearer(KEY_A))
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "admin_required"
        assert httpx.get(router.url + path, headers=bearer(KEY_ADMIN)).status_code == 200
    route = router.url + "/debug/route"
    assert httpx.post(route, json=body(llama_dir), headers=bearer(KEY_A)).status_code == 403
    assert httpx.post(route, json=body(llama_dir), headers=bearer(KEY_ADMIN)).status_code == 200


def test_a_changed_keys_file_is_read_again_without_a_restart(
    tmp_path: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
    llama_dir: Path,
) -> None:
    _, router = router_with(
        tmp_path, recording, start_router, llama_dir, TENANTS, api_keys_reload_s=0.05
    )
    url = router.url + "/v1/completions"
    new_key = "sk-rotated-key-0123456789abcdef"
    assert httpx.post(url, json=body(llama_dir), headers=bearer(new_key)).status_code == 401
    write_tenants(tmp_path / "tenants.yaml", [{"name": "team-a", "keys": [new_key]}])
    router.wait_for(
        lambda: httpx.post(url, json=body(llama_dir), headers=bearer(new_key)).status_code == 200,
        timeout=10,
    )
    assert httpx.post(url, json=body(llama_dir), headers=bearer(KEY_A)).status_code == 401
    # A broken file keeps the keys that work.
    (tmp_path / "tenants.yaml").write_text("tenants: [{name: x, keys: [short]}]")
    for _ in range(5):
        assert httpx.post(url, json=body(llama_dir), headers=bearer(new_key)).status_code == 200


def test_a_client_key_is_passed_to_workers_when_the_router_checks_none(
    tmp_path: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
    llama_dir: Path,
) -> None:
    # Auth off (kvpool up, or vLLM's own --api-key behind the router): as before.
    worker, router = router_with(tmp_path, recording, start_router, llama_dir)
    resp = httpx.post(
        router.url + "/v1/completions", json=body(llama_dir), headers=bearer("vllm-key")
    )
    assert resp.status_code == 200
    assert worker.generation_requests()[0].headers["authorization"] == "Bearer vllm-key"


# -- limits -----------------------------------------------------------------------------------


def test_the_requests_limit_answers_429_with_openai_headers(
    tmp_path: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
    llama_dir: Path,
) -> None:
    tenants = [{"name": "slow", "keys": [KEY_A], "requests_per_second": 0.2, "burst": 2}]
    worker, router = router_with(tmp_path, recording, start_router, llama_dir, tenants)
    url = router.url + "/v1/completions"
    first = httpx.post(url, json=body(llama_dir), headers=bearer(KEY_A))
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert httpx.post(url, json=body(llama_dir), headers=bearer(KEY_A)).status_code == 200
    refused = httpx.post(url, json=body(llama_dir), headers=bearer(KEY_A))
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-reset-requests"].endswith("s")
    assert len(worker.generation_requests()) == 2  # the refused one never reached it
    assert router.metric("kvpool_router_rate_limited_total", tenant="slow", limit="requests") == 1


def test_the_tokens_limit_reserves_max_tokens_and_settles_with_real_usage(
    tmp_path: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
    llama_dir: Path,
) -> None:
    # 600 tokens a minute; each request reserves its prompt plus 250 and uses ~8 (the
    # recording worker writes 4 tokens). Without settlement the third would be refused.
    tenants = [{"name": "tpm", "keys": [KEY_A], "tokens_per_minute": 600}]
    worker, router = router_with(tmp_path, recording, start_router, llama_dir, tenants)
    url = router.url + "/v1/completions"
    answers = [
        httpx.post(url, json=body(llama_dir, max_tokens=250), headers=bearer(KEY_A))
        for _ in range(6)
    ]
    assert [a.status_code for a in answers] == [200] * 6
    remaining = int(answers[-1].headers["x-ratelimit-remaining-tokens"])
    assert answers[-1].headers["x-ratelimit-limit-tokens"] == "600"
    # One request's reservation (prompt + 250) is out while it runs; the five before it
    # gave back all but what they used.
    assert 600 - 5 * 30 - 270 <= remaining <= 600 - 250
    used = router.metric("kvpool_router_tenant_tokens_total", tenant="tpm", kind="completion")
    assert used == 6 * worker.tokens

    # A request that cannot fit while another holds its reservation waits for the bucket.
    worker.mode = "stall"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(
            httpx.post, url, json=body(llama_dir, max_tokens=400), headers=bearer(KEY_A), timeout=10
        )
        worker.wait_for(lambda: len(worker.generation_requests()) == 7)
        refused = httpx.post(url, json=body(llama_dir, max_tokens=400), headers=bearer(KEY_A))
        assert refused.status_code == 429
        assert refused.json()["error"]["type"] == "tokens"
        assert int(refused.headers["retry-after"]) >= 1
        worker.gate.set()
        assert held.result().status_code == 200
    # More than the whole minute's tokens can never fit: a 400 that says so, not a 429.
    too_big = httpx.post(url, json=body(llama_dir, max_tokens=5000), headers=bearer(KEY_A))
    assert too_big.status_code == 400
    assert too_big.json()["error"]["code"] == "request_too_large"


# -- flow control -----------------------------------------------------------------------------


def _stalled_slot(
    worker: RecordingWorker, router: RunningRouter, url: str, headers: dict[str, str]
) -> tuple[concurrent.futures.ThreadPoolExecutor, concurrent.futures.Future[httpx.Response]]:
    """Fill the router's only slot with a request the worker holds until its gate opens."""
    worker.mode = "stall"
    worker.gate.clear()
    pool = concurrent.futures.ThreadPoolExecutor(8)
    held = pool.submit(
        httpx.post, url, json={"prompt": "held", "max_tokens": 4}, headers=headers, timeout=20
    )
    worker.wait_for(lambda: len(worker.generation_requests()) == 1)
    return pool, held


def test_waiting_requests_leave_by_priority_band(
    tmp_path: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
    llama_dir: Path,
) -> None:
    worker, router = router_with(
        tmp_path, recording, start_router, llama_dir, TENANTS, max_concurrency=1
    )
    url = router.url + "/v1/completions"
    pool, held = _stalled_slot(worker, router, url, bearer(KEY_A))
    with pool:
        futures = []
        order = [("batch", KEY_B, None), ("team-a", KEY_A, "low"), ("team-a", KEY_A, None)]
        for i, (_, key, band) in enumerate(order):
            headers = bearer(key) | ({"x-kvpool-priority": band} if band else {})
            futures.append(
                pool.submit(
                    httpx.post,
                    url,
                    json=body(llama_dir, prompt=f"request {i}"),
                    headers=headers,
                    timeout=10,
                )
            )
            router.wait_for(lambda n=i + 1: _queued(router) == n, timeout=5)
        # A tenant of the low class cannot raise itself to high.
        worker.mode = "ok"
        worker.gate.set()
        assert held.result(10).status_code == 200
        assert [f.result(10).status_code for f in futures] == [200, 200, 200]
    served = [r.json["prompt"] for r in worker.generation_requests()[1:]]
    # normal first (team-a), then the two low ones in arrival order
    assert served == ["request 2", "request 0", "request 1"]
    assert router.metric("kvpool_router_queue_wait_seconds_count", band="low") == 2
    assert router.metric("kvpool_router_queue_wait_seconds_count", band="normal") == 1


def _queued(router: RunningRouter) -> float:
    return sum(
        router.metric("kvpool_router_queue_depth", band=b) for b in ("high", "normal", "low")
    )


def test_a_request_that_cannot_meet_its_deadline_is_shed_at_its_deadline_not_its_timeout(
    tmp_path: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
    llama_dir: Path,
) -> None:
    tenants = [
        {"name": "team-a", "keys": [KEY_A]},
        {"name": "slo", "keys": [KEY_B], "ttft_slo_s": 0.3},
    ]
    worker, router = router_with(
        tmp_path, recording, start_router, llama_dir, tenants, max_concurrency=1
    )
    url = router.url + "/v1/completions"
    pool, held = _stalled_slot(worker, router, url, bearer(KEY_A))
    with pool:
        by_slo = httpx.post(url, json=body(llama_dir), headers=bearer(KEY_B), timeout=10)
        by_header = httpx.post(
            url,
            json=body(llama_dir),
            headers=bearer(KEY_A) | {"x-kvpool-ttft-deadline-ms": "200"},
            timeout=10,
        )
        bad = httpx.post(
            url,
            json=body(llama_dir),
            headers=bearer(KEY_A) | {"x-kvpool-ttft-deadline-ms": "soon"},
        )
        worker.gate.set()
        assert held.result(10).status_code == 200
    for shed in (by_slo, by_header):
        assert shed.status_code == 503, shed.text
        assert shed.json()["error"]["code"] == "deadline"
        assert int(shed.headers["retry-after"]) >= 1
    assert bad.status_code == 400
    assert len(worker.generation_requests()) == 1  # neither reached the worker
    assert router.metric("kvpool_router_shed_total", reason="deadline", band="normal") == 2
    assert router.metric("kvpool_router_requests_total", outcome="shed") == 2


def test_a_full_queue_refuses_with_429_and_a_client_that_leaves_frees_its_place(
    tmp_path: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
    llama_dir: Path,
) -> None:
    worker, router = router_with(
        tmp_path, recording, start_router, llama_dir, None, max_concurrency=1, queue_max_requests=1
    )
    url = router.url + "/v1/completions"
    pool, held = _stalled_slot(worker, router, url, {})
    with pool:
        # A client that gives up while it waits leaves the queue at once.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=body(llama_dir), timeout=0.5)
        router.wait_for(lambda: _queued(router) == 0, timeout=5)
        waiting = pool.submit(httpx.post, url, json=body(llama_dir), timeout=10)
        router.wait_for(lambda: _queued(router) == 1, timeout=5)
        full = httpx.post(url, json=body(llama_dir))
        assert full.status_code == 429
        assert full.json()["error"]["code"] == "queue_full"
        assert full.headers["retry-after"]
        worker.gate.set()
        assert held.result(10).status_code == 200
        assert waiting.result(10).status_code == 200
    assert len(worker.generation_requests()) == 2
    router.wait_for(lambda: router.router.active == 0)


def test_without_flow_control_saturation_sends_everything_to_the_workers(
    tmp_path: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
    llama_dir: Path,
) -> None:
    worker, router = router_with(
        tmp_path,
        recording,
        start_router,
        llama_dir,
        None,
        flow_control=False,
        saturation_ttft_s=0.001,
    )
    url = router.url + "/v1/completions"
    worker.mode = "stall"
    worker.gate.clear()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(httpx.post, url, json=body(llama_dir), timeout=10) for _ in range(4)]
        worker.wait_for(lambda: len(worker.generation_requests()) == 4)
        assert _queued(router) == 0
        worker.gate.set()
        assert [f.result().status_code for f in futures] == [200] * 4


def test_a_saturated_pool_holds_requests_in_the_router_until_a_worker_can_take_them(
    tmp_path: Path,
    recording: Callable[..., RecordingWorker],
    start_router: Callable[..., RunningRouter],
    llama_dir: Path,
) -> None:
    # Every prediction is over a tiny bound once the worker holds unanswered prompt
    # tokens: the first request goes, the rest wait for its first token.
    worker, router = router_with(
        tmp_path, recording, start_router, llama_dir, None, saturation_ttft_s=0.05
    )
    url = router.url + "/v1/completions"
    long_prompt = " ".join(["word"] * 3000)
    worker.mode = "stall"
    worker.gate.clear()
    done = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [
            pool.submit(httpx.post, url, json=body(llama_dir, prompt=long_prompt), timeout=20)
            for _ in range(3)
        ]
        router.wait_for(lambda: _queued(router) >= 1, timeout=10)
        assert len(worker.generation_requests()) < 3
        assert router.metric("kvpool_router_saturated_total", reason="ttft") >= 1
        worker.gate.set()
        assert [f.result().status_code for f in futures] == [200] * 3
        done.set()
    assert len(worker.generation_requests()) == 3


# -- the dispatcher, against a pool of a known size ---------------------------------------


def gate_of(llama_dir: Path, saturation: Callable[[Any, bool], str | None], **values: Any) -> Any:
    """The router's admission alone, before a pool whose saturation the test decides."""
    from kvpool.router.admin.metrics import RouterMetrics
    from kvpool.router.admission.gate import Gate
    from kvpool.router.settings import RouterSettings

    settings = RouterSettings(model=str(llama_dir), worker=["http://127.0.0.1:9"], **values)
    return Gate(settings, RouterMetrics(lambda: [], lambda worker: 0), saturation)


async def test_room_for_one_more_sends_one_waiting_request_not_the_whole_queue(
    llama_dir: Path,
) -> None:
    """A pool that takes 2 requests at once, 12 clients: when one ends, exactly one waiting
    request goes on. A request let go by the dispatcher counts at its worker only once its
    own task runs, so a dispatcher that asked again before that would see the same room 10
    times over and pile the whole queue into the workers' own queues, where priority
    means nothing."""
    capacity = 2
    at_worker: list[Any] = []
    most = 0

    def saturation(routed: Any, commit: bool) -> str | None:
        return "ttft" if len(at_worker) >= capacity else None

    gate = gate_of(llama_dir, saturation)
    ends: dict[int, asyncio.Event] = {}

    async def client(i: int) -> None:
        nonlocal most
        p = gate.enter({})
        await admitted(gate, p, SimpleNamespace(num_tokens=100), max_tokens=16)
        at_worker.append(p)  # routed, its ticket begun: no await between, as in the router
        p.on_worker()
        most = max(most, len(at_worker))
        ends[i] = asyncio.Event()
        await ends[i].wait()
        at_worker.remove(p)
        gate.finish(p)

    tasks = [asyncio.create_task(client(i)) for i in range(12)]
    for _ in range(50):
        await asyncio.sleep(0.01)
        for event in list(ends.values()):  # the worker answers one request at a time
            if not event.is_set():
                event.set()
                break
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
    assert most == capacity
    assert gate.active == 0 and len(gate.queue) == 0
    text = gate.metrics.render().decode()
    # every request that waited is counted, not only the one that started the queue
    assert 'kvpool_router_saturated_total{reason="ttft"} 10.0' in text
    await gate.close()


async def test_fairness_counts_the_tokens_a_request_really_took_not_its_max_tokens(
    llama_dir: Path, tmp_path: Path
) -> None:
    """Tenant x asked for 2,000 tokens but the answer took 20; y asked for and took 200.
    Both then wait for the one place: x has used less, so x goes first. Counted by what
    they asked for, y would."""
    tenants = [{"name": "x", "keys": [KEY_A]}, {"name": "y", "keys": [KEY_B]}]
    keys = write_tenants(tmp_path / "tenants.yaml", tenants)
    busy: list[Any] = []
    gate = gate_of(
        llama_dir, lambda routed, commit: "ttft" if busy else None, api_keys_file=str(keys)
    )
    order: list[str] = []

    async def request(key: str, max_tokens: int, completion: int, hold: asyncio.Event) -> None:
        p = gate.enter({"authorization": f"Bearer {key}"})
        routed = SimpleNamespace(num_tokens=100)
        await admitted(gate, p, routed, max_tokens=max_tokens)
        order.append(p.tenant.name)
        busy.append(p)
        p.on_worker()
        await hold.wait()
        p.usage = {"prompt_tokens": 100, "completion_tokens": completion}
        busy.remove(p)
        gate.finish(p)

    done = asyncio.Event()
    done.set()
    await request(KEY_A, 2000, 20, done)  # x: served alone, took 120 tokens of 2,100
    hold = asyncio.Event()
    y1 = asyncio.create_task(request(KEY_B, 200, 200, hold))  # y: holds the place
    await asyncio.sleep(0.01)
    waiting = [
        asyncio.create_task(request(KEY_B, 200, 200, done)),
        asyncio.create_task(request(KEY_A, 200, 200, done)),
    ]
    await asyncio.sleep(0.05)
    assert len(gate.queue) == 2
    hold.set()
    await asyncio.wait_for(asyncio.gather(y1, *waiting), timeout=5)
    assert order == ["x", "y", "x", "y"]
    await gate.close()


def test_a_kvpool_worker_says_how_many_requests_it_runs_at_once_and_the_router_knows_it(
    start_worker: Callable[..., Any], start_router: Callable[..., RunningRouter]
) -> None:
    # Before any request has queued there: flow control sees a full batch at once.
    worker = start_worker(max_num_seqs=3, max_num_batched_tokens=256)
    info = httpx.get(worker.url + "/kvpool/info").json()
    assert info["max_num_seqs"] == 3
    router = start_router(worker=[f"{worker.url},id=w"])
    router.wait_workers_up(1)
    assert router.workers()["w"]["batch_capacity"] == 3
