"""``kvpool router serve --processes N``: several router processes on one port.

The router runs as a process of its own here (a supervisor and its router processes), in
front of fake workers (real HTTP servers in this test process). What a client sees must
not change with the number of processes: retries before the first byte, errors after it,
a client leaving, draining at SIGTERM, and ``/metrics`` counting every process's work.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import test_router_dropin as dropin
import test_router_reliability as reliability
from test_router_reliability import FakeWorker, body, error_of, sse_data

from kvpool.router.processes import ProcessSlot, expand_peer

from conftest import RouterProcesses, RunningRouter

# the reliability tests' fake workers, as fixtures of this module too
fake_workers = reliability.fake_workers
one_fake = reliability.one_fake
recording = dropin.recording

pytestmark = pytest.mark.timeout(120)


def _scrapes(router: RunningRouter, n: int = 12) -> list[dict[tuple[str, tuple], float]]:
    return [router.metrics() for _ in range(n)]  # each on a new connection: any process


def _total(page: dict[tuple[str, tuple], float], name: str) -> float:
    return sum(v for (n, _), v in page.items() if n == name)


def test_two_processes_serve_one_port_and_metrics_add_up_whichever_answers(
    llama_dir: Path,
    fake_workers: Callable[[int], list[FakeWorker]],
    start_router: Callable[..., RunningRouter],
) -> None:
    fakes = fake_workers(2)
    router = start_router(worker=[f.spec(n) for f, n in zip(fakes, "ab", strict=True)], processes=2)
    assert isinstance(router, RouterProcesses)
    router.wait_workers_up(2)
    assert set(router.health_by_process()) == {0, 1}  # both accept from the one port

    def served_by_each() -> dict[int, int]:  # each process counts the requests it took
        served: dict[int, int] = {}
        while set(served) != {0, 1}:
            health = httpx.get(router.url + "/health").json()
            served[health["process"]] = health["requests"]
        return served

    sent = 0
    while sent < 200 and (sent < 20 or 0 in served_by_each().values()):
        # each on a new connection, until both processes have served some
        assert httpx.post(router.url + "/v1/completions", json=body(llama_dir)).status_code == 200
        sent += 1
    served = served_by_each()
    assert min(served.values()) > 0 and sum(served.values()) == sent, served
    assert sum(f.completions for f in fakes) == sent

    def every_page_counts_all() -> bool:
        for page in _scrapes(router):
            success = page.get(("kvpool_router_requests_total", (("outcome", "success"),)))
            if success != sent:
                return False
            if _total(page, "kvpool_router_routing_decisions_total") != sent:
                return False
            if page.get(("kvpool_router_decision_latency_seconds_count", ())) != sent:
                return False  # histograms add up too
        return True

    router.wait_for(every_page_counts_all, timeout=10)

    def each_hears_the_other() -> bool:  # the peer link over ipc://: rows of both workers
        for _ in range(10):
            peers = httpx.get(router.url + "/debug/peers").json()
            heard = list(peers["heard"].values())
            if not (
                peers["peers"][0].startswith("ipc://") and heard and set(heard[0]) == {"a", "b"}
            ):
                return False
        return True

    router.wait_for(each_hears_the_other, timeout=10)


def test_a_stored_response_is_continued_on_its_worker_whichever_process_takes_the_next_turn(
    llama_dir: Path,
    recording: Callable[..., dropin.RecordingWorker],
    start_router: Callable[..., RunningRouter],
) -> None:
    a, b = recording(llama_dir.name), recording(llama_dir.name)
    # round-robin: a process that does not know where the response is alternates workers
    router = start_router(worker=[a.spec("a"), b.spec("b")], policy="round-robin", processes=2)
    router.wait_workers_up(2)
    first = {"model": llama_dir.name, "input": "hello there"}
    resp = httpx.post(router.url + "/v1/responses", json=first, timeout=10)
    assert resp.status_code == 200
    worker, response_id = resp.headers["x-kvpool-worker"], resp.json()["id"]

    def the_other_process_heard_it() -> bool:  # each GET on a new connection: any process
        return any(
            httpx.get(router.url + "/debug/peers").json().get("pins_received", 0) >= 1
            for _ in range(10)
        )

    router.wait_for(the_other_process_heard_it, timeout=10)
    for turn in range(8):  # each on a new connection: either process
        follow = {"model": llama_dir.name, "input": f"and {turn}?",
                  "previous_response_id": response_id}  # fmt: skip
        again = httpx.post(router.url + "/v1/responses", json=follow, timeout=10)
        assert again.status_code == 200, again.text
        assert again.headers["x-kvpool-worker"] == worker


def test_error_before_the_first_byte_is_retried_unseen_in_every_process(
    llama_dir: Path,
    fake_workers: Callable[[int], list[FakeWorker]],
    start_router: Callable[..., RunningRouter],
) -> None:
    bad, good = fake_workers(2)
    bad.mode = "500"
    router = start_router(worker=[bad.spec("a"), good.spec("b")], policy="round-robin", processes=2)
    router.wait_workers_up(2)

    for stream in (False, True) * 4:
        resp = httpx.post(router.url + "/v1/completions", json=body(llama_dir, stream=stream))
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-kvpool-worker"] == "b"
        assert '"error"' not in resp.text
    assert bad.completions >= 1  # tried, failed, and nobody saw it
    router.wait_for(
        lambda: router.metric("kvpool_router_retries_total", reason="5xx") == bad.completions
    )


def test_every_process_explains_a_decision_by_what_any_process_routed(
    llama_dir: Path,
    fake_workers: Callable[[int], list[FakeWorker]],
    start_router: Callable[..., RunningRouter],
) -> None:
    """/debug/route, answered by whichever process takes the connection, names the worker
    another process just sent the same long prompt to, with its cached tokens and why:
    the processes share what they routed, and each explains the same decision."""
    a, b = fake_workers(2)
    router = start_router(worker=[a.spec("a"), b.spec("b")], processes=2)
    router.wait_workers_up(2)
    prompt = " ".join(f"word{i}" for i in range(400))  # well over a few blocks
    sent = httpx.post(
        router.url + "/v1/completions",
        json={"model": llama_dir.name, "prompt": prompt, "max_tokens": 4},
        timeout=10,
    )
    assert sent.status_code == 200, sent.text
    worker = sent.headers["x-kvpool-worker"]
    # Each request is a new connection, which the kernel gives to either process; ask until
    # both have answered (a process still starting under load takes none at first).
    answers: list[dict[str, Any]] = []
    deadline = time.monotonic() + 30
    while {x["process"] for x in answers} != {0, 1}:
        assert time.monotonic() < deadline, f"one process answered all {len(answers)}"
        answers.append(router.route({"model": llama_dir.name, "prompt": prompt}))
    for route in answers:
        assert route["worker"] == worker, route["explanation"]
        assert route["cached_tokens"] > 0 and route["reason"].startswith("prefix")
        assert worker in route["explanation"]


def test_failure_mid_stream_and_a_client_leaving_release_everything(
    llama_dir: Path, one_fake: Callable[..., tuple[FakeWorker, RunningRouter, str]]
) -> None:
    fake, router, url = one_fake("cut", processes=2)
    with httpx.stream("POST", url, json=body(llama_dir, stream=True), timeout=5) as resp:
        events = sse_data(resp.iter_lines())
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "worker_failed"

    fake.mode = "hang"
    with httpx.stream("POST", url, json=body(llama_dir, stream=True), timeout=5) as resp:
        assert next(resp.iter_lines()).startswith("data:")
    # The client left with the worker still hanging: its slot and its load are released.
    router.wait_for(lambda: router.metric("kvpool_router_requests_total", outcome="cancelled") == 1)
    router.wait_for(lambda: router.active() == 0, timeout=5)
    assert router.metric("kvpool_router_requests_total", outcome="stream_error") == 1
    fake.mode = "ok"
    assert httpx.post(url, json=body(llama_dir)).status_code == 200


def test_bad_input_and_unknown_paths_get_openai_errors(
    llama_dir: Path, one_fake: Callable[..., tuple[FakeWorker, RunningRouter, str]]
) -> None:
    fake, router, url = one_fake("ok", processes=2)
    resp = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 400 and error_of(resp)["type"] == "invalid_request_error"
    resp = httpx.post(url, json=body(llama_dir, model="no-such-model"))
    assert resp.status_code == 404 and error_of(resp)["code"] == 404
    resp = httpx.get(url)
    assert resp.status_code == 405 and error_of(resp)
    assert router.route(body(llama_dir))["worker"] == "a"  # the admin surface, via FastAPI
    assert fake.completions == 0


@contextmanager
def _draining_a_stream(
    llama_dir: Path,
    one_fake: Callable[..., tuple[FakeWorker, RunningRouter, str]],
    drain_timeout_s: float,
) -> Iterator[tuple[FakeWorker, RouterProcesses, Iterator[str]]]:
    """A router of two processes sent SIGTERM while a stream hangs on its worker: it drains
    (the stream's lines still to come are yielded)."""
    fake, router, url = one_fake("hang", processes=2, drain_timeout_s=drain_timeout_s)
    assert isinstance(router, RouterProcesses)
    with httpx.stream("POST", url, json=body(llama_dir, stream=True), timeout=10) as resp:
        lines = resp.iter_lines()  # kept: a dropped iterator closes the stream
        assert next(lines).startswith("data:")
        router.terminate()
        time.sleep(0.5)
        assert router.proc.poll() is None  # still draining the stream
        yield fake, router, lines


def test_sigterm_drains_the_streams_in_flight_then_every_process_exits(
    llama_dir: Path, one_fake: Callable[..., tuple[FakeWorker, RunningRouter, str]]
) -> None:
    with _draining_a_stream(llama_dir, one_fake, drain_timeout_s=10) as (fake, router, lines):
        fake.gate.set()
        rest = sse_data(lines)
    assert rest[-1] == "[DONE]" and not any('"error"' in e for e in rest)
    assert router.proc.wait(timeout=15) == 0


def test_a_second_sigterm_stops_at_once(
    llama_dir: Path, one_fake: Callable[..., tuple[FakeWorker, RunningRouter, str]]
) -> None:
    with _draining_a_stream(llama_dir, one_fake, drain_timeout_s=30) as (fake, router, _):
        t0 = time.monotonic()
        router.terminate()
        router.proc.wait(timeout=10)
    assert time.monotonic() - t0 < 8  # not the 30 s drain
    fake.gate.set()


def test_sigterm_while_the_processes_start_stops_them_all(llama_dir: Path) -> None:
    """A pod deleted while it comes up: no process is left serving, none is started."""
    import sys

    from kvpool.stack import free_port

    port = free_port()
    argv = [sys.executable, "-c", "import sys; from kvpool.cli import main; sys.exit(main())"]
    argv += ["router", "serve", "--model", str(llama_dir), "--port", str(port)]
    argv += ["--worker", "http://127.0.0.1:9", "--processes", "2"]
    proc = subprocess.Popen(argv, env={**os.environ, "PYTHONSAFEPATH": "1"})
    seen: set[int] = set()
    deadline = time.monotonic() + 30.0
    while not seen and time.monotonic() < deadline:  # the supervisor has started its first
        seen.update(_children(proc.pid))  # process (before it, an import may be under way)
        time.sleep(0.05)
    assert seen, "no router process started"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    time.sleep(0.5)
    left = [p for p in seen if Path(f"/proc/{p}").exists() and _is_router(p)]
    assert left == []
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def test_a_router_process_that_dies_is_started_again(
    llama_dir: Path, one_fake: Callable[..., tuple[FakeWorker, RunningRouter, str]]
) -> None:
    _, router, url = one_fake("ok", processes=2)
    assert isinstance(router, RouterProcesses)
    for _ in range(10):
        assert httpx.post(url, json=body(llama_dir)).status_code == 200
    routers = [p for p in _children(router.proc.pid) if _is_router(p)]
    assert len(routers) == 2
    router.wait_for(lambda: len(router.health_by_process(tries=50)) == 2)
    time.sleep(1.5)  # each process has written its rows at least once since
    os.kill(routers[0], signal.SIGKILL)

    router.wait_for(
        lambda: (
            len([p for p in _children(router.proc.pid) if _is_router(p)]) == 2
            and routers[0] not in _children(router.proc.pid)
        ),
        timeout=30,
    )
    router.wait_workers_up(1)
    for _ in range(10):
        assert httpx.post(url, json=body(llama_dir)).status_code == 200
    assert router.proc.poll() is None
    # What the dead process counted stays counted: the pod's totals never go back.
    router.wait_for(
        lambda: all(
            _total(page, "kvpool_router_routing_decisions_total") == 20 for page in _scrapes(router)
        ),
        timeout=10,
    )


def _is_router(pid: int) -> bool:
    """A live router process: not multiprocessing's resource tracker, nor a zombie (an
    exited process not yet reaped has no command line)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_text()
    except FileNotFoundError:
        return False
    return bool(cmdline) and "resource_tracker" not in cmdline


def test_a_process_that_cannot_start_stops_the_router_with_an_error(
    tmp_path: Path, llama_dir: Path
) -> None:
    with pytest.raises(RuntimeError, match="did not start"):
        # a worker spec the settings accept, a tokenizer the processes cannot load
        bad_model = tmp_path / "model"
        bad_model.mkdir()
        (bad_model / "config.json").write_text("{}")
        RouterProcesses({"model": str(bad_model), "worker": ["http://127.0.0.1:9"], "processes": 2})


def test_peering_of_processes_and_replicas() -> None:
    alone = ProcessSlot()
    assert alone.peering(None, []) == (None, [])
    assert alone.peering("tcp://*:7000", ["tcp://r2:7000"]) == ("tcp://*:7000", ["tcp://r2:7000"])

    second = ProcessSlot(1, 3, "/run/x")
    assert second.peering(None, []) == (
        "ipc:///run/x/peer-1",
        ["ipc:///run/x/peer-0", "ipc:///run/x/peer-2"],
    )
    bind, peers = second.peering("tcp://*:7000", ["tcp://r2:7000"])
    assert bind == "tcp://*:7001"
    assert peers == [
        "tcp://127.0.0.1:7000",
        "tcp://127.0.0.1:7002",
        "tcp://r2:7000",
        "tcp://r2:7001",
        "tcp://r2:7002",
    ]
    assert expand_peer("tcp://r2:7000", 1) == ["tcp://r2:7000"]
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        second.peering("tcp://*:7000", ["ipc:///elsewhere"])


async def test_discovered_router_pods_are_peers_of_every_process_but_this_pod(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--peer-selector``: the pool's router pods, less this one (its hostname), each as
    its processes' peer ports, beside this pod's other processes."""
    import asyncio
    import socket

    from kvpool.router.server import Router
    from kvpool.router.settings import RouterSettings
    from kvpool.router.state import discovery
    from kvpool.router.state.discovery import WorkerEndpoint

    asked: list[tuple[str, str, object]] = []

    class RouterPods:
        def __init__(self, namespace: str, selector: str, port: object, **_: object) -> None:
            asked.append((namespace, selector, port))
            self.port = port

        async def run(self, on_change: Callable[[list[WorkerEndpoint]], None]) -> None:
            on_change(
                [
                    WorkerEndpoint(socket.gethostname(), f"http://10.0.0.1:{self.port}"),
                    WorkerEndpoint("router-b", f"http://10.0.0.2:{self.port}"),
                ]
            )
            await asyncio.Event().wait()

    class Link:
        peers: list[str] = []

        def set_peers(self, peers: object) -> None:
            self.peers = sorted(peers)  # type: ignore[call-overload]

    monkeypatch.setattr(discovery, "KubernetesDiscovery", RouterPods)
    settings = RouterSettings(
        model=str(llama_dir),
        discovery="kubernetes",
        namespace="pools",
        peer_bind="tcp://0.0.0.0:7100",
        peer_selector="kvpool.io/component=router",
    )
    router = Router(settings, slot=ProcessSlot(1, 2, str(tmp_path)))
    router.peers = link = Link()
    task = asyncio.create_task(router._discover_peers())
    for _ in range(100):
        await asyncio.sleep(0.01)
        if link.peers:
            break
    task.cancel()
    assert asked == [("pools", "kvpool.io/component=router", 7100)]
    assert link.peers == ["tcp://10.0.0.2:7100", "tcp://10.0.0.2:7101", "tcp://127.0.0.1:7100"]


def test_router_processes_leave_when_their_supervisor_is_killed(
    llama_dir: Path, one_fake: Callable[..., tuple[FakeWorker, RunningRouter, str]]
) -> None:
    """No process serves on alone (its port, its share of the load) once the supervisor
    is gone: SIGKILLed, say, when it is not the container's first process."""
    _, router, _ = one_fake("ok", processes=2)
    assert isinstance(router, RouterProcesses)
    routers = [p for p in _children(router.proc.pid) if _is_router(p)]
    assert len(routers) == 2
    router.proc.kill()
    router.proc.wait()
    router.wait_for(lambda: not any(_is_router(p) for p in routers), timeout=15)
