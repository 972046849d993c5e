"""The operator beside other controllers, through restarts: what a platform team checks
before installing it in a real cluster (issue 19). Run against kmock's emulator, which
stores what it is sent and merges patches as plain JSON. ``kube_emulator`` adds what the
operator relies on of server-side apply (create on apply; a field one manager applied and
applies no more is removed unless another manager applied it; ``managedFields`` naming the
managers), so these tests show what the operator sends and what it leaves alone; the README
says what only a real API server shows (field ownership by field, conflicts, admission).
"""

from __future__ import annotations

import asyncio
import base64
import threading
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from kvpool.operator import handlers
from kvpool.operator.cluster import APPLY_PATCH, FIELD_MANAGER, contains, foreign_owner

import test_operator_kopf as kopf_tests
from test_operator_kopf import NS, POOL_SPEC, Kube, all_children_exist, condition, eventually

kube = kopf_tests.kube  # the operator, run by KopfRunner against the emulator (a fixture)

API = "/apis/kvpool.io/v1alpha1"


def child_writes(kube: Kube, since: int) -> list[str]:
    """Writes to the pools' children (not Events, not the pool itself)."""
    return [w for w in kube.writes()[since:] if "/inferencepools" not in w and "/events" not in w]


async def events(kube: Kube, reason: str | None = None) -> list[dict[str, Any]]:
    """The Events the operator posted (as sent: kmock stores one object per name, and kopf
    names Events by ``generateName``, which kmock does not expand)."""
    posted = [
        r.data for r in kube.kmock
        if str(r.method).upper().endswith("POST") and r.url.path.endswith("/events")
        and isinstance(r.data, dict)
    ]  # fmt: skip
    return [e for e in posted if reason is None or e.get("reason") == reason]


# CacheAgreement's message until the operator's loop has scraped the pool once (status.py)
NOT_SCRAPED = "the routers not scraped yet"


async def settled(kube: Kube, name: str, generation: int) -> dict[str, Any]:
    """The pool once the operator has seen ``generation`` and its loop has had a first round:
    the first sync (from the create handler) may come before that round, whose scrape then
    changes CacheAgreement's message (the routers scraped), one status write later."""

    async def observed() -> dict[str, Any] | None:
        pool = await kube.pool(name)
        status = pool.get("status") or {}
        scraped = condition(pool, "CacheAgreement").get("message", NOT_SCRAPED) != NOT_SCRAPED
        return pool if status.get("observedGeneration") == generation and scraped else None

    return await eventually(observed, f"observedGeneration {generation}, the routers scraped")


# --- never take another's object -------------------------------------------------------------

WIDGET_OWNER = {
    "apiVersion": "example.com/v1",
    "kind": "Widget",
    "name": "w1",
    "uid": "uid-widget",
    "controller": True,
    "blockOwnerDeletion": True,
}


async def test_a_configmap_owned_by_another_controller_survives_the_pool(kube: Kube) -> None:
    theirs = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "tiny-router",
            "namespace": NS,
            "ownerReferences": [WIDGET_OWNER],
        },
        "data": {"theirs": "yes"},
    }
    r = await kube.http.post(kube.child_url("ConfigMap"), json=theirs)
    assert r.status_code in (200, 201), r.text
    await kube.create_pool("tiny", POOL_SPEC)

    async def already_owned() -> dict[str, Any] | None:
        pool = await kube.pool("tiny")
        return pool if condition(pool, "Degraded").get("reason") == "AlreadyOwned" else None

    pool = await eventually(already_owned, "Degraded AlreadyOwned")
    message = condition(pool, "Degraded")["message"]
    assert "ConfigMap tiny-router" in message and "Widget w1" in message, message
    assert pool["status"]["phase"] == "Degraded"
    warned = await eventually(lambda: events(kube, "AlreadyOwned"), "an AlreadyOwned Event")
    assert warned[0]["type"] == "Warning" and "Widget w1" in warned[0]["message"]
    assert warned[0]["involvedObject"]["name"] == "tiny"

    live = await kube.child("ConfigMap", "tiny-router")
    assert live is not None
    assert live["metadata"]["ownerReferences"] == theirs["metadata"]["ownerReferences"]
    assert live["data"] == {"theirs": "yes"}
    # Nothing half-made: a router reading another's ConfigMap would serve wrongly.
    assert await kube.child("Deployment", "tiny-router") is None

    r = await kube.http.delete(f"{API}/namespaces/{NS}/inferencepools/tiny")
    assert r.status_code == 200, r.text
    await asyncio.sleep(2.5)  # a resync
    live = await kube.child("ConfigMap", "tiny-router")
    assert live is not None, "the other controller's ConfigMap was deleted"
    assert live["metadata"]["ownerReferences"] == theirs["metadata"]["ownerReferences"]


def test_whose_object_is_it() -> None:
    ours = {"metadata": {"ownerReferences": [{"kind": "InferencePool", "name": "tiny",
                                              "uid": "u1", "controller": True}]}}  # fmt: skip
    assert foreign_owner(ours, "tiny", "u1") is None
    other = {"metadata": {"ownerReferences": [{"kind": "InferencePool", "name": "tiny",
                                               "uid": "u0", "controller": True}]}}  # fmt: skip
    assert "uid u0" in (foreign_owner(other, "tiny", "u1") or "")  # an older pool of that name
    orphan = {
        "metadata": {
            "labels": {"kvpool.io/pool": "tiny", "app.kubernetes.io/managed-by": "kvpool-operator"}
        }
    }
    assert foreign_owner(orphan, "tiny", "u1") is None  # ours, orphaned: adopted
    by_hand = {"metadata": {"managedFields": [{"manager": "kubectl-create"}]}}
    assert foreign_owner(by_hand, "tiny", "u1") == "not made by kvpool (managed by kubectl-create)"


# --- converge to zero writes -----------------------------------------------------------------


def test_live_objects_in_the_api_servers_canonical_form_hold_the_rendering() -> None:
    desired = {"spec": {"containers": [{"name": "w", "resources": {
        "requests": {"cpu": "0.5", "memory": "1024Mi"}, "limits": {"nvidia.com/gpu": "1"}}}],
        "volumes": [], "nodeSelector": {}}}  # fmt: skip
    canonical = {"spec": {"containers": [{"name": "w", "resources": {
        "requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"nvidia.com/gpu": 1}}},
        {"name": "istio-proxy"}]}}  # fmt: skip
    assert contains(canonical, desired)
    changed = {
        "spec": {
            "containers": [
                {
                    "name": "w",
                    "resources": {
                        "requests": {"cpu": "600m", "memory": "1Gi"},
                        "limits": {"nvidia.com/gpu": 1},
                    },
                }
            ]
        }
    }
    assert not contains(changed, desired)
    # quantities only where the API server canonicalises them: an env value is text
    assert not contains({"env": [{"name": "N", "value": "1e3"}]},
                        {"env": [{"name": "N", "value": "1000"}]})  # fmt: skip


async def test_a_second_sync_of_canonicalised_quantities_sends_no_write(kube: Kube) -> None:
    spec = {**POOL_SPEC, "decode": {"replicas": 2, "resources": {
        "requests": {"cpu": "0.5", "memory": "1024Mi"}}}}  # fmt: skip
    await kube.create_pool("tiny", spec)
    await eventually(lambda: all_children_exist(kube, "tiny", spec), "every child")
    await settled(kube, "tiny", 1)
    await asyncio.sleep(1)
    # What a real API server stores: quantities in canonical form.
    dep = await kube.child("Deployment", "tiny-decode")
    assert dep is not None
    containers = dep["spec"]["template"]["spec"]["containers"]
    containers[0]["resources"]["requests"] = {"cpu": "500m", "memory": "1Gi"}
    template = {"spec": {"containers": containers}}
    await kube.patch_child("Deployment", "tiny-decode", {"spec": {"template": template}})
    since = len(kube.writes())
    await asyncio.sleep(4.5)  # the watch event's sync, and two resyncs (every 2 s here)
    assert child_writes(kube, since) == []
    status_writes = [w for w in kube.writes()[since:] if w.endswith("/tiny/status")]
    assert status_writes == []


async def test_a_handler_run_again_on_a_stale_event_rewrites_nothing(kube: Kube) -> None:
    """kopf runs creation again when its annotation lags the operator's status write, with
    the event's body from before that write (seen in CI under load): the condition times
    stay, and nothing is written."""
    await kube.create_pool("tiny", POOL_SPEC)
    await eventually(lambda: all_children_exist(kube, "tiny", POOL_SPEC), "every child")
    settled_pool = await settled(kube, "tiny", 1)
    stale = {k: v for k, v in settled_pool.items() if k != "status"}
    await asyncio.sleep(1.1)  # a condition written now would carry a later second
    since = len(kube.writes())
    await asyncio.to_thread(handlers.reconcile, namespace=NS, name="tiny", body=stale)
    assert [w for w in kube.writes()[since:] if w.endswith("/tiny/status")] == []
    assert (await kube.pool("tiny"))["status"] == settled_pool["status"]


async def test_children_are_written_with_server_side_apply(kube: Kube) -> None:
    await kube.create_pool("tiny", POOL_SPEC)
    await eventually(lambda: all_children_exist(kube, "tiny", POOL_SPEC), "every child")
    await kube.change_spec("tiny", {"engine": {"image": "mine:2"}})
    await settled(kube, "tiny", 2)
    applies = [
        r for r in kube.kmock
        if str(r.method).upper().endswith("PATCH") and "/deployments/tiny-decode" in r.url.path
        and r.headers.get("Content-Type", "").startswith(APPLY_PATCH)
    ]  # fmt: skip
    assert applies, "the image change was not sent as a server-side apply"
    params = dict(applies[-1].params)
    assert params.get("fieldManager") == FIELD_MANAGER
    assert params.get("force") in ("true", "True")


MIRROR = "registry.internal/mirror/"


def _webhook(handle: Any) -> Any:
    """A mutating admission webhook (a registry rewrite, as Kyverno or a mirror's): every
    container image of a Deployment written is moved to the mirror, before it is stored."""

    async def mutate(self: Any, request: Any) -> Any:
        data = request.data
        if isinstance(data, dict) and "/deployments" in request.url.path:
            pod = data.get("spec", {}).get("template", {}).get("spec", {})
            for key in ("containers", "initContainers"):
                for container in pod.get(key) or []:
                    image = container.get("image")
                    if isinstance(image, str) and not image.startswith(MIRROR):
                        container["image"] = MIRROR + image
        return await handle(self, request)

    return mutate


async def test_a_mutating_webhook_causes_no_writes(
    kube: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kmock._internal import k8s

    monkeypatch.setattr(k8s.KubernetesEmulator, "_handle", _webhook(k8s.KubernetesEmulator._handle))
    await kube.create_pool("tiny", POOL_SPEC)
    await eventually(lambda: all_children_exist(kube, "tiny", POOL_SPEC), "every child")
    await settled(kube, "tiny", 1)
    decode = await kube.child("Deployment", "tiny-decode")
    assert decode["spec"]["template"]["spec"]["containers"][0]["image"].startswith(MIRROR)
    await asyncio.sleep(2.5)  # the writes of the pool's making, and their echoes, are done
    since = len(kube.writes())
    await asyncio.sleep(7.0)  # three resyncs (every 2 s here)
    assert child_writes(kube, since) == [], "the webhook's rewrite was written over again"


async def test_a_steady_pool_is_read_from_the_watches(kube: Kube) -> None:
    """A resync reads its children from what the watches showed, and prune lists nothing:
    at 200 pools, a list per kind per resync was 80 requests a second. (The scrape of the
    pool's pods for its metrics still lists them, once a round.)"""
    await kube.create_pool("tiny", POOL_SPEC)
    await eventually(lambda: all_children_exist(kube, "tiny", POOL_SPEC), "every child")
    await settled(kube, "tiny", 1)
    await asyncio.sleep(2.5)
    since = len(list(kube.kmock))
    await asyncio.sleep(4.5)  # two resyncs
    reads = [
        f"{r.method} {r.url.path}" for r in list(kube.kmock)[since:]
        if str(r.method).upper().endswith("GET") and "/inferencepools" not in r.url.path
        and not r.url.path.endswith("/pods") and r.params.get("watch") not in ("true", "1")
        and r.headers.get("User-Agent", "").startswith("OpenAPI")
    ]  # fmt: skip
    assert reads == [], reads


async def test_a_spec_change_is_one_write_of_the_deployment(kube: Kube) -> None:
    """Dropping a field and changing another is one template revision, not a removal patch
    and then an apply (two roll-outs, a wasted surge pod on a GPU)."""
    spec = {**POOL_SPEC, "decode": {"replicas": 2, "nodeSelector": {"gpu": "h100"}}}
    await kube.create_pool("tiny", spec)
    await eventually(lambda: all_children_exist(kube, "tiny", spec), "every child")
    await settled(kube, "tiny", 1)
    since = len(kube.writes())
    await kube.change_spec("tiny", {"decode": {"replicas": 2, "nodeSelector": None},
                                    "engine": {"image": "mine:2"}})  # fmt: skip
    await settled(kube, "tiny", 2)
    await asyncio.sleep(2.5)
    writes = [w for w in kube.writes()[since:] if w.endswith("/deployments/tiny-decode")]
    assert writes == ["PATCH /apis/apps/v1/namespaces/llm/deployments/tiny-decode"], writes
    dep = await kube.child("Deployment", "tiny-decode")
    assert "nodeSelector" not in dep["spec"]["template"]["spec"]
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "mine:2"


# --- replicas: External mode, HPA, mode switches -----------------------------------------------


async def replicas(kube: Kube, name: str) -> int | None:
    dep = await kube.child("Deployment", name)
    return None if dep is None else dep["spec"].get("replicas")


async def test_an_hpa_owned_replica_count_survives_syncs_and_a_mode_switch(kube: Kube) -> None:
    spec = {**POOL_SPEC, "autoscaling": {"mode": "External"}}
    await kube.create_pool("tiny", spec)
    await eventually(lambda: all_children_exist(kube, "tiny", spec), "every child")
    await settled(kube, "tiny", 1)
    # the HPA scales decode (through the scale subresource; here a patch of the same field)
    await kube.patch_child("Deployment", "tiny-decode", {"spec": {"replicas": 5}})
    for generation in (2, 3, 4):  # three syncs, each from a spec change elsewhere
        await kube.change_spec("tiny", {"router": {"replicas": generation - 1}})
        await settled(kube, "tiny", generation)
    assert await replicas(kube, "tiny-decode") == 5
    # switching to the spec's count (no autoscaling) keeps what runs until the count changes
    await kube.change_spec("tiny", {"autoscaling": None})
    await settled(kube, "tiny", 5)
    await asyncio.sleep(2.5)
    assert await replicas(kube, "tiny-decode") == 5
    await kube.change_spec("tiny", {"decode": {"replicas": 3}})
    await eventually(lambda: _is(replicas(kube, "tiny-decode"), 3), "the spec's new count")


async def _is(value: Any, want: Any) -> bool:
    return await value == want


async def test_active_to_advisory_does_not_snap_replicas_back(kube: Kube) -> None:
    spec = {
        **POOL_SPEC,
        "slo": {"itlMilliseconds": 50},
        "autoscaling": {"enabled": True, "intervalSeconds": 3600,
                        "decode": {"minReplicas": 1, "maxReplicas": 6},
                        "prefill": {"minReplicas": 1, "maxReplicas": 2}},
    }  # fmt: skip
    await kube.create_pool("tiny", spec)
    await eventually(lambda: all_children_exist(kube, "tiny", spec), "every child")
    await settled(kube, "tiny", 1)
    await kube.patch_child("Deployment", "tiny-decode", {"spec": {"replicas": 4}})  # scaled up
    await kube.change_spec("tiny", {"autoscaling": {"mode": "Advisory"}})
    await settled(kube, "tiny", 2)
    await asyncio.sleep(2.5)  # and a resync
    assert await replicas(kube, "tiny-decode") == 4


# --- status that tells the truth ---------------------------------------------------------------


async def test_status_keys_that_no_longer_apply_are_removed(kube: Kube) -> None:
    await kube.create_pool("tiny", POOL_SPEC)
    await settled(kube, "tiny", 1)
    left = {"status": {"autoscaler": {"lastEvaluationTime": "2026-01-01T00:00:00Z",
                                      "recommendation": {}, "decisions": []}}}  # fmt: skip
    r = await kube.http.patch(
        f"{API}/namespaces/{NS}/inferencepools/tiny/status", json=left,
        headers={"Content-Type": "application/merge-patch+json"},
    )  # fmt: skip
    assert r.status_code == 200, r.text

    async def gone() -> bool:
        return "autoscaler" not in ((await kube.pool("tiny")).get("status") or {})

    await eventually(gone, "status.autoscaler removed (autoscaling is off)")
    await kube.change_spec("tiny", {"disaggregation": {"mode": "Aggregated"}, "prefill": None})
    pool = await settled(kube, "tiny", 2)
    assert "prefill" not in pool["status"]


def test_no_sync_request_is_lost_while_one_finishes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that arrives just as the running sync lets go of the pool's lock."""
    rounds: list[int] = []
    monkeypatch.setattr(handlers, "_timed_sync_once", lambda *a: rounds.append(1))
    rt = handlers.runtime("llm", "race")
    monkeypatch.setattr(rt, "lock", _LateRequestLock(lambda: handlers.sync("llm", "race")))
    handlers.sync("llm", "race")
    assert len(rounds) == 2, "the request made while the first round let go was dropped"


class _LateRequestLock:
    """A lock whose first release lets another thread ask for a sync just before it lets go."""

    def __init__(self, request: Any) -> None:
        self._lock = threading.Lock()
        self._request = request
        self._fired = False

    def acquire(self, blocking: bool = True) -> bool:
        return self._lock.acquire(blocking)

    def release(self) -> None:
        if not self._fired:
            self._fired = True
            other = threading.Thread(target=self._request)
            other.start()
            other.join()
        self._lock.release()


def test_a_failed_apply_is_retried_with_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handlers, "_retry", {})
    rt = handlers.runtime("llm", "flaky")
    calls = iter(["error", "error", "ok"])
    monkeypatch.setattr(handlers, "_sync_once", lambda *a: next(calls))
    delays = []
    for _ in range(3):
        handlers._retry.clear()
        start = handlers.time.monotonic()
        handlers.sync("llm", "flaky")
        due = handlers._retry.get(("llm", "flaky"))
        delays.append(None if due is None else round(due - start))
    assert delays == [1, 2, None]
    assert rt.failures == 0


async def test_an_apply_failure_is_a_condition_and_an_event_and_is_retried(
    kube: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_apply = handlers.Cluster.apply
    refused = {"on": True}  # until the test has seen the failure: syncs come fast

    def flaky_apply(self: Any, obj: dict[str, Any], live: Any, **kwargs: Any) -> Any:
        if obj["kind"] == "PodDisruptionBudget" and refused["on"]:
            raise ApiException(status=422, reason="Unprocessable Entity")
        return real_apply(self, obj, live, **kwargs)

    monkeypatch.setattr(handlers.Cluster, "apply", flaky_apply)
    monkeypatch.setattr(handlers, "RETRY_MAX_S", 1.0)
    await kube.create_pool("tiny", POOL_SPEC)

    async def failed() -> dict[str, Any] | None:
        pool = await kube.pool("tiny")
        return pool if condition(pool, "Degraded").get("reason") == "ApplyFailed" else None

    pool = await eventually(failed, "Degraded ApplyFailed")
    assert "PodDisruptionBudget" in condition(pool, "Degraded")["message"]
    assert "422" in condition(pool, "Degraded")["message"]
    await eventually(lambda: events(kube, "ApplyFailed"), "an ApplyFailed Event")
    refused["on"] = False

    async def recovered() -> bool:
        pool = await kube.pool("tiny")
        return condition(pool, "Degraded").get("status") == "False"

    # retried by the backoff (1 s), well before the resync would (60 s in production)
    await eventually(recovered, "the retry to succeed", timeout=8)


# --- Events, watches, restarts ----------------------------------------------------------------


async def test_invalid_spec_and_applies_are_events(kube: Kube) -> None:
    await kube.create_pool("tiny", POOL_SPEC)
    applied = await eventually(lambda: events(kube, "Applied"), "an Applied Event")
    assert "Deployment tiny-decode" in applied[0]["message"]
    await kube.change_spec("tiny", {"decode": {"replicas": -1}})
    warned = await eventually(lambda: events(kube, "InvalidSpec"), "an InvalidSpec Event")
    assert warned[0]["type"] == "Warning"
    assert "spec.decode.replicas" in warned[0]["message"]
    await asyncio.sleep(2.5)  # resyncs do not repeat it
    got = await events(kube, "InvalidSpec")
    assert len(got) == 1, [(e["message"], e.get("involvedObject")) for e in got]


async def test_child_watches_carry_a_label_selector(kube: Kube) -> None:
    await kube.create_pool("tiny", POOL_SPEC)
    await eventually(lambda: all_children_exist(kube, "tiny", POOL_SPEC), "every child")
    watched = {}
    for r in kube.kmock:
        params = dict(r.params)
        if params.get("watch") in ("true", "1") and "inferencepools" not in r.url.path:
            watched[r.url.path] = params.get("labelSelector")
    kinds = ["deployments", "services", "configmaps", "serviceaccounts", "roles",
             "rolebindings", "poddisruptionbudgets", "networkpolicies"]  # fmt: skip
    for kind in kinds:
        paths = [p for p in watched if p.endswith(f"/{kind}")]
        assert paths, f"no watch on {kind}"
        for path in paths:
            assert watched[path] == "app.kubernetes.io/managed-by=kvpool-operator", path
    # The pool secret is made once and never restored: the operator watches no Secret.
    assert not [p for p in watched if p.endswith("/secrets")], watched


async def test_a_restarted_operator_says_it_resumed(kube: Kube) -> None:
    await kube.create_pool("tiny", POOL_SPEC)
    await settled(kube, "tiny", 1)
    await kube.restart_operator()
    resumed = await eventually(lambda: events(kube, "Resumed"), "a Resumed Event")
    assert resumed[0]["involvedObject"]["name"] == "tiny"


@pytest.mark.slow
async def test_a_restarted_operator_resumes_the_autoscaler_windows_from_status(
    kube: Kube,
) -> None:
    """The first leader gathers evidence without scaling (one sample is not enough); its
    successor finds the windows in the pool's status and goes on from them."""
    from test_operator_kopf import AUTOSCALED, add_worker_pod, metrics_server, start_operator

    spec = {**AUTOSCALED, "autoscaling": {**AUTOSCALED["autoscaling"],
            "scaleUp": {"stabilizationWindowSeconds": 600, "maxStep": 2}}}  # fmt: skip
    with metrics_server(kv_usage=0.99, waiting=12) as port:
        await kube.create_pool("auto", spec)
        await eventually(lambda: kube.child("Deployment", "auto-decode"), "the Deployment")
        await kube.become_ready("auto-decode", 2)
        await add_worker_pod(kube, "auto", "decode", "auto-decode-a", port)

        async def window() -> dict[str, Any]:
            """decode's run of proposals: its start (since) and proposals ([time, replicas])."""
            status = (await kube.pool("auto")).get("status") or {}
            state = ((status.get("autoscaler") or {}).get("state") or {}).get("decode") or {}
            return state if state.get("proposals") else {}

        await eventually(window, "a proposal in status", timeout=20)
        assert await replicas(kube, "auto-decode") == 2, "scaled up on a single sample"
        # A restart, in two steps: the windows as the first leader left them are read
        # between (it may add a proposal while it stops).
        leader = kube.runners[-1]
        await asyncio.to_thread(leader.__exit__, None, None, None)
        assert leader.exception is None, leader.stdout[-3000:]
        left = await window()
        kube.runners.append(start_operator())
        resumed = await eventually(lambda: events(kube, "Resumed"), "a Resumed Event")
        assert "resumes its windows" in resumed[-1]["message"]

        async def carried_on() -> dict[str, Any] | None:
            now = await window()
            return now if now and now["proposals"][-1][0] > left["proposals"][-1][0] else None

        later = await eventually(carried_on, "the successor's proposal", timeout=20)
        # one run: begun by the first leader, its last proposal kept (a window started
        # again begins at the successor's first proposal and holds none of the leader's)
        assert later["since"] == left["since"], "the successor started its windows again"
        assert left["proposals"][-1] in later["proposals"]
        assert await replicas(kube, "auto-decode") == 2


# --- what review found: zero values, a failed scale, fields dropped -----------------------------


def test_values_the_api_server_omits_count_as_absent() -> None:
    desired = {
        "spec": {
            "hostNetwork": False,
            "containers": [
                {"name": "w", "env": [{"name": "E", "value": ""}], "ports": [{"hostPort": 0}]}
            ],
        }
    }
    stored = {"spec": {"containers": [{"name": "w", "env": [{"name": "E"}], "ports": [{}]}]}}
    assert contains(stored, desired)
    assert not contains({"spec": {"hostNetwork": True}}, desired)


def _decode_child(spec: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    from kvpool.api import validate_pool
    from kvpool.operator.render import render

    pool = validate_pool("tiny", spec)
    child = next(
        c
        for c in render("tiny", NS, pool)
        if c["kind"] == "Deployment" and c["metadata"]["name"] == "tiny-decode"
    )
    return pool, child


def test_a_spec_count_that_failed_to_be_written_is_tried_again() -> None:
    pool, child = _decode_child({**POOL_SPEC, "decode": {"replicas": 3}})
    live = {"metadata": {"annotations": {handlers.SPEC_REPLICAS: "2"}}, "spec": {"replicas": 2}}
    assert handlers._worker_replicas(pool, child, live) == 3
    assert "replicas" not in child["spec"]  # not part of the apply: its own field manager
    # recorded only once written: if the scale fails, the next sync writes again
    assert child["metadata"]["annotations"][handlers.SPEC_REPLICAS] == "2"
    pool, child = _decode_child({**POOL_SPEC, "decode": {"replicas": 3}})
    done = {"metadata": {"annotations": {handlers.SPEC_REPLICAS: "2"}}, "spec": {"replicas": 3}}
    assert handlers._worker_replicas(pool, child, done) is None
    assert child["metadata"]["annotations"][handlers.SPEC_REPLICAS] == "3"
    # created with its count (handlers pass it to the first apply: never the default 1)
    pool, child = _decode_child({**POOL_SPEC, "decode": {"replicas": 0}})
    assert handlers._worker_replicas(pool, child, None) == 0


async def test_a_field_dropped_from_the_spec_is_removed_from_the_child(kube: Kube) -> None:
    spec = {**POOL_SPEC, "decode": {"replicas": 2, "nodeSelector": {"gpu": "h100"}}}
    await kube.create_pool("tiny", spec)
    await eventually(lambda: all_children_exist(kube, "tiny", spec), "every child")
    await kube.change_spec("tiny", {"decode": {"replicas": 2, "nodeSelector": None}})
    await settled(kube, "tiny", 2)

    async def dropped() -> bool:
        dep = await kube.child("Deployment", "tiny-decode") or {}
        pod = dep.get("spec", {}).get("template", {}).get("spec", {})
        return bool(pod) and "nodeSelector" not in pod

    await eventually(dropped, "nodeSelector removed from the decode pods")
    assert await replicas(kube, "tiny-decode") == 2


# --- the pool secret: made once, never rewritten ------------------------------------------------

SECRET = "tiny-pool-secret"


async def pool_key(kube: Kube) -> str | None:
    secret = await kube.child("Secret", SECRET)
    if secret is None:
        return None
    return base64.b64decode(secret["data"]["pool-secret"]).decode()


def secret_refs(deployment: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The secretKeyRefs of a Deployment's first container, by variable."""
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in container.get("env", [])
        if "secretKeyRef" in (e.get("valueFrom") or {})
    }


async def test_the_pool_secret_is_made_once_and_stays_through_reconciles(kube: Kube) -> None:
    await kube.create_pool("tiny", POOL_SPEC)
    await eventually(lambda: all_children_exist(kube, "tiny", POOL_SPEC), "every child")
    await settled(kube, "tiny", 1)
    secret = await kube.child("Secret", SECRET)
    assert secret is not None
    assert secret["immutable"] is True and secret["type"] == "Opaque"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-tiny"  # collected with it
    key = await pool_key(kube)
    assert key is not None and len(key) == 64  # 256 random bits, as hex
    ref = {"name": SECRET, "key": "pool-secret"}
    router = await kube.child("Deployment", "tiny-router")
    assert router is not None and secret_refs(router) == {"KVPOOL_ROUTER_POOL_SECRET": ref}
    for role in ("prefill", "decode"):
        worker = await kube.child("Deployment", f"tiny-{role}")
        assert worker is not None and secret_refs(worker) == {"KVPOOL_POOL_SECRET": ref}

    # Spec changes and resyncs: the key is never written again, and a steady pool gets no
    # write at all (NetworkPolicies and the Secret included).
    await kube.change_spec("tiny", {"router": {"replicas": 2}})
    await settled(kube, "tiny", 2)
    await asyncio.sleep(2.5)  # a resync
    since = len(kube.writes())
    await asyncio.sleep(4.5)  # two more
    assert child_writes(kube, since) == []
    assert await pool_key(kube) == key
    # A create per spec generation (the second answered 409: the operator cannot read
    # Secrets to look), and nothing else.
    secret_writes = [w for w in kube.writes() if "/secrets" in w]
    assert secret_writes == [f"POST /api/v1/namespaces/{NS}/secrets"] * 2, secret_writes


async def test_a_deleted_pool_secret_is_made_again_with_a_new_key(kube: Kube) -> None:
    """Deleting the Secret rotates the key (the pods read it when they restart): the
    operator, which cannot read Secrets, makes it again at the pool's next spec change."""
    await kube.create_pool("tiny", POOL_SPEC)
    old = await eventually(lambda: pool_key(kube), "the pool secret")
    await kube.delete_child("Secret", SECRET)
    await kube.change_spec("tiny", {"router": {"replicas": 2}})
    new = await eventually(lambda: pool_key(kube), "the pool secret again, at the spec change")
    assert new != old
    pool = await kube.pool("tiny")
    made = await kube.child("Secret", SECRET)
    assert pool["status"]["poolSecret"] == {"name": SECRET, "uid": made["metadata"]["uid"]}


async def test_the_operator_never_reads_or_lists_secrets(kube: Kube) -> None:
    """Least privilege: the operator may create Secrets, and delete the one it made (by name
    and uid); no request of it reads one."""
    await kube.create_pool("tiny", POOL_SPEC)
    await eventually(lambda: pool_key(kube), "the pool secret")
    await settled(kube, "tiny", 1)
    await asyncio.sleep(2.5)  # a resync
    await kube.change_spec("tiny", {"poolSecret": {"secretName": "mine", "key": "hmac"}})
    await settled(kube, "tiny", 2)
    await eventually(lambda: _is(kube.child("Secret", SECRET), None), "the made one deleted")
    verbs = {
        (str(r.method).upper().split(".")[-1], "name" if r.url.path.endswith(SECRET) else "")
        for r in kube.kmock
        if "/secrets" in r.url.path and r.headers.get("User-Agent", "").startswith("OpenAPI")
    }
    assert verbs == {("POST", ""), ("DELETE", "name")}, verbs


async def test_a_pool_secret_name_taken_by_another_is_left_alone(kube: Kube) -> None:
    theirs = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": SECRET, "namespace": NS, "ownerReferences": [WIDGET_OWNER]},
        "data": {"pool-secret": base64.b64encode(b"theirs").decode()},
    }
    r = await kube.http.post(kube.child_url("Secret"), json=theirs)
    assert r.status_code in (200, 201), r.text
    await kube.create_pool("tiny", POOL_SPEC)

    async def already_owned() -> dict[str, Any] | None:
        pool = await kube.pool("tiny")
        return pool if condition(pool, "Degraded").get("reason") == "AlreadyOwned" else None

    pool = await eventually(already_owned, "Degraded AlreadyOwned")
    assert f"Secret {SECRET}" in condition(pool, "Degraded")["message"]
    assert await pool_key(kube) == "theirs"
    assert "theirs" not in str(pool), "a Secret's data in the status"
    assert await kube.child("Deployment", "tiny-decode") is None  # nothing half-made


async def test_naming_your_own_pool_secret_removes_the_made_one(kube: Kube) -> None:
    await kube.create_pool("tiny", POOL_SPEC)
    await eventually(lambda: pool_key(kube), "the pool secret")
    await kube.change_spec("tiny", {"poolSecret": {"secretName": "mine", "key": "hmac"}})
    await settled(kube, "tiny", 2)

    async def gone() -> bool:
        return await kube.child("Secret", SECRET) is None

    await eventually(gone, "the operator's pool secret pruned")
    router = await kube.child("Deployment", "tiny-router")
    assert router is not None
    assert secret_refs(router) == {"KVPOOL_ROUTER_POOL_SECRET": {"name": "mine", "key": "hmac"}}


async def test_turning_network_policies_off_removes_them(kube: Kube) -> None:
    await kube.create_pool("tiny", POOL_SPEC)
    await eventually(lambda: kube.child("NetworkPolicy", "tiny-workers"), "the workers' policy")
    await kube.change_spec("tiny", {"networkPolicy": {"enabled": False}})

    async def gone() -> bool:
        return (
            await kube.child("NetworkPolicy", "tiny-workers") is None
            and await kube.child("NetworkPolicy", "tiny-router") is None
        )

    await eventually(gone, "both NetworkPolicies pruned")


# --- an object written before server-side apply: taken over without a roll-out ----------------


def test_fields_written_by_update_are_taken_over_in_managed_fields_only() -> None:
    """A Deployment the operator wrote by create and merge patch (before server-side apply,
    or on a cluster without it) lists those fields under an Update. The next apply first
    moves them to the apply's manager by a JSON patch of managedFields alone (as kubectl's
    client-side to server-side upgrade does; the template is not touched, so nothing rolls),
    then applies once: no merge patch of the fields themselves."""
    from kvpool.operator.cluster import JSON_PATCH, LAST_APPLIED, MERGE_PATCH, Cluster

    template = {"f:spec": {"f:containers": {'k:{"name":"worker"}': {"f:image": {}}},
                           "f:nodeSelector": {}}}  # fmt: skip
    live = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": "tiny-decode", "namespace": NS, "resourceVersion": "41",
            "annotations": {LAST_APPLIED: "{}"},
            "managedFields": [
                {"manager": FIELD_MANAGER, "operation": "Update", "apiVersion": "apps/v1",
                 "fieldsType": "FieldsV1",
                 "fieldsV1": {"f:spec": {"f:replicas": {}, "f:template": template}}},
                {"manager": "kube-controller-manager", "operation": "Update",
                 "subresource": "status", "fieldsV1": {"f:status": {}}},
                {"manager": "kubectl-edit", "operation": "Update", "fieldsV1": {"f:x": {}}},
            ],
        },
        "spec": {"replicas": 3, "template": {"spec": {"nodeSelector": {"gpu": "h100"}}}},
    }  # fmt: skip
    desired = {"apiVersion": "apps/v1", "kind": "Deployment",
               "metadata": {"name": "tiny-decode", "namespace": NS},
               "spec": {"template": {"spec": {"containers": [{"name": "worker",
                                                               "image": "b"}]}}}}  # fmt: skip
    calls: list[tuple[str, Any]] = []
    cluster = Cluster(client=object())

    def call(kind: Any, verb: str, *args: Any, **kwargs: Any) -> Any:
        calls.append((kwargs.get("_content_type", verb), args[2] if len(args) > 2 else None))

        class Resp:
            data = b'{"metadata": {}}'

        return Resp()

    cluster._call = call  # type: ignore[method-assign]
    cluster.apply(desired, live)
    assert [c for c, _ in calls] == [JSON_PATCH, APPLY_PATCH], calls
    assert MERGE_PATCH not in [c for c, _ in calls]
    ops = calls[0][1]
    assert ops[0] == {"op": "test", "path": "/metadata/resourceVersion", "value": "41"}
    entries = ops[1]["value"]
    assert [(e["manager"], e["operation"]) for e in entries] == [
        ("kube-controller-manager", "Update"), ("kubectl-edit", "Update"),
        (FIELD_MANAGER, "Apply"),
    ]  # fmt: skip
    # the template's fields are the apply's now (dropped by a later apply, they go); the
    # replicas are not: they stay their own manager's, never reset by an apply
    assert entries[-1]["fieldsV1"] == {"f:spec": {"f:template": template}}
