"""Rendering an InferencePool into its children: golden manifests and the rules behind them.

The golden files in ``tests/golden/operator/`` are what the operator applies for four pools
(aggregated and disaggregated, over kvpool and vLLM workers). A change of rendering shows
up as a diff of those files; regenerate them on purpose with
``KVPOOL_UPDATE_GOLDEN=1 pytest tests/test_operator_render.py`` and review the diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool.api import validate_pool
from kvpool.operator.render import (
    GROUP_LABEL,
    ROLE_LABEL,
    Images,
    Peers,
    merge_template,
    render,
    router_config,
    worker_selector,
)
from kvpool.operator.standins import restricted_problems

GOLDEN = Path(__file__).parent / "golden" / "operator"
NS = "llm"

GPU = {"limits": {"nvidia.com/gpu": 1, "memory": "64Gi"}, "requests": {"cpu": "8"}}
SCHEDULING = {
    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
}
SLO = {"quantile": 0.9, "ttftMilliseconds": 500, "itlMilliseconds": 50}

SPECS: dict[str, dict[str, Any]] = {
    "aggregated-kvpool": {
        "model": {
            "name": "llama-3.1-8b",
            "source": {"pvc": {"claimName": "models", "path": "llama-3.1-8b-instruct"}},
        },
        "engine": {"type": "kvpool"},  # GPUs and no engine named would be vLLM
        "decode": {"replicas": 2, "resources": GPU, **SCHEDULING},
        "router": {"replicas": 2, "scorers": {"prefix": 3, "in-flight": 1}},
        "slo": SLO,
    },
    "disaggregated-kvpool": {
        "model": {"name": "llama-3.1-8b", "source": {"hostPath": {"path": "/data/llama"}}},
        "engine": {"type": "kvpool"},
        "disaggregation": {"mode": "Disaggregated"},
        "prefill": {"replicas": 1, "resources": GPU, **SCHEDULING},
        "decode": {"replicas": 3, "resources": GPU, **SCHEDULING},
        "router": {
            "auth": {"secretName": "llama-tenants"},
            "flowControl": {"saturationTtftSeconds": 1.5, "queueMaxRequests": 2000},
            "clientLimits": {"maxConnectionsPerClient": 64},
        },
        "slo": SLO,
        "autoscaling": {
            "enabled": True,
            "prefill": {"minReplicas": 1, "maxReplicas": 4},
            "decode": {"minReplicas": 2, "maxReplicas": 8},
        },
    },
    "aggregated-vllm": {
        "model": {"name": "qwen2.5-7b", "source": {"image": {"path": "/models/qwen2.5-7b"}}},
        "engine": {"type": "vllm", "args": ["--gpu-memory-utilization", "0.9"], "hashSeed": "42"},
        "decode": {"replicas": 2, "resources": GPU},
        "networkPolicy": {
            "clientsFrom": [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
            ]
        },
    },
    "disaggregated-vllm": {
        "model": {
            "name": "llama-3.1-70b",
            "source": {"pvc": {"claimName": "models", "path": "llama-3.1-70b"}},
            "maxModelLen": 32768,
        },
        "engine": {"type": "vllm", "args": ["--tensor-parallel-size", "4"]},
        "disaggregation": {"mode": "Auto", "thresholdTokens": 1024},
        "prefill": {"replicas": 2, "resources": {"limits": {"nvidia.com/gpu": 4}}},
        "decode": {"replicas": 2, "resources": {"limits": {"nvidia.com/gpu": 4}}},
    },
}


# The operator's pods, as the chart's defaults describe them (its settings' pod_namespace and
# pod_selector): let through every pool's NetworkPolicies to scrape routers and workers.
OPERATOR = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kvpool-system"}},
    "podSelector": {
        "matchLabels": {
            "app.kubernetes.io/name": "kvpool",
            "app.kubernetes.io/instance": "kvpool",
            "app.kubernetes.io/component": "operator",
        }
    },
}
PEERS = Peers(operator=OPERATOR)


def rendered(case: str) -> list[dict[str, Any]]:
    return render(case, NS, validate_pool(case, SPECS[case]), Images(), PEERS)


def by_kind(children: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [c for c in children if c["kind"] == kind and c["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name} rendered {len(found)} times"
    return found[0]


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def arg(c: dict[str, Any], flag: str) -> str:
    args = c["args"]
    assert flag in args, f"{flag} not in {args}"
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("case", sorted(SPECS))
def test_rendered_children_match_the_golden_manifests(case: str) -> None:
    text = yaml.safe_dump_all(rendered(case), sort_keys=False, width=100)
    path = GOLDEN / f"{case}.yaml"
    if os.environ.get("KVPOOL_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"{path} is missing: run with KVPOOL_UPDATE_GOLDEN=1 to write it"
    assert text == path.read_text(), (
        f"rendering of {case} changed: review, then KVPOOL_UPDATE_GOLDEN=1 to accept"
    )


def test_an_aggregated_pool_has_one_worker_role_that_serves_whole_requests() -> None:
    children = rendered("aggregated-kvpool")
    kinds = sorted(f"{c['kind']}/{c['metadata']['name']}" for c in children)
    assert kinds == sorted(
        [
            "ServiceAccount/aggregated-kvpool-router",
            "Role/aggregated-kvpool-router",
            "RoleBinding/aggregated-kvpool-router",
            "ConfigMap/aggregated-kvpool-router",
            "Service/aggregated-kvpool-router",
            "Deployment/aggregated-kvpool-router",
            "PodDisruptionBudget/aggregated-kvpool-router",
            "Service/aggregated-kvpool-decode",
            "Deployment/aggregated-kvpool-decode",
            "PodDisruptionBudget/aggregated-kvpool-decode",
            "NetworkPolicy/aggregated-kvpool-workers",
            "NetworkPolicy/aggregated-kvpool-router",
            "Secret/aggregated-kvpool-pool-secret",
        ]
    )
    decode = by_kind(children, "Deployment", "aggregated-kvpool-decode")
    pod_labels = decode["spec"]["template"]["metadata"]["labels"]
    assert pod_labels[ROLE_LABEL] == "both"
    assert arg(container(decode), "--role") == "both"
    assert decode["spec"]["replicas"] == 2


def test_every_child_is_labelled_with_its_pool_and_namespaced() -> None:
    for child in rendered("disaggregated-vllm"):
        meta = child["metadata"]
        assert meta["namespace"] == NS
        assert meta["labels"]["kvpool.io/pool"] == "disaggregated-vllm"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "kvpool-operator"


def test_deployment_selectors_never_use_the_role_label_that_modes_change() -> None:
    # Deployment selectors are immutable: switching Auto -> Disaggregated changes decode
    # pods' kvpool.io/role from "both" to "decode", which must not need a new Deployment.
    auto = rendered("disaggregated-vllm")
    spec = dict(SPECS["disaggregated-vllm"], disaggregation={"mode": "Disaggregated"})
    disagg = render("disaggregated-vllm", NS, validate_pool("x", spec), Images())
    for name in ("disaggregated-vllm-decode", "disaggregated-vllm-prefill"):
        a, b = by_kind(auto, "Deployment", name), by_kind(disagg, "Deployment", name)
        assert a["spec"]["selector"] == b["spec"]["selector"]
        assert ROLE_LABEL not in a["spec"]["selector"]["matchLabels"]
        assert GROUP_LABEL in a["spec"]["selector"]["matchLabels"]
    roles = {
        name: by_kind(c, "Deployment", f"disaggregated-vllm-{name}")["spec"]["template"][
            "metadata"
        ]["labels"][ROLE_LABEL]
        for c, name in ((auto, "decode"), (auto, "prefill"))
    }
    assert roles == {"decode": "both", "prefill": "prefill"}
    decode = by_kind(disagg, "Deployment", "disaggregated-vllm-decode")
    assert decode["spec"]["template"]["metadata"]["labels"][ROLE_LABEL] == "decode"


def test_vllm_workers_get_kv_events_prefix_hashing_and_nixl_flags() -> None:
    children = rendered("disaggregated-vllm")
    for role in ("prefill", "decode"):
        c = container(by_kind(children, "Deployment", f"disaggregated-vllm-{role}"))
        assert c["command"] == ["vllm", "serve"]
        assert c["args"][0] == "/models/source/llama-3.1-70b"
        assert arg(c, "--prefix-caching-hash-algo") == "sha256_cbor"
        # cached prompt tokens in every answer's usage: the router's realised hit ratio
        assert "--enable-prompt-tokens-details" in c["args"]
        assert arg(c, "--block-size") == "16"
        assert arg(c, "--max-model-len") == "32768"
        events = json.loads(arg(c, "--kv-events-config"))
        assert events == {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "replay_endpoint": "tcp://*:5558",
            "topic": "",
        }
        transfer = json.loads(arg(c, "--kv-transfer-config"))
        assert transfer == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["PYTHONHASHSEED"] == "0"
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$(POD_IP)"
        assert c["args"][-2:] == ["--tensor-parallel-size", "4"]  # the user's args come last
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "4"


def test_a_vllm_pods_slot_count_is_on_the_pod_for_the_router() -> None:
    """vLLM publishes its --max-num-seqs nowhere: where the pool's args set it, the pod's
    annotation says it (each role its own), and the router's discovery reads it, so a first
    burst fills no worker past its slots."""
    from kvpool.router.state.discovery import endpoint_from_pod

    spec = json.loads(json.dumps(SPECS["disaggregated-vllm"]))
    spec["engine"]["args"] += ["--max-num-seqs", "64"]
    spec["prefill"]["args"] = ["--max-num-seqs=32"]  # the role's come last: they win
    children = render("p", NS, validate_pool("p", spec), Images(), PEERS)
    slots = {}
    for role in ("prefill", "decode"):
        template = by_kind(children, "Deployment", f"p-{role}")["spec"]["template"]
        slots[role] = template["metadata"]["annotations"].get("kvpool.io/max-num-seqs")
        pod = {
            "metadata": {"name": f"p-{role}-0", **template["metadata"]},
            "spec": template["spec"],
            "status": {
                "phase": "Running",
                "podIP": "10.0.0.9",
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }
        endpoint = endpoint_from_pod(pod, port="http")
        assert endpoint is not None and endpoint.max_num_seqs == int(slots[role])
    assert slots == {"prefill": "32", "decode": "64"}
    # where vLLM's own default stands (it depends on the GPU), the router learns it
    plain = rendered("disaggregated-vllm")
    template = by_kind(plain, "Deployment", "disaggregated-vllm-decode")["spec"]["template"]
    assert "kvpool.io/max-num-seqs" not in template["metadata"]["annotations"]


def test_a_data_parallel_vllms_ranks_publish_where_the_router_and_policy_expect() -> None:
    """vLLM --data-parallel-size N: rank r publishes at the events port + r and replays at
    the replay port + r. The pod names each rank's ports, the NetworkPolicy lets the router
    reach them all, and a spec whose ranges meet (the defaults 5557/5558 with two ranks: vLLM
    would fail to bind) is refused naming the fix."""
    spec = json.loads(json.dumps(SPECS["aggregated-vllm"]))
    spec["engine"]["args"] += ["--data-parallel-size", "2"]
    with pytest.raises(ValueError, match="set replayPort to 5559 or more"):
        validate_pool("p", spec)
    spec["engine"]["kvEvents"] = {"replayPort": 5567}
    children = render("p", NS, validate_pool("p", spec), Images(), PEERS)
    c = container(by_kind(children, "Deployment", "p-decode"))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert {k: v for k, v in ports.items() if k.startswith("kv-")} == {
        "kv-events": 5557,
        "kv-replay": 5567,
        "kv-events-dp1": 5558,
        "kv-replay-dp1": 5568,
    }
    policy = by_kind(children, "NetworkPolicy", "p-workers")
    ranges = [p for rule in policy["spec"]["ingress"] for p in rule.get("ports", [])]
    assert {"protocol": "TCP", "port": 5557, "endPort": 5558} in ranges
    assert {"protocol": "TCP", "port": 5567, "endPort": 5568} in ranges


def kubelet_refusals(template: dict[str, Any], root_images: set[str]) -> list[str]:
    """What the kubelet refuses to start in a pod template: a container whose image runs
    as root (``root_images``) where runAsNonRoot holds (the pod's or its own) and no
    non-zero runAsUser says who to run as instead ("container has runAsNonRoot and image
    will run as root")."""
    spec = template["spec"]
    pod = spec.get("securityContext") or {}
    out = []
    for c in spec.get("initContainers", []) + spec["containers"]:
        own = c.get("securityContext") or {}
        non_root = own.get("runAsNonRoot", pod.get("runAsNonRoot", False))
        user = own.get("runAsUser", pod.get("runAsUser"))
        if c["image"] in root_images and non_root and not user:
            out.append(c["name"])
    return out


def test_the_router_of_a_vllm_pool_whose_model_is_in_the_image_starts_as_non_root() -> None:
    """The router copies the tokenizer out of the worker image, vLLM's, which runs as root,
    in a pod that must run as non-root: the copy is given a user of its own."""
    children = rendered("aggregated-vllm")  # model.source.image
    template = by_kind(children, "Deployment", "aggregated-vllm-router")["spec"]["template"]
    names = [c["name"] for c in template["spec"]["initContainers"]]
    assert "copy-tokenizer" in names
    assert kubelet_refusals(template, {Images().vllm}) == []
    copy = template["spec"]["initContainers"][names.index("copy-tokenizer")]
    assert copy["securityContext"]["runAsUser"] == 65532
    assert copy["securityContext"]["runAsNonRoot"] is True


def test_an_aggregated_vllm_pool_has_no_kv_transfer() -> None:
    c = container(by_kind(rendered("aggregated-vllm"), "Deployment", "aggregated-vllm-decode"))
    assert "--kv-transfer-config" not in c["args"]
    assert {e["name"]: e.get("value") for e in c["env"]}["PYTHONHASHSEED"] == "42"


def test_router_is_told_the_vllm_event_ports_and_the_hash_seed() -> None:
    config = router_config("p", validate_pool("p", SPECS["aggregated-vllm"]))
    assert config["KVPOOL_ROUTER_WORKER_EVENTS_PORT"] == "5557"
    assert config["KVPOOL_ROUTER_WORKER_REPLAY_PORT"] == "5558"
    assert config["KVPOOL_ROUTER_HASH_SEED"] == "42"
    assert config["KVPOOL_ROUTER_DISCOVERY"] == "kubernetes"
    assert config["KVPOOL_ROUTER_SELECTOR"] == worker_selector("p")
    assert "KVPOOL_ROUTER_CHAT_TEMPLATE_CONTENT_FORMAT" not in config  # vLLM's auto
    given = json.loads(json.dumps(SPECS["aggregated-vllm"]))
    given["engine"]["args"] += ["--chat-template-content-format", "openai"]
    told = router_config("p", validate_pool("p", given))
    assert told["KVPOOL_ROUTER_CHAT_TEMPLATE_CONTENT_FORMAT"] == "openai"  # the router follows
    ours = router_config("p", validate_pool("p", SPECS["aggregated-kvpool"]))
    assert "KVPOOL_ROUTER_WORKER_EVENTS_PORT" not in ours  # kvpool workers say so themselves
    assert ours["KVPOOL_ROUTER_SCORER"] == "prefix=3 in-flight=1"


@pytest.mark.parametrize(
    ("name", "mode", "threshold"),
    [
        ("aggregated-kvpool", "Aggregated", "512"),
        ("disaggregated-kvpool", "Disaggregated", "512"),
        ("disaggregated-vllm", "Auto", "1024"),
    ],
)
def test_router_is_told_the_pools_disaggregation(name: str, mode: str, threshold: str) -> None:
    from kvpool.router.settings import ENV_PREFIX, RouterSettings

    config = router_config("p", validate_pool("p", SPECS[name]))
    assert config["KVPOOL_ROUTER_PD_MODE"] == mode
    assert config["KVPOOL_ROUTER_PD_THRESHOLD_TOKENS"] == threshold
    # Every variable names a router setting, and the split's values are ones it takes.
    fields = RouterSettings.model_fields
    assert {k.removeprefix(ENV_PREFIX).lower() for k in config} <= set(fields)
    assert mode in fields["pd_mode"].annotation.__args__


def test_kvpool_workers_publish_events_and_drain_before_they_stop() -> None:
    children = rendered("disaggregated-kvpool")
    c = container(by_kind(children, "Deployment", "disaggregated-kvpool-prefill"))
    assert c["command"] == ["kvpool", "worker", "serve"]
    assert arg(c, "--role") == "prefill"
    assert arg(c, "--kv-events-endpoint") == "tcp://*:5557"
    assert arg(c, "--kv-events-replay-endpoint") == "tcp://*:5558"
    assert arg(c, "--kv-pin-timeout-s") == "30"
    assert arg(c, "--model") == "/models/source"
    assert c["lifecycle"]["preStop"]["exec"]["command"][:3] == ["kvpool", "worker", "drain"]
    # draining ends before the kubelet's grace period does
    assert float(arg(c, "--drain-timeout-s")) < 120
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "tcpSocket" in c["livenessProbe"]  # a draining worker answers 503, and lives
    pod = by_kind(children, "Deployment", "disaggregated-kvpool-prefill")["spec"]["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert pod["spec"]["tolerations"] == SCHEDULING["tolerations"]
    assert pod["spec"]["volumes"] == [
        {"name": "model", "hostPath": {"path": "/data/llama", "type": "Directory"}},
        {"name": "tmp", "emptyDir": {}},
    ]


def test_our_images_run_restricted_and_vllm_runs_as_a_user_too() -> None:
    """Router and kvpool worker pods: non-root, read-only root, no capabilities, a writable
    /tmp for every container (init containers too). vLLM's image runs as root: its pods run
    it as uid 65532, restricted too (a namespace enforcing Pod Security "restricted" refused
    them), with HOME and the caches under /tmp."""
    spec = {**SPECS["aggregated-kvpool"], "model": {"name": "t", "source": {"builtin": {}}}}
    for children in (
        rendered("disaggregated-kvpool"),
        render("t", NS, validate_pool("t", spec), Images()),
    ):
        for dep in (c for c in children if c["kind"] == "Deployment"):
            pod = dep["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True, dep["metadata"]["name"]
            assert {"name": "tmp", "emptyDir": {}} in pod["volumes"]
            for c in pod["containers"] + pod.get("initContainers", []):
                sc = c["securityContext"]
                assert sc["readOnlyRootFilesystem"] is True, c["name"]
                assert sc["allowPrivilegeEscalation"] is False
                assert sc["capabilities"] == {"drop": ["ALL"]}
                assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"], c["name"]
    vllm = rendered("disaggregated-vllm")
    for dep in (
        c for c in vllm if c["kind"] == "Deployment" and "router" not in c["metadata"]["name"]
    ):
        pod = dep["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == 65532 and pod["securityContext"][
            "runAsNonRoot"] is True  # fmt: skip
        assert restricted_problems(pod) == [], dep["metadata"]["name"]
        for c in pod["containers"] + pod.get("initContainers", []):
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["HOME"] == "/tmp" and env["USER"], c["name"]
            assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"], c["name"]


def test_worker_image_follows_the_gpu_request_unless_the_spec_names_one() -> None:
    images = Images(worker="w:cuda", worker_cpu="w:cpu", vllm="v", router="r")
    gpu = render("p", NS, validate_pool("p", SPECS["aggregated-kvpool"]), images)
    assert container(by_kind(gpu, "Deployment", "p-decode"))["image"] == "w:cuda"
    cpu_spec = {"model": {"name": "tiny", "source": {"builtin": {}}}}
    cpu = render("p", NS, validate_pool("p", cpu_spec), images)
    assert container(by_kind(cpu, "Deployment", "p-decode"))["image"] == "w:cpu"
    named = dict(cpu_spec, engine={"image": "mine:1"})
    mine = render("p", NS, validate_pool("p", named), images)
    assert container(by_kind(mine, "Deployment", "p-decode"))["image"] == "mine:1"


def test_builtin_model_is_made_by_an_init_container_for_workers_and_router() -> None:
    spec = {"model": {"name": "tiny", "source": {"builtin": {"seed": 3}}}}
    children = render("t", NS, validate_pool("t", spec), Images())
    for name in ("t-decode", "t-router"):
        pod = by_kind(children, "Deployment", name)["spec"]["template"]["spec"]
        init = pod["initContainers"][0]
        assert init["command"] == ["kvpool", "worker", "make-tiny-model"]
        assert init["args"] == ["/models/source/tiny-llama", "--seed", "3"]
        assert {"name": "model", "emptyDir": {}} in pod["volumes"]
    config = by_kind(children, "ConfigMap", "t-router")["data"]
    assert config["KVPOOL_ROUTER_MODEL"] == "/models/source/tiny-llama"


def test_router_gets_the_tokenizer_of_a_model_baked_into_the_image_by_copy() -> None:
    children = rendered("aggregated-vllm")
    pod = by_kind(children, "Deployment", "aggregated-vllm-router")["spec"]["template"]["spec"]
    copy = pod["initContainers"][0]
    assert copy["image"] == Images().vllm
    assert "/models/qwen2.5-7b" in copy["command"][-1]
    assert "! -name '*.safetensors'" in copy["command"][-1]  # never the weights
    config = by_kind(children, "ConfigMap", "aggregated-vllm-router")["data"]
    assert config["KVPOOL_ROUTER_MODEL"] == "/models/tokenizer"


def test_router_may_list_and_watch_pods_in_its_namespace_and_nothing_more() -> None:
    children = rendered("aggregated-kvpool")
    role = by_kind(children, "Role", "aggregated-kvpool-router")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    binding = by_kind(children, "RoleBinding", "aggregated-kvpool-router")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "aggregated-kvpool-router", "namespace": NS}
    ]
    router = by_kind(children, "Deployment", "aggregated-kvpool-router")
    assert router["spec"]["template"]["spec"]["serviceAccountName"] == "aggregated-kvpool-router"


def test_a_router_config_change_rolls_the_router_pods() -> None:
    base = SPECS["aggregated-kvpool"]
    other = dict(base, router={"replicas": 2, "policy": "round-robin"})

    def config_hash(spec: dict[str, Any]) -> str:
        children = render("p", NS, validate_pool("p", spec), Images())
        template = by_kind(children, "Deployment", "p-router")["spec"]["template"]
        return template["metadata"]["annotations"]["kvpool.io/config-hash"]

    assert config_hash(base) != config_hash(other)
    assert config_hash(base) == config_hash(dict(base))


def test_pod_template_overrides_merge_containers_by_name_and_replace_other_lists() -> None:
    spec = dict(
        SPECS["aggregated-kvpool"],
        decode={
            "podTemplate": {
                "metadata": {"annotations": {"team": "search"}},
                "spec": {
                    "priorityClassName": "inference",
                    "containers": [
                        {"name": "worker", "env": [{"name": "EXTRA", "value": "1"}]},
                        {"name": "sidecar", "image": "busybox"},
                    ],
                },
            }
        },
    )
    children = render("p", NS, validate_pool("p", spec), Images())
    template = by_kind(children, "Deployment", "p-decode")["spec"]["template"]
    assert template["metadata"]["annotations"]["team"] == "search"
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert template["spec"]["priorityClassName"] == "inference"
    names = [c["name"] for c in template["spec"]["containers"]]
    assert names == ["worker", "sidecar"]
    worker = template["spec"]["containers"][0]
    assert worker["command"] == ["kvpool", "worker", "serve"]  # kept from the rendering
    assert [e["name"] for e in worker["env"]] == [
        "POD_IP",
        "HF_HUB_OFFLINE",
        "KVPOOL_POOL_SECRET",
        "EXTRA",
    ]


def test_merge_template_merges_named_lists_item_by_item() -> None:
    base = {"env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}], "args": ["x"]}
    over = {"env": [{"name": "B", "value": "3"}, {"name": "C", "value": "4"}], "args": ["y"]}
    assert merge_template(base, over) == {
        "env": [
            {"name": "A", "value": "1"},
            {"name": "B", "value": "3"},
            {"name": "C", "value": "4"},
        ],
        "args": ["y"],
    }


def test_an_autoscaled_role_starts_within_its_bounds() -> None:
    spec = {
        **SPECS["disaggregated-kvpool"],
        "decode": {"replicas": 1},
        "prefill": {"replicas": 9},
    }
    children = render("p", NS, validate_pool("p", spec), Images())
    assert by_kind(children, "Deployment", "p-decode")["spec"]["replicas"] == 2  # min 2
    assert by_kind(children, "Deployment", "p-prefill")["spec"]["replicas"] == 4  # max 4


def test_an_override_of_a_one_of_field_replaces_the_base_member_as_kubernetes_requires() -> None:
    """A probe has one handler, a volume one source, an env var a value or a valueFrom:
    merged key by key, an override naming another would leave both, and the API server
    refuses the Deployment ("may not specify more than 1 handler type")."""
    base = {
        "spec": {
            "containers": [
                {
                    "name": "worker",
                    "readinessProbe": {
                        "httpGet": {"path": "/health", "port": "http"},
                        "periodSeconds": 5,
                    },
                    "lifecycle": {"preStop": {"exec": {"command": ["drain"]}}},
                    "env": [
                        {"name": "A", "value": "1"},
                        {"name": "B", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    ],
                }
            ],
            "volumes": [{"name": "model", "emptyDir": {}}],
        }
    }
    over = {
        "spec": {
            "containers": [
                {
                    "name": "worker",
                    "readinessProbe": {"exec": {"command": ["check"]}},
                    "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
                    "env": [
                        {"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
                        {"name": "B", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
                    ],
                }
            ],
            "volumes": [{"name": "model", "persistentVolumeClaim": {"claimName": "models"}}],
        }
    }
    merged = merge_template(base, over)["spec"]
    c = merged["containers"][0]
    # the handler replaced, the probe's other settings kept
    assert c["readinessProbe"] == {"exec": {"command": ["check"]}, "periodSeconds": 5}
    assert c["lifecycle"]["preStop"] == {"sleep": {"seconds": 5}}
    assert c["env"] == [
        {"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
        {"name": "B", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
    ]
    assert merged["volumes"] == [
        {"name": "model", "persistentVolumeClaim": {"claimName": "models"}}
    ]
    # an override of another member's settings alone keeps the base's member
    again = merge_template(
        base,
        {
            "spec": {
                "containers": [
                    {"name": "worker", "readinessProbe": {"httpGet": {"path": "/ready"}}}
                ]
            }
        },
    )
    assert again["spec"]["containers"][0]["readinessProbe"]["httpGet"] == {
        "path": "/ready",
        "port": "http",
    }


@pytest.mark.parametrize("case", list(SPECS))
def test_rollouts_are_not_failed_before_the_weights_load_and_drains_are_not_blocked(
    case: str,
) -> None:
    """A large model loads for up to its startup window (30 min): a Deployment reported
    ProgressDeadlineExceeded before that (the default is 600 s) shows as failed in Argo CD,
    Flux and kube-state-metrics' alerts. A pod stuck loading must not block a node drain
    (the PDB's default policy waits for it to be ready), and a probe does not fail a worker
    for answering in more than a second."""
    children = rendered(case)
    for deployment in [c for c in children if c["kind"] == "Deployment"]:
        spec = deployment["spec"]
        main = spec["template"]["spec"]["containers"][0]
        startup = main["startupProbe"]
        window = startup["periodSeconds"] * startup["failureThreshold"]
        assert spec["progressDeadlineSeconds"] > window, deployment["metadata"]["name"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert main[probe]["timeoutSeconds"] >= 5
    budgets = [c for c in children if c["kind"] == "PodDisruptionBudget"]
    assert budgets and all(
        b["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow" for b in budgets
    )


def test_router_replicas_spread_over_nodes_and_zones() -> None:
    """Two router replicas on one node are one node's loss away from none."""
    children = rendered("aggregated-kvpool")  # router.replicas: 2
    pod = by_kind(children, "Deployment", "aggregated-kvpool-router")["spec"]["template"]
    spread = pod["spec"]["topologySpreadConstraints"]
    assert {c["topologyKey"] for c in spread} == {
        "kubernetes.io/hostname",
        "topology.kubernetes.io/zone",
    }
    labels = pod["metadata"]["labels"]
    for c in spread:  # it selects the router's own pods, and never leaves one unscheduled
        assert c["whenUnsatisfiable"] == "ScheduleAnyway"
        assert c["labelSelector"]["matchLabels"].items() <= labels.items()
    # one replica renders the same: scaling the router must not roll it
    one = rendered("aggregated-vllm")
    pod = by_kind(one, "Deployment", "aggregated-vllm-router")["spec"]["template"]
    assert [c["topologyKey"] for c in pod["spec"]["topologySpreadConstraints"]] == [
        "kubernetes.io/hostname",
        "topology.kubernetes.io/zone",
    ]


def _strategy(children: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return by_kind(children, "Deployment", name)["spec"]["strategy"]["rollingUpdate"]


def test_a_gpu_role_rolls_without_surge_so_the_rollout_ends_on_a_full_cluster() -> None:
    """A surge pod asks for a GPU a full cluster does not have: it stays Pending, and the
    roll-out never ends. Unset, a GPU role replaces one pod at a time; a CPU role surges."""
    gpu = SPECS["aggregated-kvpool"]
    assert "nvidia.com/gpu" in str(gpu["decode"]["resources"])
    children = render("p", NS, validate_pool("p", gpu), Images())
    assert _strategy(children, "p-decode") == {"maxSurge": 0, "maxUnavailable": 1}
    assert _strategy(children, "p-router") == {"maxSurge": 1, "maxUnavailable": 0}
    cpu = {**gpu, "decode": {"replicas": 2}}
    children = render("p", NS, validate_pool("p", cpu), Images())
    assert _strategy(children, "p-decode") == {"maxSurge": 1, "maxUnavailable": 0}
    # what the spec says stands; a surge asked for takes nothing away
    mine = {**gpu, "decode": {**gpu["decode"], "rollout": {"maxSurge": 1}}}
    children = render("p", NS, validate_pool("p", mine), Images())
    assert _strategy(children, "p-decode") == {"maxSurge": 1, "maxUnavailable": 0}
    # none unavailable asked of a GPU role: it surges (0 and 0, the API server refuses)
    mine = {**gpu, "decode": {**gpu["decode"], "rollout": {"maxUnavailable": 0}}}
    children = render("p", NS, validate_pool("p", mine), Images())
    assert _strategy(children, "p-decode") == {"maxSurge": 1, "maxUnavailable": 0}
    mine = {**gpu, "decode": {**gpu["decode"], "rollout": {"maxSurge": "0%"}}}
    children = render("p", NS, validate_pool("p", mine), Images())
    assert _strategy(children, "p-decode") == {"maxSurge": "0%", "maxUnavailable": 1}


def test_the_progress_deadline_follows_a_longer_startup_window() -> None:
    """A podTemplate that gives the weights two hours to load: a deadline of 30 min plus
    the default window would mark every roll-out ProgressDeadlineExceeded meanwhile."""
    base = SPECS["aggregated-kvpool"]
    children = render("p", NS, validate_pool("p", base), Images())
    default = by_kind(children, "Deployment", "p-decode")["spec"]["progressDeadlineSeconds"]
    assert default == 180 * 10 + 1800
    probe = {"startupProbe": {"periodSeconds": 10, "failureThreshold": 720}}
    template = {"spec": {"containers": [{"name": "worker", **probe}]}}
    slow = {**base, "decode": {**base["decode"], "podTemplate": template}}
    children = render("p", NS, validate_pool("p", slow), Images())
    dep = by_kind(children, "Deployment", "p-decode")
    assert dep["spec"]["progressDeadlineSeconds"] == 7200 + 1800
