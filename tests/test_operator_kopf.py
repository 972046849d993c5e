"""The operator, run by ``kopf.testing.KopfRunner`` against kmock's Kubernetes emulator.

No kube-apiserver can be installed here; kmock's ``KubernetesEmulator`` (by kopf's author)
stores objects, serves list/watch/get/create/patch/delete and API discovery. What a real
API server does beyond that, the tests do by hand where the operator depends on it:
- they give a pool the ``uid`` and ``generation`` the server would assign (and bump the
  generation with each spec change);
- they play the Deployment controller: ready replicas appear when a test writes them into
  a Deployment's status;
- the emulator validates nothing, which stands for a cluster whose CRD is older than the
  operator: the operator's own validation must catch a bad spec.
The operator reaches the emulator as it would any cluster: through ``KUBECONFIG``.
"""

from __future__ import annotations

import asyncio
import http.server
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kopf.testing import KopfRunner
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from kvpool.api import validate_pool
from kvpool.operator import handlers
from kvpool.operator.cluster import contains
from kvpool.operator.render import Images, render

from kube_emulator import declare_resources, write_kubeconfig

NS = "llm"
API = "/apis/kvpool.io/v1alpha1"
CHILD_PATHS = {
    "Deployment": "/apis/apps/v1",
    "Service": "/api/v1",
    "ConfigMap": "/api/v1",
    "ServiceAccount": "/api/v1",
    "Role": "/apis/rbac.authorization.k8s.io/v1",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1",
    "PodDisruptionBudget": "/apis/policy/v1",
    "NetworkPolicy": "/apis/networking.k8s.io/v1",
    "Secret": "/api/v1",
}
PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "ConfigMap": "configmaps",
    "ServiceAccount": "serviceaccounts",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "NetworkPolicy": "networkpolicies",
    "Secret": "secrets",
}

POOL_SPEC: dict[str, Any] = {
    "model": {"name": "tiny", "source": {"builtin": {}}},
    "disaggregation": {"mode": "Disaggregated"},
    "prefill": {"replicas": 1},
    "decode": {"replicas": 2},
}


@dataclass
class Kube:
    """kubectl, in a few verbs, on the emulator."""

    http: httpx.AsyncClient
    kmock: Any
    runners: list[KopfRunner] = field(default_factory=list)

    async def restart_operator(self) -> None:
        """Stop the operator and start a new one: a restart, or another replica taking over."""
        old = self.runners[-1]
        await asyncio.to_thread(old.__exit__, None, None, None)
        assert old.exception is None, old.stdout[-3000:]
        self.runners.append(start_operator())

    async def create_pool(self, name: str, spec: dict[str, Any]) -> None:
        body = {
            "apiVersion": "kvpool.io/v1alpha1",
            "kind": "InferencePool",
            "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1},
            "spec": spec,
        }
        r = await self.http.post(f"{API}/namespaces/{NS}/inferencepools", json=body)
        assert r.status_code in (200, 201), r.text

    async def pool(self, name: str) -> dict[str, Any]:
        r = await self.http.get(f"{API}/namespaces/{NS}/inferencepools/{name}")
        assert r.status_code == 200, r.text
        return r.json()

    async def change_spec(self, name: str, spec: dict[str, Any]) -> None:
        """A spec change, as the API server records it: the generation moves on."""
        generation = (await self.pool(name))["metadata"].get("generation", 1)
        patch = {"metadata": {"generation": generation + 1}, "spec": spec}
        r = await self.http.patch(
            f"{API}/namespaces/{NS}/inferencepools/{name}",
            json=patch,
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert r.status_code == 200, r.text

    def child_url(self, kind: str, name: str | None = None) -> str:
        url = f"{CHILD_PATHS[kind]}/namespaces/{NS}/{PLURALS[kind]}"
        return f"{url}/{name}" if name else url

    async def child(self, kind: str, name: str) -> dict[str, Any] | None:
        r = await self.http.get(self.child_url(kind, name))
        return r.json() if r.status_code == 200 else None

    async def children(self, kind: str) -> dict[str, dict[str, Any]]:
        r = await self.http.get(self.child_url(kind))
        return {i["metadata"]["name"]: i for i in r.json().get("items", [])}

    async def patch_child(self, kind: str, name: str, patch: dict[str, Any], sub: str = "") -> None:
        r = await self.http.patch(
            self.child_url(kind, name) + sub,
            json=patch,
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert r.status_code == 200, r.text

    async def delete_child(self, kind: str, name: str) -> None:
        r = await self.http.delete(self.child_url(kind, name))
        assert r.status_code == 200, r.text

    async def become_ready(self, name: str, replicas: int) -> None:
        """Play the Deployment controller: every replica updated, ready and available."""
        status = {
            "observedGeneration": (await self.child("Deployment", name) or {})
            .get("metadata", {})
            .get("generation", 0),
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": replicas,
            "availableReplicas": replicas,
        }
        await self.patch_child("Deployment", name, {"status": status}, "/status")

    def writes(self) -> list[str]:
        """Every write the emulator saw, as 'METHOD path'."""
        return [
            f"{r.method.name if hasattr(r.method, 'name') else r.method} {r.url.path}"
            for r in self.kmock
            if str(r.method).upper().split(".")[-1] in ("POST", "PATCH", "PUT", "DELETE")
        ]


async def eventually(check: Callable[[], Any], what: str, timeout: float = 15.0) -> Any:
    """Await ``check()`` (sync or async) until it gives a truthy value; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(0.1)
    pytest.fail(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def condition(pool: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(
        (c for c in (pool.get("status") or {}).get("conditions", []) if c["type"] == kind), {}
    )


@pytest.fixture
async def kube(kmock: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Kube]:
    """The emulator with the CRD installed and the operator running against it."""
    declare_resources(kmock)
    url = str(kmock.url).rstrip("/")
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kubeconfig", url)))
    monkeypatch.setenv("KVPOOL_OPERATOR_RESYNC_INTERVAL_S", "2")
    monkeypatch.setenv("KVPOOL_OPERATOR_SCRAPE_TIMEOUT_S", "1")
    monkeypatch.setenv("KVPOOL_OPERATOR_METRICS_PORT", "0")  # a free port: handlers.metrics_port()
    monkeypatch.setattr(handlers, "SETTINGS", None)
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        crd = yaml.safe_load((Path(__file__).parents[1] / "crds/inferencepool.yaml").read_text())
        r = await client.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=crd)
        assert r.status_code in (200, 201), r.text
        kube = Kube(client, kmock, [start_operator()])
        try:
            yield kube
        finally:
            # Stopped from a thread: the emulator runs on this loop and must keep answering
            # while the operator's handlers finish their calls.
            await asyncio.to_thread(kube.runners[-1].__exit__, None, None, None)
    runner = kube.runners[-1]
    assert runner.exception is None, runner.stdout[-3000:]


def start_operator() -> KopfRunner:
    args = ["run", "-A", "--standalone", "-m", "kvpool.operator.handlers"]
    runner = KopfRunner(args, timeout=30, reraise=False)
    runner.__enter__()
    return runner


def expected_children(name: str, spec: dict[str, Any]) -> list[dict[str, Any]]:
    return render(name, NS, validate_pool(name, spec), Images())


async def all_children_exist(kube: Kube, name: str, spec: dict[str, Any]) -> bool:
    for child in expected_children(name, spec):
        if await kube.child(child["kind"], child["metadata"]["name"]) is None:
            return False
    return True


# --- tests ----------------------------------------------------------------------------------


async def test_applying_a_pool_creates_every_child_owned_and_as_rendered(kube: Kube) -> None:
    await kube.create_pool("tiny", POOL_SPEC)
    await eventually(lambda: all_children_exist(kube, "tiny", POOL_SPEC), "every child")
    for want in expected_children("tiny", POOL_SPEC):
        live = await kube.child(want["kind"], want["metadata"]["name"])
        assert live is not None
        what = f"{want['kind']}/{want['metadata']['name']}"
        assert contains(live, want), f"{what} differs from its rendering"
        owners = live["metadata"]["ownerReferences"]
        assert owners == [
            {
                "apiVersion": "kvpool.io/v1alpha1",
                "kind": "InferencePool",
                "name": "tiny",
                "uid": "uid-tiny",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ], what

    pool = await eventually(lambda: _with_status(kube, "tiny"), "the status", timeout=10)
    status = pool["status"]
    assert status["observedGeneration"] == 1
    assert status["phase"] == "Progressing"
    assert status["prefill"]["summary"] == "0/1"
    assert status["decode"]["summary"] == "0/2"
    assert status["router"]["endpoint"] == "http://tiny-router.llm.svc"
    assert {c["type"] for c in status["conditions"]} == {
        "Ready", "Progressing", "Degraded", "AutoscalingActive", "SLOMet", "CacheAgreement",
    }  # fmt: skip
    assert condition(pool, "CacheAgreement")["status"] == "Unknown"  # no router pod to scrape
    assert condition(pool, "Ready")["status"] == "False"
    assert "router: no available replica" in condition(pool, "Ready")["message"]
    assert condition(pool, "Degraded")["status"] == "False"


async def _with_status(kube: Kube, name: str) -> dict[str, Any] | None:
    pool = await kube.pool(name)
    return pool if (pool.get("status") or {}).get("conditions") else None


async def test_ready_is_true_only_when_the_router_and_every_role_have_ready_replicas(
    kube: Kube,
) -> None:
    await kube.create_pool("tiny", POOL_SPEC)
    await eventually(lambda: all_children_exist(kube, "tiny", POOL_SPEC), "every child")
    await kube.become_ready("tiny-router", 1)
    await kube.become_ready("tiny-decode", 2)

    async def ready_status() -> str | None:
        return condition(await kube.pool("tiny"), "Ready").get("message")

    async def only_prefill_missing() -> bool:
        return await ready_status() == "prefill: no ready worker (0/1)"

    await eventually(only_prefill_missing, "Ready to name only the role without workers")
    pool = await kube.pool("tiny")
    assert condition(pool, "Ready")["status"] == "False"
    await kube.become_ready("tiny-prefill", 1)

    async def is_ready() -> dict[str, Any] | None:
        pool = await kube.pool("tiny")
        return pool if condition(pool, "Ready").get("status") == "True" else None

    pool = await eventually(is_ready, "Ready=True")
    assert pool["status"]["phase"] == "Ready"
    assert pool["status"]["decode"]["summary"] == "2/2"
    assert condition(pool, "Progressing")["status"] == "False"


async def test_changing_replicas_or_image_patches_the_children(kube: Kube) -> None:
    await kube.create_pool("tiny", POOL_SPEC)
    await eventually(lambda: all_children_exist(kube, "tiny", POOL_SPEC), "every child")
    await kube.change_spec("tiny", {"decode": {"replicas": 4}, "engine": {"image": "mine:2"}})

    async def patched() -> dict[str, Any] | None:
        dep = await kube.child("Deployment", "tiny-decode")
        return dep if dep and dep["spec"]["replicas"] == 4 else None

    dep = await eventually(patched, "decode replicas 4")
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "mine:2"
    prefill = await kube.child("Deployment", "tiny-prefill")
    assert prefill is not None
    assert prefill["spec"]["template"]["spec"]["containers"][0]["image"] == "mine:2"
    pool = await eventually(lambda: _generation_observed(kube, "tiny", 2), "observedGeneration 2")
    assert pool["status"]["decode"]["desiredReplicas"] == 4


async def _generation_observed(kube: Kube, name: str, generation: int) -> dict[str, Any] | None:
    pool = await kube.pool(name)
    return pool if (pool.get("status") or {}).get("observedGeneration") == generation else None


async def test_a_child_deleted_or_edited_by_hand_is_restored(kube: Kube) -> None:
    await kube.create_pool("tiny", POOL_SPEC)
    await eventually(lambda: all_children_exist(kube, "tiny", POOL_SPEC), "every child")
    await kube.delete_child("Service", "tiny-router")
    await kube.delete_child("Role", "tiny-router")
    await kube.delete_child("NetworkPolicy", "tiny-workers")
    await eventually(lambda: kube.child("Service", "tiny-router"), "the Service back")
    await eventually(lambda: kube.child("Role", "tiny-router"), "the Role back")
    # the workers' policy is watched too: back at once, not at the next resync
    await eventually(lambda: kube.child("NetworkPolicy", "tiny-workers"), "the policy back")

    want = next(
        c for c in expected_children("tiny", POOL_SPEC)
        if c["kind"] == "Deployment" and c["metadata"]["name"] == "tiny-decode"
    )  # fmt: skip
    hand_edit = {
        "spec": {"template": {"spec": {"containers": [{"name": "worker", "image": "evil:1"}]}}}
    }
    await kube.patch_child("Deployment", "tiny-decode", hand_edit)

    async def restored() -> bool:
        live = await kube.child("Deployment", "tiny-decode")
        return bool(live) and contains(live, want)

    await eventually(restored, "the decode Deployment as rendered again")


async def test_an_invalid_spec_is_degraded_and_the_children_are_left_alone(kube: Kube) -> None:
    await kube.create_pool("tiny", POOL_SPEC)
    await eventually(lambda: all_children_exist(kube, "tiny", POOL_SPEC), "every child")
    await eventually(lambda: _generation_observed(kube, "tiny", 1), "the first status")
    before = {kind: await kube.children(kind) for kind in PLURALS}
    writes_before = len(kube.writes())

    await kube.change_spec("tiny", {"decode": {"replicas": -1}, "autoscaling": {"enabled": True}})

    async def degraded() -> dict[str, Any] | None:
        pool = await kube.pool("tiny")
        return pool if condition(pool, "Degraded").get("status") == "True" else None

    pool = await eventually(degraded, "Degraded=True")
    message = condition(pool, "Degraded")["message"]
    assert condition(pool, "Degraded")["reason"] == "InvalidSpec"
    assert "spec.decode.replicas: Input should be greater than or equal to 0" in message
    assert "autoscaling.decode (minReplicas, maxReplicas) is required" in message
    assert pool["status"]["phase"] == "Degraded"
    assert pool["status"]["observedGeneration"] == 2
    await asyncio.sleep(2.5)  # a periodic resync (every 2 s here) must not touch them either
    after = {kind: await kube.children(kind) for kind in PLURALS}
    assert after == before
    child_writes = [
        w
        for w in kube.writes()[writes_before:]
        if "/inferencepools/" not in w and "/events" not in w
    ]
    assert child_writes == []


async def test_switching_to_aggregated_removes_the_prefill_role(kube: Kube) -> None:
    await kube.create_pool("tiny", POOL_SPEC)
    await eventually(lambda: all_children_exist(kube, "tiny", POOL_SPEC), "every child")
    await kube.change_spec("tiny", {"disaggregation": {"mode": "Aggregated"}, "prefill": None})

    async def prefill_gone() -> bool:
        return (
            await kube.child("Deployment", "tiny-prefill") is None
            and await kube.child("Service", "tiny-prefill") is None
            and await kube.child("PodDisruptionBudget", "tiny-prefill") is None
        )

    await eventually(prefill_gone, "the prefill children deleted")
    decode = await kube.child("Deployment", "tiny-decode")
    assert decode is not None
    labels = decode["spec"]["template"]["metadata"]["labels"]
    assert labels["kvpool.io/role"] == "both"
    pool = await eventually(lambda: _generation_observed(kube, "tiny", 2), "the new status")
    assert pool["status"].get("prefill") is None


# --- autoscaling, with pods that serve real /metrics on loopback -----------------------------


@contextmanager
def metrics_server(kv_usage: float, waiting: float) -> Iterator[int]:
    registry = CollectorRegistry()
    Gauge("vllm:kv_cache_usage_perc", "KV usage", registry=registry).set(kv_usage)
    Gauge("vllm:num_requests_waiting", "waiting", registry=registry).set(waiting)
    Gauge("vllm:num_requests_running", "running", registry=registry).set(4)
    body = generate_latest(registry)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


async def add_worker_pod(kube: Kube, pool: str, group: str, name: str, port: int) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {
                "kvpool.io/pool": pool,
                "app.kubernetes.io/component": "worker",
                "kvpool.io/group": group,
            },
            "annotations": {"prometheus.io/port": str(port)},
        },
        "spec": {"containers": [{"name": "worker", "image": "w"}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1"},
    }
    r = await kube.http.post(f"/api/v1/namespaces/{NS}/pods", json=pod)
    assert r.status_code in (200, 201), r.text


AUTOSCALED = {
    "model": {"name": "tiny", "source": {"builtin": {}}},
    "decode": {"replicas": 2},
    "slo": {"quantile": 0.9, "itlMilliseconds": 50},
    "autoscaling": {
        "enabled": True,
        "intervalSeconds": 5,
        "decode": {"minReplicas": 1, "maxReplicas": 6},
        # no stabilisation: these tests are about acting on the first decision
        "scaleUp": {"stabilizationWindowSeconds": 0, "maxStep": 2},
    },
}


@pytest.mark.slow
async def test_autoscaler_scales_decode_up_when_kv_cache_runs_full(kube: Kube) -> None:
    with metrics_server(kv_usage=0.99, waiting=12) as port:
        await kube.create_pool("auto", AUTOSCALED)
        await eventually(lambda: kube.child("Deployment", "auto-decode"), "the decode Deployment")
        await kube.become_ready("auto-decode", 2)
        await add_worker_pod(kube, "auto", "decode", "auto-decode-a", port)
        await add_worker_pod(kube, "auto", "decode", "auto-decode-b", port)

        async def scaled() -> dict[str, Any] | None:
            dep = await kube.child("Deployment", "auto-decode")
            return dep if dep and dep["spec"]["replicas"] > 2 else None

        dep = await eventually(scaled, "decode scaled above 2", timeout=20)
        assert dep["spec"]["replicas"] <= 2 + 2  # the scale-up step limit

        async def recorded() -> dict[str, Any] | None:
            pool = await kube.pool("auto")
            decisions = ((pool.get("status") or {}).get("autoscaler") or {}).get("decisions")
            return pool if decisions else None

        pool = await eventually(recorded, "the decision in status")
    decision = pool["status"]["autoscaler"]["decisions"][-1]
    assert decision["role"] == "decode"
    assert decision["current"] == 2
    assert decision["desired"] == dep["spec"]["replicas"]
    assert decision["applied"] is True
    assert "KV" in decision["reason"] or "waiting" in decision["reason"]
    assert condition(pool, "AutoscalingActive")["status"] == "True"
    # one owner: a resync does not put the spec's replicas (2) back
    await asyncio.sleep(2.5)
    live = await kube.child("Deployment", "auto-decode")
    assert live is not None and live["spec"]["replicas"] == dep["spec"]["replicas"]


@pytest.mark.slow
async def test_advisory_autoscaling_records_and_changes_nothing(kube: Kube) -> None:
    spec = {**AUTOSCALED, "autoscaling": {**AUTOSCALED["autoscaling"], "mode": "Advisory"}}
    with metrics_server(kv_usage=0.99, waiting=12) as port:
        await kube.create_pool("adv", spec)
        await eventually(lambda: kube.child("Deployment", "adv-decode"), "the decode Deployment")
        await kube.become_ready("adv-decode", 2)
        await add_worker_pod(kube, "adv", "decode", "adv-decode-a", port)

        async def recommended() -> dict[str, Any] | None:
            pool = await kube.pool("adv")
            rec = ((pool.get("status") or {}).get("autoscaler") or {}).get("recommendation")
            return pool if rec and rec.get("decode", {}).get("desired", 2) > 2 else None

        pool = await eventually(recommended, "a recommendation above 2", timeout=20)
    rec = pool["status"]["autoscaler"]["recommendation"]["decode"]
    assert rec["applied"] is False
    assert condition(pool, "AutoscalingActive")["reason"] == "Advisory"
    dep = await kube.child("Deployment", "adv-decode")
    assert dep is not None and dep["spec"]["replicas"] == 2
