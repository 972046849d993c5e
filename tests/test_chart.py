"""The Helm chart (``charts/kvpool``): lint, render, validate, and check it against the code.

``helm template`` runs once per value set (a module fixture); every rendered object is
validated against the Kubernetes schemas (``kubernetes-validate``, strict). The custom kinds
those schemas do not know (``ServiceMonitor`` / ``PodMonitor``) are checked against the
subset of prometheus-operator's ``monitoring.coreos.com/v1`` schema the chart uses, closed
(``additionalProperties`` false), so a misspelt field fails; their metadata against
Kubernetes' ObjectMeta.

The RBAC rules are compared with what the operator does: the real operator (its leader
election, kopf and ``kvpool.operator.handlers``) runs against kmock's Kubernetes emulator
with the chart's settings and namespaces, and takes a pool through creation, a hand edit of
each child (patched back), and a change that prunes a role and an outdated child of each
kind; every request the emulator saw becomes a needed (group, resource, verb). The
autoscaler's calls, the permissions the operator grants to routers (Kubernetes lets it grant
only what it holds) and kopf's Events are added. The chart must grant every need, in the
right scope, and nothing else. The RBAC tables of README.md and charts/README.md are read
and compared with the rendered rules, so that they say what the chart grants.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml
from kopf.testing import KopfRunner

from kvpool import __version__
from kvpool.api import validate_pool
from kvpool.api.manifests import load_pools
from kvpool.devtools import helm
from kvpool.operator import handlers
from kvpool.operator import settings as operator_settings
from kvpool.operator.cli import leader_elector
from kvpool.operator.cluster import KINDS, Cluster
from kvpool.operator.leader import Leadership
from kvpool.operator.render import (
    DEFAULT_METRICS_FROM,
    MANAGED_BY,
    POOL_LABEL,
    ROLE_LABEL,
    Images,
    render,
)

from kube_emulator import chart_crds, declare_resources, write_kubeconfig

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "kvpool"
RELEASE = "kvpool"
NAMESPACE = "kvpool-system"
KUBE_VERSIONS = ("1.25.0", kubernetes_validate.latest_version())  # the chart's oldest, newest

VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "namespaced": {"watchNamespaces": ["a", "b"]},
    "replicas2": {"replicas": 2},
    "monitors": {
        "metrics": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}, "interval": "30s"},
            "podMonitor": {"enabled": True, "labels": {"release": "prom"}},
        }
    },
    "namespaced-monitors": {
        "watchNamespaces": ["a", "b"],
        "metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}},
    },
    "no-dashboards": {"dashboards": {"enabled": False}},
    "network-policy": {
        "networkPolicy": {
            "operator": {"enabled": True},
            "metricsFrom": [
                {
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}
                    }
                }
            ],
        }
    },
    "custom": {
        "fullnameOverride": "llm-operator",
        "image": {"tag": "0.2.0"},
        "leaderElection": {
            "leaseName": "llm-leader",
            "leaseDurationSeconds": 30,
            "renewDeadlineSeconds": 20,
            "retryPeriodSeconds": 4,
        },
        "serviceAccount": {"name": "llm-operator-sa"},
        "dashboards": {
            "namespace": "grafana",
            "label": {"name": "kvpool_dashboards", "value": "yes"},
            "folder": {"annotation": "k8s-sidecar-target-directory", "name": "/tmp/kvpool"},
        },
    },
}


# --- helm -----------------------------------------------------------------------------------


def run_helm(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(helm()), *map(str, args)], capture_output=True, text=True, timeout=120
    )


def values_file(tmp: Path, values: dict[str, Any]) -> Path:
    text = json.dumps(values, sort_keys=True)
    path = tmp / f"values-{hashlib.sha256(text.encode()).hexdigest()[:12]}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def template(tmp: Path, values: dict[str, Any]) -> list[dict[str, Any]]:
    proc = run_helm(
        "template", RELEASE, CHART, "--namespace", NAMESPACE, "-f", values_file(tmp, values)
    )
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("values")
    return {name: template(tmp, values) for name, values in VALUE_SETS.items()}


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = of_kind(docs, kind)
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


def operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def plain_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in operator_container(docs)["env"] if "value" in e}


# --- lint, render, validate -----------------------------------------------------------------


@pytest.mark.parametrize("strict", [False, True])
def test_helm_lint_passes(strict: bool, tmp_path: Path) -> None:
    for values in (VALUE_SETS["default"], VALUE_SETS["namespaced-monitors"]):
        args = ["lint", CHART, "-f", values_file(tmp_path, values)]
        proc = run_helm(*args, *(["--strict"] if strict else []))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "0 chart(s) failed" in proc.stdout


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert (chart["name"], chart["version"], chart["appVersion"]) == ("kvpool", "0.1.0", "0.1.0")
    assert chart["appVersion"] == __version__, "the chart's appVersion is the package version"


RELABEL_CONFIG = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "sourceLabels": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"},
        },
        "separator": {"type": "string"},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "modulus": {"type": "integer"},
        "replacement": {"type": "string"},
        "action": {
            "enum": [
                "replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod", "HashMod",
                "labelmap", "LabelMap", "labeldrop", "LabelDrop", "labelkeep", "LabelKeep",
                "lowercase", "Lowercase", "uppercase", "Uppercase", "keepequal", "KeepEqual",
                "dropequal", "DropEqual",
            ]
        },
    },
}  # fmt: skip
DURATION = {"type": "string", "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?"
                                         "(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}  # fmt: skip
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "port": {"type": "string", "minLength": 1},
        "path": {"type": "string"},
        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
        "interval": DURATION,
        "scrapeTimeout": DURATION,
        "honorLabels": {"type": "boolean"},
        "relabelings": {"type": "array", "items": RELABEL_CONFIG},
        "metricRelabelings": {"type": "array", "items": RELABEL_CONFIG},
    },
}


def _monitor_schema(kind: str, endpoints: str) -> dict[str, Any]:
    """The part of prometheus-operator's v1 schema the chart uses (selector is required)."""
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": {"type": "object"},
            "spec": {
                "type": "object",
                "required": ["selector", endpoints],
                "additionalProperties": False,
                "properties": {
                    "selector": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "matchLabels": STRING_MAP,
                            "matchExpressions": {"type": "array"},
                        },
                    },
                    "namespaceSelector": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "any": {"type": "boolean"},
                            "matchNames": {"type": "array", "items": {"type": "string"}},
                        },
                    },
                    "jobLabel": {"type": "string"},
                    endpoints: {"type": "array", "minItems": 1, "items": ENDPOINT},
                },
            },
        },
    }


MONITOR_SCHEMAS = {
    "ServiceMonitor": _monitor_schema("ServiceMonitor", "endpoints"),
    "PodMonitor": _monitor_schema("PodMonitor", "podMetricsEndpoints"),
}


def validate_metadata(doc: dict[str, Any]) -> None:
    """A custom kind's metadata, against Kubernetes' ObjectMeta (carried by a ConfigMap)."""
    carrier = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]}
    kubernetes_validate.validate(carrier, KUBE_VERSIONS[-1], strict=True)


def validate_object(doc: dict[str, Any]) -> None:
    kind = doc["kind"]
    if kind in MONITOR_SCHEMAS:
        jsonschema.Draft202012Validator(MONITOR_SCHEMAS[kind]).validate(doc)
        validate_metadata(doc)
    else:
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_every_rendered_object_validates(
    value_set: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    docs = rendered[value_set]
    assert docs, "nothing rendered"
    problems = []
    for doc in docs:
        try:
            validate_object(doc)
        except jsonschema.ValidationError as exc:  # kubernetes_validate's too
            where = "/".join(map(str, exc.path))
            problems.append(f"{doc['kind']} {doc['metadata']['name']} at {where}: {exc.message}")
    assert not problems, "\n".join(problems)
    names = [(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), "two objects of one kind share a name"


def test_a_validation_error_is_caught(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The validators above do fail: a misspelt field in each kind of check."""
    deployment = json.loads(json.dumps(one(rendered["default"], "Deployment")))
    deployment["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_object(deployment)
    monitor = json.loads(json.dumps(one(rendered["monitors"], "ServiceMonitor")))
    monitor["spec"]["endpoints"][0]["honorlabels"] = True
    with pytest.raises(jsonschema.ValidationError):
        validate_object(monitor)


def test_the_crds_are_valid_and_the_inferencepool_crd_is_the_generated_one() -> None:
    crds = chart_crds()
    assert set(crds) == {"inferencepool.yaml"}, "kopf's peering CRDs went with kopf peering"
    for crd in crds.values():
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(crd, version, strict=True)
    generated = (ROOT / "crds" / "inferencepool.yaml").read_bytes()
    assert (CHART / "crds" / "inferencepool.yaml").read_bytes() == generated, (
        "charts/kvpool/crds/inferencepool.yaml differs from crds/inferencepool.yaml: run `make crd`"
    )


# --- bad values -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"replicas": "two"}, "at '/replicas': got string, want integer"),
        ({"replica": 2}, "additional properties 'replica' not allowed"),
        ({"image": {"pullPolicy": "Sometimes"}}, "at '/image/pullPolicy'"),
        ({"metrics": {"port": 70000}}, "at '/metrics/port'"),
        ({"watchNamespaces": ["Team_A"]}, "at '/watchNamespaces/0'"),
        ({"leaderElection": {"leaseDurationSeconds": "15s"}}, "at '/leaderElection/leaseDuration"),
        ({"peering": {"name": "old"}}, "additional properties 'peering' not allowed"),
        ({"dashboards": {"enable": False}}, "additional properties 'enable' not allowed"),
        ({"networkPolicy": {"metricsFrom": [{}]}}, "at '/networkPolicy/metricsFrom/0'"),
        (
            {"networkPolicy": {"metricsFrom": [{"podSelecter": {}}]}},
            "additional properties 'podSelecter' not allowed",
        ),
        (
            {"leaderElection": {"leaseDurationSeconds": 10}},
            "leaseDurationSeconds (10) must be longer than renewDeadlineSeconds (10)",
        ),
        (
            {"leaderElection": {"renewDeadlineSeconds": 4, "retryPeriodSeconds": 4}},
            "renewDeadlineSeconds (4) must be longer than retryPeriodSeconds (4) times 1.2",
        ),
        (
            {"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}},
            "metrics.serviceMonitor.enabled needs metrics.service.enabled",
        ),
    ],
)
def test_bad_values_are_refused_with_a_clear_message(
    values: dict[str, Any], message: str, tmp_path: Path
) -> None:
    proc = run_helm("template", RELEASE, CHART, "-f", values_file(tmp_path, values))
    assert proc.returncode != 0, f"{values} rendered"
    assert message in proc.stderr, proc.stderr


@pytest.mark.parametrize("value_set", ["default", "namespaced", "replicas2"])
def test_the_notes_render(value_set: str, tmp_path: Path) -> None:
    values = values_file(tmp_path, VALUE_SETS[value_set])
    proc = run_helm("install", RELEASE, CHART, "--dry-run=client", "-n", NAMESPACE, "-f", values)
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert f"kubectl -n {NAMESPACE} logs deploy/{RELEASE}" in notes
    if value_set == "namespaced":
        assert "It reconciles InferencePools in: a, b." in notes


def test_lint_refuses_bad_values(tmp_path: Path) -> None:
    proc = run_helm("lint", CHART, "-f", values_file(tmp_path, {"replicas": "two"}))
    assert proc.returncode != 0
    assert "at '/replicas': got string, want integer" in proc.stdout + proc.stderr


# --- the operator's Deployment --------------------------------------------------------------


@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_the_operator_runs_non_root_with_a_read_only_root_filesystem(
    value_set: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    pod = one(rendered[value_set], "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ctx = container["securityContext"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 65532
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert ctx["runAsNonRoot"] is True
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert "emptyDir" in volumes[tmp["name"]]


def test_the_operator_image_and_command(rendered: dict[str, list[dict[str, Any]]]) -> None:
    container = operator_container(rendered["default"])
    assert container["image"] == f"ghcr.io/kvpool/kvpool-operator:{__version__}"
    assert container["args"] == ["operator", "run"]
    assert "command" not in container, "the image's entrypoint is kvpool"
    assert operator_container(rendered["custom"])["image"] == "ghcr.io/kvpool/kvpool-operator:0.2.0"
    from kvpool.cli import main as kvpool_main

    with pytest.raises(SystemExit) as exit_info:  # `kvpool operator run --help` exists
        kvpool_main([*container["args"], "--help"])
    assert exit_info.value.code == 0


def test_the_operator_elects_a_leader_by_a_lease_in_its_namespace(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """Always, whatever the replicas: a rolling update runs two pods even with one."""
    for value_set, docs in rendered.items():
        container = operator_container(docs)
        (pod_id,) = [e for e in container["env"] if e["name"] == "POD_ID"]
        assert pod_id["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}, value_set
        env = plain_env(docs)
        assert env["KVPOOL_OPERATOR_LEASE_NAMESPACE"] == NAMESPACE, value_set
        watched = VALUE_SETS[value_set].get("watchNamespaces", [])
        if watched:
            assert env["KVPOOL_OPERATOR_NAMESPACE"].split() == watched
        else:
            assert "KVPOOL_OPERATOR_NAMESPACE" not in env, "unset: every namespace"
        assert not [d for d in docs if d["apiVersion"].startswith("kopf.dev/")], "no peering"
        assert "KVPOOL_OPERATOR_PEERING" not in env
    default, custom = plain_env(rendered["default"]), plain_env(rendered["custom"])
    assert default["KVPOOL_OPERATOR_LEASE_NAME"] == RELEASE
    durations = ("LEASE_DURATION_S", "RENEW_DEADLINE_S", "RETRY_PERIOD_S")
    assert [default[f"KVPOOL_OPERATOR_{k}"] for k in durations] == ["15", "10", "2"]
    assert custom["KVPOOL_OPERATOR_LEASE_NAME"] == "llm-leader"
    assert [custom[f"KVPOOL_OPERATOR_{k}"] for k in durations] == ["30", "20", "4"]
    assert plain_env(rendered["replicas2"]) == default
    assert one(rendered["replicas2"], "Deployment")["spec"]["replicas"] == 2


def test_the_children_images_default_to_the_operators_defaults(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    env = plain_env(rendered["default"])
    images = Images()
    assert env["KVPOOL_OPERATOR_WORKER_IMAGE"] == images.worker
    assert env["KVPOOL_OPERATOR_WORKER_CPU_IMAGE"] == images.worker_cpu
    assert env["KVPOOL_OPERATOR_VLLM_IMAGE"] == images.vllm
    assert env["KVPOOL_OPERATOR_ROUTER_IMAGE"] == images.router
    custom = plain_env(rendered["custom"])  # image.tag 0.2.0: the children follow it
    assert custom["KVPOOL_OPERATOR_WORKER_IMAGE"] == "ghcr.io/kvpool/kvpool-worker:0.2.0"
    assert custom["KVPOOL_OPERATOR_WORKER_CPU_IMAGE"] == "ghcr.io/kvpool/kvpool-worker:0.2.0-cpu"
    assert custom["KVPOOL_OPERATOR_ROUTER_IMAGE"] == "ghcr.io/kvpool/kvpool-router:0.2.0"
    assert custom["KVPOOL_OPERATOR_VLLM_IMAGE"] == images.vllm


@pytest.mark.parametrize("value_set", ["default", "namespaced", "custom"])
def test_the_operator_env_is_settings_the_operator_reads(
    value_set: str, rendered: dict[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    env = plain_env(rendered[value_set])
    fields = set(operator_settings.OperatorSettings.model_fields)
    ours = {k for k in env if k.startswith(operator_settings.ENV_PREFIX)}
    unknown = {
        k for k in ours if k.removeprefix(operator_settings.ENV_PREFIX).lower() not in fields
    }
    assert not unknown, f"the operator reads no setting named {sorted(unknown)}"
    for key in list(os.environ):
        if key.startswith(operator_settings.ENV_PREFIX):
            monkeypatch.delenv(key)
    for key in ours:
        monkeypatch.setenv(key, env[key])
    settings = operator_settings.from_environment()  # a bad value raises, naming the field
    assert settings.namespace == VALUE_SETS[value_set].get("watchNamespaces", [])
    assert settings.lease() == (NAMESPACE, env["KVPOOL_OPERATOR_LEASE_NAME"])


def test_the_ports_and_the_liveness_probe(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["default"]
    container = operator_container(docs)
    env = plain_env(docs)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == int(env["KVPOOL_OPERATOR_METRICS_PORT"]) == 8080
    assert ports["liveness"] == int(env["KVPOOL_OPERATOR_LIVENESS_PORT"]) == 8081
    probe = container["livenessProbe"]["httpGet"]
    assert probe == {"path": "/healthz", "port": "liveness"}
    assert env["KVPOOL_OPERATOR_RESYNC_INTERVAL_S"] == "60"


def test_a_disruption_budget_only_with_more_than_one_replica(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    assert not of_kind(rendered["default"], "PodDisruptionBudget")
    pdb = one(rendered["replicas2"], "PodDisruptionBudget")
    pods = one(rendered["replicas2"], "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pods.items()


def test_every_object_has_the_standard_labels(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for value_set, docs in rendered.items():
        for doc in docs:
            labels = doc["metadata"].get("labels") or {}
            what = f"{value_set}: {doc['kind']} {doc['metadata']['name']}"
            assert labels.get("app.kubernetes.io/name") == "kvpool", what
            assert labels.get("app.kubernetes.io/instance") == RELEASE, what
            assert labels.get("app.kubernetes.io/version") == __version__, what
            assert labels.get("app.kubernetes.io/managed-by") == "Helm", what
            assert labels.get("helm.sh/chart") == "kvpool-0.1.0", what


def test_objects_live_in_the_release_namespace(rendered: dict[str, list[dict[str, Any]]]) -> None:
    cluster_scoped = {"ClusterRole", "ClusterRoleBinding"}
    per_watched_namespace = {"Role", "RoleBinding"}
    for value_set, docs in rendered.items():
        watched = VALUE_SETS[value_set].get("watchNamespaces", [])
        grafana = VALUE_SETS[value_set].get("dashboards", {}).get("namespace") or NAMESPACE
        for doc in docs:
            ns = doc["metadata"].get("namespace")
            if doc["kind"] in cluster_scoped:
                assert ns is None, doc["kind"]
            elif (
                doc["kind"] in per_watched_namespace
                and "-leader-election" in doc["metadata"]["name"]
            ):
                assert ns == NAMESPACE, doc["kind"]  # the Lease's, in the release namespace
            elif doc["kind"] in per_watched_namespace:
                assert ns in watched, doc["kind"]
            elif doc["kind"] == "ConfigMap":
                assert ns == grafana
            else:
                assert ns == NAMESPACE, f"{value_set}: {doc['kind']} in {ns}"


# --- RBAC -----------------------------------------------------------------------------------

Need = tuple[str, str, str]  # (group, resource[/subresource], verb)
K8S_PATH = re.compile(
    r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))/(?P<rest>.+)$"
)


def request_need(method: str, path: str, params: dict[str, str]) -> tuple[str | None, Need] | None:
    """(namespace or None, need) of one API request; None for discovery (/api, /apis, /version:
    every authenticated client may read those)."""
    m = K8S_PATH.match(path)
    if not m:
        return None
    group = m["group"] or ""
    parts = m["rest"].split("/")
    namespace = None
    if parts[0] == "namespaces" and len(parts) >= 3:
        namespace, parts = parts[1], parts[2:]
    resource, name, sub = parts[0], parts[1] if len(parts) > 1 else None, parts[2:]
    watch = params.get("watch") in ("true", "1")
    verb = {
        "GET": "watch" if watch else ("get" if name else "list"),
        "POST": "create",
        "PATCH": "patch",
        "PUT": "update",
        "DELETE": "delete" if name else "deletecollection",
    }[method]
    return namespace, (group, "/".join([resource, *sub]), verb)


def rule_grants(rules: Iterable[dict[str, Any]]) -> set[Need]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule.get("apiGroups", [])
        for resource in rule.get("resources", [])
        for verb in rule.get("verbs", [])
    }


def bound_roles(docs: list[dict[str, Any]]) -> Iterator[tuple[str | None, dict[str, Any]]]:
    """(namespace, or None for a ClusterRoleBinding; the role) of each binding of the
    operator's ServiceAccount."""
    sa = one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    subject = {"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d for d in docs}
    for binding in of_kind(docs, "ClusterRoleBinding") + of_kind(docs, "RoleBinding"):
        if subject not in binding["subjects"]:
            continue
        ref = binding["roleRef"]
        ns = binding["metadata"].get("namespace")
        role = roles[(ref["kind"], ns if ref["kind"] == "Role" else None, ref["name"])]
        yield (None if binding["kind"] == "ClusterRoleBinding" else ns), role


def grants(docs: list[dict[str, Any]]) -> tuple[set[Need], dict[str, set[Need]]]:
    """What the operator's ServiceAccount holds: cluster-wide, and per namespace."""
    cluster: set[Need] = set()
    namespaced: dict[str, set[Need]] = {}
    for ns, role in bound_roles(docs):
        if ns is None:
            cluster |= rule_grants(role["rules"])
        else:
            namespaced.setdefault(ns, set()).update(rule_grants(role["rules"]))
    return cluster, namespaced


EXAMPLE_POOLS: dict[str, dict[str, Any]] = {
    "disaggregated": {
        "model": {"name": "tiny", "source": {"builtin": {}}},
        "disaggregation": {"mode": "Disaggregated"},
        "prefill": {"replicas": 1},
        "decode": {"replicas": 2},
    },
    "aggregated": {"model": {"name": "tiny", "source": {"builtin": {}}}, "decode": {"replicas": 1}},
    "vllm": {
        "model": {"name": "llama", "source": {"pvc": {"claimName": "models", "path": "llama"}}},
        "engine": {"type": "vllm"},
        "disaggregation": {"mode": "Disaggregated"},
        "prefill": {"replicas": 1},
        "decode": {"replicas": 1},
    },
}


def granted_to_routers() -> set[Need]:
    """Every permission the operator's rendered Roles hand out, for the pools above and those
    in examples/: Kubernetes lets it grant (and bind) only what it holds itself, there."""
    pools = [(name, validate_pool(name, spec)) for name, spec in EXAMPLE_POOLS.items()]
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        pools += load_pools(path)
    needs: set[Need] = set()
    for name, spec in pools:
        for child in render(name, "llm", spec):
            if child["kind"] in ("Role", "ClusterRole"):
                needs |= rule_grants(child["rules"])
    return needs


# kopf posts Events (core v1, POST only) about a pool for handler errors and warnings
# (settings.posting.level is WARNING), which this run does not provoke.
KOPF_EVENTS: set[Need] = {("", "events", "create")}
# Not a request: the admission plugin OwnerReferencesPermissionEnforcement (on in OpenShift)
# checks it when a child names its pool as owner with blockOwnerDeletion.
OWNER_REFERENCES: set[Need] = {("kvpool.io", "inferencepools/finalizers", "update")}
# Cluster's methods: every one of them is exercised by the run below (directly or through
# handlers.sync), so a new one (a new kind of API call) fails here until it is.
CLUSTER_METHODS = {
    "read", "apply", "owned_children", "prune", "scale", "deployment", "pods", "pool",
    "patch_status", "kind_of", "record", "converged", "create_once", "read_cached",
    "delete_made",
}  # fmt: skip


def test_every_cluster_method_is_exercised_by_the_rbac_run() -> None:
    public = {n for n, _ in inspect.getmembers(Cluster, callable) if not n.startswith("_")}
    assert public == CLUSTER_METHODS, (
        "Cluster's methods changed: exercise the new ones in the RBAC run, then list them here"
    )


async def eventually(check: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(0.1)
    pytest.fail(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def serve_namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    """kmock 0.8 reads ``/api/v1/namespaces[/NAME]`` as a namespace with no resource and fails
    (HTTP 500); kopf lists and watches namespaces when restricted to some. Parse those two
    paths as the namespaces resource, the way the API server serves them."""
    from kmock._internal import parsing

    original = parsing.parse_path

    def parse_path(path: str) -> Any:
        parts = path.strip("/").split("/")
        if parts[:3] == ["api", "v1", "namespaces"] and len(parts) <= 4:
            return parsing.ParsedPath("", "v1", "namespaces", None, (parts[3:] or [None])[0])
        return original(path)

    monkeypatch.setattr(parsing, "parse_path", parse_path)


TEST_CLIENT = "kvpool-chart-test"


def kopf_args(env: dict[str, str]) -> list[str]:
    """``kopf run`` with what ``kvpool operator run`` makes of the chart's env (standalone:
    the Lease, taken before, says which replica runs it)."""
    namespaces = env.get("KVPOOL_OPERATOR_NAMESPACE", "").split()
    scope = [a for ns in namespaces for a in ("--namespace", ns)] or ["--all-namespaces"]
    return ["run", "-m", "kvpool.operator.handlers", "--standalone", *scope]


async def operator_requests(
    docs: list[dict[str, Any]], kmock: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[str | None, Need]]:
    """Run the operator as the chart configures it and reconcile a pool through creation, a
    change that prunes a role, and the autoscaler's calls; return every request it made."""
    env = plain_env(docs)
    watched = env.get("KVPOOL_OPERATOR_NAMESPACE", "").split()
    ns = watched[0] if watched else "llm"
    declare_resources(kmock)
    serve_namespaces(monkeypatch)
    url = str(kmock.url).rstrip("/")
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kubeconfig", url)))
    monkeypatch.setenv("POD_ID", "kvpool-0")
    for key, value in env.items():  # the operator's settings, as the chart sets them
        if key.startswith(operator_settings.ENV_PREFIX):
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("KVPOOL_OPERATOR_METRICS_PORT", "0")  # a free port, not the pod's
    monkeypatch.setattr(handlers, "SETTINGS", None)
    headers = {"User-Agent": TEST_CLIENT}  # the test's own requests, told apart
    async with httpx.AsyncClient(base_url=url, timeout=10, headers=headers) as http:

        async def post(path: str, body: dict[str, Any]) -> None:
            r = await http.post(path, json=body)
            assert r.status_code in (200, 201), r.text

        async def get(path: str) -> dict[str, Any] | None:
            r = await http.get(path)
            return r.json() if r.status_code == 200 else None

        for name in watched or [ns]:
            await post("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                              "metadata": {"name": name}})  # fmt: skip
        for crd in chart_crds().values():
            await post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
        seen_before = len(list(kmock))

        # As `kvpool operator run`: take the Lease (create it), keep renewing it (update),
        # run kopf, and release it at the end (update).
        leadership = Leadership(
            leader_elector(operator_settings.from_environment()), on_lost=lambda: None
        )
        assert await asyncio.to_thread(leadership.acquire)
        leadership.start_renewing()
        monkeypatch.setattr(handlers, "LEADER", leadership.elector)
        runner = KopfRunner(kopf_args(env), timeout=60, reraise=False)
        runner.__enter__()
        try:
            await reconcile_a_pool(http, ns)
            # The autoscaler's calls (scaling.autoscale_step), which need live metrics to
            # happen on their own: read the Deployment, list the pods, scale.
            cluster = Cluster()
            await asyncio.to_thread(cluster.deployment, ns, "tiny-decode")
            await asyncio.to_thread(cluster.pods, ns, "tiny")
            await asyncio.to_thread(cluster.scale, ns, "tiny-decode", 3)
        finally:
            # Stopped from a thread: the emulator runs on this loop and must keep answering.
            await asyncio.to_thread(runner.__exit__, None, None, None)
            await asyncio.to_thread(leadership.stop)
    assert runner.exception is None, runner.stdout[-3000:]
    requests = []
    for r in list(kmock)[seen_before:]:
        if r.headers.get("User-Agent") == TEST_CLIENT:
            continue
        method = str(r.method.value if hasattr(r.method, "value") else r.method).upper()
        found = request_need(method, r.url.path, dict(r.params))
        if found is not None:
            requests.append(found)
            # an apply that finds no object creates it: the API server checks create too
            if method == "PATCH" and r.headers.get("Content-Type", "").startswith(
                "application/apply-patch"
            ) and "/" not in found[1][1]:  # fmt: skip
                requests.append((found[0], (found[1][0], found[1][1], "create")))
    return requests


def child_url(ns: str, api_version: str, kind: str, name: str | None = None) -> str:
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    plural = kind.lower()[:-1] + "ies" if kind.endswith("y") else f"{kind.lower()}s"
    url = f"{base}/namespaces/{ns}/{plural}"
    return f"{url}/{name}" if name else url


async def reconcile_a_pool(http: httpx.AsyncClient, ns: str) -> None:
    """A pool's life that makes every call of the operator on every kind it manages: create
    the pool (children read and created); edit each child by hand (each patched back); leave
    an outdated child of each kind and drop the prefill role (each pruned: listed, deleted)."""
    api = f"/apis/kvpool.io/v1alpha1/namespaces/{ns}/inferencepools"
    owner = {"apiVersion": "kvpool.io/v1alpha1", "kind": "InferencePool", "name": "tiny",
             "uid": "uid-tiny", "controller": True, "blockOwnerDeletion": True}  # fmt: skip

    async def get(url: str) -> dict[str, Any] | None:
        r = await http.get(url)
        return r.json() if r.status_code == 200 else None

    async def write(method: str, url: str, body: dict[str, Any]) -> None:
        headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
        r = await http.request(method, url, json=body, headers=headers)
        assert r.status_code in (200, 201), r.text

    pool = {
        "apiVersion": "kvpool.io/v1alpha1",
        "kind": "InferencePool",
        "metadata": {"name": "tiny", "namespace": ns, "uid": "uid-tiny", "generation": 1},
        "spec": EXAMPLE_POOLS["disaggregated"],
    }
    await write("POST", api, pool)
    children = render("tiny", ns, validate_pool("tiny", EXAMPLE_POOLS["disaggregated"]))
    urls = [child_url(ns, c["apiVersion"], c["kind"], c["metadata"]["name"]) for c in children]
    assert {(c["apiVersion"], c["kind"]) for c in children} == set(KINDS), "a kind unexercised"

    async def all_children() -> bool:
        return all([await get(url) for url in urls])

    await eventually(all_children, "every child created")
    # every child but the pool secret, which is made once and never written again
    edited = [url for c, url in zip(children, urls, strict=True) if c["kind"] != "Secret"]
    edit = {"metadata": {"labels": {"app.kubernetes.io/version": "edited-by-hand"}}}
    for url in edited:
        await write("PATCH", url, edit)

    async def restored() -> bool:
        for url in edited:
            labels = ((await get(url) or {}).get("metadata") or {}).get("labels") or {}
            if labels.get("app.kubernetes.io/version") != __version__:
                return False
        return True

    await eventually(restored, "every child edited by hand patched back")
    # An outdated child of each kind is pruned, but a Secret: the operator never reads or
    # deletes one (the garbage collector removes a pool's secret with its pool).
    pruned_kinds = [(v, k) for v, k in KINDS if k != "Secret"]
    for api_version, kind in pruned_kinds:
        labels = {POOL_LABEL: "tiny", "app.kubernetes.io/managed-by": MANAGED_BY}
        meta = {"name": "tiny-outdated", "namespace": ns, "ownerReferences": [owner],
                "labels": labels}  # fmt: skip
        await write("POST", child_url(ns, api_version, kind),
                    {"apiVersion": api_version, "kind": kind, "metadata": meta})  # fmt: skip
    # ... and the pool names a Secret of its own: the one the operator made is deleted
    change = {"metadata": {"generation": 2},
              "spec": {"disaggregation": {"mode": "Aggregated"}, "prefill": None,
                       "poolSecret": {"secretName": "mine", "key": "k"}}}  # fmt: skip
    await write("PATCH", f"{api}/tiny", change)
    gone = [child_url(ns, v, k, "tiny-outdated") for v, k in pruned_kinds]
    gone.append(child_url(ns, "apps/v1", "Deployment", "tiny-prefill"))
    gone.append(child_url(ns, "v1", "Secret", "tiny-pool-secret"))

    async def pruned() -> bool:
        live = await get(f"{api}/tiny") or {}
        if (live.get("status") or {}).get("observedGeneration") != 2:
            return False
        return not any([await get(url) for url in gone])

    await eventually(pruned, "the outdated children and the prefill role pruned")


@pytest.mark.parametrize("value_set", ["default", "namespaced"])
async def test_rbac_grants_exactly_what_the_operator_needs(
    value_set: str,
    rendered: dict[str, list[dict[str, Any]]],
    kmock: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docs = rendered[value_set]
    requests = await operator_requests(docs, kmock, tmp_path, monkeypatch)
    cluster_needs = {need for ns, need in requests if ns is None}
    # the Lease, in the operator's own namespace; everything else in the pools' namespaces
    release_needs = {need for ns, need in requests if ns == NAMESPACE}
    namespaced_needs = {need for ns, need in requests if ns not in (None, NAMESPACE)}
    namespaced_needs |= granted_to_routers() | KOPF_EVENTS | OWNER_REFERENCES
    cluster_grants, namespace_grants = grants(docs)
    watched = VALUE_SETS[value_set].get("watchNamespaces", [])
    assert release_needs == {("coordination.k8s.io", "leases", v) for v in
                             ("get", "create", "update")}  # fmt: skip
    assert namespace_grants.pop(NAMESPACE) == release_needs, "the Lease's Role"

    if not watched:  # one ClusterRole: a namespaced need is met cluster-wide
        assert namespace_grants == {}
        needs = cluster_needs | namespaced_needs
        assert needs - cluster_grants == set(), "needed but not granted"
        assert cluster_grants - needs == set(), "granted but never needed"
    else:
        assert set(namespace_grants) == set(watched), "a Role in each watched namespace"
        assert cluster_needs - cluster_grants == set(), "needed cluster-wide, not granted"
        assert cluster_grants - cluster_needs == set(), "granted cluster-wide, never needed"
        for ns in watched:
            assert namespaced_needs - namespace_grants[ns] == set(), f"not granted in {ns}"
            assert namespace_grants[ns] - namespaced_needs == set(), f"never needed in {ns}"
        # every namespaced request went to a watched namespace (or the Lease's)
        assert {ns for ns, _ in requests if ns is not None} <= {*watched, NAMESPACE}

    # the operator holds what it grants to routers, where it grants it
    for ns_grants in namespace_grants.values() or [cluster_grants]:
        assert granted_to_routers() <= ns_grants | cluster_grants
    assert ("", "pods", "list") in granted_to_routers()
    assert ("", "pods", "watch") in granted_to_routers()


def test_the_lease_rules_name_the_lease_where_kubernetes_allows(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for value_set in ("default", "namespaced", "custom"):
        docs = rendered[value_set]
        lease = plain_env(docs)["KVPOOL_OPERATOR_LEASE_NAME"]
        roles = [r for r in of_kind(docs, "Role") if r["metadata"]["namespace"] == NAMESPACE]
        (role,) = roles
        by_verb = {
            verb: rule.get("resourceNames") for rule in role["rules"] for verb in rule["verbs"]
        }
        assert by_verb == {"get": [lease], "update": [lease], "create": None}, value_set
        assert {(r["apiGroups"][0], r["resources"][0]) for r in role["rules"]} == {
            ("coordination.k8s.io", "leases")
        }


Entry = tuple[str, str, str, bool]  # (group, resource, verb, limited to named objects)
RBAC_TABLE_HEADER = "| Where | API group | Resources | Verbs |"
# what each "Where" of the tables means, by value set: the scope -> ClusterRole (None) or Role
WHERE = {
    "default": {"pools": None, "cluster": None, "release namespace": NAMESPACE},
    "namespaced": {
        "pools": ("a", "b"),
        "cluster": None,
        "cluster, watchNamespaces": None,
        "release namespace": NAMESPACE,
    },
}


def held(docs: list[dict[str, Any]]) -> dict[str | None, set[Entry]]:
    """What the operator's ServiceAccount holds, by namespace (None: cluster-wide), with
    whether a rule names its objects (resourceNames)."""
    out: dict[str | None, set[Entry]] = {}
    for ns, role in bound_roles(docs):
        out.setdefault(ns, set()).update(
            (group, resource, verb, bool(rule.get("resourceNames")))
            for rule in role["rules"]
            for group in rule["apiGroups"]
            for resource in rule["resources"]
            for verb in rule["verbs"]
        )
    return out


def rbac_tables(path: Path) -> dict[str, set[Entry]]:
    """The RBAC tables of a README, by "Where": each row's group (`core` or `""` is the core
    group), its backquoted resources ("named" when the row is limited to one object) and its
    verbs (the text before any parenthesis)."""
    rows: dict[str, set[Entry]] = {}
    lines = path.read_text().splitlines()
    tables = [i for i, line in enumerate(lines) if line.startswith(RBAC_TABLE_HEADER)]
    assert tables, f"{path.name}: no RBAC table ({RBAC_TABLE_HEADER})"
    for start in tables:
        for line in lines[start + 2 :]:
            if not line.startswith("|"):
                break
            where, group, resources, verbs = [c.strip() for c in line.strip("|").split("|")][:4]
            group = group.strip("`")
            group = "" if group in ("core", '""') else group
            named = " named " in f" {resources} "
            names = re.findall(r"`([^`]+)`", resources.split(" named ")[0])
            assert names, f"{path.name}: no resource in {line!r}"
            rows.setdefault(where, set()).update(
                (group, resource, verb.strip(), named)
                for resource in names
                for verb in verbs.split("(")[0].split(",")
            )
    return rows


@pytest.mark.parametrize("readme", ["README.md", "charts/README.md"])
@pytest.mark.parametrize("value_set", list(WHERE))
def test_the_readme_rbac_tables_are_what_the_chart_grants(
    readme: str, value_set: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    table = rbac_tables(ROOT / readme)
    assert set(table) == {"pools", "cluster", "cluster, watchNamespaces", "release namespace"}
    said: dict[str | None, set[Entry]] = {}
    for where, scope in WHERE[value_set].items():
        for ns in scope if isinstance(scope, tuple) else (scope,):
            said.setdefault(ns, set()).update(table[where])
    granted = held(rendered[value_set])
    assert set(said) == set(granted), f"{readme}: the scopes ({value_set})"
    for ns in granted:
        where = "cluster-wide" if ns is None else f"in {ns}"
        assert granted[ns] - said[ns] == set(), f"{readme} leaves out, {where} ({value_set})"
        assert said[ns] - granted[ns] == set(), f"{readme} says more, {where} ({value_set})"


def test_the_readme_table_parser_reads_scopes_groups_names_and_verbs(tmp_path: Path) -> None:
    text = (
        f"{RBAC_TABLE_HEADER} Why |\n|---|---|---|---|---|\n"
        "| pools | core | `a`, `b/c` | get, list (why not) | x |\n"
        "| release namespace | `x.io` | `leases` named `name` | update | |\n"
        "\nnot a row\n"
    )
    (tmp_path / "README.md").write_text(text)
    assert rbac_tables(tmp_path / "README.md") == {
        "pools": {("", r, v, False) for r in ("a", "b/c") for v in ("get", "list")},
        "release namespace": {("x.io", "leases", "update", True)},
    }


@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_rbac_uses_no_wildcard_and_binds_only_the_operator(
    value_set: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    docs = rendered[value_set]
    sa = one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    for role in of_kind(docs, "ClusterRole") + of_kind(docs, "Role"):
        for rule in role["rules"]:
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[key], f"{role['kind']} {key}: a wildcard"
            named = {"resourceNames"} if rule["resources"] == ["leases"] else set()
            assert set(rule) - named == {"apiGroups", "resources", "verbs"}, rule
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), rule
            if "update" in rule["verbs"]:  # what owner references need, and the one Lease
                assert rule["resources"] in (["inferencepools/finalizers"], ["leases"]), rule
                assert rule["resources"] != ["leases"] or len(rule["resourceNames"]) == 1
    for binding in of_kind(docs, "ClusterRoleBinding") + of_kind(docs, "RoleBinding"):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}
        ]
    if VALUE_SETS[value_set].get("serviceAccount", {}).get("name"):
        assert sa == VALUE_SETS[value_set]["serviceAccount"]["name"]
        assert one(docs, "ServiceAccount")["metadata"]["name"] == sa


def test_the_operator_may_never_read_a_secret(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """The pool secret is created once (a 409 means it exists), deleted by name and uid
    when a pool names its own, else removed with its pool by the garbage collector: no
    right to read, list, watch or change a Secret."""
    for value_set in ("default", "namespaced"):
        cluster, namespaced = grants(rendered[value_set])
        watched = VALUE_SETS[value_set].get("watchNamespaces", [])
        scopes = [namespaced[ns] for ns in watched] or [cluster]
        assert not [need for need in namespaced.get(NAMESPACE, ()) if need[1] == "secrets"]
        for holding in scopes:
            secrets = {
                verb for group, resource, verb in holding if (group, resource) == ("", "secrets")
            }
            assert secrets == {"create", "delete"}, value_set
        if watched:  # and nothing on Secrets cluster-wide
            assert not [need for need in cluster if need[1] == "secrets"]


def test_the_request_parser_maps_verbs() -> None:
    assert request_need("GET", "/api/v1/namespaces/a/pods", {}) == ("a", ("", "pods", "list"))
    assert request_need("GET", "/api/v1/namespaces", {"watch": "true"}) == (
        None, ("", "namespaces", "watch"),
    )  # fmt: skip
    assert request_need(
        "PATCH", "/apis/kvpool.io/v1alpha1/namespaces/a/inferencepools/p/status", {}
    ) == ("a", ("kvpool.io", "inferencepools/status", "patch"))
    assert request_need("DELETE", "/apis/apps/v1/namespaces/a/deployments/d", {}) == (
        "a", ("apps", "deployments", "delete"),
    )  # fmt: skip
    assert request_need("GET", "/apis", {}) is None
    assert request_need("GET", "/apis/apps/v1", {}) is None


# --- network policies -----------------------------------------------------------------------


def test_the_operator_knows_its_pods_and_the_default_scrapers(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """What the pools' NetworkPolicies let through: the operator's pods (the autoscaler
    scrapes routers and workers), as they run, and the scrapers of networkPolicy.metricsFrom,
    whose default is the operator's own."""
    for value_set in ("default", "custom", "network-policy"):
        docs = rendered[value_set]
        env = plain_env(docs)
        assert env["KVPOOL_OPERATOR_POD_NAMESPACE"] == NAMESPACE
        pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
        selector = dict(item.split("=") for item in env["KVPOOL_OPERATOR_POD_SELECTOR"].split(","))
        assert selector.items() <= pod_labels.items(), value_set
        assert selector["app.kubernetes.io/component"] == "operator"
        settings = operator_settings.OperatorSettings(
            pod_namespace=env["KVPOOL_OPERATOR_POD_NAMESPACE"],
            pod_selector=env["KVPOOL_OPERATOR_POD_SELECTOR"],
            metrics_from=env["KVPOOL_OPERATOR_METRICS_FROM"],
        )
        peers = settings.peers()
        assert peers.operator is not None
        assert peers.operator["podSelector"]["matchLabels"] == selector
        want = VALUE_SETS[value_set].get("networkPolicy", {}).get("metricsFrom")
        assert list(peers.metrics) == (want if want is not None else list(DEFAULT_METRICS_FROM))
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["networkPolicy"]["metricsFrom"] == list(DEFAULT_METRICS_FROM), (
        "the chart's default scrapers are the operator's"
    )


def test_the_operators_own_network_policy_only_when_asked(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    assert not of_kind(rendered["default"], "NetworkPolicy")
    docs = rendered["network-policy"]
    policy = one(docs, "NetworkPolicy")
    pod = one(docs, "Deployment")["spec"]["template"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == VALUE_SETS["network-policy"]["networkPolicy"]["metricsFrom"]
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    assert rule["ports"] == [{"protocol": "TCP", "port": ports["metrics"]}]
    # nobody scrapes: no rule at all (an empty "from" would let everyone in)
    closed = template(
        tmp_path, {"networkPolicy": {"operator": {"enabled": True}, "metricsFrom": []}}
    )
    assert one(closed, "NetworkPolicy")["spec"].get("ingress") in ([], None)


# --- dashboards -----------------------------------------------------------------------------


def dashboard_maps(docs: list[dict[str, Any]], label: str = "grafana_dashboard") -> list[Any]:
    return [d for d in of_kind(docs, "ConfigMap") if label in d["metadata"].get("labels", {})]


def test_one_configmap_per_dashboard_file(rendered: dict[str, list[dict[str, Any]]]) -> None:
    files = sorted((CHART / "dashboards").glob("*.json"))
    assert files, "the chart ships no dashboards"
    maps = dashboard_maps(rendered["default"])
    assert len(maps) == len(files)
    by_key = {key: (m, value) for m in maps for key, value in m["data"].items()}
    assert sorted(by_key) == [f.name for f in files], "one data key per file, named as it"
    for f in files:
        config_map, content = by_key[f.name]
        assert content == f.read_text(), f"{f.name}: the ConfigMap holds the file as it is"
        json.loads(content)
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert config_map["metadata"]["annotations"]["grafana_folder"] == "kvpool"
        assert config_map["metadata"]["namespace"] == NAMESPACE


def test_dashboards_label_folder_and_namespace_are_configurable(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    maps = dashboard_maps(rendered["custom"], "kvpool_dashboards")
    assert len(maps) == len(list((CHART / "dashboards").glob("*.json")))
    for m in maps:
        assert m["metadata"]["labels"]["kvpool_dashboards"] == "yes"
        assert "grafana_dashboard" not in m["metadata"]["labels"]
        assert m["metadata"]["annotations"] == {"k8s-sidecar-target-directory": "/tmp/kvpool"}
        assert m["metadata"]["namespace"] == "grafana"


def test_no_dashboards_when_disabled(rendered: dict[str, list[dict[str, Any]]]) -> None:
    assert of_kind(rendered["no-dashboards"], "ConfigMap") == []


# --- monitoring -----------------------------------------------------------------------------


def test_monitors_only_when_enabled(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for value_set in ("default", "namespaced", "replicas2", "no-dashboards", "custom"):
        docs = rendered[value_set]
        assert not of_kind(docs, "ServiceMonitor") and not of_kind(docs, "PodMonitor")
    for kind in ("ServiceMonitor", "PodMonitor"):
        monitor = one(rendered["monitors"], kind)
        assert monitor["metadata"]["labels"]["release"] == "prom", "the Prometheus selector's label"


def test_the_service_monitor_scrapes_the_operator_with_its_own_labels(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["monitors"]
    monitor = one(docs, "ServiceMonitor")
    service = one(docs, "Service")
    pod = one(docs, "Deployment")["spec"]["template"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True
    assert endpoint["path"] == "/metrics"
    assert endpoint["interval"] == "30s"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    container_ports = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert port["targetPort"] in container_ports


def prometheus_label(pod_label: str) -> str:
    """How Kubernetes service discovery names a pod label (invalid characters become _)."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", pod_label)


def relabel(labels: dict[str, str], configs: list[dict[str, Any]]) -> dict[str, str]:
    """Prometheus' relabelling, for the replace action the chart uses."""
    out = dict(labels)
    for c in configs:
        assert c.get("action", "replace").lower() == "replace", c
        value = c.get("separator", ";").join(out.get(s, "") for s in c.get("sourceLabels", []))
        m = re.fullmatch(c.get("regex", "(.*)"), value)
        if not m:
            continue
        result = m.expand(c.get("replacement", "$1").replace("$", "\\"))
        if result:
            out[c["targetLabel"]] = result
        else:
            out.pop(c["targetLabel"], None)  # Prometheus drops empty labels
    return {k: v for k, v in out.items() if not k.startswith("__")}


def test_the_pod_monitor_gives_pool_and_role_to_routers_and_workers(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    monitor = one(rendered["monitors"], "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector == {"app.kubernetes.io/managed-by": MANAGED_BY}
    spec = validate_pool("tiny", EXAMPLE_POOLS["disaggregated"])
    pods = 0
    for child in render("tiny", "llm", spec):
        if child["kind"] != "Deployment":
            continue
        template = child["spec"]["template"]
        pod_labels = template["metadata"]["labels"]
        assert selector.items() <= pod_labels.items(), "the PodMonitor selects every pod"
        ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        assert endpoint["port"] in ports
        meta = {prometheus_label(k): v for k, v in pod_labels.items()}
        got = relabel(meta, endpoint["relabelings"])
        assert got["pool"] == "tiny" == pod_labels[POOL_LABEL]
        if ROLE_LABEL in pod_labels:  # workers
            assert got["role"] == pod_labels[ROLE_LABEL] in ("prefill", "decode", "both")
        else:  # the router
            assert "role" not in got
        pods += 1
    assert pods == 3  # router, prefill, decode


def test_the_pod_monitor_follows_the_watched_namespaces(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    monitor = one(rendered["namespaced-monitors"], "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["a", "b"]}
