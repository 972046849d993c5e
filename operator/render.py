"""From an InferencePool spec to the Kubernetes objects that run it: pure functions.

``render`` returns every child of a pool, in the order they are applied. Nothing here
talks to an API server: the kopf handlers apply what this returns (and adopt it), the
tests compare it with golden manifests, and ``kvpool operator render`` prints it.

Names: ``<pool>-prefill`` and ``<pool>-decode`` (worker Deployments, headless Services and
PodDisruptionBudgets), ``<pool>-router`` (the router's Deployment, Service, ConfigMap,
ServiceAccount, Role, RoleBinding, PodDisruptionBudget and NetworkPolicy),
``<pool>-workers`` (the workers' NetworkPolicy) and ``<pool>-pool-secret`` (the Secret with
the key the router and kvpool workers share, made once by the operator: see
:func:`pool_secret`).

Labels: every child carries the standard ``app.kubernetes.io/*`` labels and
``kvpool.io/pool``; worker pods carry ``kvpool.io/role`` (prefill, decode or both), which the
router reads. A Deployment's selector is immutable, so it selects on ``kvpool.io/group``
(the Deployment's role), never on ``kvpool.io/role``, which changes with the
disaggregation mode.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpool import __version__
from kvpool.api.inferencepool import (
    CLIENT_LIMIT_SETTINGS,
    FLOW_CONTROL_SETTINGS,
    InferencePoolSpec,
    RoleSpec,
    arg_value,
)
from kvpool.api.podtemplate import MAX_NUM_SEQS_ANNOTATION, ONE_OF, PROBES

from .standins import KEY_DEFAULTS, list_map_keys

Manifest = dict[str, Any]

MANAGED_BY = "kvpool-operator"
POOL_LABEL = "kvpool.io/pool"
GROUP_LABEL = "kvpool.io/group"
ROLE_LABEL = "kvpool.io/role"
COMPONENT_LABEL = "app.kubernetes.io/component"
CONFIG_HASH = "kvpool.io/config-hash"
# On a worker Deployment: which of the operator's default images its workers run ("worker",
# "worker-cpu", "vllm"); absent when the spec (or its podTemplate) names the image.
DEFAULT_IMAGE = "kvpool.io/default-image"
# Beside it, the default images the operator gave the containers ({"worker": image, ...}):
# a live image is kept only if it is still the one recorded, so a hand edit is undone.
DEFAULT_IMAGES = "kvpool.io/default-images"
VERSION_LABEL = "app.kubernetes.io/version"

ROUTER_PORT = 8080
#: where each router replica publishes its load to the others (router/state/peers.py)
ROUTER_PEER_PORT = 7100
MODEL_MOUNT = "/models/source"
TOKENIZER_COPY = "/models/tokenizer"
WORKER_CONTAINER = "worker"
ROUTER_CONTAINER = "router"
# Weights and other bulk files a router does not need from a model baked into an image.
_WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.ckpt")
# A Hugging Face source: the download cache (a claim, or an emptyDir) and, in the pod's own
# model emptyDir, a link to the snapshot of the commit this pod's init container resolved.
HF_CACHE_VOLUME = "hf-cache"
HF_CACHE_MOUNT = "/models/hf-cache"
HF_SNAPSHOT = f"{MODEL_MOUNT}/snapshot"
# What the router reads from a Hub repository: tokenizer, chat template and configs. An
# allow-list, as repositories hold weights in more formats than _WEIGHT_GLOBS names.
_TOKENIZER_GLOBS = ("*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken")
IMAGE_GROUP = 65532  # the group our images run as (their Dockerfiles' USER)
# The tenants Secret, mounted whole as a directory (never subPath: the kubelet then updates
# the files in place when the Secret changes, and the router reads them again).
TENANTS_VOLUME = "tenants"
TENANTS_MOUNT = "/etc/kvpool/tenants"
# The pool secret the operator makes (when the spec names none), and where it goes.
POOL_SECRET_KEY = "pool-secret"
ROUTER_POOL_SECRET_ENV = "KVPOOL_ROUTER_POOL_SECRET"
# kvpool workers read their settings from KVPOOL_* (not KVPOOL_WORKER_*): serve and the
# preStop hook's drain alike (tests/test_operator_network.py checks it with the worker).
WORKER_POOL_SECRET_ENV = "KVPOOL_POOL_SECRET"
# On a child the operator creates once and never writes again: the key of its data that
# the operator fills with a random value at creation (see handlers).
GENERATED_KEY = "kvpool.io/generated-key"


@dataclass(frozen=True)
class Images:
    """Default images, from the operator's settings; a pool's spec may name its own."""

    worker: str = f"ghcr.io/kvpool/kvpool-worker:{__version__}"
    worker_cpu: str = f"ghcr.io/kvpool/kvpool-worker:{__version__}-cpu"
    vllm: str = "vllm/vllm-openai:v0.32.0"
    router: str = f"ghcr.io/kvpool/kvpool-router:{__version__}"

    @classmethod
    def of_version(cls, version: str) -> Images:
        """The defaults of kvpool ``version`` (what that version's operator runs with)."""
        return cls(
            worker=f"ghcr.io/kvpool/kvpool-worker:{version}",
            worker_cpu=f"ghcr.io/kvpool/kvpool-worker:{version}-cpu",
            vllm=cls.vllm,
            router=f"ghcr.io/kvpool/kvpool-router:{version}",
        )


# Who scrapes metrics when neither the pool (networkPolicy.metricsFrom) nor the operator's
# settings say: Prometheus pods, as prometheus-operator (kube-prometheus-stack) and the
# prometheus-community chart label them, in the namespace "monitoring" or the pool's own.
# Not any namespace: whoever may create a pod anywhere could label it so, and a worker's
# metrics port is its API port too.
PROMETHEUS_PODS: Manifest = {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
DEFAULT_METRICS_FROM: tuple[Manifest, ...] = (
    {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": PROMETHEUS_PODS,
    },
    {"podSelector": PROMETHEUS_PODS},
)


@dataclass(frozen=True)
class Peers:
    """Who reaches a pool's pods besides its own routers and workers, from the operator's
    settings (as Images are): the metrics scrapers when the spec names none, and the
    operator's own pods, which scrape routers and workers for the autoscaler (None: the
    operator runs outside the cluster, or its pods are not known)."""

    metrics: tuple[Manifest, ...] = DEFAULT_METRICS_FROM
    operator: Manifest | None = None


# --- labels and names -----------------------------------------------------------------------


def pool_labels(pool: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "kvpool",
        "app.kubernetes.io/instance": pool,
        COMPONENT_LABEL: component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        VERSION_LABEL: __version__,
        POOL_LABEL: pool,
    }


def pod_labels(pool: str, component: str) -> dict[str, str]:
    """A pod template's labels: the pool's without the operator's version, so that an
    operator upgrade changes no template and rolls no pod by itself."""
    labels = pool_labels(pool, component)
    del labels[VERSION_LABEL]
    return labels


def selector_labels(pool: str, component: str, group: str | None = None) -> dict[str, str]:
    labels = {POOL_LABEL: pool, COMPONENT_LABEL: component}
    if group:
        labels[GROUP_LABEL] = group
    return labels


def worker_selector(pool: str, component: str = "worker") -> str:
    """The label selector the router's discovery watches: every worker of this pool (or,
    ``component="router"``, every router replica: its peers)."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(pool, component).items())


def _meta(pool: str, namespace: str, name: str, component: str, **extra: Any) -> dict[str, Any]:
    labels = pool_labels(pool, component)
    labels.update(extra.pop("labels", {}))
    return {"name": name, "namespace": namespace, "labels": labels, **extra}


# --- model ----------------------------------------------------------------------------------


def model_dir(spec: InferencePoolSpec) -> str:
    """Where workers read the model, inside their container."""
    src = spec.model.source
    if src.pvc is not None:
        return f"{MODEL_MOUNT}/{src.pvc.path}".rstrip("/")
    if src.image is not None:
        return src.image.path
    if src.builtin is not None:
        return f"{MODEL_MOUNT}/{src.builtin.name}"
    if src.huggingface is not None:
        return HF_SNAPSHOT
    return MODEL_MOUNT  # hostPath


# Our images (router, kvpool worker) run as uid 65532 and write only under /tmp (HOME and the
# Hugging Face caches point there), so their pods run restricted: non-root, read-only root
# filesystem, no capabilities, an emptyDir at /tmp. vLLM's image runs as root and writes to
# its home directory: its pods run restricted too (Pod Security "restricted" admits them),
# as uid 65532, with HOME and every cache vLLM, PyTorch and Triton write pointed at /tmp, and
# a writable root filesystem (vLLM's kernels may compile into site-packages' caches).
POD_SECURITY: Manifest = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY: Manifest = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}
#: the user a container of an image that runs as root is run as (a distroless image's)
NON_ROOT_UID = 65532
TMP_VOLUME: Manifest = {"name": "tmp", "emptyDir": {}}
TMP_MOUNT: Manifest = {"name": "tmp", "mountPath": "/tmp"}
# Where a root image's programs write, moved to /tmp: HOME (~/.cache/vllm, ~/.triton,
# ~/.config), the XDG directories, PyTorch's compile cache (found by user name, which uid
# 65532 has none of in /etc/passwd: USER names it).
ROOT_IMAGE_ENV: list[Manifest] = [
    {"name": "HOME", "value": "/tmp"},
    {"name": "USER", "value": "kvpool"},
    {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
    {"name": "XDG_CONFIG_HOME", "value": "/tmp/.config"},
    {"name": "TORCHINDUCTOR_CACHE_DIR", "value": "/tmp/torchinductor"},
]


def _restrict(pod_spec: Manifest, root_image: bool = False) -> None:
    """Run every container of ``pod_spec`` restricted, each with a writable /tmp.
    ``root_image``: the images run as root (vLLM's): the pod runs them as uid and gid 65532,
    with HOME and the caches under /tmp, and their root filesystem writable."""
    pod_spec["securityContext"] = copy.deepcopy(POD_SECURITY)
    if root_image:
        pod_spec["securityContext"].update(
            runAsUser=NON_ROOT_UID, runAsGroup=NON_ROOT_UID, fsGroup=NON_ROOT_UID
        )
    pod_spec["volumes"] = [*pod_spec.get("volumes", []), copy.deepcopy(TMP_VOLUME)]
    for c in pod_spec["containers"] + pod_spec.get("initContainers", []):
        c["securityContext"] = copy.deepcopy(CONTAINER_SECURITY)
        c["volumeMounts"] = [*c.get("volumeMounts", []), copy.deepcopy(TMP_MOUNT)]
        if root_image:
            c["securityContext"]["readOnlyRootFilesystem"] = False
            have = {e.get("name") for e in c.get("env") or ()}
            c["env"] = [*c.get("env", []), *(copy.deepcopy(e) for e in ROOT_IMAGE_ENV
                                              if e["name"] not in have)]  # fmt: skip


def _model_volume(spec: InferencePoolSpec) -> Manifest | None:
    src = spec.model.source
    if src.pvc is not None:
        return {
            "name": "model",
            "persistentVolumeClaim": {"claimName": src.pvc.claim_name, "readOnly": True},
        }
    if src.host_path is not None:
        return {"name": "model", "hostPath": {"path": src.host_path.path, "type": "Directory"}}
    if src.builtin is not None or src.huggingface is not None:
        return {"name": "model", "emptyDir": {}}
    return None  # baked into the image


def _model_volumes(spec: InferencePoolSpec, *, router: bool = False) -> list[Manifest]:
    """The model's volumes; for a Hugging Face source also the download cache: the claim
    it names for workers (shared, kept between pods), an emptyDir otherwise. The router
    downloads only the tokenizer, always into an emptyDir."""
    model = _model_volume(spec)
    volumes = [model] if model is not None else []
    hf = spec.model.source.huggingface
    if hf is not None:
        if hf.cache_claim_name and not router:
            cache = {"persistentVolumeClaim": {"claimName": hf.cache_claim_name}}
        else:
            cache = {"emptyDir": {}}
        volumes.append({"name": HF_CACHE_VOLUME, **cache})
    return volumes


def _model_mounts(spec: InferencePoolSpec) -> list[Manifest]:
    """The serving container's view of the model: read-only (the snapshot link resolves
    into the cache, so both are mounted)."""
    mounts = []
    if _model_volume(spec) is not None:
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    if spec.model.source.huggingface is not None:
        mounts.append({"name": HF_CACHE_VOLUME, "mountPath": HF_CACHE_MOUNT, "readOnly": True})
    return mounts


def _model_init(
    spec: InferencePoolSpec, images: Images, worker: Manifest | None = None
) -> Manifest | None:
    """The init container that puts the model in place, if the source needs one: the
    built-in model's maker, or the Hugging Face download. ``worker``: the worker container
    it runs beside, whose image it uses; None in the router's pod."""
    if spec.model.source.huggingface is not None:
        return _huggingface_init(spec, images, worker)
    return _builtin_init(spec, images)


# vLLM's image has huggingface_hub but not our CLI. Its Python API is used rather than its
# command line: `snapshot_download(repo, revision=, cache_dir=)` is the same from 0.x to today,
# while the CLI was renamed (`huggingface-cli download` became `hf download` in 0.34; today's
# releases have only `hf`), so this works with whatever vLLM image `engine.image` names. It
# prints one line on failure, not a traceback; the token (HF_TOKEN) is in no message.
_VLLM_FETCH = """\
import os, sys
from huggingface_hub import snapshot_download
repo, revision, cache, link = sys.argv[1:]
try:
    path = snapshot_download(repo, revision=revision, cache_dir=cache)
except Exception as exc:
    text, token = str(exc), os.environ.get("HF_TOKEN")
    text = text.replace(token, "***") if token else text
    sys.exit(f"cannot fetch {repo} at {revision}: {type(exc).__name__}: {text}")
if os.path.lexists(link + ".tmp"):
    os.remove(link + ".tmp")
os.symlink(path, link + ".tmp")
os.replace(link + ".tmp", link)
print(f"fetched {repo} at {revision}: {path}", flush=True)
"""


def _huggingface_init(spec: InferencePoolSpec, images: Images, worker: Manifest | None) -> Manifest:
    """Download the snapshot (the router: its tokenizer and configs only) into the cache and
    link it at HF_SNAPSHOT. The revision is in the arguments, so a new one rolls the pods.
    The token reaches this container only, from the Secret: never the spec or the engine."""
    hf = spec.model.source.huggingface
    assert hf is not None
    env = [
        {"name": "HF_HUB_DISABLE_PROGRESS_BARS", "value": "1"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
    ]
    if hf.token_secret_ref is not None:
        ref = hf.token_secret_ref
        env.append(
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
        )
    if worker is not None and spec.engine_type == "vllm":
        command = ["python3", "-c", _VLLM_FETCH]
        args = [hf.repo, hf.revision, HF_CACHE_MOUNT, HF_SNAPSHOT]
    else:
        command = ["kvpool", "worker", "fetch-model"]
        args = [
            "--repo", hf.repo,
            "--revision", hf.revision,
            "--cache-dir", HF_CACHE_MOUNT,
            "--dir", HF_SNAPSHOT,
        ]  # fmt: skip
        if worker is None:  # the router: no weights
            args += [a for g in _TOKENIZER_GLOBS for a in ("--include", g)]
            args += [a for g in _WEIGHT_GLOBS for a in ("--exclude", g)]
    init: Manifest = {
        "name": "fetch-model",
        "image": worker["image"] if worker is not None else images.worker_cpu,
        "command": command,
        "args": args,
        "env": env,
        "volumeMounts": [
            {"name": "model", "mountPath": MODEL_MOUNT},
            {"name": HF_CACHE_VOLUME, "mountPath": HF_CACHE_MOUNT},
        ],
    }
    if worker is not None and "imagePullPolicy" in worker:
        init["imagePullPolicy"] = worker["imagePullPolicy"]
    return init


def _cache_claim_writable(spec: InferencePoolSpec, pod_spec: Manifest) -> None:
    """A restricted pod (our images, uid and gid 65532) writes to the cache claim through
    its group: the kubelet gives the claim that group (once, while its root differs)."""
    hf = spec.model.source.huggingface
    if hf is not None and hf.cache_claim_name:
        security = pod_spec.setdefault("securityContext", {})
        security.update({"fsGroup": IMAGE_GROUP, "fsGroupChangePolicy": "OnRootMismatch"})


def _builtin_init(spec: InferencePoolSpec, images: Images) -> Manifest | None:
    """The init container that writes the built-in tiny model (same seed: same tokenizer)."""
    src = spec.model.source.builtin
    if src is None:
        return None
    return {
        "name": "make-model",
        "image": images.worker_cpu,
        "command": ["kvpool", "worker", "make-tiny-model"],
        "args": [model_dir(spec), "--seed", str(src.seed)],
        "volumeMounts": [{"name": "model", "mountPath": MODEL_MOUNT}],
    }


# --- workers --------------------------------------------------------------------------------


def _env(items: list[Any]) -> list[Manifest]:
    return [e.model_dump(by_alias=True, exclude_none=True) for e in items]


def _pod_ip_env() -> Manifest:
    return {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def default_image_key(spec: InferencePoolSpec, role: str) -> str | None:
    """Which of the operator's default images this role's workers run; None when the spec
    names its own (``engine.image``)."""
    if spec.engine.image:
        return None
    if spec.engine_type == "vllm":
        return "vllm"
    resources = spec.roles()[role].resources
    gpu = "nvidia.com/gpu" in {**resources.requests, **resources.limits}
    return "worker" if gpu else "worker-cpu"


def worker_image(spec: InferencePoolSpec, role: str, images: Images) -> str:
    """The spec's image, else the default for the engine (CUDA only where GPUs are asked)."""
    if spec.engine.image:
        return spec.engine.image
    if spec.engine_type == "vllm":
        return images.vllm
    resources = spec.roles()[role].resources
    gpu = "nvidia.com/gpu" in {**resources.requests, **resources.limits}
    return images.worker if gpu else images.worker_cpu


def _kvpool_worker(spec: InferencePoolSpec, role: str, images: Images) -> Manifest:
    engine = spec.engine
    role_spec = spec.roles()[role]
    args = [
        "--model", model_dir(spec),
        "--served-model-name", spec.model.name,
        "--host", "0.0.0.0",
        "--port", str(engine.port),
        "--role", spec.worker_role_label(role),
        "--block-size", str(spec.block_size),
        "--hash-seed", engine.hash_seed,
        "--drain-timeout-s", str(max(role_spec.termination_grace_period_seconds - 5, 0)),
    ]  # fmt: skip
    if spec.model.max_model_len:
        args += ["--max-model-len", str(spec.model.max_model_len)]
    if engine.kv_events.enabled:
        args += [
            "--kv-events-endpoint", f"tcp://*:{engine.kv_events.port}",
            "--kv-events-replay-endpoint", f"tcp://*:{engine.kv_events.replay_port}",
            "--kv-events-topic", engine.kv_events.topic,
        ]  # fmt: skip
    if spec.prefill is not None:
        args += ["--kv-pin-timeout-s", f"{engine.kv_transfer.pin_timeout_seconds:g}"]
    return {
        "name": WORKER_CONTAINER,
        "image": worker_image(spec, role, images),
        "command": ["kvpool", "worker", "serve"],
        "args": args + engine.args + role_spec.args,
        "env": [_pod_ip_env(), {"name": "HF_HUB_OFFLINE", "value": "1"}],
        "lifecycle": {
            # Stop taking requests and finish those in flight before SIGTERM arrives.
            "preStop": {
                "exec": {"command": ["kvpool", "worker", "drain", "--port", str(engine.port)]}
            },
        },
    }


def _vllm_worker(spec: InferencePoolSpec, role: str, images: Images) -> Manifest:
    engine = spec.engine
    role_spec = spec.roles()[role]
    args = [
        model_dir(spec),
        "--served-model-name", spec.model.name,
        "--host", "0.0.0.0",
        "--port", str(engine.port),
        "--block-size", str(spec.block_size),
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo", "sha256_cbor",
        # usage.prompt_tokens_details.cached_tokens: the router's realised hit ratio
        "--enable-prompt-tokens-details",
    ]  # fmt: skip
    if spec.model.tokenizer:
        args += ["--tokenizer", spec.model.tokenizer]
    if spec.model.max_model_len:
        args += ["--max-model-len", str(spec.model.max_model_len)]
    if engine.kv_events.enabled:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{engine.kv_events.port}",
            "replay_endpoint": f"tcp://*:{engine.kv_events.replay_port}",
            "topic": engine.kv_events.topic,
        }
        args += ["--kv-events-config", json.dumps(events, separators=(",", ":"))]
    env = [
        _pod_ip_env(),
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        # vLLM seeds its block hashes from PYTHONHASHSEED: the router must use the same.
        {"name": "PYTHONHASHSEED", "value": engine.hash_seed},
    ]
    if spec.prefill is not None:
        transfer = {"kv_connector": engine.kv_transfer.connector, "kv_role": "kv_both"}
        args += ["--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]
        transfer_env = {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "$(POD_IP)",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(engine.kv_transfer.side_channel_port),
            "VLLM_NIXL_ABORT_REQUEST_TIMEOUT": str(int(engine.kv_transfer.pin_timeout_seconds)),
        }
        env += [{"name": k, "value": v} for k, v in transfer_env.items()]
    return {
        "name": WORKER_CONTAINER,
        "image": worker_image(spec, role, images),
        "command": ["vllm", "serve"],
        "args": args + engine.args + role_spec.args,
        "env": env,
        "lifecycle": {
            # vLLM has no drain endpoint: give the router (which drops a terminating pod at
            # once) time to stop sending before SIGTERM ends the server.
            "preStop": {"exec": {"command": ["sleep", "10"]}},
        },
    }


def _worker_ports(spec: InferencePoolSpec, role: str) -> list[Manifest]:
    engine = spec.engine
    ports = [{"name": "http", "containerPort": engine.port, "protocol": "TCP"}]
    if engine.kv_events.enabled:
        # a data-parallel vLLM's rank r publishes at each port + r
        for rank in range(spec.data_parallel_size(role)):
            suffix = f"-dp{rank}" if rank else ""
            ports += [
                {
                    "name": "kv-events" + suffix,
                    "containerPort": engine.kv_events.port + rank,
                    "protocol": "TCP",
                },
                {
                    "name": "kv-replay" + suffix,
                    "containerPort": engine.kv_events.replay_port + rank,
                    "protocol": "TCP",
                },
            ]
    if spec.engine_type == "vllm":
        port = engine.kv_transfer.side_channel_port
        ports.append({"name": "nixl", "containerPort": port, "protocol": "TCP"})
    return ports


def _probes(port: str) -> Manifest:
    """Started: /health answers 200 (model loaded; up to 30 min for big weights). Ready:
    /health is 200 (503 while loading or draining). Alive: the port accepts connections, so
    a worker that is draining is not killed for answering 503."""
    # a probe times out after 1 s by default: a worker busy with a long prefill, or a GC
    # pause, answers later than that without being unhealthy
    return {
        "startupProbe": {
            "httpGet": {"path": "/health", "port": port},
            "periodSeconds": 10,
            "timeoutSeconds": PROBE_TIMEOUT_S,
            "failureThreshold": STARTUP_PROBES,
        },
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": port},
            "periodSeconds": 5,
            "timeoutSeconds": PROBE_TIMEOUT_S,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "tcpSocket": {"port": port},
            "periodSeconds": 10,
            "timeoutSeconds": PROBE_TIMEOUT_S,
            "failureThreshold": 6,
        },
    }


PROBE_TIMEOUT_S = 5
STARTUP_PROBES = 180  # every 10 s: 30 min to load the weights
#: a Deployment's rollout is reported failed (ProgressDeadlineExceeded: Argo CD, Flux and
#: kube-state-metrics' alerts read it) after this long without progress; the default 600 s
#: is shorter than a worker's startup window, so every large model's rollout "failed". The
#: window, and as long again for what comes before it (a ~10 GB image, a model download)
PROGRESS_DEADLINE_S = STARTUP_PROBES * 10 + 1800
PRE_START_S = 1800  # what comes before the startup window: image pull, model download


def progress_deadline(template: Manifest) -> int:
    """A pod template's progress deadline: its longest startup window (a startup probe's
    initial delay plus period times failure threshold, the kubelet's defaults where unset;
    a podTemplate may lengthen ours), and :data:`PRE_START_S` before it."""
    window = 0
    for container in (template.get("spec") or {}).get("containers") or ():
        probe = container.get("startupProbe") if isinstance(container, dict) else None
        if isinstance(probe, dict):
            try:
                window = max(window, int(probe.get("initialDelaySeconds") or 0)
                             + int(probe.get("periodSeconds") or 10)
                             * int(probe.get("failureThreshold") or 3))  # fmt: skip
            except (TypeError, ValueError):  # the schema check names it
                continue
    return max(window, STARTUP_PROBES * 10) + PRE_START_S


def _scrape_annotations(port: int) -> dict[str, str]:
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }


def _resources(resources: Any) -> Manifest:
    out = {}
    for key in ("requests", "limits"):
        values = getattr(resources, key)
        if values:
            out[key] = {k: str(v) for k, v in values.items()}
    return out


def _add_pod_parts(
    pod_spec: Manifest,
    init: list[Manifest],
    volumes: list[Manifest],
    scheduling: Any,
    affinity: Manifest | None,
) -> None:
    """Init containers, volumes and scheduling, each only when there is one."""
    parts = {
        "initContainers": init,
        "volumes": volumes,
        "nodeSelector": dict(scheduling.node_selector),
        "tolerations": copy.deepcopy(scheduling.tolerations),
        "affinity": copy.deepcopy(affinity),
    }
    pod_spec.update({k: v for k, v in parts.items() if v})


def _add_pull_secrets(pod_spec: Manifest, secrets: list[Any]) -> None:
    if secrets:
        pod_spec["imagePullSecrets"] = [{"name": s.name} for s in secrets]


def worker_deployment(
    pool: str, namespace: str, spec: InferencePoolSpec, role: str, images: Images
) -> Manifest:
    role_spec: RoleSpec = spec.roles()[role]
    engine = spec.engine
    build = _vllm_worker if spec.engine_type == "vllm" else _kvpool_worker
    container = build(spec, role, images)
    # kvpool workers sign and check the hand-off, and guard their admin endpoints, with the
    # pool secret: on the container, where the preStop hook's drain reads it too.
    container["env"] += _pool_secret_env(pool, spec, WORKER_POOL_SECRET_ENV)
    container["env"] += _env(engine.env) + _env(role_spec.env)
    container["ports"] = _worker_ports(spec, role)
    if engine.image_pull_policy:
        container["imagePullPolicy"] = engine.image_pull_policy
    container.update(_probes("http"))
    resources = _resources(role_spec.resources)
    if resources:
        container["resources"] = resources
    volumes = _model_volumes(spec)
    mounts = _model_mounts(spec)
    if spec.engine_type == "vllm":  # NCCL and the tokenizer pool use shared memory
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if mounts:
        container["volumeMounts"] = mounts

    pod_spec: Manifest = {
        "automountServiceAccountToken": False,  # workers never call the API server
        "terminationGracePeriodSeconds": role_spec.termination_grace_period_seconds,
        "containers": [container],
    }
    init = _model_init(spec, images, container)
    _add_pod_parts(pod_spec, [init] if init else [], volumes, role_spec, role_spec.affinity)
    _add_pull_secrets(pod_spec, engine.image_pull_secrets)
    _restrict(pod_spec, root_image=spec.engine_type == "vllm")
    _cache_claim_writable(spec, pod_spec)

    selector = selector_labels(pool, "worker", role)
    template: Manifest = {
        "metadata": {
            "labels": {
                **pod_labels(pool, "worker"),
                **selector,
                ROLE_LABEL: spec.worker_role_label(role),
            },
            "annotations": _scrape_annotations(engine.port),
        },
        "spec": pod_spec,
    }
    slots = arg_value(container["args"], "--max-num-seqs")
    if spec.engine_type == "vllm" and slots is not None and slots.isdecimal() and int(slots):
        # vLLM says its slot count nowhere the router can read: the pod says it
        template["metadata"]["annotations"][MAX_NUM_SEQS_ANNOTATION] = slots
    defaulted = _default_imaged(template)
    if role_spec.pod_template:
        template = merge_template(template, role_spec.pod_template)
    key = default_image_key(spec, role)
    if _default_imaged(template) != defaulted:  # the podTemplate names an image of ours
        key = None
    metadata = _meta(pool, namespace, f"{pool}-{role}", "worker", labels={GROUP_LABEL: role})
    if key is not None:
        metadata["annotations"] = {DEFAULT_IMAGE: key, DEFAULT_IMAGES: _record(defaulted)}
    rollout = role_spec.rollout
    # An HPA or KEDA owns an external role's replicas: no count here, so that applying the
    # Deployment never takes them back (a new one starts at the API server's default, 1).
    replicas = {}
    if spec.replicas_owner(role) != "external":
        replicas["replicas"] = initial_replicas(spec, role)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            **replicas,
            "selector": {"matchLabels": selector},
            "progressDeadlineSeconds": progress_deadline(template),
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": dict(
                    zip(
                        ("maxSurge", "maxUnavailable"),
                        rollout.strategy(role in spec.gpus()),
                        strict=True,
                    )
                ),
            },
            "template": template,
        },
    }


def initial_replicas(spec: InferencePoolSpec, role: str) -> int:
    """The spec's count; for an autoscaled role, within its bounds. The autoscaler owns the
    count after the Deployment is created (it is not patched back to this)."""
    replicas = spec.roles()[role].replicas
    bounds = getattr(spec.autoscaling, role) if spec.autoscaling.enabled else None
    if bounds is not None:
        replicas = min(max(replicas, bounds.min_replicas), bounds.max_replicas)
    return replicas


def worker_service(pool: str, namespace: str, spec: InferencePoolSpec, role: str) -> Manifest:
    """A headless Service per role: stable DNS for each worker, for debugging and scraping."""
    ports = [
        {"name": p["name"], "port": p["containerPort"], "targetPort": p["name"]}
        for p in _worker_ports(spec, role)
    ]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(pool, namespace, f"{pool}-{role}", "worker", labels={GROUP_LABEL: role}),
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(pool, "worker", role),
            "ports": ports,
        },
    }


def disruption_budget(pool: str, namespace: str, component: str, group: str | None) -> Manifest:
    name = f"{pool}-{group or component}"
    extra = {"labels": {GROUP_LABEL: group}} if group else {}
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(pool, namespace, name, component, **extra),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(pool, component, group)},
            # a pod stuck loading or crash-looping serves nobody: a node drain or a cluster
            # autoscaler's scale-down may evict it (the default waits for it to be ready)
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


# --- router ---------------------------------------------------------------------------------


def _snake(camel: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in camel).upper()


def router_config(pool: str, spec: InferencePoolSpec) -> dict[str, str]:
    """The router's settings as KVPOOL_ROUTER_* variables (its ConfigMap)."""
    router = spec.router
    engine = spec.engine
    data = {
        "KVPOOL_ROUTER_MODEL": TOKENIZER_COPY if _router_copies_tokenizer(spec)
        else model_dir(spec),
        "KVPOOL_ROUTER_SERVED_MODEL_NAME": spec.model.name,
        "KVPOOL_ROUTER_HOST": "0.0.0.0",
        "KVPOOL_ROUTER_PORT": str(ROUTER_PORT),
        "KVPOOL_ROUTER_DISCOVERY": "kubernetes",
        "KVPOOL_ROUTER_SELECTOR": worker_selector(pool),
        "KVPOOL_ROUTER_WORKER_PORT": "http",
        "KVPOOL_ROUTER_ROLE_LABEL": ROLE_LABEL,
        "KVPOOL_ROUTER_BLOCK_SIZE": str(spec.block_size),  # the workers' --block-size
        "KVPOOL_ROUTER_HASH_SEED": engine.hash_seed,
        "KVPOOL_ROUTER_POLICY": router.policy,
        # when the router splits a request between a prefill and a decode worker
        "KVPOOL_ROUTER_PD_MODE": spec.disaggregation.mode,
        "KVPOOL_ROUTER_PD_THRESHOLD_TOKENS": str(spec.disaggregation.threshold_tokens),
        # the replicas share their load and speculations (one replica: nobody to tell; set
        # anyway, so that scaling the router does not change its settings and roll it)
        "KVPOOL_ROUTER_PEER_BIND": f"tcp://0.0.0.0:{ROUTER_PEER_PORT}",
        "KVPOOL_ROUTER_PEER_SELECTOR": worker_selector(pool, "router"),
    }  # fmt: skip
    if router.processes > 1:  # process i of each pod binds the peer port + i
        data["KVPOOL_ROUTER_PROCESSES"] = str(router.processes)
    if spec.engine_type == "vllm":
        # vLLM's own override of how a message's content reaches the template: the router
        # renders chats as the workers do
        given = {
            arg_value(spec.engine_args(r), "--chat-template-content-format") or "auto"
            for r in spec.roles()
        }
        if len(given) == 1 and (fmt := given.pop()) != "auto":  # roles that differ: auto
            data["KVPOOL_ROUTER_CHAT_TEMPLATE_CONTENT_FORMAT"] = fmt
    if spec.engine_type == "vllm" and engine.kv_events.enabled:
        # vLLM has no /kvpool/info to say where its events are: tell the router.
        data["KVPOOL_ROUTER_WORKER_EVENTS_PORT"] = str(engine.kv_events.port)
        data["KVPOOL_ROUTER_WORKER_REPLAY_PORT"] = str(engine.kv_events.replay_port)
    if router.scorers:
        data["KVPOOL_ROUTER_SCORER"] = " ".join(f"{k}={v:g}" for k, v in router.scorers.items())
    if router.auth is not None:  # without it, the router asks for no key
        data["KVPOOL_ROUTER_API_KEYS_FILE"] = f"{TENANTS_MOUNT}/{router.auth.key}"
    typed = ((router.flow_control, FLOW_CONTROL_SETTINGS),
             (router.client_limits, CLIENT_LIMIT_SETTINGS))  # fmt: skip
    for part, settings in typed:
        for field, setting in settings.items():
            value = getattr(part, field)
            if value is not None:  # unset: the router's default
                data[f"KVPOOL_ROUTER_{setting.upper()}"] = _setting_text(value)
    for key, value in router.settings.items():
        data[f"KVPOOL_ROUTER_{_snake(key)}"] = value
    return data


def _setting_text(value: bool | int | float | str | list[str]) -> str:
    if isinstance(value, list):  # a list setting's variable: its items, space-separated
        return " ".join(value)
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _router_copies_tokenizer(spec: InferencePoolSpec) -> bool:
    """The router reads the tokenizer and chat template from the model directory; one baked
    into the worker image reaches it through an init container and an emptyDir."""
    return spec.model.source.image is not None


def config_hash(data: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def router_deployment(
    pool: str, namespace: str, spec: InferencePoolSpec, images: Images
) -> Manifest:
    router = spec.router
    name = f"{pool}-router"
    container: Manifest = {
        "name": ROUTER_CONTAINER,
        "image": router.image or images.router,
        "command": ["kvpool", "router", "serve"],
        "envFrom": [{"configMapRef": {"name": name}}],
        "env": [
            {
                "name": "KVPOOL_ROUTER_NAMESPACE",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
            },
            *_pool_secret_env(pool, spec, ROUTER_POOL_SECRET_ENV),
        ],
        "ports": [
            {"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"},
            {"name": "peers", "containerPort": ROUTER_PEER_PORT, "protocol": "TCP"},
        ],
        **_probes("http"),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}},
    }
    resources = _resources(router.resources)
    if resources:
        container["resources"] = resources
    if router.image_pull_policy:
        container["imagePullPolicy"] = router.image_pull_policy
    volumes: list[Manifest] = []
    init: list[Manifest] = []
    if _router_copies_tokenizer(spec):
        volumes.append({"name": "tokenizer", "emptyDir": {}})
        container["volumeMounts"] = [{"name": "tokenizer", "mountPath": TOKENIZER_COPY}]
        excludes = " ".join(f"! -name {shlex.quote(g)}" for g in _WEIGHT_GLOBS)
        init.append({
            "name": "copy-tokenizer",  # "+": find fails when a copy does
            "image": worker_image(spec, "decode", images),  # the image that holds the model
            "command": ["sh", "-c", f"find {shlex.quote(model_dir(spec))} -maxdepth 1 -type f "
                                    f"{excludes} -exec sh -c 'cp \"$@\" {TOKENIZER_COPY}/' "
                                    "sh {} +"],
            "volumeMounts": [{"name": "tokenizer", "mountPath": TOKENIZER_COPY}],
        })  # fmt: skip
    else:
        volumes += _model_volumes(spec, router=True)
        if mounts := _model_mounts(spec):
            container["volumeMounts"] = mounts
        model_init = _model_init(spec, images)
        if model_init is not None:
            init.append(model_init)
    if router.auth is not None:
        volumes.append({"name": TENANTS_VOLUME, "secret": {"secretName": router.auth.secret_name}})
        container["volumeMounts"] = [
            *container.get("volumeMounts", []),
            {"name": TENANTS_VOLUME, "mountPath": TENANTS_MOUNT, "readOnly": True},
        ]
    pod_spec: Manifest = {
        "serviceAccountName": name,
        "terminationGracePeriodSeconds": 60,
        "containers": [container],
    }
    _add_pod_parts(pod_spec, init, volumes, router, router.affinity)
    # replicas on different nodes, and zones, where the cluster can: one node's loss takes
    # one replica (ScheduleAnyway: a small cluster still schedules them all). Rendered
    # whatever the count: scaling the router must not change its pod template
    pod_spec["topologySpreadConstraints"] = [
        {
            "maxSkew": 1,
            "topologyKey": key,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": selector_labels(pool, "router")},
        }
        for key in ("kubernetes.io/hostname", "topology.kubernetes.io/zone")
    ]
    _add_pull_secrets(pod_spec, router.image_pull_secrets)
    _restrict(pod_spec)
    if _router_copies_tokenizer(spec) and spec.engine_type == "vllm":
        # vLLM's image runs as root, which the pod's runAsNonRoot makes the kubelet refuse:
        # the copy runs as a user of ours (the files it reads are the image's, world-readable)
        for c in pod_spec["initContainers"]:
            if c["name"] == _COPY_TOKENIZER:
                c["securityContext"].update(runAsUser=NON_ROOT_UID, runAsGroup=NON_ROOT_UID)
    selector = selector_labels(pool, "router")
    annotations = {
        **_scrape_annotations(ROUTER_PORT),
        CONFIG_HASH: config_hash(router_config(pool, spec)),  # a config change rolls the pods
    }
    template: Manifest = {
        "metadata": {
            "labels": {**pod_labels(pool, "router"), **selector},
            "annotations": annotations,
        },
        "spec": pod_spec,
    }
    if router.pod_template:
        template = merge_template(template, router.pod_template)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(pool, namespace, name, "router"),
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": selector},
            "progressDeadlineSeconds": PROGRESS_DEADLINE_S,  # it may download a tokenizer
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": template,
        },
    }


def router_manifests(
    pool: str, namespace: str, spec: InferencePoolSpec, images: Images
) -> list[Manifest]:
    name = f"{pool}-router"

    def meta() -> dict[str, Any]:
        return _meta(pool, namespace, name, "router")

    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta()},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta(),
            # Discovery lists and watches the pool's pods in this namespace: nothing more.
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta(),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta(),
            "data": router_config(pool, spec),
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta(),
            "spec": {
                "type": spec.router.service.type,
                "selector": selector_labels(pool, "router"),
                "ports": [{"name": "http", "port": spec.router.service.port, "targetPort": "http"}],
            },
        },
        router_deployment(pool, namespace, spec, images),
        disruption_budget(pool, namespace, "router", None),
    ]


# --- the pool secret ------------------------------------------------------------------------


def pool_secret_ref(pool: str, spec: InferencePoolSpec) -> tuple[str, str] | None:
    """The Secret and key holding the pool secret: the spec's (``poolSecret``), else the
    one the operator makes. None in a pool of vLLM workers, where nothing would check it."""
    if spec.engine_type != "kvpool":
        return None
    if spec.pool_secret is not None:
        return spec.pool_secret.secret_name, spec.pool_secret.key
    return f"{pool}-pool-secret", POOL_SECRET_KEY


def _pool_secret_env(pool: str, spec: InferencePoolSpec, variable: str) -> list[Manifest]:
    ref = pool_secret_ref(pool, spec)
    if ref is None:
        return []
    return [{"name": variable, "valueFrom": {"secretKeyRef": {"name": ref[0], "key": ref[1]}}}]


def pool_secret(pool: str, namespace: str, spec: InferencePoolSpec) -> Manifest | None:
    """The Secret of the pool secret when the operator makes it (the spec names none), as
    rendered: without its data, as rendering is pure and the key must be random. The
    operator creates it once with a random value under the key ``kvpool.io/generated-key``
    names, and never writes it again, so the key stays the one every pod started with;
    immutable, so that nobody changes it under running pods either. Deleting it rotates the
    key: the operator makes a new one, which pods read when they (re)start."""
    ref = pool_secret_ref(pool, spec)
    if ref is None or spec.pool_secret is not None:
        return None
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(
            pool, namespace, ref[0], "pool-secret", annotations={GENERATED_KEY: ref[1]}
        ),
        "type": "Opaque",
        "immutable": True,
    }


# --- network policies -----------------------------------------------------------------------


def _peers(given: list[Any] | None, default: Iterable[Manifest]) -> list[Manifest]:
    if given is None:
        return copy.deepcopy(list(default))
    return [p.model_dump(by_alias=True, exclude_defaults=True) for p in given]


def network_policies(
    pool: str, namespace: str, spec: InferencePoolSpec, peers: Peers | None = None
) -> list[Manifest]:
    """Who may connect to the pool's pods (``networkPolicy``; none when it is off).

    Workers (``<pool>-workers``): their HTTP port from the pool's routers, from the metrics
    scrapers and the operator (``/metrics`` is on that port, and the autoscaler scrapes it)
    and, in a disaggregated pool, from the pool's other workers (a decode worker pulls the
    prompt's KV blocks from a prefill worker there); the KV event and replay ports from the
    routers only. vLLM workers of a disaggregated pool take any port from the pool's other
    workers: NIXL's side channel, then UCX's transports, on ports of their choosing.

    The router (``<pool>-router``): its port from anyone, unless ``clientsFrom`` names who
    (the metrics scrapers and the operator are then added); its peer port from the pool's
    other router replicas. A rule's ``from`` is never
    empty, which would mean everyone: a router nobody may reach has no rule at all."""
    policy = spec.network_policy
    if not policy.enabled:
        return []
    peers = peers or Peers()
    engine = spec.engine
    routers = {"podSelector": {"matchLabels": selector_labels(pool, "router")}}
    workers = {"podSelector": {"matchLabels": selector_labels(pool, "worker")}}
    watchers = _peers(policy.metrics_from, peers.metrics)
    if peers.operator is not None:
        watchers.append(copy.deepcopy(peers.operator))
    disaggregated = spec.prefill is not None

    http_from = [copy.deepcopy(routers)]
    if disaggregated and spec.engine_type == "kvpool":
        http_from.append(copy.deepcopy(workers))
    worker_ingress: list[Manifest] = [{"from": http_from + watchers, "ports": [_tcp(engine.port)]}]
    if engine.kv_events.enabled:
        ports = [_tcp(engine.kv_events.port), _tcp(engine.kv_events.replay_port)]
        ranks = max(spec.data_parallel_size(role) for role in spec.roles())
        if ranks > 1:  # a data-parallel vLLM's rank r publishes at each port + r
            for port in ports:
                port["endPort"] = port["port"] + ranks - 1
        worker_ingress.append({"from": [copy.deepcopy(routers)], "ports": ports})
    if disaggregated and spec.engine_type == "vllm":
        worker_ingress.append({"from": [copy.deepcopy(workers)]})

    if policy.clients_from is None:  # anyone: router.auth's keys guard it
        router_ingress = [{"ports": [_tcp(ROUTER_PORT)]}]
    else:
        clients = _peers(policy.clients_from, ()) + copy.deepcopy(watchers)
        router_ingress = [{"from": clients, "ports": [_tcp(ROUTER_PORT)]}] if clients else []
    # the replicas' load and speculations, from the other replicas only
    peer_ports = _tcp(ROUTER_PEER_PORT)
    if spec.router.processes > 1:  # each process of a pod binds a port of its own
        peer_ports["endPort"] = ROUTER_PEER_PORT + spec.router.processes - 1
    router_ingress.append({"from": [copy.deepcopy(routers)], "ports": [peer_ports]})
    return [
        _network_policy(pool, namespace, f"{pool}-workers", "worker", worker_ingress),
        _network_policy(pool, namespace, f"{pool}-router", "router", router_ingress),
    ]


def _tcp(port: int) -> Manifest:
    return {"protocol": "TCP", "port": port}


def _network_policy(
    pool: str, namespace: str, name: str, component: str, ingress: list[Manifest]
) -> Manifest:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(pool, namespace, name, component),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(pool, component)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


# --- the pool -------------------------------------------------------------------------------


def render(
    pool: str,
    namespace: str,
    spec: InferencePoolSpec,
    images: Images | None = None,
    peers: Peers | None = None,
) -> list[Manifest]:
    """Every child of the pool, in the order to apply them: who may connect first (no pod
    runs before its policy), then the pool secret, then config before its users."""
    images = images or Images()
    children = network_policies(pool, namespace, spec, peers)
    secret = pool_secret(pool, namespace, spec)
    if secret is not None:
        children.append(secret)
    children += router_manifests(pool, namespace, spec, images)
    for role in spec.roles():
        children += [
            worker_service(pool, namespace, spec, role),
            worker_deployment(pool, namespace, spec, role, images),
            disruption_budget(pool, namespace, "worker", role),
        ]
    return children


def router_endpoint(pool: str, namespace: str, spec: InferencePoolSpec) -> str:
    port = spec.router.service.port
    suffix = "" if port == 80 else f":{port}"
    return f"http://{pool}-router.{namespace}.svc{suffix}"


# --- pod template overrides -----------------------------------------------------------------


def merge_template(base: Manifest, override: Manifest, _within: str = "") -> Manifest:
    """``override`` (a partial pod template) deep-merged over ``base``: maps key by key, the
    associative lists by their keys as the API server merges them (containers, volumes and
    env by name, ports by containerPort and protocol, volume mounts by mountPath: see
    :data:`MERGE_KEYS`), other lists replaced. Where
    Kubernetes allows one of several fields (a probe's or hook's handler, a volume's source,
    an env var's value or valueFrom and its kind), an override that names one replaces the
    base's other: merged key by key, both would stand, and the API server refuses that."""
    out = copy.deepcopy(base)
    group = ONE_OF.get(_within)
    named = {k for k in group & override.keys() if override[k] is not None} if group else set()
    if named:  # (a member given as null names nothing)
        for key in group - named:  # type: ignore[operator]
            out.pop(key, None)
    for key, value in override.items():
        mine = out.get(key)
        if isinstance(mine, dict) and isinstance(value, dict):
            out[key] = merge_template(mine, value, _one_of_kind(_within, key))
        elif isinstance(mine, list) and isinstance(value, list) and _keyed(key, mine, value):
            keys = MERGE_KEYS[key]
            theirs = list(value)  # an override's own repeated key stays, for the checks
            kind = key if key in ("volumes", "env") else ""
            merged = []
            for item in mine:
                match = next((t for t in theirs if _item_key(keys, t) == _item_key(keys, item)),
                             None)  # fmt: skip
                if match is not None:
                    theirs.remove(match)
                merged.append(merge_template(item, match or {}, kind))
            out[key] = merged + [copy.deepcopy(i) for i in theirs]
        else:
            out[key] = copy.deepcopy(value)
    return out


def _one_of_kind(within: str, key: str) -> str:
    """What the map under ``key`` is, for :data:`ONE_OF`: a probe or a lifecycle hook (a
    handler), an env var's valueFrom; "" for anything else."""
    if key in PROBES or (within == "lifecycle" and key in ("postStart", "preStop")):
        return "handler"
    if key == "lifecycle":
        return "lifecycle"
    if within == "env" and key == "valueFrom":
        return "valueFrom"
    return ""


# The associative lists of a pod template and their keys, as the API server merges them
# (server-side apply's x-kubernetes-list-map-keys, read from the Kubernetes schema): a
# volume mount is its mountPath, a port its containerPort and protocol. Other lists are
# atomic: an override replaces them whole.
MERGE_KEYS: dict[str, tuple[str, ...]] = {
    field: keys
    for definition, fields in (
        (
            "io.k8s.api.core.v1.PodSpec",
            (
                "containers",
                "initContainers",
                "ephemeralContainers",
                "volumes",
                "imagePullSecrets",
                "hostAliases",
                "topologySpreadConstraints",
                "resourceClaims",
                "schedulingGates",
            ),
        ),
        ("io.k8s.api.core.v1.Container", ("env", "ports", "volumeMounts", "volumeDevices")),
    )
    for field in fields
    if (keys := list_map_keys(definition, field))
}


def _item_key(keys: tuple[str, ...], item: Any) -> tuple[Any, ...]:
    return tuple(str(item.get(k, KEY_DEFAULTS.get(k))) for k in keys)


def _keyed(field: str, *lists: list[Any]) -> bool:
    """Whether both lists merge item by item: an associative list whose items all have
    their keys (else the override replaces it, and the checks say what is wrong)."""
    keys = MERGE_KEYS.get(field)
    return keys is not None and all(
        isinstance(i, dict) and all(k in i or k in KEY_DEFAULTS for k in keys)
        for items in lists
        for i in items
    )


# --- operator upgrades ----------------------------------------------------------------------

# The containers of a worker pod whose images the operator picks when the spec names none:
# the worker, and the init containers that fetch or make the model beside it.
_DEFAULT_IMAGED = (WORKER_CONTAINER, "fetch-model", "make-model")
# The router's init container that copies the tokenizer out of the (decode) worker image.
_COPY_TOKENIZER = "copy-tokenizer"


def _containers(deployment: Manifest) -> list[Manifest]:
    pod = ((deployment.get("spec") or {}).get("template") or {}).get("spec") or {}
    return [*(pod.get("containers") or []), *(pod.get("initContainers") or [])]


def _default_imaged(template: Manifest) -> dict[str, str | None]:
    """The images of the containers in ``_DEFAULT_IMAGED``, by name."""
    return {
        c["name"]: c.get("image")
        for c in _containers({"spec": {"template": template}})
        if c.get("name") in _DEFAULT_IMAGED
    }


def _annotation(obj: Manifest, key: str) -> str | None:
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(key)


def _record(images: dict[str, str | None]) -> str:
    return json.dumps(images, sort_keys=True, separators=(",", ":"))


def _recorded(obj: Manifest) -> dict[str, Any]:
    try:
        found = json.loads(_annotation(obj, DEFAULT_IMAGES) or "{}")
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def keep_default_images(
    children: list[Manifest],
    lives: Iterable[Manifest | None] | Mapping[tuple[str, str], Manifest],
) -> list[Manifest]:
    """``children`` (as ``render`` made them) with the worker images of the running pool
    kept where only the operator's defaults moved, so that upgrading the operator restarts
    no GPU pod; the children themselves are left as they are.

    ``lives``: the live objects, in any order, None for one not made yet (the list the
    handlers read, parallel to ``children``, will do), or a mapping by (kind, name).

    The rule: a worker Deployment rendered with the default-image annotation whose live
    Deployment carries the same key keeps the live images of its worker, fetch-model and
    make-model containers, each where it is still the image the operator recorded having
    given it (``kvpool.io/default-images``: an image edited by hand is put back, to the new
    default). Where the key changed (another engine type, a GPU added or
    removed) or is gone (the spec or its podTemplate names an image) the new image is
    applied, and those pods roll as they would anyway. The router's copy-tokenizer init
    container, which reads the model out of the decode worker image, follows the decode
    Deployment's kept image; the router itself follows the operator's default router image
    (router and operator move together).

    To move a pool's workers to the new operator's default images: name the image in the
    spec (``engine.image``), or remove the annotation from the worker Deployments
    (``kubectl annotate deployment <pool>-decode kvpool.io/default-image-``): the next sync
    renders the default of the running operator, and the Deployment rolls to it."""
    if isinstance(lives, Mapping):
        lives = lives.values()
    live = {
        (obj["kind"], obj["metadata"]["name"]): obj
        for obj in lives
        if obj is not None and obj.get("kind") and (obj.get("metadata") or {}).get("name")
    }
    out = copy.deepcopy(children)
    followed: dict[str, str] = {}  # a rendered default image -> the live one it gives way to
    for child in out:
        key = _annotation(child, DEFAULT_IMAGE)
        running = live.get((child["kind"], child["metadata"]["name"]))
        if child["kind"] != "Deployment" or key is None or running is None:
            continue
        if _annotation(running, DEFAULT_IMAGE) != key:
            continue
        decode = child["metadata"]["labels"].get(GROUP_LABEL) == "decode"
        images = {c.get("name"): c.get("image") for c in _containers(running)}
        recorded = _recorded(running)
        for c in _containers(child):
            kept = images.get(c["name"]) if c["name"] in _DEFAULT_IMAGED else None
            if kept and recorded.get(c["name"]) == kept:
                if decode and c["name"] == WORKER_CONTAINER:
                    followed[c["image"]] = kept
                c["image"] = kept
        template = child["spec"]["template"]
        child["metadata"]["annotations"][DEFAULT_IMAGES] = _record(_default_imaged(template))
    for child in out:
        if child["kind"] == "Deployment" and _is_router(child):
            for c in _containers(child):
                if c["name"] == _COPY_TOKENIZER and c.get("image") in followed:
                    c["image"] = followed[c["image"]]
    return out


def _is_router(obj: Manifest) -> bool:
    return (obj["metadata"].get("labels") or {}).get(COMPONENT_LABEL) == "router"
