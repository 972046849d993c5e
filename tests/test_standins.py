"""The stand-ins for the API server's own checks (``kvpool.operator.standins``), through
``kvpool check``: each fails its fixture (taken from what Kubernetes documents it refuses)
naming the field, and the examples and the chart's rendered manifests pass all four."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool.api import validate_pool
from kvpool.cli import STAND_INS, main
from kvpool.devtools import helm
from kvpool.operator.podcheck import check_children, pod_security_warning
from kvpool.operator.render import Images, merge_template, render
from kvpool.operator.standins import CHECKS, check_objects

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "data" / "standins"
EXAMPLES = sorted(str(p) for p in (ROOT / "examples").rglob("*.yaml"))

# check -> the field its fixture gets wrong
FAILS = {
    "cel-cost": "CustomResourceDefinition widgets.example.com: spec.versions[].schema."
    "openAPIV3Schema.spec.settings: iterated by a rule, and has no maxProperties",
    "pod-validation": "Deployment web: spec.template.spec.containers[web].readinessProbe: more"
    " than one handler (exec, httpGet)",
    "pod-security-restricted": "Deployment nginx: spec.template.spec.containers[nginx]."
    "securityContext.allowPrivilegeEscalation: must be false",
    "server-side-apply": "Deployment web: spec.template.spec.containers[name=web].ports"
    "[containerPort=80,protocol=TCP]: duplicate entries for key",
}


def test_the_cli_and_the_operator_know_the_same_checks() -> None:
    assert STAND_INS == CHECKS
    assert set(FAILS) == set(CHECKS)


@pytest.mark.parametrize("check", CHECKS)
def test_each_check_fails_its_fixture_naming_the_field(check: str, capsys: Any) -> None:
    fixture = FIXTURES / f"{check}.yaml"
    assert main(["check", str(fixture)]) == 1
    err = capsys.readouterr().err
    assert f"{fixture}: {FAILS[check]}" in err, err
    assert f"[{check}]" in err
    # the other checks find nothing in it: each fixture is about its own check
    others = [c for c in CHECKS if c != check]
    assert all(f"[{c}]" not in err for c in others), err
    assert main(["check", "--skip", check, str(fixture)]) == 0


def test_every_example_passes_the_four_checks(capsys: Any) -> None:
    assert main(["check", *EXAMPLES]) == 0
    err = capsys.readouterr().err
    assert "checked as the API server would: " + ", ".join(CHECKS) in err, err


def test_the_charts_rendered_manifests_pass_the_four_checks(tmp_path: Path, capsys: Any) -> None:
    chart = ROOT / "charts" / "kvpool"
    rendered = subprocess.run(
        [str(helm()), "template", "kvpool", str(chart), "--namespace", "kvpool-system",
         "--include-crds"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    path = tmp_path / "chart.yaml"
    path.write_text(rendered)
    kinds = {d["kind"] for d in yaml.safe_load_all(rendered) if d}
    assert {"Deployment", "CustomResourceDefinition", "ClusterRole"} <= kinds, kinds
    assert main(["check", str(path)]) == 0, capsys.readouterr().err


def _spec(**decode: Any) -> dict[str, Any]:
    return {
        "model": {"name": "m", "source": {"pvc": {"claimName": "models", "path": "m"}}},
        "engine": {"type": "vllm"},
        "disaggregation": {"mode": "Aggregated"},
        "decode": {"replicas": 1, **decode},
    }


def test_a_vllm_pool_passes_restricted_and_a_privileged_template_is_warned_of() -> None:
    children = render("p", "llm", validate_pool("p", _spec()), Images())
    assert pod_security_warning(children) is None
    privileged = {"spec": {"containers": [{"name": "worker",
                                           "securityContext": {"privileged": True}}]}}  # fmt: skip
    children = render(
        "p", "llm", validate_pool("p", _spec(podTemplate=privileged), allow_host_access=True)
    )
    warning = pod_security_warning(children)
    assert warning is not None
    assert "Deployment p-decode: spec.template.spec.containers[worker].securityContext" \
        ".privileged: must be false" in warning  # fmt: skip


def test_a_template_whose_ports_server_side_apply_refuses_is_refused_before_any_write() -> None:
    """Another name for the worker's port: the merged pod has two ports of one number."""
    port = {"name": "api", "containerPort": 8000}
    template = {"spec": {"containers": [{"name": "worker", "ports": [port]}]}}
    template["spec"]["containers"][0]["ports"][0]["protocol"] = "UDP"
    check_children(render("p", "llm", validate_pool("p", _spec(podTemplate=template))))
    del template["spec"]["containers"][0]["ports"][0]["protocol"]
    spec = _spec(podTemplate=template)
    children = render("p", "llm", validate_pool("p", spec))
    ports = children_ports(children)
    assert [p["containerPort"] for p in ports].count(8000) == 1, ports  # merged, as SSA would
    template["spec"]["containers"][0]["ports"].append({"name": "api2", "containerPort": 8000})
    with pytest.raises(ValueError, match=r"Deployment p-decode: .*ports\[containerPort=8000,"
                       r"protocol=TCP\]: duplicate entries for key"):  # fmt: skip
        check_children(render("p", "llm", validate_pool("p", _spec(podTemplate=template))))


def children_ports(children: list[dict[str, Any]]) -> list[dict[str, Any]]:
    dep = next(c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] ==
               "p-decode")  # fmt: skip
    return dep["spec"]["template"]["spec"]["containers"][0]["ports"]


def test_a_template_merges_lists_by_the_keys_the_api_server_merges_them_by() -> None:
    """Volume mounts are their mountPath: the same volume mounted at a second path is a
    second mount (merged by name, it moved the first); an override of a port's number is
    another port; a toleration list (atomic) is replaced whole."""
    base = {"spec": {
        "tolerations": [{"key": "a", "operator": "Exists"}],
        "containers": [{"name": "w", "volumeMounts": [{"name": "model", "mountPath": "/m"}],
                        "ports": [{"name": "http", "containerPort": 8000}]}],
    }}  # fmt: skip
    override = {"spec": {
        "tolerations": [{"key": "b", "operator": "Exists"}],
        "containers": [{"name": "w", "volumeMounts": [{"name": "model", "mountPath": "/n",
                                                        "readOnly": True}],
                        "ports": [{"name": "http", "containerPort": 8000, "hostPort": 0}]}],
    }}  # fmt: skip
    merged = merge_template(base, override)["spec"]
    container = merged["containers"][0]
    assert container["volumeMounts"] == [
        {"name": "model", "mountPath": "/m"},
        {"name": "model", "mountPath": "/n", "readOnly": True},
    ]
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "hostPort": 0}]
    assert merged["tolerations"] == [{"key": "b", "operator": "Exists"}]


# --- the rules, case by case (the Pod Security Standards' controls; pod validation) -----------

RESTRICTED_POD: dict[str, Any] = {
    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
    "containers": [{
        "name": "app", "image": "app:1",
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }],
}  # fmt: skip


def _pod(**changes: Any) -> dict[str, Any]:
    """The restricted pod with ``changes``: ``pod__x`` sets the pod spec's x, ``c__x`` the
    container's x, ``sc__x`` the container's securityContext's x."""
    import copy

    pod = copy.deepcopy(RESTRICTED_POD)
    container = pod["containers"][0]
    for key, value in changes.items():
        where, _, field = key.partition("__")
        target = {"pod": pod, "c": container, "sc": container["securityContext"],
                  "psc": pod["securityContext"]}[where]  # fmt: skip
        if value is None:
            target.pop(field, None)
        else:
            target[field] = value
    return pod


RESTRICTED_CASES = {
    # control: (the pod, the field named); from the Pod Security Standards' restricted table
    "host network": (_pod(pod__hostNetwork=True), "spec.hostNetwork"),
    "privileged": (_pod(sc__privileged=True), "spec.containers[app].securityContext.privileged"),
    "capability added": (
        _pod(sc__capabilities={"drop": ["ALL"], "add": ["SYS_ADMIN"]}),
        "spec.containers[app].securityContext.capabilities.add",
    ),
    "capabilities not dropped": (
        _pod(sc__capabilities=None),
        "spec.containers[app].securityContext.capabilities.drop",
    ),
    "hostPath volume": (
        _pod(pod__volumes=[{"name": "h", "hostPath": {"path": "/"}}]),
        "spec.volumes[h].hostPath",
    ),
    "host port": (
        _pod(c__ports=[{"containerPort": 80, "hostPort": 80}]),
        "spec.containers[app].ports[0].hostPort",
    ),
    "container overrides runAsNonRoot": (
        _pod(sc__runAsNonRoot=False),
        "spec.containers[app].securityContext.runAsNonRoot",
    ),
    "uid 0": (_pod(psc__runAsUser=0), "spec.securityContext.runAsUser"),
    "no seccomp at either level": (
        _pod(psc__seccompProfile=None),
        "spec.containers[app].securityContext.seccompProfile.type",
    ),
    "seccomp unconfined": (
        _pod(sc__seccompProfile={"type": "Unconfined"}),
        "spec.containers[app].securityContext.seccompProfile.type",
    ),
    "unsafe sysctl": (
        _pod(psc__sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
        "spec.securityContext.sysctls[kernel.msgmax]",
    ),
    "procMount": (_pod(sc__procMount="Unmasked"), "spec.containers[app].securityContext.procMount"),
    "SELinux type": (
        _pod(sc__seLinuxOptions={"type": "spc_t"}),
        "spec.containers[app].securityContext.seLinuxOptions",
    ),
    "privilege escalation": (
        _pod(sc__allowPrivilegeEscalation=None),
        "spec.containers[app].securityContext.allowPrivilegeEscalation",
    ),
    "probe host": (
        _pod(c__readinessProbe={"httpGet": {"host": "10.0.0.1", "port": 80}}),
        "spec.containers[app].readinessProbe.httpGet.host",
    ),
}


def test_a_restricted_pod_passes_and_seccomp_may_be_set_on_the_container() -> None:
    from kvpool.operator.standins import restricted_problems

    assert restricted_problems(_pod()) == []
    localhost = {"type": "Localhost", "localhostProfile": "p.json"}
    moved = _pod(psc__seccompProfile=None, sc__seccompProfile=localhost)
    assert restricted_problems(moved) == []
    low_ports = {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}
    assert restricted_problems(_pod(sc__capabilities=low_ports)) == []


@pytest.mark.parametrize("case", RESTRICTED_CASES)
def test_each_restricted_control_is_refused_naming_its_field(case: str) -> None:
    from kvpool.operator.standins import restricted_problems

    pod, field = RESTRICTED_CASES[case]
    assert field in [path for path, _ in restricted_problems(pod)], restricted_problems(pod)


def test_an_apparmor_annotation_other_than_the_runtimes_is_refused() -> None:
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
                  "spec": {"template": {"metadata": {"annotations": {
                      "container.apparmor.security.beta.kubernetes.io/app": "unconfined"}},
                      "spec": _pod()}}}  # fmt: skip
    found = check_objects([deployment], ["pod-security-restricted"])
    assert [f.path for f in found] == [
        "spec.template.metadata.annotations[container.apparmor.security.beta.kubernetes.io/app]"
    ]


VALIDATION_CASES = {
    # what the API server's pod validation refuses: (the pod, the field named)
    "port name with an underscore": (
        _pod(c__ports=[{"name": "http_1", "containerPort": 80}]),
        "spec.containers[app].ports[0].name",
    ),
    "port name over 15": (
        _pod(c__ports=[{"name": "a-very-long-port-name", "containerPort": 80}]),
        "spec.containers[app].ports[0].name",
    ),
    "liveness successThreshold": (
        _pod(c__livenessProbe={"tcpSocket": {"port": 80}, "successThreshold": 2}),
        "spec.containers[app].livenessProbe.successThreshold",
    ),
    "probe without a handler": (
        _pod(c__readinessProbe={"periodSeconds": 5}),
        "spec.containers[app].readinessProbe",
    ),
    "requests over limits": (
        _pod(c__resources={"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}}),
        "spec.containers[app].resources.requests[memory]",
    ),
    "one path mounted twice": (
        _pod(
            pod__volumes=[{"name": "a", "emptyDir": {}}, {"name": "b", "emptyDir": {}}],
            c__volumeMounts=[{"name": "a", "mountPath": "/x"}, {"name": "b", "mountPath": "/x"}],
        ),
        "spec.containers[app].volumeMounts[1].mountPath",
    ),
    "a volume with no source": (_pod(pod__volumes=[{"name": "v"}]), "spec.volumes[v]"),
    "env value and valueFrom": (
        _pod(
            c__env=[
                {
                    "name": "E",
                    "value": "1",
                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                }
            ]
        ),
        "spec.containers[app].env[E]",
    ),
    "lifecycle on an init container": (
        _pod(
            pod__initContainers=[
                {
                    "name": "i",
                    "image": "i:1",
                    "lifecycle": {"preStop": {"exec": {"command": ["x"]}}},
                }
            ]
        ),
        "spec.initContainers[i].lifecycle",
    ),
}


@pytest.mark.parametrize("case", VALIDATION_CASES)
def test_each_pod_validation_is_refused_naming_its_field(case: str) -> None:
    from kvpool.operator.standins import pod_problems

    pod, field = VALIDATION_CASES[case]
    assert pod_problems(_pod()) == []
    assert field in [path for path, _ in pod_problems(pod)], pod_problems(pod)


def test_a_rollout_that_can_move_no_pod_is_refused() -> None:
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
                  "spec": {"strategy": {"rollingUpdate": {"maxSurge": 0, "maxUnavailable": "0%"}},
                           "template": {"spec": _pod()}}}  # fmt: skip
    found = check_objects([deployment], ["pod-validation"])
    assert [f.path for f in found] == ["spec.strategy.rollingUpdate.maxUnavailable"]
