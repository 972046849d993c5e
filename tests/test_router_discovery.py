"""Worker discovery: CLI specs, pod readiness rules, and list + watch against kmock's emulator.

kmock 0.8's emulator, as read in its source (kmock/_internal/k8s.py), differs from a real API
server in ways these tests work with rather than around:
- it ignores ``labelSelector`` on list and watch, so the discovery also filters labels
  client-side (the unlabelled pod below is served to it and must still be ignored);
- it ignores ``timeoutSeconds`` and ``resourceVersion`` on watches: a watch never ends on its
  own and always starts by replaying every object as ADDED; the discovery's client read
  timeout ends it, and it then relists;
- objects carry no ``resourceVersion``; lists answer with the placeholder ``"..."``;
- DELETE of an object with finalizers only sets ``deletionTimestamp`` (a MODIFIED event),
  like a pod in graceful termination; without finalizers it is gone at once (DELETED).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import kubernetes.client
import pytest

from kvpool.router.state.discovery import (
    KubernetesDiscovery,
    StaticDiscovery,
    WorkerEndpoint,
    endpoint_from_pod,
    label_selector_matches,
    parse_static_worker,
)

pytestmark = pytest.mark.timeout(20)

NS = "workers"
SELECTOR = "app=kvpool-worker"


def make_pod(
    name: str,
    *,
    namespace: str = NS,
    labels: dict[str, str] | None = None,
    phase: str = "Running",
    ip: str | None = "10.0.0.5",
    ready: bool = True,
    deleting: bool = False,
    finalizers: list[str] | None = None,
) -> dict[str, Any]:
    """A pod in its JSON form, as the API serves it."""
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": {"app": "kvpool-worker"} if labels is None else labels,
    }
    if deleting:
        metadata["deletionTimestamp"] = "2024-01-01T00:00:00Z"
    if finalizers:
        metadata["finalizers"] = finalizers
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip:
        status["podIP"] = ip
    container = {"name": "worker", "ports": [{"name": "http", "containerPort": 8000}]}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {"containers": [container]},
        "status": status,
    }


# --- parse_static_worker / StaticDiscovery --------------------------------------------------


def test_bare_url_is_a_worker_of_both_roles_named_by_its_host_and_port() -> None:
    assert parse_static_worker("http://10.0.0.5:8000/") == WorkerEndpoint(
        id="10.0.0.5:8000", url="http://10.0.0.5:8000"
    )


def test_spec_options_set_role_event_endpoints_and_id() -> None:
    spec = "http://w1:8000/,role=prefill,events=tcp://w1:5557,replay=tcp://w1:5558,id=w1"
    assert parse_static_worker(spec + ",max-num-seqs=16") == WorkerEndpoint(
        id="w1",
        url="http://w1:8000",
        role="prefill",
        kv_events_endpoint="tcp://w1:5557",
        kv_events_replay_endpoint="tcp://w1:5558",
        max_num_seqs=16,  # a vLLM worker's --max-num-seqs, which vLLM publishes nowhere
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("w1:8000", "URL 'w1:8000': scheme must be http:// or https://"),
        ("ftp://w1", "scheme must be http:// or https://"),
        ("role=prefill", "scheme must be http:// or https://"),
        ("http://:8000", "URL 'http://:8000': needs a host"),
        ("http://w1:99999", "URL 'http://w1:99999': Port out of range"),
        ("http://w1?x=1", "must not have a query or fragment"),
        ("http://w1,weight=2", "unknown key 'weight' (known: role, events, replay, id, max-num"),
        ("http://w1,max-num-seqs=0", "max-num-seqs must be a positive integer"),
        ("http://w1,max-num-seqs=many", "max-num-seqs must be a positive integer"),
        ("http://w1,role=encode", "role 'encode' is not one of both, prefill, decode"),
        ("http://w1,role=decode,role=both", "duplicate key 'role'"),
        ("http://w1,prefill", "expected key=value, got 'prefill'"),
        ("http://w1,id=", "expected key=value, got 'id='"),
        ("http://w1,events=udp://w1:5557", "events 'udp://w1:5557': scheme must be tcp://"),
        ("http://w1,events=tcp://w1", "events 'tcp://w1': needs a host and a port"),
        ("http://w1,events=tcp://w1:1,replay=w1:2", "replay 'w1:2': scheme must be tcp://"),
        ("http://w1,replay=tcp://w1:5558", "replay= needs events="),
    ],
)
def test_bad_spec_is_refused_with_a_message_naming_the_problem(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match="worker spec") as info:
        parse_static_worker(spec)
    assert message in str(info.value)


def test_static_discovery_refuses_duplicate_ids() -> None:
    with pytest.raises(ValueError, match="duplicate worker ids: w1"):
        StaticDiscovery(
            [parse_static_worker("http://a:1,id=w1"), parse_static_worker("http://b:1,id=w1")]
        )


async def test_static_discovery_reports_once_and_runs_until_cancelled() -> None:
    endpoints = [parse_static_worker("http://a:8000"), parse_static_worker("http://b:8000")]
    seen: list[list[WorkerEndpoint]] = []
    task = asyncio.create_task(StaticDiscovery(endpoints).run(seen.append))
    await eventually(lambda: bool(seen), "the static list")
    await asyncio.sleep(0.05)  # give a wrong second report the chance to show up
    assert seen == [endpoints]
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_failing_callback_does_not_stop_discovery(caplog: pytest.LogCaptureFixture) -> None:
    def explode(endpoints: list[WorkerEndpoint]) -> None:
        raise RuntimeError("router bug")

    task = asyncio.create_task(StaticDiscovery([]).run(explode))
    await eventually(lambda: "on_change failed" in caplog.text, "the logged failure")
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# --- endpoint_from_pod ----------------------------------------------------------------------


def test_ready_running_pod_is_an_endpoint_named_by_the_pod() -> None:
    assert endpoint_from_pod(make_pod("w-0"), port=8000) == WorkerEndpoint(
        id="w-0", url="http://10.0.0.5:8000"
    )


@pytest.mark.parametrize(
    "pod",
    [
        pytest.param(make_pod("w-0", ready=False), id="not-ready"),
        pytest.param(make_pod("w-0", deleting=True), id="terminating-but-still-ready"),
        pytest.param(make_pod("w-0", phase="Pending", ip=None, ready=False), id="pending-no-ip"),
        pytest.param(make_pod("w-0", ip=None), id="running-no-ip"),
        pytest.param(make_pod("w-0", phase="Succeeded"), id="finished"),
        pytest.param({"metadata": {"name": "w-0"}}, id="no-status-yet"),
    ],
)
def test_pod_that_must_not_get_requests_is_no_endpoint(pod: dict[str, Any]) -> None:
    assert endpoint_from_pod(pod, port=8000) is None


def test_a_pod_that_was_ready_stays_an_endpoint_while_its_readiness_probe_fails() -> None:
    # A busy worker fails its readiness probe as it fails the router's health check: out of
    # rotation (the router's own check decides), not out of the pool, which would drop its
    # index entries and abort its streams. One that was never Ready is no endpoint.
    busy = make_pod("w-0", ready=False)
    assert endpoint_from_pod(busy, port=8000, was_ready=True) == endpoint_from_pod(
        make_pod("w-0"), port=8000
    )
    assert endpoint_from_pod(make_pod("w-0", deleting=True), port=8000, was_ready=True) is None


def test_role_comes_from_the_role_label() -> None:
    pod = make_pod("w-0", labels={"kvpool.io/role": "decode"})
    assert endpoint_from_pod(pod, port=8000).role == "decode"  # type: ignore[union-attr]
    pod = make_pod("w-0", labels={"tier": "prefill"})
    assert endpoint_from_pod(pod, port=8000, role_label="tier").role == "prefill"  # type: ignore[union-attr]


def test_unknown_role_is_no_endpoint_and_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    pod = make_pod("w-0", labels={"kvpool.io/role": "encode"})
    with caplog.at_level(logging.WARNING, logger="kvpool.router.state.discovery"):
        assert endpoint_from_pod(pod, port=8000) is None
    assert "w-0" in caplog.text and "'encode'" in caplog.text


def test_named_port_is_looked_up_in_the_containers() -> None:
    pod = make_pod("w-0")
    pod["spec"]["containers"].insert(0, {"name": "sidecar", "ports": [{"containerPort": 9090}]})
    pod["spec"]["containers"][1]["ports"].append({"name": "metrics", "containerPort": 9100})
    assert endpoint_from_pod(pod, port="http").url == "http://10.0.0.5:8000"  # type: ignore[union-attr]
    assert endpoint_from_pod(pod, port="metrics").url == "http://10.0.0.5:9100"  # type: ignore[union-attr]


def test_missing_named_port_is_no_endpoint_and_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvpool.router.state.discovery"):
        assert endpoint_from_pod(make_pod("w-0"), port="grpc") is None
    assert "no container port named 'grpc'" in caplog.text


def test_event_ports_give_event_endpoints_on_the_pod_ip() -> None:
    endpoint = endpoint_from_pod(make_pod("w-0"), port=8000, events_port=5557, replay_port=5558)
    assert endpoint is not None
    assert endpoint.kv_events_endpoint == "tcp://10.0.0.5:5557"
    assert endpoint.kv_events_replay_endpoint == "tcp://10.0.0.5:5558"
    assert endpoint_from_pod(make_pod("w-0"), port=8000).kv_events_endpoint is None  # type: ignore[union-attr]


def test_ipv6_pod_ip_is_bracketed() -> None:
    endpoint = endpoint_from_pod(make_pod("w-0", ip="fd00::5"), port=8000, events_port=5557)
    assert endpoint is not None
    assert endpoint.url == "http://[fd00::5]:8000"
    assert endpoint.kv_events_endpoint == "tcp://[fd00::5]:5557"


@pytest.mark.parametrize(
    ("selector", "labels", "matches"),
    [
        ("app=w", {"app": "w"}, True),
        ("app==w", {"app": "x"}, False),
        ("app=w,tier!=cache", {"app": "w"}, True),
        ("app=w,tier!=cache", {"app": "w", "tier": "cache"}, False),
        ("tier in (prefill, decode),app", {"app": "w", "tier": "decode"}, True),
        ("tier in (prefill,decode)", {}, False),
        ("tier notin (cache)", {}, True),
        ("!canary", {"canary": "1"}, False),
        ("", {}, True),
    ],
)
def test_label_selector_is_checked_client_side(
    selector: str, labels: dict[str, str], matches: bool
) -> None:
    assert label_selector_matches(selector, labels) is matches


# --- KubernetesDiscovery against kmock's emulator -------------------------------------------


async def eventually(check: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    """Poll ``check`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


def discovery_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvpool-discovery"]


def declare_pods(kmock: Any) -> None:
    kmock.resources["v1/pods"] = kmock.ResourceInfo(
        kind="Pod",
        namespaced=True,
        verbs={"list", "watch", "get", "create", "patch", "delete"},
        subresources={"status"},
    )


@pytest.fixture
async def kube(kmock: Any) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client on the emulator, as kubectl would use it; pods are not declared yet."""
    async with httpx.AsyncClient(base_url=str(kmock.url).rstrip("/")) as client:
        yield client


def discovery_for(kube: httpx.AsyncClient, **kwargs: Any) -> KubernetesDiscovery:
    config = kubernetes.client.Configuration(host=str(kube.base_url).rstrip("/"))
    api_client = kubernetes.client.ApiClient(config)
    return KubernetesDiscovery(NS, SELECTOR, "http", api_client=api_client, **kwargs)


@asynccontextmanager
async def running(discovery: KubernetesDiscovery) -> AsyncIterator[list[list[WorkerEndpoint]]]:
    """Run the discovery as a task; yield what it reported; cancel it and check its thread."""
    seen: list[list[WorkerEndpoint]] = []
    task = asyncio.create_task(discovery.run(seen.append))
    try:
        yield seen
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not discovery_threads()


def ids(seen: list[list[WorkerEndpoint]]) -> list[str] | None:
    return [e.id for e in seen[-1]] if seen else None


async def create(kube: httpx.AsyncClient, pod: dict[str, Any]) -> None:
    namespace = pod["metadata"]["namespace"]
    response = await kube.post(f"/api/v1/namespaces/{namespace}/pods", json=pod)
    response.raise_for_status()


async def patch(kube: httpx.AsyncClient, path: str, body: dict[str, Any]) -> None:
    headers = {"Content-Type": "application/merge-patch+json"}
    response = await kube.patch(f"/api/v1/namespaces/{NS}/pods/{path}", json=body, headers=headers)
    response.raise_for_status()


async def test_discovery_follows_ready_labelled_pods_in_its_namespace(
    kmock: Any, kube: httpx.AsyncClient
) -> None:
    declare_pods(kmock)
    async with running(discovery_for(kube, events_port=5557)) as seen:
        await eventually(lambda: ids(seen) == [], "the first, empty report")
        labels = {"app": "kvpool-worker", "kvpool.io/role": "prefill"}
        await create(kube, make_pod("a", ip="10.0.0.1", labels=labels, finalizers=["test/hold"]))
        await create(kube, make_pod("b", ip="10.0.0.2", ready=False))
        await create(kube, make_pod("unlabelled", labels={"app": "other"}))
        await create(kube, make_pod("elsewhere", namespace="other"))
        await create(kube, make_pod("pending", phase="Pending", ip=None, ready=False))
        await eventually(lambda: ids(seen) == ["a"], "the ready pod")
        assert seen[-1] == [
            WorkerEndpoint(
                id="a",
                url="http://10.0.0.1:8000",
                role="prefill",
                kv_events_endpoint="tcp://10.0.0.1:5557",
            )
        ]

        ready = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
        await patch(kube, "b/status", ready)
        await eventually(lambda: ids(seen) == ["a", "b"], "b once it is Ready")

        # Ready once, b stays while its readiness probe fails (busy): the router's health
        # check takes it out of rotation, and it keeps its index entries and its streams.
        not_ready = {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
        await patch(kube, "b/status", not_ready)
        await create(kube, make_pod("c", ip="10.0.0.3"))  # seen after b's change, in order
        await eventually(lambda: ids(seen) == ["a", "b", "c"], "c, with b still there")
        (await kube.delete(f"/api/v1/namespaces/{NS}/pods/c")).raise_for_status()
        await eventually(lambda: ids(seen) == ["a", "b"], "c gone")

        # With a finalizer, DELETE only marks the pod terminating; it is still Ready.
        (await kube.delete(f"/api/v1/namespaces/{NS}/pods/a")).raise_for_status()
        await eventually(lambda: ids(seen) == ["b"], "a gone once it is terminating")
        await patch(kube, "a", {"metadata": {"finalizers": []}})  # now really deleted

        (await kube.delete(f"/api/v1/namespaces/{NS}/pods/b")).raise_for_status()
        await eventually(lambda: ids(seen) == [], "b gone once deleted")

    reports = [[e.id for e in report] for report in seen]
    assert reports == [[], ["a"], ["a", "b"], ["a", "b", "c"], ["a", "b"], ["b"], []]
    watches = [r for r in kmock if r.params.get("watch") == "true"]
    assert watches and all(r.params.get("labelSelector") == SELECTOR for r in watches)


async def test_discovery_retries_until_the_api_serves_pods(
    kmock: Any, kube: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    # Pods are not declared yet: the emulator answers 404, like an API server still starting.
    discovery = discovery_for(kube, backoff_initial=0.05, backoff_max=0.2)
    async with running(discovery) as seen:
        await eventually(lambda: len([r for r in kmock if r.resource]) >= 3, "a few failed lists")
        assert "HTTP 404" in caplog.text and not seen
        declare_pods(kmock)
        await create(kube, make_pod("a"))
        await eventually(lambda: ids(seen) == ["a"], "the pod once the API serves pods")


async def test_discovery_carries_on_after_a_watch_stream_ends(
    kmock: Any, kube: httpx.AsyncClient
) -> None:
    declare_pods(kmock)
    async with running(discovery_for(kube, watch_timeout=1)) as seen:
        await eventually(lambda: ids(seen) == [], "the first, empty report")
        await create(kube, make_pod("a"))
        await eventually(lambda: ids(seen) == ["a"], "the first pod")

        def watches() -> int:
            return len([r for r in kmock if r.params.get("watch") == "true"])

        await eventually(lambda: watches() >= 2, "a second watch request", timeout=8)
        await create(kube, make_pod("b", ip="10.0.0.6"))
        await eventually(lambda: ids(seen) == ["a", "b"], "a pod added on the new watch")
    assert [[e.id for e in report] for report in seen] == [[], ["a"], ["a", "b"]]


async def test_cancelling_discovery_stops_its_thread_promptly(
    kmock: Any, kube: httpx.AsyncClient
) -> None:
    declare_pods(kmock)
    # A long watch timeout: only the socket shutdown on cancel can make the stop prompt.
    discovery = discovery_for(kube, watch_timeout=60)
    task = asyncio.create_task(discovery.run(lambda endpoints: None))
    await eventually(lambda: any(r.params.get("watch") == "true" for r in kmock), "the watch")
    assert discovery_threads()
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not discovery_threads()
    assert time.monotonic() - started < 2.0
