"""A pool in a real cluster: what an operator upgrade, a router change and an external
autoscaler (HPA, KEDA) do to its children.

* Upgrading the operator rolls the router (its image moves with the operator) and no worker:
  pod templates carry no version label, and default worker images stay what runs
  (``keep_default_images``).
* The router's pod template depends on the router's inputs only, so a worker-only change
  leaves the router pods alone.
* ``autoscaling.mode: External`` and ``autoscaling.externalRoles`` leave a role's replicas
  to an HPA or KEDA: the operator renders its Deployment without ``replicas``.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from test_api import api_server_failures, operator_failures

from kvpool.api import validate_pool
from kvpool.api.manifests import load_pools
from kvpool.operator import render as render_module
from kvpool.operator.render import (
    DEFAULT_IMAGE,
    DEFAULT_IMAGES,
    GROUP_LABEL,
    VERSION_LABEL,
    Images,
    keep_default_images,
    render,
)

NS = "llm"
KUBERNETES = "1.31.0"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "external-autoscaling"

GPU = {"limits": {"nvidia.com/gpu": 1, "memory": "64Gi"}}
SLO = {"ttftMilliseconds": 500}
BOUNDS = {"minReplicas": 1, "maxReplicas": 4}

# Pools covering every image the operator picks: the CUDA and CPU worker images, vLLM's, the
# built-in model's maker, and the router's copy of the tokenizer from a model in the image.
POOLS: dict[str, dict[str, Any]] = {
    "kvpool-gpu-disaggregated": {
        "model": {"name": "m", "source": {"pvc": {"claimName": "models", "path": "m"}}},
        "engine": {"type": "kvpool"},  # named: GPUs and no engine named run vLLM
        "disaggregation": {"mode": "Disaggregated"},
        "prefill": {"replicas": 1, "resources": GPU},
        "decode": {"replicas": 2, "resources": GPU},
        "slo": SLO,
        "autoscaling": {"enabled": True, "prefill": BOUNDS, "decode": BOUNDS},
    },
    "kvpool-cpu-builtin": {
        "model": {"name": "tiny", "source": {"builtin": {}}},
        "decode": {"replicas": 2},
    },
    "kvpool-gpu-builtin": {
        "model": {"name": "tiny", "source": {"builtin": {}}},
        "engine": {"type": "kvpool"},
        "decode": {"replicas": 1, "resources": GPU},
    },
    "vllm-model-in-image": {
        "model": {"name": "q", "source": {"image": {"path": "/models/q"}}},
        "engine": {"type": "vllm"},
        "decode": {"replicas": 2, "resources": GPU},
    },
    "kvpool-cpu-model-in-image": {
        "model": {"name": "q", "source": {"image": {"path": "/models/q"}}},
        "decode": {"replicas": 1},
    },
}


def children_of(
    spec: dict[str, Any], version: str, monkeypatch: pytest.MonkeyPatch, pool: str = "p"
) -> list[dict[str, Any]]:
    """What the operator of kvpool ``version`` renders for the pool, with its default images
    (the settings' defaults are that version's)."""
    monkeypatch.setattr(render_module, "__version__", version)
    return render(pool, NS, validate_pool(pool, spec), Images.of_version(version))


def deployments(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Deployments by role (prefill, decode) or "router"."""
    return {
        c["metadata"]["labels"].get(GROUP_LABEL, "router"): c
        for c in children
        if c["kind"] == "Deployment"
    }


def dump(obj: Any) -> str:
    """Byte for byte, in the order the API server gets the keys."""
    return json.dumps(obj, sort_keys=False)


def images(deployment: dict[str, Any]) -> dict[str, str]:
    pod = deployment["spec"]["template"]["spec"]
    return {c["name"]: c["image"] for c in pod["containers"] + pod.get("initContainers", [])}


# --- operator upgrades ----------------------------------------------------------------------


def test_images_of_the_running_version_are_the_operators_defaults() -> None:
    assert Images.of_version(render_module.__version__) == Images()


def test_pod_templates_carry_no_operator_version_but_the_objects_do() -> None:
    children = render("p", NS, validate_pool("p", POOLS["kvpool-gpu-disaggregated"]))
    for role, deployment in deployments(children).items():
        assert VERSION_LABEL in deployment["metadata"]["labels"], role
        assert VERSION_LABEL not in deployment["spec"]["template"]["metadata"]["labels"], role


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_an_operator_upgrade_leaves_worker_pod_templates_byte_identical(
    pool: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = POOLS[pool]
    old = children_of(spec, "0.1.0", monkeypatch)  # what runs: the live objects
    new = children_of(spec, "0.2.0", monkeypatch)
    kept = keep_default_images(new, old)

    before, after, raw = deployments(old), deployments(kept), deployments(new)
    for role in validate_pool("p", spec).roles():
        assert after[role]["metadata"]["annotations"][DEFAULT_IMAGE]
        assert dump(after[role]["spec"]) == dump(before[role]["spec"]), role
        assert after[role]["metadata"]["labels"][VERSION_LABEL] == "0.2.0"
    # Without keeping them, only the default images would move (so the check above bites).
    decode_images = images(raw["decode"])
    if not decode_images["worker"].startswith("vllm/"):
        assert decode_images != images(before["decode"])
    # The router moves with the operator; a tokenizer copied out of the worker image comes
    # from the image the workers keep running.
    assert images(after["router"])["router"] == Images.of_version("0.2.0").router
    if "copy-tokenizer" in images(after["router"]):
        kept_worker = images(after["decode"])["worker"]
        assert images(after["router"])["copy-tokenizer"] == kept_worker
        assert images(raw["router"])["copy-tokenizer"] == images(raw["decode"])["worker"]


def test_a_new_default_image_key_takes_the_new_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU added: the CUDA image of the new operator, not the CPU image that ran."""
    cpu = POOLS["kvpool-cpu-model-in-image"]
    gpu = {**cpu, "engine": {"type": "kvpool"}, "decode": {"replicas": 1, "resources": GPU}}
    old = children_of(cpu, "0.1.0", monkeypatch)
    kept = deployments(keep_default_images(children_of(gpu, "0.2.0", monkeypatch), old))
    assert deployments(old)["decode"]["metadata"]["annotations"][DEFAULT_IMAGE] == "worker-cpu"
    assert kept["decode"]["metadata"]["annotations"][DEFAULT_IMAGE] == "worker"
    new_worker = Images.of_version("0.2.0").worker
    assert images(kept["decode"])["worker"] == new_worker
    assert images(kept["router"])["copy-tokenizer"] == new_worker


def test_an_engine_type_switch_takes_the_new_default(monkeypatch: pytest.MonkeyPatch) -> None:
    kvpool = POOLS["kvpool-gpu-builtin"]
    old = children_of(kvpool, "0.1.0", monkeypatch)
    vllm = {**kvpool, "engine": {"type": "vllm"}}
    kept = deployments(keep_default_images(children_of(vllm, "0.2.0", monkeypatch), old))
    assert images(kept["decode"]) == {
        "worker": Images().vllm,
        "make-model": Images.of_version("0.2.0").worker_cpu,
    }


def test_a_pool_moves_to_the_new_defaults_when_the_annotation_is_removed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = POOLS["kvpool-gpu-disaggregated"]
    old = children_of(spec, "0.1.0", monkeypatch)
    for live in old:
        live["metadata"].get("annotations", {}).pop(DEFAULT_IMAGE, None)
    new = children_of(spec, "0.2.0", monkeypatch)
    assert keep_default_images(new, old) == new


def test_an_image_edited_by_hand_is_put_back_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = POOLS["kvpool-gpu-builtin"]
    old = children_of(spec, "0.1.0", monkeypatch)
    live = deployments(old)["decode"]
    live["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:1"
    kept = deployments(keep_default_images(children_of(spec, "0.2.0", monkeypatch), old))
    assert images(kept["decode"]) == {
        "worker": Images.of_version("0.2.0").worker,  # put back, to the new default
        "make-model": Images.of_version("0.1.0").worker_cpu,  # untouched: kept
    }
    recorded = json.loads(kept["decode"]["metadata"]["annotations"][DEFAULT_IMAGES])
    assert recorded == images(kept["decode"])  # what the next upgrade will keep


def test_an_image_named_by_the_spec_is_applied_and_carries_no_annotation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = {**POOLS["kvpool-cpu-builtin"], "engine": {"image": "registry.local/worker:7"}}
    old = children_of(POOLS["kvpool-cpu-builtin"], "0.1.0", monkeypatch)
    new = children_of(spec, "0.2.0", monkeypatch)
    decode = deployments(new)["decode"]
    assert DEFAULT_IMAGE not in decode["metadata"].get("annotations", {})
    assert keep_default_images(new, old) == new
    assert images(decode)["worker"] == "registry.local/worker:7"


def test_a_pod_template_naming_an_image_of_ours_drops_the_annotation() -> None:
    spec = copy.deepcopy(POOLS["kvpool-cpu-builtin"])
    spec["decode"]["podTemplate"] = {
        "spec": {"initContainers": [{"name": "make-model", "image": "mirror.local/w:1"}]}
    }
    decode = deployments(render("p", NS, validate_pool("p", spec)))["decode"]
    assert DEFAULT_IMAGE not in decode["metadata"].get("annotations", {})
    sidecar = copy.deepcopy(POOLS["kvpool-cpu-builtin"])
    sidecar["decode"]["podTemplate"] = {
        "spec": {"containers": [{"name": "log-shipper", "image": "fluent-bit:3"}]}
    }
    decode = deployments(render("p", NS, validate_pool("p", sidecar)))["decode"]
    assert decode["metadata"]["annotations"][DEFAULT_IMAGE] == "worker-cpu"


def test_keep_default_images_takes_the_live_objects_as_the_handlers_read_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A list parallel to the children (None: not made yet), or a mapping by (kind, name);
    the children passed in are left as they are."""
    spec = POOLS["kvpool-cpu-builtin"]
    old = children_of(spec, "0.1.0", monkeypatch)
    new = children_of(spec, "0.2.0", monkeypatch)
    untouched = copy.deepcopy(new)
    by_name = {(o["kind"], o["metadata"]["name"]): o for o in old}
    parallel = [by_name.get((c["kind"], c["metadata"]["name"])) for c in new]
    assert keep_default_images(new, parallel) == keep_default_images(new, by_name)
    assert new == untouched
    assert keep_default_images(new, [None] * len(new)) == new  # a new pool: the new defaults
    kept = deployments(keep_default_images(new, parallel))["decode"]
    assert images(kept) == images(deployments(old)["decode"])


# --- the router rolls on its own settings only ----------------------------------------------

ROUTER_BASES = {
    "pvc": POOLS["kvpool-gpu-disaggregated"],
    "model in the image": {
        **POOLS["vllm-model-in-image"],
        "disaggregation": {"mode": "Auto"},
        "prefill": {"replicas": 1, "resources": GPU},
    },
}

WORKER_ONLY: dict[str, Any] = {
    "decode replicas": lambda s: s["decode"].update(replicas=7),
    "prefill replicas": lambda s: s["prefill"].update(replicas=3),
    "engine args": lambda s: s.setdefault("engine", {}).update(args=["--max-num-seqs", "64"]),
    "engine env": lambda s: s.setdefault("engine", {}).update(env=[{"name": "X", "value": "1"}]),
    "engine image pull secrets": lambda s: s.setdefault("engine", {}).update(
        imagePullSecrets=[{"name": "regcred"}]
    ),
    "decode resources (same GPU count)": lambda s: s["decode"].update(
        resources={"limits": {"nvidia.com/gpu": 1, "memory": "80Gi"}, "requests": {"cpu": "8"}}
    ),
    "decode podTemplate": lambda s: s["decode"].update(
        podTemplate={"spec": {"priorityClassName": "gpu-high"}}
    ),
    "decode scheduling": lambda s: s["decode"].update(
        nodeSelector={"gpu": "h100"},
        tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
    ),
    "decode rollout and grace": lambda s: s["decode"].update(
        rollout={"maxSurge": 0, "maxUnavailable": 1}, terminationGracePeriodSeconds=30
    ),
    "autoscaling": lambda s: s.update(
        slo={"itlMilliseconds": 20},
        autoscaling={"enabled": True, "mode": "Advisory", "prefill": BOUNDS, "decode": BOUNDS},
    ),
    "external autoscaling": lambda s: s.update(autoscaling={"mode": "External"}),
}

ROUTER_CHANGES: dict[str, Any] = {
    "policy": lambda s: s.setdefault("router", {}).update(policy="least-loaded"),
    "scorers": lambda s: s.setdefault("router", {}).update(scorers={"prefix": 2}),
    "settings": lambda s: s.setdefault("router", {}).update(settings={"maxConcurrency": "64"}),
    "image": lambda s: s.setdefault("router", {}).update(image="mirror.local/router:1"),
    "resources": lambda s: s.setdefault("router", {}).update(resources={"requests": {"cpu": "2"}}),
    "podTemplate": lambda s: s.setdefault("router", {}).update(
        podTemplate={"metadata": {"annotations": {"team": "edge"}}}
    ),
    "affinity": lambda s: s.setdefault("router", {}).update(
        affinity={"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}
    ),
}


def router_deployment_of(spec: dict[str, Any]) -> dict[str, Any]:
    return deployments(render("p", NS, validate_pool("p", spec)))["router"]


@pytest.mark.parametrize("base", sorted(ROUTER_BASES))
@pytest.mark.parametrize("change", sorted(WORKER_ONLY))
def test_a_worker_only_change_leaves_the_router_deployment_byte_identical(
    base: str, change: str
) -> None:
    spec = ROUTER_BASES[base]
    changed = copy.deepcopy(spec)
    WORKER_ONLY[change](changed)
    assert validate_pool("p", changed) != validate_pool("p", spec)
    assert dump(router_deployment_of(changed)) == dump(router_deployment_of(spec))


@pytest.mark.parametrize("change", sorted(ROUTER_CHANGES))
def test_a_router_change_changes_its_pod_template(change: str) -> None:
    spec = POOLS["kvpool-gpu-disaggregated"]
    changed = copy.deepcopy(spec)
    ROUTER_CHANGES[change](changed)
    before = router_deployment_of(spec)["spec"]["template"]
    assert dump(router_deployment_of(changed)["spec"]["template"]) != dump(before)


def test_router_replicas_change_the_deployment_not_the_pod_template() -> None:
    spec = POOLS["kvpool-gpu-disaggregated"]
    more = {**spec, "router": {"replicas": 3}}
    assert router_deployment_of(more)["spec"]["replicas"] == 3
    assert dump(router_deployment_of(more)["spec"]["template"]) == dump(
        router_deployment_of(spec)["spec"]["template"]
    )


# --- router and worker pod settings ---------------------------------------------------------


def test_router_pod_template_affinity_and_pull_secrets_are_rendered() -> None:
    affinity = {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": {"kvpool.io/pool": "p"}},
                    },
                }
            ]
        }
    }
    spec = {
        **POOLS["kvpool-gpu-disaggregated"],
        "engine": {"type": "kvpool", "imagePullSecrets": [{"name": "gpu-registry"}]},
        "router": {
            "affinity": affinity,
            "imagePullSecrets": [{"name": "regcred"}],
            "podTemplate": {
                "metadata": {"labels": {"team": "edge"}},
                "spec": {
                    "priorityClassName": "serving",
                    "containers": [{"name": "router", "env": [{"name": "X", "value": "1"}]}],
                },
            },
        },
    }
    children = render("p", NS, validate_pool("p", spec))
    found = deployments(children)
    router = found["router"]["spec"]["template"]
    assert router["spec"]["affinity"] == affinity
    assert router["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert router["spec"]["priorityClassName"] == "serving"
    assert router["metadata"]["labels"]["team"] == "edge"
    assert router["metadata"]["labels"]["kvpool.io/pool"] == "p"  # the selector's, kept
    [c] = router["spec"]["containers"]
    assert c["command"] == ["kvpool", "router", "serve"]
    assert [e["name"] for e in c["env"]] == [
        "KVPOOL_ROUTER_NAMESPACE",
        "KVPOOL_ROUTER_POOL_SECRET",
        "X",
    ]
    for role in ("prefill", "decode"):
        pod = found[role]["spec"]["template"]["spec"]
        assert pod["imagePullSecrets"] == [{"name": "gpu-registry"}], role
    for child in children:
        kubernetes_validate.validate(child, KUBERNETES, strict=True)


def test_pull_secrets_must_be_secret_names() -> None:
    spec = {**POOLS["kvpool-cpu-builtin"], "router": {"imagePullSecrets": [{"name": "Bad_Name"}]}}
    with pytest.raises(ValueError, match=r"spec\.router\.imagePullSecrets\.0\.name"):
        validate_pool("p", spec)


# --- external autoscaling -------------------------------------------------------------------

AUTO = {
    "model": {"name": "m", "source": {"builtin": {}}},
    "disaggregation": {"mode": "Auto"},
    "prefill": {"replicas": 2},
    "decode": {"replicas": 3},
}


@pytest.mark.parametrize(
    "autoscaling, owners",
    [
        ({}, {"prefill": "spec", "decode": "spec"}),
        ({"mode": "External"}, {"prefill": "external", "decode": "external"}),
        ({"enabled": True, "mode": "External"}, {"prefill": "external", "decode": "external"}),
        ({"externalRoles": ["decode"]}, {"prefill": "spec", "decode": "external"}),
        (
            {"enabled": True, "prefill": BOUNDS, "decode": BOUNDS, "externalRoles": ["decode"]},
            {"prefill": "autoscaler", "decode": "external"},
        ),
        (
            {"enabled": True, "prefill": BOUNDS, "externalRoles": ["decode"]},
            {"prefill": "autoscaler", "decode": "external"},
        ),
        (
            {"enabled": True, "mode": "Advisory", "prefill": BOUNDS, "decode": BOUNDS},
            {"prefill": "spec", "decode": "spec"},
        ),
        (
            {"enabled": True, "decode": BOUNDS, "externalRoles": ["prefill"]},
            {"prefill": "external", "decode": "autoscaler"},
        ),
    ],
    ids=[
        "off",
        "External",
        "External, enabled",
        "decode external, autoscaler off",
        "decode external, prefill Active",
        "decode external needs no decode bounds",
        "Advisory",
        "prefill external needs no prefill bounds",
    ],
)
def test_the_replicas_owner_of_each_role(
    autoscaling: dict[str, Any], owners: dict[str, str]
) -> None:
    spec = {**AUTO, "autoscaling": autoscaling, "slo": SLO}
    pool = validate_pool("p", spec)
    assert api_server_failures("p", spec) == set()  # the CRD's CEL rules agree
    assert {role: pool.replicas_owner(role) for role in owners} == owners
    for role, owner in owners.items():
        assert pool.autoscaled(role) == (owner == "autoscaler"), role
    found = deployments(render("p", NS, pool))
    for role, owner in owners.items():
        if owner == "external":
            assert "replicas" not in found[role]["spec"], role
        else:  # the spec's count, within the bounds (which hold it) for the autoscaler
            assert found[role]["spec"]["replicas"] == AUTO[role]["replicas"], role


def test_external_needs_neither_enabled_nor_an_slo() -> None:
    spec = {**AUTO, "autoscaling": {"mode": "External"}}
    assert validate_pool("p", spec).replicas_owner("decode") == "external"
    assert api_server_failures("p", spec) == operator_failures("p", spec) == set()


@pytest.mark.parametrize(
    "autoscaling, fragment",
    [
        ({"enabled": True, "prefill": BOUNDS, "externalRoles": ["prefill"]}, "autoscaling.decode"),
        ({"enabled": True, "decode": BOUNDS, "externalRoles": ["decode"]}, "autoscaling.prefill"),
        ({"enabled": True, "mode": "Advisory", "prefill": BOUNDS}, "autoscaling.decode"),
    ],
)
def test_bounds_are_still_required_for_roles_the_autoscaler_sizes(
    autoscaling: dict[str, Any], fragment: str
) -> None:
    spec = {**AUTO, "autoscaling": autoscaling, "slo": SLO}
    cel = api_server_failures("p", spec)
    assert cel and all(fragment in message for _, message in cel)
    assert operator_failures("p", spec) == cel


def test_an_unknown_external_role_is_refused() -> None:
    with pytest.raises(ValueError, match=r"spec\.autoscaling\.externalRoles\.0"):
        validate_pool("p", {**AUTO, "autoscaling": {"externalRoles": ["router"]}})


def test_an_external_role_keeps_the_replicas_that_run_after_an_upgrade(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rendered without replicas, so applying it never takes a count back from the HPA."""
    spec = {**POOLS["kvpool-gpu-disaggregated"], "autoscaling": {"externalRoles": ["decode"]}}
    old = children_of(spec, "0.1.0", monkeypatch)
    new = keep_default_images(children_of(spec, "0.2.0", monkeypatch), old)
    decode = deployments(new)["decode"]
    assert "replicas" not in decode["spec"]
    assert dump(decode["spec"]) == dump(deployments(old)["decode"]["spec"])


# --- the examples ---------------------------------------------------------------------------


def example(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLE / name).read_text()) if d]


def the_example_pool() -> tuple[str, Any, list[dict[str, Any]]]:
    [(pool, spec)] = load_pools(EXAMPLE / "pool.yaml")
    return pool, spec, render(pool, "default", spec)


def router_series() -> set[str]:
    """The series names the router exports (gauges and histograms; counters with _total)."""
    from kvpool.router.admin.metrics import RouterMetrics

    text = RouterMetrics(lambda: [], lambda worker: 0).render().decode()
    return set(re.findall(r"^# TYPE (\S+) ", text, flags=re.MULTILINE))


def test_the_example_pool_is_external_and_valid() -> None:
    [doc] = example("pool.yaml")
    spec = validate_pool(doc["metadata"]["name"], doc["spec"])
    assert api_server_failures(doc["metadata"]["name"], doc["spec"]) == set()
    assert spec.autoscaling.mode == "External" and not spec.autoscaling.enabled
    _, _, children = the_example_pool()
    for role in spec.roles():
        assert spec.replicas_owner(role) == "external"
        assert "replicas" not in deployments(children)[role]["spec"]
    for child in children:
        kubernetes_validate.validate(child, KUBERNETES, strict=True)


@pytest.mark.parametrize("name", ["hpa.yaml", "keda-scaledobject.yaml"])
def test_the_scalers_target_the_decode_deployment_the_operator_renders(name: str) -> None:
    pool, _, children = the_example_pool()
    decode = deployments(children)["decode"]
    [scaler] = example(name)
    target = scaler["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        decode["apiVersion"],
        decode["kind"],
        decode["metadata"]["name"],
    )
    assert decode["metadata"]["name"] == f"{pool}-decode"


def test_the_hpa_is_a_valid_kubernetes_object_on_a_router_series() -> None:
    [hpa] = example("hpa.yaml")
    kubernetes_validate.validate(hpa, KUBERNETES, strict=True)
    names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert names and names <= router_series()
    adapter_rule = (EXAMPLE / "hpa.yaml").read_text()  # the prometheus-adapter rule, comments
    assert all(f"seriesQuery: '{n}{{" in adapter_rule for n in names)


def test_the_keda_queries_read_router_series_of_the_decode_pods() -> None:
    pool, _, _ = the_example_pool()
    [scaled] = example("keda-scaledobject.yaml")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1" and scaled["kind"] == "ScaledObject"
    spec = scaled["spec"]
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    triggers = spec["triggers"]
    assert triggers and all(t["type"] == "prometheus" for t in triggers)
    series = router_series()
    for trigger in triggers:
        query = trigger["metadata"]["query"]
        float(trigger["metadata"]["threshold"])
        names = set(re.findall(r"\bkvpool_[a-z_]+", query))
        assert names and names <= series, query
        [worker] = re.findall(r'worker=~"([^"]+)"', query)
        assert re.fullmatch(worker, f"{pool}-decode-7d4b9c8f6-x2x9k")  # a decode pod's name
        assert not re.fullmatch(worker, f"{pool}-prefill-7d4b9c8f6-x2x9k")
        assert not re.fullmatch(worker, f"{pool}-router-7d4b9c8f6-x2x9k")
    # The HPA KEDA makes for it must be valid too: its behavior is an HPA's.
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": f"keda-hpa-{scaled['metadata']['name']}"},
        "spec": {
            "scaleTargetRef": spec["scaleTargetRef"],
            "maxReplicas": spec["maxReplicaCount"],
            "behavior": behavior,
        },
    }
    kubernetes_validate.validate(hpa, KUBERNETES, strict=True)


# --- the CRD upgrade: pools stored under the previous CRD, read with the new one ---------------

PREVIOUS_CRD = Path(__file__).parent / "data" / "crd-upgrade" / "inferencepool-before-issue-42.yaml"


def test_pools_stored_under_the_previous_crd_pass_the_new_one() -> None:
    """The README's upgrade: apply the new CRD over the old one, then the operator. Every
    example pool, as the old CRD's API server stored it (its defaults written in), passes the
    new CRD's CEL rules and the operator's checks. A pool that set no ``rollout`` gets the
    new default (no surge for a GPU role); one that set part of it had the old defaults
    written beside it (``maxSurge: 1``), and keeps them."""
    from test_api import SCHEMA, cel_failures, pool_object, with_defaults

    from kvpool.api.manifests import load_documents

    previous = yaml.safe_load(PREVIOUS_CRD.read_text())
    old_schema = previous["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    examples = Path(__file__).resolve().parents[1] / "examples"
    pools = [d for p in sorted(examples.rglob("*.yaml")) for d in load_documents(p)
             if d.get("kind") == "InferencePool"]  # fmt: skip
    assert len(pools) >= 6
    partial = copy.deepcopy(pools[0])
    partial["metadata"]["name"] = "partial"
    partial["spec"]["decode"]["rollout"] = {"maxUnavailable": 1}
    for doc in [*pools, partial]:
        name = doc["metadata"]["name"]
        stored = with_defaults(pool_object(name, doc["spec"]), old_schema)
        assert cel_failures(stored, SCHEMA) == [], name
        spec = validate_pool(name, stored["spec"])
        deployment = next(c for c in render(name, "llm", spec) if c["kind"] == "Deployment"
                          and c["metadata"]["name"] == f"{name}-decode")  # fmt: skip
        strategy = deployment["spec"]["strategy"]["rollingUpdate"]
        gpu = "decode" in spec.gpus()
        if name == "partial":
            assert stored["spec"]["decode"]["rollout"] == {"maxSurge": 1, "maxUnavailable": 1}
            assert strategy == {"maxSurge": 1, "maxUnavailable": 1}
        else:
            assert "rollout" not in stored["spec"]["decode"], name
            assert strategy == ({"maxSurge": 0, "maxUnavailable": 1} if gpu else
                                {"maxSurge": 1, "maxUnavailable": 0}), name  # fmt: skip
