"""Who may reach a pool's pods, and how its secrets reach them: the NetworkPolicies, the
tenants Secret and the pool secret the operator renders (issue 20).

The policies are read here the way a network plugin that enforces them reads them
(Kubernetes' NetworkPolicy semantics: a pod selected by no policy takes anything; one
selected by a policy takes only what one of its ingress rules admits), against the pods the
operator renders, so each test asks a question a platform team asks: may this pod reach that
port? Whether a real plugin enforces them is what only a real cluster shows.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from kvpool.api import validate_pool
from kvpool.operator import handlers
from kvpool.operator.render import (
    GENERATED_KEY,
    ROUTER_PEER_PORT,
    ROUTER_PORT,
    TENANTS_MOUNT,
    Images,
    Peers,
    render,
)
from kvpool.operator.settings import OperatorSettings

NS = "llm"
MODEL = {"name": "tiny", "source": {"builtin": {}}}
AGGREGATED: dict[str, Any] = {"model": MODEL}
DISAGGREGATED: dict[str, Any] = {
    "model": MODEL,
    "disaggregation": {"mode": "Disaggregated"},
    "prefill": {"replicas": 1},
    "decode": {"replicas": 1},
}
VLLM_DISAGGREGATED: dict[str, Any] = {
    **DISAGGREGATED,
    "model": {"name": "m", "source": {"pvc": {"claimName": "models"}}},
    "engine": {"type": "vllm"},
}
OPERATOR_PEER = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kvpool-system"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator"}},
}
PEERS = Peers(operator=OPERATOR_PEER)
HTTP, EVENTS, REPLAY = 8000, 5557, 5558


# --- NetworkPolicy, as an enforcing network plugin reads it ------------------------------------


@dataclass(frozen=True)
class Pod:
    labels: dict[str, str]
    namespace: str = NS
    namespace_labels: dict[str, str] = field(default_factory=dict)

    def ns_labels(self) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": self.namespace, **self.namespace_labels}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for req in selector.get("matchExpressions") or []:
        present, value = req["key"] in labels, labels.get(req["key"])
        ok = {
            "In": present and value in req.get("values", []),
            "NotIn": not present or value not in req.get("values", []),
            "Exists": present,
            "DoesNotExist": not present,
        }[req["operator"]]
        if not ok:
            return False
    return True


def admits(peer: dict[str, Any], source: Pod, policy_namespace: str) -> bool:
    if "ipBlock" in peer:
        return False  # these tests tell pods by their labels
    namespaces = peer.get("namespaceSelector")
    if namespaces is None:  # a podSelector alone: the policy's own namespace
        in_namespace = source.namespace == policy_namespace
    else:
        in_namespace = selects(namespaces, source.ns_labels())
    pods = peer.get("podSelector")
    return in_namespace and (pods is None or selects(pods, source.labels))


def may_connect(policies: list[dict[str, Any]], source: Pod, target: Pod, port: int) -> bool:
    applying = [
        p for p in policies
        if p["metadata"]["namespace"] == target.namespace
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and selects(p["spec"]["podSelector"], target.labels)
    ]  # fmt: skip
    if not applying:
        return True
    for policy in applying:
        for rule in policy["spec"].get("ingress") or []:
            ports = rule.get("ports")
            if ports and not any(
                p["port"] <= port <= p.get("endPort", p["port"]) and p["protocol"] == "TCP"
                for p in ports
            ):
                continue
            peers = rule.get("from")
            assert peers != [], "an empty from admits everyone: never rendered"
            if peers is None or any(admits(p, source, target.namespace) for p in peers):
                return True
    return False


def policies_of(children: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for c in children if c["kind"] == "NetworkPolicy"]


def pods_of(children: list[dict[str, Any]]) -> dict[str, Pod]:
    """A pod of each Deployment, with the labels the operator gives its template."""
    return {
        c["metadata"]["name"].rsplit("-", 1)[1]: Pod(c["spec"]["template"]["metadata"]["labels"])
        for c in children
        if c["kind"] == "Deployment"
    }


def pool(spec: dict[str, Any], name: str = "p", peers: Peers = PEERS) -> list[dict[str, Any]]:
    return render(name, NS, validate_pool(name, spec), Images(), peers)


STRANGER = Pod({"app": "curl"})
PROMETHEUS = Pod({"app.kubernetes.io/name": "prometheus"}, namespace="monitoring")
OPERATOR = Pod({"app.kubernetes.io/component": "operator"}, namespace="kvpool-system")


# --- who may reach what --------------------------------------------------------------------


def test_workers_take_their_routers_on_http_events_and_replay() -> None:
    children = pool(DISAGGREGATED)
    policies, pods = policies_of(children), pods_of(children)
    for role in ("prefill", "decode"):
        for port in (HTTP, EVENTS, REPLAY):
            assert may_connect(policies, pods["router"], pods[role], port), (role, port)
        assert not may_connect(policies, pods["router"], pods[role], 9999)


def test_a_stranger_in_the_namespace_reaches_the_router_and_no_worker() -> None:
    """The attacks of issue 20 start here: the replay socket, GET /kv/{id}, a forged
    kv_transfer_params, POST /drain. None of the workers' ports answers a stranger."""
    children = pool(DISAGGREGATED)
    policies, pods = policies_of(children), pods_of(children)
    for role in ("prefill", "decode"):
        for port in (HTTP, EVENTS, REPLAY):
            assert not may_connect(policies, STRANGER, pods[role], port), (role, port)
    assert may_connect(policies, STRANGER, pods["router"], ROUTER_PORT)
    assert not may_connect(policies, STRANGER, pods["router"], 9090)  # nothing else opens
    elsewhere = Pod({"app": "curl"}, namespace="other")
    assert may_connect(policies, elsewhere, pods["router"], ROUTER_PORT)


def test_router_replicas_reach_each_others_peer_port_and_nobody_else_does() -> None:
    children = pool(DISAGGREGATED)
    policies, pods = policies_of(children), pods_of(children)
    (router,) = [
        c
        for c in children
        if c["kind"] == "Deployment" and c["metadata"]["name"].endswith("-router")
    ]
    (container,) = router["spec"]["template"]["spec"]["containers"]
    assert {"name": "peers", "containerPort": ROUTER_PEER_PORT, "protocol": "TCP"} in container[
        "ports"
    ]
    assert may_connect(policies, pods["router"], pods["router"], ROUTER_PEER_PORT)
    assert not may_connect(policies, STRANGER, pods["router"], ROUTER_PEER_PORT)
    for role in ("prefill", "decode"):
        assert not may_connect(policies, pods[role], pods["router"], ROUTER_PEER_PORT)


def test_router_processes_reach_each_others_peer_ports_across_replicas() -> None:
    spec = {**DISAGGREGATED, "router": {"replicas": 2, "processes": 3}}
    children = pool(spec)
    policies, pods = policies_of(children), pods_of(children)
    (config,) = [
        c for c in children if c["kind"] == "ConfigMap" and "-router" in c["metadata"]["name"]
    ]
    assert config["data"]["KVPOOL_ROUTER_PROCESSES"] == "3"
    for port in range(ROUTER_PEER_PORT, ROUTER_PEER_PORT + 3):  # process i binds port + i
        assert may_connect(policies, pods["router"], pods["router"], port)
        assert not may_connect(policies, STRANGER, pods["router"], port)
    assert not may_connect(policies, pods["router"], pods["router"], ROUTER_PEER_PORT + 3)
    # and one process opens only the one port, as before
    alone = pool(DISAGGREGATED)
    assert not may_connect(policies_of(alone), pods["router"], pods["router"], ROUTER_PEER_PORT + 1)


def test_decode_workers_pull_kv_from_prefill_workers_over_http_only() -> None:
    children = pool(DISAGGREGATED)
    policies, pods = policies_of(children), pods_of(children)
    assert may_connect(policies, pods["decode"], pods["prefill"], HTTP)
    assert not may_connect(policies, pods["decode"], pods["prefill"], EVENTS)
    assert not may_connect(policies, pods["decode"], pods["prefill"], REPLAY)
    # an aggregated pool's workers never pull from each other: they may not reach each other
    aggregated = pool({**AGGREGATED, "decode": {"replicas": 2}})
    decode = pods_of(aggregated)["decode"]
    assert not may_connect(policies_of(aggregated), decode, decode, HTTP)


def test_another_pools_router_or_a_lookalike_elsewhere_reaches_no_worker() -> None:
    ours, theirs = pool(DISAGGREGATED, "p"), pool(DISAGGREGATED, "q")
    policies = policies_of(ours) + policies_of(theirs)
    their_router = pods_of(theirs)["router"]
    decode = pods_of(ours)["decode"]
    for port in (HTTP, EVENTS, REPLAY):
        assert not may_connect(policies, their_router, decode, port)
    lookalike = Pod(pods_of(ours)["router"].labels, namespace="other")
    assert not may_connect(policies, lookalike, decode, EVENTS)


def test_prometheus_and_the_operator_scrape_http_and_nothing_else() -> None:
    children = pool(DISAGGREGATED)
    policies, pods = policies_of(children), pods_of(children)
    for scraper in (PROMETHEUS, OPERATOR):
        for target in (pods["prefill"], pods["decode"]):
            assert may_connect(policies, scraper, target, HTTP)
            assert not may_connect(policies, scraper, target, EVENTS)
            assert not may_connect(policies, scraper, target, REPLAY)
        assert may_connect(policies, scraper, pods["router"], ROUTER_PORT)
    unknown_operator = Pod(OPERATOR.labels, namespace="default")
    assert not may_connect(policies, unknown_operator, pods["decode"], HTTP)


def test_a_pod_labelled_prometheus_in_any_other_namespace_reaches_no_worker() -> None:
    """Anyone who may create a pod somewhere may label it as Prometheus: by default only
    the monitoring namespace and the pool's own are trusted to scrape (the worker's metrics
    port is its API port)."""
    children = pool(DISAGGREGATED)
    policies, pods = policies_of(children), pods_of(children)
    for namespace in ("default", "tenant-x", "kube-system"):
        lookalike = Pod(PROMETHEUS.labels, namespace=namespace)
        for target in (pods["prefill"], pods["decode"]):
            assert not may_connect(policies, lookalike, target, HTTP)
    assert may_connect(policies, Pod(PROMETHEUS.labels), pods["decode"], HTTP)  # its own
    # an operator outside the cluster (no pod of its own known): no policy names it
    outside = pool(DISAGGREGATED, peers=Peers())
    assert not may_connect(policies_of(outside), OPERATOR, pods_of(outside)["decode"], HTTP)


def test_metrics_from_replaces_the_default_scrapers() -> None:
    own = {"metricsFrom": [{"namespaceSelector": {"matchLabels": {"team": "obs"}}}]}
    children = pool({**AGGREGATED, "networkPolicy": own})
    policies, decode = policies_of(children), pods_of(children)["decode"]
    ours = Pod({"app": "vmagent"}, namespace="obs", namespace_labels={"team": "obs"})
    assert may_connect(policies, ours, decode, HTTP)
    assert not may_connect(policies, PROMETHEUS, decode, HTTP)
    # nobody but the operator
    children = pool({**AGGREGATED, "networkPolicy": {"metricsFrom": []}})
    policies, decode = policies_of(children), pods_of(children)["decode"]
    assert not may_connect(policies, PROMETHEUS, decode, HTTP)
    assert may_connect(policies, OPERATOR, decode, HTTP)


def test_the_operators_setting_is_the_default_a_pool_may_override() -> None:
    settings = OperatorSettings(
        pod_namespace="kvpool-system",
        pod_selector="app.kubernetes.io/component=operator",
        metrics_from='[{"namespaceSelector": {"matchLabels": {"team": "obs"}}}]',
    )
    ours = Pod({"app": "vmagent"}, namespace="obs", namespace_labels={"team": "obs"})
    children = pool(AGGREGATED, peers=settings.peers())
    policies, decode = policies_of(children), pods_of(children)["decode"]
    assert may_connect(policies, ours, decode, HTTP)
    assert not may_connect(policies, PROMETHEUS, decode, HTTP)
    assert may_connect(policies, OPERATOR, decode, HTTP)
    spec = {**AGGREGATED, "networkPolicy": {"metricsFrom": [{"namespaceSelector": {}}]}}
    children = pool(spec, peers=settings.peers())
    assert may_connect(policies_of(children), PROMETHEUS, pods_of(children)["decode"], HTTP)


def test_the_operators_settings_are_checked_at_start_up() -> None:
    with pytest.raises(ValueError, match="give both or neither"):
        OperatorSettings(pod_namespace="kvpool-system")
    with pytest.raises(ValueError, match="pod_selector: not k=v"):
        OperatorSettings(pod_namespace="kvpool-system", pod_selector="operator")
    with pytest.raises(ValueError, match="metrics_from: at 0: a peer needs"):
        OperatorSettings(metrics_from="[{}]")
    with pytest.raises(ValueError, match="metrics_from: not JSON"):
        OperatorSettings(metrics_from="prometheus")


def test_clients_from_narrows_the_router_and_keeps_the_scrapers() -> None:
    gateway = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
    children = pool({**AGGREGATED, "networkPolicy": {"clientsFrom": [gateway]}})
    policies, router = policies_of(children), pods_of(children)["router"]
    assert may_connect(policies, Pod({"app": "envoy"}, namespace="gateway"), router, ROUTER_PORT)
    assert not may_connect(policies, STRANGER, router, ROUTER_PORT)
    assert may_connect(policies, PROMETHEUS, router, ROUTER_PORT)
    assert may_connect(policies, OPERATOR, router, ROUTER_PORT)


def test_an_empty_peer_list_shuts_a_port_rather_than_opening_it() -> None:
    """``from: []`` would admit everyone: a router nobody may reach gets no rule at all."""
    spec = {**AGGREGATED, "networkPolicy": {"clientsFrom": [], "metricsFrom": []}}
    children = pool(spec, peers=Peers())
    policies, pods = policies_of(children), pods_of(children)
    for source in (STRANGER, PROMETHEUS, pods["decode"]):
        assert not may_connect(policies, source, pods["router"], ROUTER_PORT)
    for policy in policies:
        for rule in policy["spec"]["ingress"]:
            assert rule.get("from", None) != []


def test_vllm_workers_of_a_disaggregated_pool_reach_each_other_on_any_port() -> None:
    """NIXL's side channel, then UCX's transports on ports of their choosing."""
    children = pool(VLLM_DISAGGREGATED)
    policies, pods = policies_of(children), pods_of(children)
    for port in (5600, 41234):
        assert may_connect(policies, pods["decode"], pods["prefill"], port)
        assert not may_connect(policies, pods["router"], pods["prefill"], port)
        assert not may_connect(policies, STRANGER, pods["prefill"], port)
    assert may_connect(policies, pods["router"], pods["prefill"], EVENTS)


def test_no_events_port_opens_when_events_are_off() -> None:
    spec = {**AGGREGATED, "engine": {"kvEvents": {"enabled": False}}}
    children = pool(spec)
    policies, pods = policies_of(children), pods_of(children)
    assert not may_connect(policies, pods["router"], pods["decode"], EVENTS)
    assert may_connect(policies, pods["router"], pods["decode"], HTTP)


def test_policies_are_on_by_default_and_can_be_turned_off() -> None:
    assert [p["metadata"]["name"] for p in policies_of(pool(AGGREGATED))] == [
        "p-workers",
        "p-router",
    ]
    off = pool({**AGGREGATED, "networkPolicy": {"enabled": False}})
    assert policies_of(off) == []
    assert may_connect([], STRANGER, pods_of(off)["decode"], EVENTS)  # say so: open again


def test_policies_come_before_the_pods_they_guard() -> None:
    kinds = [c["kind"] for c in pool(DISAGGREGATED)]
    assert kinds.index("NetworkPolicy") < kinds.index("Deployment")
    assert kinds.index("Secret") < kinds.index("Deployment")


@pytest.mark.parametrize("spec", [AGGREGATED, DISAGGREGATED, VLLM_DISAGGREGATED])
def test_the_new_children_are_valid_kubernetes(spec: dict[str, Any]) -> None:
    spec = {
        **spec,
        "router": {"auth": {"secretName": "tenants"}},
        "networkPolicy": {
            "clientsFrom": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.9.0.0/16"]}}],
            "metricsFrom": [
                {"podSelector": {"matchExpressions": [{"key": "app", "operator": "Exists"}]}}
            ],
        },
    }
    for child in pool(spec):
        if child["kind"] in ("NetworkPolicy", "Secret", "Deployment", "ConfigMap"):
            kubernetes_validate.validate(child, "1.31.0", strict=True)


# --- the tenants Secret ---------------------------------------------------------------------


def find(children: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [found] = [c for c in children if c["kind"] == kind and c["metadata"]["name"] == name]
    return found


def router_pod(children: list[dict[str, Any]]) -> dict[str, Any]:
    return find(children, "Deployment", "p-router")["spec"]["template"]["spec"]


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_the_router_mounts_the_tenants_secret_read_only_as_a_directory() -> None:
    """A directory, not subPath: the kubelet updates the file in place when the Secret
    changes, and the router reads it again (keys revoked without a restart)."""
    spec = {**AGGREGATED, "router": {"auth": {"secretName": "team-keys", "key": "keys.json"}}}
    children = pool(spec)
    pod = router_pod(children)
    volumes = {v["name"]: v for v in pod["volumes"]}
    [mount] = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == TENANTS_MOUNT]
    assert mount["readOnly"] is True and "subPath" not in mount
    assert volumes[mount["name"]] == {"name": mount["name"], "secret": {"secretName": "team-keys"}}
    config = find(children, "ConfigMap", "p-router")["data"]
    assert config["KVPOOL_ROUTER_API_KEYS_FILE"] == f"{TENANTS_MOUNT}/keys.json"
    # only the router sees the keys
    for role in ("decode",):
        worker = find(children, "Deployment", f"p-{role}")["spec"]["template"]["spec"]
        assert "team-keys" not in str(worker)


def test_without_auth_the_router_asks_for_no_key() -> None:
    children = pool(AGGREGATED)
    assert "KVPOOL_ROUTER_API_KEYS_FILE" not in find(children, "ConfigMap", "p-router")["data"]
    assert TENANTS_MOUNT not in str(router_pod(children))


def test_turning_auth_on_rolls_the_router() -> None:
    def config_hash(spec: dict[str, Any]) -> str:
        template = find(pool(spec), "Deployment", "p-router")["spec"]["template"]
        return template["metadata"]["annotations"]["kvpool.io/config-hash"]

    keyed = {**AGGREGATED, "router": {"auth": {"secretName": "team-keys"}}}
    assert config_hash(AGGREGATED) != config_hash(keyed)


# --- the pool secret ------------------------------------------------------------------------

REF = {"secretKeyRef": {"name": "p-pool-secret", "key": "pool-secret"}}


def test_router_and_kvpool_workers_share_the_pool_secret_by_reference() -> None:
    children = pool(DISAGGREGATED)
    assert env(router_pod(children)["containers"][0])["KVPOOL_ROUTER_POOL_SECRET"] == REF
    for role in ("prefill", "decode"):
        worker = find(children, "Deployment", f"p-{role}")["spec"]["template"]["spec"]
        [container] = worker["containers"]
        assert env(container)["KVPOOL_POOL_SECRET"] == REF, role
        # on the container whose preStop hook drains: `kvpool worker drain` reads it there
        assert container["lifecycle"]["preStop"]["exec"]["command"][:3] == [
            "kvpool", "worker", "drain",
        ]  # fmt: skip
        for init in worker.get("initContainers", []):
            assert "KVPOOL_POOL_SECRET" not in env(init), init["name"]
    # never as a value, never in the router's ConfigMap
    config = find(children, "ConfigMap", "p-router")["data"]
    assert not [k for k in config if "SECRET" in k]


def test_the_operator_makes_the_pool_secret_without_data_in_the_rendering() -> None:
    secret = find(pool(DISAGGREGATED), "Secret", "p-pool-secret")
    assert "data" not in secret and "stringData" not in secret
    assert secret["immutable"] is True
    assert secret["metadata"]["annotations"][GENERATED_KEY] == "pool-secret"


def test_the_generated_key_is_random_and_fills_only_that_key() -> None:
    secret = find(pool(DISAGGREGATED), "Secret", "p-pool-secret")
    made = [handlers.with_generated_key(secret) for _ in range(2)]
    keys = [base64.b64decode(m["data"]["pool-secret"]).decode() for m in made]
    assert keys[0] != keys[1]
    assert all(len(k) == 64 and int(k, 16) >= 0 for k in keys)  # 256 bits, as hex
    assert "data" not in secret  # the rendering is left as it was
    assert {k: v for k, v in made[0].items() if k != "data"} == secret


def test_a_pool_secret_of_your_own_replaces_the_made_one() -> None:
    spec = {**DISAGGREGATED, "poolSecret": {"secretName": "mine", "key": "hmac"}}
    children = pool(spec)
    assert [c for c in children if c["kind"] == "Secret"] == []
    ref = {"secretKeyRef": {"name": "mine", "key": "hmac"}}
    assert env(router_pod(children)["containers"][0])["KVPOOL_ROUTER_POOL_SECRET"] == ref
    decode = find(children, "Deployment", "p-decode")["spec"]["template"]["spec"]
    assert env(decode["containers"][0])["KVPOOL_POOL_SECRET"] == ref


def test_a_pool_of_vllm_workers_has_no_pool_secret() -> None:
    """vLLM workers neither sign nor check the hand-off, nor take the pool's password on
    their event sockets: neither they nor their router get the secret."""
    children = pool(VLLM_DISAGGREGATED)
    assert [c for c in children if c["kind"] == "Secret"] == []
    assert "POOL_SECRET" not in str([c for c in children if c["kind"] == "Deployment"])


def test_kvpool_workers_take_the_pool_secret_they_are_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The variable the operator sets is the worker's own setting, and the key the
    operator makes is one the worker accepts."""
    import argparse

    from kvpool.settings_cli import build_settings, settings_values
    from kvpool.worker.cli import ENV_PREFIX
    from kvpool.worker.settings import WorkerSettings

    (tmp_path / "config.json").write_text("{}")
    children = pool(DISAGGREGATED)
    decode = find(children, "Deployment", "p-decode")["spec"]["template"]["spec"]
    names = [e["name"] for e in decode["containers"][0]["env"] if "POOL_SECRET" in e["name"]]
    assert names == ["KVPOOL_POOL_SECRET"]
    made = handlers.with_generated_key(find(children, "Secret", "p-pool-secret"))
    key = base64.b64decode(made["data"]["pool-secret"]).decode()
    for name in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(name)
    monkeypatch.setenv(names[0], key)
    values = settings_values(argparse.Namespace(), WorkerSettings, ENV_PREFIX)
    settings = build_settings(WorkerSettings, {**values, "model": str(tmp_path)})
    assert settings.secret == key


# --- the router's typed settings ------------------------------------------------------------


def test_flow_control_and_client_limits_reach_the_router_as_its_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvpool.router.settings import ENV_PREFIX, RouterSettings
    from kvpool.settings_cli import build_settings, settings_values

    router = {
        "flowControl": {
            "enabled": False,
            "saturationTtftSeconds": 0.75,
            "queueMaxRequests": 500,
            "queueMaxBytes": 64 * 2**20,
            "queueTimeoutSeconds": 20,
        },
        "clientLimits": {
            "headerTimeoutSeconds": 3,
            "bodyTimeoutSeconds": 12.5,
            "maxHeaderBytes": 16384,
            "maxConnectionsPerClient": 32,
            "trustedProxies": ["10.0.0.0/8", "fd00::/8"],
            "clientAddressHeader": "forwarded",
            "maxRequestsPerClient": 100,
        },
        "auth": {"secretName": "keys"},
    }
    children = pool({**AGGREGATED, "router": router})
    data = find(children, "ConfigMap", "p-router")["data"]
    (tmp_path / "config.json").write_text("{}")
    for key in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(key)
    for key, value in {**data, "KVPOOL_ROUTER_MODEL": str(tmp_path)}.items():
        monkeypatch.setenv(key, value)
    [secret_var] = [k for k, v in env(router_pod(children)["containers"][0]).items() if v == REF]
    monkeypatch.setenv(secret_var, "k" * 64)  # the router's own setting, by its variable
    import argparse

    settings = build_settings(
        RouterSettings, settings_values(argparse.Namespace(), RouterSettings, ENV_PREFIX)
    )
    assert settings.flow_control is False
    assert settings.saturation_ttft_s == 0.75
    assert settings.queue_max_requests == 500
    assert settings.queue_max_bytes == 64 * 2**20
    assert settings.queue_timeout_s == 20
    assert settings.header_timeout_s == 3
    assert settings.body_timeout_s == 12.5
    assert settings.max_header_bytes == 16384
    assert settings.max_connections_per_client == 32
    assert settings.trusted_proxies == ["10.0.0.0/8", "fd00::/8"]
    assert settings.client_address_header == "forwarded"
    assert settings.max_requests_per_client == 100
    assert settings.api_keys_file == f"{TENANTS_MOUNT}/tenants.yaml"
    assert settings.pool_secret is not None
    assert settings.pool_secret.get_secret_value() == "k" * 64
    # unset: the router's own defaults, not a copy of them
    plain = find(pool(AGGREGATED), "ConfigMap", "p-router")["data"]
    assert "KVPOOL_ROUTER_FLOW_CONTROL" not in plain
    assert "KVPOOL_ROUTER_QUEUE_MAX_REQUESTS" not in plain
