"""A pool's podTemplate, checked: what it may ask for (``kvpool.api.podtemplate``, through
``validate_pool`` and ``kvpool check``) and whether the Deployments it is merged into are
ones the API server takes (``kvpool.operator.podcheck``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.api import validate_pool
from kvpool.api.podtemplate import MAX_DEPTH, PROTECTED_LABELS
from kvpool.cli import main
from kvpool.devtools import helm
from kvpool.operator import settings as operator_settings
from kvpool.operator.podcheck import check_children
from kvpool.operator.render import Images, render

MODEL = {"name": "tiny", "source": {"builtin": {}}}
CHART = Path(__file__).parent.parent / "charts" / "kvpool"
# where a template goes, and the path validate_pool names it by
PLACES = {
    "decode": ("decode", "spec.decode.podTemplate"),
    "prefill": ("prefill", "spec.prefill.podTemplate"),
    "router": ("router", "spec.router.podTemplate"),
}


def spec_with(place: str, template: Any, **more: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": MODEL, place: {"podTemplate": template}, **more}
    if place == "prefill":
        spec["disaggregation"] = {"mode": "Disaggregated"}
    return spec


def problems(place: str, template: Any, **kwargs: Any) -> str:
    with pytest.raises(ValueError) as exc:
        validate_pool("tiny", spec_with(place, template), **kwargs)
    return str(exc.value)


def nested(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {"a": 1}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


def manifest(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "kvpool.io/v1alpha1", "kind": "InferencePool",
            "metadata": {"name": "tiny"}, "spec": spec}  # fmt: skip


def deep_manifest(tmp_path: Path, levels: int) -> Path:
    """A pool whose decode podTemplate is ``levels`` objects deep, as flow-style YAML (JSON),
    written without a recursive dumper."""
    doc = manifest({"model": MODEL, "decode": {"podTemplate": 0}})
    head, tail = json.dumps(doc).split("0", 1)
    path = tmp_path / "deep.yaml"
    path.write_text(head + '{"a": ' * levels + "1" + "}" * levels + tail)
    return path


# --- shape ----------------------------------------------------------------------------------


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("template", [["spec"], "spec: {}", 7, True])
def test_a_template_that_is_not_an_object_is_refused(place: str, template: Any) -> None:
    message = problems(place, template)
    assert message.startswith(f"{PLACES[place][1]}: must be an object (a partial pod template)")


@pytest.mark.parametrize("place", PLACES)
def test_containers_that_are_not_a_list_of_objects_are_refused(place: str) -> None:
    where = PLACES[place][1]
    message = problems(place, {"spec": {"containers": {"name": "worker"}}})
    assert message == f"{where}.spec.containers: must be a list of objects, not an object"
    message = problems(place, {"spec": {"initContainers": ["busybox"], "volumes": "tmp"}})
    assert f"{where}.spec.initContainers[0]: must be an object, not a string" in message
    assert f"{where}.spec.volumes: must be a list of objects, not a string" in message
    message = problems(place, {"metadata": [], "spec": {"containers": [{"ports": {}}]}})
    assert f"{where}.metadata: must be an object, not a list" in message
    assert f"{where}.spec.containers[0].ports: must be a list of objects" in message


@pytest.mark.parametrize("place", PLACES)
def test_a_deeply_nested_template_is_refused_naming_the_field(place: str) -> None:
    assert problems(place, nested(5000)) == f"{PLACES[place][1]}: nested deeper than 64 levels"
    validate_pool("tiny", spec_with(place, {"metadata": nested(MAX_DEPTH - 1)}))  # at the limit


def test_other_free_form_fields_are_refused_nested_too_deep() -> None:
    spec = {"model": MODEL, "decode": {"affinity": nested(5000), "tolerations": [nested(100)]}}
    with pytest.raises(ValueError) as exc:
        validate_pool("tiny", spec)
    assert str(exc.value) == (
        "spec.decode.tolerations.0: nested deeper than 64 levels; "
        "spec.decode.affinity: nested deeper than 64 levels"
    )


def test_kvpool_check_refuses_a_deep_template_naming_the_field(tmp_path: Path, capsys) -> None:
    path = deep_manifest(tmp_path, 5000)
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert err == f"{path}: InferencePool tiny: spec.decode.podTemplate: nested deeper than 64" \
                  " levels\n"  # fmt: skip


def test_the_kvpool_command_refuses_a_very_deep_template_cleanly(tmp_path: Path) -> None:
    """As a user runs it: 20000 levels (YAML's own composer recursed once per level)."""
    path = deep_manifest(tmp_path, 20000)
    command = [sys.executable, "-m", "kvpool.cli", "check", str(path)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "spec.decode.podTemplate: nested deeper than 64 levels" in proc.stderr


# --- what a template may ask for ------------------------------------------------------------


def pod(**spec: Any) -> dict[str, Any]:
    return {"spec": spec}


PRIVILEGED = {"name": "worker", "securityContext": {"privileged": True}}
HOST_PROCESS = {"name": "w", "securityContext": {"windowsOptions": {"hostProcess": True}}}
HOST_ACCESS = {
    "spec.hostNetwork": pod(hostNetwork=True),
    "spec.hostPID": pod(hostPID=True),
    "spec.hostIPC": pod(hostIPC=True),
    "spec.volumes[1].hostPath": pod(volumes=[{"name": "a", "emptyDir": {}},
                                             {"name": "b", "hostPath": {"path": "/"}}]),
    "spec.containers[0].securityContext.privileged": pod(containers=[PRIVILEGED]),
    "spec.containers[1].securityContext.privileged": pod(containers=[{"name": "x"}, PRIVILEGED]),
    "spec.initContainers[0].securityContext.privileged": pod(initContainers=[PRIVILEGED]),
    "spec.containers[0].ports[0].hostPort": pod(containers=[
        {"name": "worker", "ports": [{"containerPort": 80, "hostPort": 80}]}]),
    "spec.containers[0].securityContext.windowsOptions.hostProcess": pod(containers=[HOST_PROCESS]),
}  # fmt: skip
SERVICE_ACCOUNT = {
    "spec.serviceAccountName": {"spec": {"serviceAccountName": "kvpool-operator"}},
    "spec.serviceAccount": {"spec": {"serviceAccount": "default"}},
}
LABELS = {
    f"metadata.labels.{label}": {"metadata": {"labels": {label: "other-pool"}}}
    for label in sorted(PROTECTED_LABELS)
}


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("path", HOST_ACCESS)
def test_host_access_is_refused_naming_the_field(place: str, path: str) -> None:
    message = problems(place, HOST_ACCESS[path])
    assert message == f"{PLACES[place][1]}.{path}: host access, which this operator refuses" \
                      " (its allowHostAccess setting is off)"  # fmt: skip


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("path", HOST_ACCESS)
def test_host_access_is_accepted_where_the_operator_allows_it(place: str, path: str) -> None:
    validate_pool("tiny", spec_with(place, HOST_ACCESS[path]), allow_host_access=True)


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("path", [*SERVICE_ACCOUNT, *LABELS])
def test_service_accounts_and_kvpools_labels_are_refused_even_with_host_access(
    place: str, path: str
) -> None:
    template = {**SERVICE_ACCOUNT, **LABELS}[path]
    for allow in (False, True):
        message = problems(place, template, allow_host_access=allow)
        assert message.startswith(f"{PLACES[place][1]}.{path}: set by the operator")


def test_every_problem_of_a_template_is_named_at_once() -> None:
    template = {
        "metadata": {"labels": {"kvpool.io/pool": "other"}, "annotations": {"team": "a"}},
        "spec": {
            "hostPID": True,
            "serviceAccountName": "admin",
            "containers": [{"name": "worker", "securityContext": {"privileged": True}}],
        },
    }
    assert problems("decode", template).split("; ") == [
        "spec.decode.podTemplate.metadata.labels.kvpool.io/pool: set by the operator:"
        " kvpool's selectors read it",
        "spec.decode.podTemplate.spec.serviceAccountName: set by the operator: a pool's pods"
        " run as the account it gives them",
        "spec.decode.podTemplate.spec.hostPID: host access, which this operator refuses"
        " (its allowHostAccess setting is off)",
        "spec.decode.podTemplate.spec.containers[0].securityContext.privileged: host access,"
        " which this operator refuses (its allowHostAccess setting is off)",
    ]


@pytest.mark.parametrize("place", PLACES)
def test_a_harmless_template_is_accepted(place: str) -> None:
    template = {
        "metadata": {"labels": {"team": "search"}, "annotations": {"prometheus.io/path": "/m"}},
        "spec": {
            "priorityClassName": "inference",
            "hostNetwork": False,
            "automountServiceAccountToken": True,
            "tolerations": [{"key": "gpu", "operator": "Exists"}],
            "volumes": [{"name": "cache", "emptyDir": {}}],
            "containers": [
                {
                    "name": "sidecar",
                    "image": "busybox",
                    "ports": [{"containerPort": 9000, "hostPort": 0}],
                    "securityContext": {"privileged": False, "allowPrivilegeEscalation": True},
                }
            ],
        },
    }
    pool = validate_pool("tiny", spec_with(place, template))
    assert getattr(pool, place).pod_template == template


def pools(tmp_path: Path, template: Any) -> Path:
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(manifest(spec_with("decode", template))))
    return path


def test_kvpool_check_allows_host_access_with_the_flag(tmp_path: Path, capsys) -> None:
    path = pools(tmp_path, HOST_ACCESS["spec.hostNetwork"])
    assert main(["check", str(path)]) == 1
    assert "spec.decode.podTemplate.spec.hostNetwork: host access" in capsys.readouterr().err
    # host access is what Pod Security "restricted" forbids: that check says so ...
    assert main(["check", "--allow-host-access", str(path)]) == 1
    assert "spec.template.spec.hostNetwork: must be false" in capsys.readouterr().err
    # ... and is left out for a namespace that does not enforce it
    skip = ["--skip", "pod-security-restricted"]
    assert main(["check", "--allow-host-access", *skip, str(path)]) == 0
    assert capsys.readouterr().out.startswith(f"{path}: InferencePool tiny: valid (engine ")
    path = pools(tmp_path, SERVICE_ACCOUNT["spec.serviceAccountName"])
    assert main(["check", "--allow-host-access", str(path)]) == 1
    assert "spec.decode.podTemplate.spec.serviceAccountName: set by" in capsys.readouterr().err


# --- any input: a ValueError or a pool, nothing else ----------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=30,
)
KEYS = st.sampled_from(["metadata", "spec", "labels", "annotations", "containers",
                        "initContainers", "ephemeralContainers", "volumes", "ports", "hostPath",
                        "securityContext", "privileged", "windowsOptions", "hostProcess",
                        "hostNetwork", "hostPort", "serviceAccountName", "kvpool.io/pool",
                        "name", "tolerations"])  # fmt: skip
# Objects keyed by the names the checks look at, so that they reach every branch.
TEMPLATES = st.recursive(
    JSON,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=5),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(template=TEMPLATES, place=st.sampled_from(sorted(PLACES)), allow=st.booleans())
def test_validate_pool_raises_only_value_error_for_any_template(
    template: Any, place: str, allow: bool
) -> None:
    try:
        pool = validate_pool("tiny", spec_with(place, template), allow_host_access=allow)
    except ValueError as exc:
        assert str(exc).startswith("spec.")
    else:
        assert template is None or isinstance(template, dict)
        assert getattr(pool, place).pod_template == template


# --- the merged Deployments against the Kubernetes schema -----------------------------------


@pytest.mark.parametrize("mode", ["Aggregated", "Disaggregated"])
def test_a_rendered_pool_passes_the_schema_check(mode: str) -> None:
    spec: dict[str, Any] = {"model": MODEL, "disaggregation": {"mode": mode}}
    if mode == "Disaggregated":
        spec["prefill"] = {}
    check_children(render("tiny", "llm", validate_pool("tiny", spec), Images()))


def test_a_template_the_api_server_would_refuse_is_caught_naming_the_child_and_field() -> None:
    # a port is its number (and protocol), as the API server merges ports: this one is added
    template = {"spec": {"containers": [{"name": "worker", "ports": [{"containerPort": "abc"}]}]}}
    children = render("tiny", "llm", validate_pool("tiny", spec_with("decode", template)))
    with pytest.raises(ValueError) as exc:
        check_children(children)
    assert str(exc.value) == (
        "Deployment tiny-decode: spec.template.spec.containers[0].ports[3].containerPort:"
        " 'abc' is not of type 'integer'"
    )


def test_a_sidecar_without_an_image_or_its_volume_is_caught() -> None:
    no_image = {"spec": {"containers": [{"name": "sidecar"}]}}
    children = render("tiny", "llm", validate_pool("tiny", spec_with("decode", no_image)))
    with pytest.raises(ValueError, match=r"tiny-decode: spec\.template\.spec\.containers"
                       r"\[sidecar\]\.image: Required value"):  # fmt: skip
        check_children(children)
    mount = {"name": "x", "mountPath": "/x"}
    no_volume = pod(containers=[{"name": "worker", "volumeMounts": [mount]}])
    children = render("tiny", "llm", validate_pool("tiny", spec_with("decode", no_volume)))
    with pytest.raises(ValueError, match=r"containers\[worker\]\.volumeMounts\[\d\]\.name: "
                       r"Not found: no volume 'x'"):  # fmt: skip
        check_children(children)


# --- the operator's setting and the chart's value -------------------------------------------


@pytest.mark.parametrize(("value", "allowed"), [(None, False), ("false", False), ("true", True)])
def test_the_operator_reads_allow_host_access_from_its_environment(
    value: str | None, allowed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVPOOL_OPERATOR_ALLOW_HOST_ACCESS", raising=False)
    if value is not None:
        monkeypatch.setenv("KVPOOL_OPERATOR_ALLOW_HOST_ACCESS", value)
    assert operator_settings.from_environment().allow_host_access is allowed


@pytest.mark.parametrize(("values", "env"), [([], "false"), (["allowHostAccess=true"], "true")])
def test_the_chart_passes_allow_host_access_to_the_operator(values: list[str], env: str) -> None:
    args = [str(helm()), "template", "kvpool", str(CHART), "--show-only",
            "templates/deployment.yaml", *(a for v in values for a in ("--set", v))]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (container,) = yaml.safe_load(proc.stdout)["spec"]["template"]["spec"]["containers"]
    plain = {e["name"]: e.get("value") for e in container["env"]}
    assert plain["KVPOOL_OPERATOR_ALLOW_HOST_ACCESS"] == env


@pytest.mark.parametrize(
    ("container", "volumes", "path", "words"),
    [
        (
            {
                "name": "worker",
                "readinessProbe": {"exec": {"command": ["x"]}, "httpGet": {"port": 80}},
            },
            [],
            "spec.containers[0].readinessProbe",
            "more than one handler (exec, httpGet)",
        ),
        (
            {"name": "worker", "lifecycle": {"preStop": {"sleep": {"seconds": 1}, "exec": {}}}},
            [],
            "spec.containers[0].lifecycle.preStop",
            "more than one handler (exec, sleep)",
        ),
        (
            {"name": "worker", "env": [{"name": "A", "value": "1", "valueFrom": {}}]},
            [],
            "spec.containers[0].env[0]",
            "more than one value (value, valueFrom)",
        ),
        (
            {
                "name": "w",
                "env": [{"name": "A", "valueFrom": {"fieldRef": {}, "secretKeyRef": {}}}],
            },
            [],
            "spec.containers[0].env[0].valueFrom",
            "more than one source (fieldRef, secretKeyRef)",
        ),
        (
            {"name": "worker"},
            [{"name": "model", "emptyDir": {}, "persistentVolumeClaim": {"claimName": "m"}}],
            "spec.volumes[0]",
            "more than one source (emptyDir, persistentVolumeClaim)",
        ),
    ],
)
def test_a_template_with_two_members_of_a_one_of_field_is_refused_naming_it(
    container: dict[str, Any], volumes: list[Any], path: str, words: str
) -> None:
    """What the API server refuses (a probe with two handlers, a volume with two sources,
    an env var with a value and a valueFrom) is refused by the check, not half-applied."""
    template = {"spec": {"containers": [container], "volumes": volumes}}
    found = problems("decode", template)
    assert f"spec.decode.podTemplate.{path}: {words}" in found, found


def test_a_null_member_or_an_empty_value_beside_the_one_given_is_accepted() -> None:
    """What the API server takes: a member given as null is no member, an env var's empty
    value beside its valueFrom is no value."""
    container = {
        "name": "worker",
        "readinessProbe": {"httpGet": None, "exec": {"command": ["check"]}},
        "env": [
            {"name": "A", "value": "", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
        ],
    }
    validate_pool("tiny", spec_with("decode", {"spec": {"containers": [container]}}))
