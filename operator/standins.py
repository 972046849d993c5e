"""Stand-ins for what a real API server checks and kmock's emulator does not: run by the
operator before it writes a pool's children, and by ``kvpool check`` on manifests.

* **CEL cost** (:func:`cel_cost_problems`): each validation rule of a CRD, priced by the API
  server's estimator (see :mod:`kvpool.api.crd`), within the per-rule and per-CRD limits,
  or the CRD itself is refused ("estimated rule cost exceeds budget").
* **Pod validation** (:func:`pod_problems`): what ``ValidatePodSpec`` refuses that the
  OpenAPI schema cannot say: one-of fields (a probe's or hook's handler, a volume's source,
  an env var's value or valueFrom), unique container, volume, port and mount names, mounts
  of volumes the pod has, port names as IANA service names, requests within limits, and
  probes' thresholds.
* **Pod Security "restricted"** (:func:`restricted_problems`): the profile's controls, as
  Pod Security admission applies them (``restricted:latest``), to every pod template.
* **Server-side apply** (:func:`apply_problems`): every associative list (the schema's
  ``x-kubernetes-list-type: map``) has its key fields in each item and no two items with
  one key (the API server refuses the apply: "duplicate entries for key"); a ``set`` has
  no repeated item. The keys come from the Kubernetes OpenAPI that kubernetes-validate
  ships, so they are the API server's, not a list kept here.

Each problem names the object and the field: ``Deployment tiny-decode:
spec.template.spec.containers[worker].securityContext.allowPrivilegeEscalation: must be
false``.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import resources
from typing import Any

from kvpool.api.inferencepool import zero_count
from kvpool.api.podtemplate import CONTAINER_LISTS, HANDLERS, ONE_OF, PROBES

Manifest = dict[str, Any]

KUBERNETES_VERSION = "1.37.0"
_SCHEMAS = f"kubernetes-json-schema/v{KUBERNETES_VERSION}-local"
# Kinds whose object holds a pod template, and where.
POD_TEMPLATE_AT = {
    "Deployment": ("spec", "template"),
    "StatefulSet": ("spec", "template"),
    "DaemonSet": ("spec", "template"),
    "ReplicaSet": ("spec", "template"),
    "Job": ("spec", "template"),
}
CHECKS = ("cel-cost", "pod-validation", "pod-security-restricted", "server-side-apply")


@dataclass(frozen=True)
class Finding:
    check: str  # one of CHECKS
    obj: str  # "Deployment tiny-decode"
    path: str  # the field, from the object's root
    message: str

    def __str__(self) -> str:
        return f"{self.obj}: {self.path}: {self.message} [{self.check}]"


def check_objects(objects: Iterable[Manifest], checks: Iterable[str] = CHECKS) -> list[Finding]:
    """Every stand-in in ``checks`` on every object (CRDs: cost; pod templates: the pod
    checks; every kind with a schema: server-side apply)."""
    wanted = set(checks)
    findings: list[Finding] = []
    for obj in objects:
        kind = obj.get("kind", "?")
        name = f"{kind} {(obj.get('metadata') or {}).get('name', '?')}"

        def add(check: str, problems: Iterable[tuple[str, str]], name: str = name) -> None:
            if check in wanted:
                findings.extend(Finding(check, name, p, m) for p, m in problems)

        if kind == "CustomResourceDefinition":
            add("cel-cost", cel_cost_problems(obj))
        at = POD_TEMPLATE_AT.get(kind)
        pod, prefix = None, ""
        if at is not None:
            pod = ((obj.get(at[0]) or {}).get(at[1]) or {}).get("spec")
            prefix = f"{at[0]}.{at[1]}.spec"
        elif kind == "Pod":
            pod, prefix = obj.get("spec"), "spec"
        if kind == "Deployment":
            add("pod-validation", _strategy_problems(obj))
        if isinstance(pod, dict):
            meta_at = prefix.rsplit(".spec", 1)[0] + ".metadata" if at else "metadata"
            template = ((obj.get(at[0]) or {}).get(at[1]) or {}) if at else obj
            annotations = (template.get("metadata") or {}).get("annotations") or {}
            add("pod-validation", pod_problems(pod, prefix))
            add("pod-security-restricted", restricted_problems(pod, prefix))
            add("pod-security-restricted", apparmor_problems(annotations, f"{meta_at}.annotations"))
        add("server-side-apply", apply_problems(obj))
    return findings


# --- CEL cost -------------------------------------------------------------------------------


def cel_cost_problems(crd: Manifest) -> list[tuple[str, str]]:
    from kvpool.api.crd import cost_problems

    found = []
    for problem in cost_problems(crd):
        path, _, message = problem.partition(": ")
        if path.startswith(".") and message:  # a field of the schema
            found.append((f"spec.versions[].schema.openAPIV3Schema{path}", message))
        else:
            found.append(("spec.versions", problem))
    return found


# --- pod validation -------------------------------------------------------------------------

# RFC 1123 label (container, volume names) and IANA service name (port names), as
# k8s.io/apimachinery/pkg/util/validation has them
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_IANA_SVC = re.compile(r"^[-a-z0-9]+$")
_LETTER = re.compile(r"[a-z]")


def _containers(pod: Manifest, prefix: str) -> Iterator[tuple[str, str, Manifest]]:
    """(list key, path, container) of each container of a pod spec."""
    for key in CONTAINER_LISTS:
        for i, container in enumerate(pod.get(key) or ()):
            if isinstance(container, dict):
                yield key, f"{prefix}.{key}[{container.get('name', i)}]", container


def _one(value: Any, members: Iterable[str], path: str, what: str, need: bool) -> list[Any]:
    if not isinstance(value, dict):
        return []
    given = sorted(k for k in members if value.get(k) is not None and value.get(k) != "")
    if len(given) > 1:
        return [(path, f"more than one {what} ({', '.join(given)}): Kubernetes allows one")]
    if need and not given:
        return [(path, f"no {what}: Kubernetes needs one ({', '.join(sorted(members))})")]
    return []


def _quantity(value: Any) -> Any:
    from kubernetes.utils import parse_quantity

    try:
        return parse_quantity(value)
    except (ValueError, TypeError, ArithmeticError):
        return None


def pod_problems(pod: Manifest, prefix: str = "spec") -> list[tuple[str, str]]:
    """What the API server's pod validation refuses beyond the schema (``prefix``: where the
    pod spec is in its object)."""
    problems: list[tuple[str, str]] = []
    volumes = [v for v in pod.get("volumes") or () if isinstance(v, dict)]
    names = [v.get("name") for v in volumes]
    for i, volume in enumerate(volumes):
        path = f"{prefix}.volumes[{volume.get('name', i)}]"
        if names.count(volume.get("name")) > 1:
            problems.append((f"{path}.name", "Duplicate value: volume names must be unique"))
        problems += _one(volume, ONE_OF["volumes"], path, "volume source", need=True)
    seen: set[str] = set()
    for key, path, container in _containers(pod, prefix):
        name = container.get("name")
        if not isinstance(name, str) or not _DNS_LABEL.match(name) or len(name) > 63:
            problems.append((f"{path}.name", f"{name!r}: a container name is an RFC 1123 label"))
        elif name in seen:
            problems.append((f"{path}.name", f"Duplicate value: {name!r}"))
        seen.add(str(name))
        if key != "ephemeralContainers" and not container.get("image"):
            problems.append((f"{path}.image", "Required value"))
        problems += _container_problems(container, path, key, set(names))
    return problems


def _strategy_problems(deployment: Manifest) -> list[tuple[str, str]]:
    """A rolling update that can move no pod: maxSurge and maxUnavailable both zero."""
    rolling = ((deployment.get("spec") or {}).get("strategy") or {}).get("rollingUpdate") or {}
    surge, unavailable = rolling.get("maxSurge", "25%"), rolling.get("maxUnavailable", "25%")
    if zero_count(surge) and zero_count(unavailable):
        path = "spec.strategy.rollingUpdate.maxUnavailable"
        return [(path, "may not be 0 when maxSurge is 0")]
    return []


def _container_problems(
    container: Manifest, path: str, key: str, volumes: set[Any]
) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    port_names: set[str] = set()
    for j, port in enumerate(container.get("ports") or ()):
        if not isinstance(port, dict):
            continue
        at = f"{path}.ports[{j}]"
        name = port.get("name")
        if name is not None:
            if not (isinstance(name, str) and len(name) <= 15 and _IANA_SVC.match(name)
                    and _LETTER.search(name) and not name.startswith("-")
                    and not name.endswith("-") and "--" not in name):  # fmt: skip
                problems.append((f"{at}.name", f"{name!r}: a port name is an IANA service name "
                                 "(at most 15 of a-z, 0-9 and '-', with a letter)"))  # fmt: skip
            elif name in port_names:
                problems.append((f"{at}.name", f"Duplicate value: {name!r}"))
            port_names.add(str(name))
        number = port.get("containerPort")
        if not (isinstance(number, int) and 0 < number < 65536):
            problems.append((f"{at}.containerPort", f"{number!r}: must be 1 to 65535"))
    mounts: set[str] = set()
    for j, mount in enumerate(container.get("volumeMounts") or ()):
        if not isinstance(mount, dict):
            continue
        at = f"{path}.volumeMounts[{j}]"
        if mount.get("name") not in volumes:
            problems.append((f"{at}.name", f"Not found: no volume {mount.get('name')!r}"))
        if mount.get("mountPath") in mounts:
            problems.append((f"{at}.mountPath", f"Duplicate value: {mount.get('mountPath')!r}"))
        mounts.add(str(mount.get("mountPath")))
    for j, env in enumerate(container.get("env") or ()):
        if not isinstance(env, dict):
            continue
        at = f"{path}.env[{env.get('name', j)}]"
        problems += _one(env, ONE_OF["env"], at, "value (value, valueFrom)", need=False)
        if isinstance(env.get("valueFrom"), dict):
            problems += _one(env["valueFrom"], ONE_OF["valueFrom"], f"{at}.valueFrom",
                             "source", need=True)  # fmt: skip
    for probe in PROBES:
        value = container.get(probe)
        if value is None:
            continue
        if key == "initContainers" and container.get("restartPolicy") != "Always":
            problems.append((f"{path}.{probe}", "Forbidden: an init container has no probes"))
            continue
        problems += _one(value, HANDLERS - {"sleep"}, f"{path}.{probe}", "handler", need=True)
        threshold = (value or {}).get("successThreshold")
        if probe != "readinessProbe" and threshold not in (None, 1):
            problems.append((f"{path}.{probe}.successThreshold", "must be 1"))
    if (
        key == "initContainers"
        and container.get("lifecycle") is not None
        and container.get("restartPolicy") != "Always"
    ):
        problems.append((f"{path}.lifecycle", "Forbidden: may not be set for init containers"))
    for hook in ("postStart", "preStop"):
        value = (container.get("lifecycle") or {}).get(hook)
        if value is not None:
            problems += _one(value, HANDLERS - {"grpc"}, f"{path}.lifecycle.{hook}", "handler",
                             need=True)  # fmt: skip
    resources_ = container.get("resources") or {}
    limits, requests = resources_.get("limits") or {}, resources_.get("requests") or {}
    for resource, request in requests.items():
        limit = limits.get(resource)
        if limit is None:
            continue
        low, high = _quantity(request), _quantity(limit)
        if low is not None and high is not None and low > high:
            message = f"{request} must be less than or equal to the limit {limit}"
            problems.append((f"{path}.resources.requests[{resource}]", message))
    return problems


# --- Pod Security "restricted" --------------------------------------------------------------

# The restricted profile, as k8s.io/pod-security-admission/policy has it (latest).
_RESTRICTED_VOLUMES = frozenset({
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
    "projected", "secret",
})  # fmt: skip
_SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes", "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem",
})  # fmt: skip
_SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t",
                            "container_engine_t"})  # fmt: skip


def restricted_problems(pod: Manifest, prefix: str = "spec") -> list[tuple[str, str]]:
    """The controls of Pod Security's "restricted" profile that the pod spec fails, each at
    its field (a namespace labelled ``pod-security.kubernetes.io/enforce: restricted``
    refuses the pod; the Deployment then shows ReplicaFailure, FailedCreate)."""
    problems: list[tuple[str, str]] = []
    pod_sc = pod.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            problems.append((f"{prefix}.{key}", "must be false (host namespaces)"))
    for volume in pod.get("volumes") or ():
        if not isinstance(volume, dict):
            continue
        kinds = sorted(k for k in volume if k != "name" and volume[k] is not None)
        for kind in kinds:
            if kind not in _RESTRICTED_VOLUMES:
                problems.append((f"{prefix}.volumes[{volume.get('name')}].{kind}",
                                 "a volume type the restricted profile forbids"))  # fmt: skip
    for sysctl in pod_sc.get("sysctls") or ():
        if isinstance(sysctl, dict) and sysctl.get("name") not in _SAFE_SYSCTLS:
            problems.append((f"{prefix}.securityContext.sysctls[{sysctl.get('name')}]",
                             "not a safe sysctl"))  # fmt: skip
    problems += _context_problems(pod_sc, f"{prefix}.securityContext")
    if pod_sc.get("runAsUser") == 0:
        problems.append((f"{prefix}.securityContext.runAsUser", "must not be 0"))
    for _, path, container in _containers(pod, prefix):
        sc = container.get("securityContext") or {}
        at = f"{path}.securityContext"
        problems += _context_problems(sc, at)
        if sc.get("privileged"):
            problems.append((f"{at}.privileged", "must be false"))
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append((f"{at}.allowPrivilegeEscalation", "must be false"))
        run_as_non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
        if run_as_non_root is not True:
            problems.append((f"{at}.runAsNonRoot", "must be true (here or in the pod's)"))
        if sc.get("runAsUser") == 0:
            problems.append((f"{at}.runAsUser", "must not be 0"))
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            message = "must be RuntimeDefault or Localhost (here or in the pod's)"
            problems.append((f"{at}.seccompProfile.type", message))
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or ()):
            problems.append((f"{at}.capabilities.drop", "must include ALL"))
        extra = [c for c in caps.get("add") or () if c != "NET_BIND_SERVICE"]
        if extra:
            message = f"may add only NET_BIND_SERVICE, not {', '.join(map(str, extra))}"
            problems.append((f"{at}.capabilities.add", message))
        for j, port in enumerate(container.get("ports") or ()):
            if isinstance(port, dict) and port.get("hostPort"):
                problems.append((f"{path}.ports[{j}].hostPort", "must be unset (host ports)"))
        problems += _probe_host_problems(container, path)
    return problems


def _probe_host_problems(container: Manifest, path: str) -> list[tuple[str, str]]:
    """Probes and lifecycle hooks (baseline, Kubernetes 1.34 on): no ``host`` of a
    ``httpGet`` or ``tcpSocket``, which would make the kubelet call another host."""
    handlers = [(f"{path}.{p}", container.get(p)) for p in PROBES]
    lifecycle = container.get("lifecycle") or {}
    handlers += [(f"{path}.lifecycle.{h}", lifecycle.get(h)) for h in ("postStart", "preStop")]
    problems = []
    for at, handler in handlers:
        for kind in ("httpGet", "tcpSocket"):
            action = (handler or {}).get(kind) if isinstance(handler, dict) else None
            if isinstance(action, dict) and action.get("host"):
                problems.append((f"{at}.{kind}.host", "must be unset (the pod's own address)"))
    return problems


_APPARMOR = "container.apparmor.security.beta.kubernetes.io/"


def apparmor_problems(annotations: Manifest, at: str) -> list[tuple[str, str]]:
    """AppArmor by annotation (before the securityContext field): only the runtime's
    default profile or a localhost one."""
    return [
        (f"{at}[{key}]", f"{value!r}: must be runtime/default or localhost/<profile>")
        for key, value in annotations.items()
        if key.startswith(_APPARMOR)
        and not (value == "runtime/default" or str(value).startswith("localhost/"))
    ]


def _context_problems(sc: Manifest, at: str) -> list[tuple[str, str]]:
    """The controls a pod's and a container's securityContext share."""
    problems: list[tuple[str, str]] = []
    if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        problems.append((f"{at}.seccompProfile.type", "must not be Unconfined"))
    if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
        problems.append((f"{at}.appArmorProfile.type", "must not be Unconfined"))
    selinux = sc.get("seLinuxOptions") or {}
    if selinux.get("type", "") not in _SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
        problems.append((f"{at}.seLinuxOptions", "a custom SELinux type, user or role"))
    if sc.get("procMount") not in (None, "Default"):
        problems.append((f"{at}.procMount", "must be Default"))
    if (sc.get("windowsOptions") or {}).get("hostProcess"):
        problems.append((f"{at}.windowsOptions.hostProcess", "must be false"))
    return problems


# --- server-side apply ----------------------------------------------------------------------

# Key fields that the API server defaults before it merges (the OpenAPI's defaults, which
# the JSON schemas here leave out): an item without one has the default as its key.
KEY_DEFAULTS = {"protocol": "TCP"}


def apply_problems(obj: Manifest) -> list[tuple[str, str]]:
    """Where server-side apply would refuse ``obj``: associative lists with an item lacking
    a key field or two items of one key, sets with a repeated item. Kinds without a schema
    here are not checked."""
    schema = _kind_schema(obj.get("apiVersion", ""), obj.get("kind", ""))
    if schema is None:
        return []
    problems: list[tuple[str, str]] = []
    _walk(obj, schema, "", problems)
    return problems


def _walk(value: Any, schema: Manifest, path: str, problems: list[tuple[str, str]]) -> None:
    schema = _resolve(schema)
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = props.get(key) or (extra if isinstance(extra, dict) else None)
            if sub is not None:
                _walk(item, sub, f"{path}.{key}" if path else str(key), problems)
        return
    if not isinstance(value, list):
        return
    items = schema.get("items")
    list_type = schema.get("x-kubernetes-list-type")
    keys = schema.get("x-kubernetes-list-map-keys") or []
    seen: dict[Any, int] = {}
    for i, item in enumerate(value):
        label = str(i)
        if list_type == "map" and isinstance(item, dict):
            missing = [k for k in keys if item.get(k) is None and k not in KEY_DEFAULTS]
            if missing:
                problems.append((f"{path}[{i}]", f"an item of an associative list omits its key "
                                 f"field {', '.join(missing)}"))  # fmt: skip
                continue
            key = tuple(item.get(k, KEY_DEFAULTS.get(k)) for k in keys)
            label = ",".join(f"{k}={v}" for k, v in zip(keys, key, strict=True))
            if key in seen:
                problems.append((f"{path}[{label}]", f"duplicate entries for key [{label}]: "
                                 "server-side apply refuses the object"))  # fmt: skip
            seen.setdefault(key, i)
        elif list_type == "set":
            marker = json.dumps(item, sort_keys=True)
            if marker in seen:
                problems.append((f"{path}[{i}]", f"duplicate item {item!r} in a set"))
            seen.setdefault(marker, i)
        if isinstance(items, dict):
            _walk(item, items, f"{path}[{label}]", problems)


def _resolve(schema: Manifest) -> Manifest:
    for _ in range(16):
        ref = schema.get("$ref")
        if not isinstance(ref, str):
            for key in ("allOf", "anyOf", "oneOf"):
                for option in schema.get(key) or ():
                    if isinstance(option, dict) and "$ref" in option:
                        return _resolve(option)
            return schema
        schema = _definitions().get(ref.rsplit("/", 1)[-1], {})
    return schema


def _kind_schema(api_version: str, kind: str) -> Manifest | None:
    group, _, version = api_version.rpartition("/")
    stem = kind.lower() + (f"-{group.split('.')[0]}" if group else "") + f"-{version}.json"
    return _schema_file(stem)


@functools.cache
def _schema_file(stem: str) -> Manifest | None:
    path = resources.files("kubernetes_validate").joinpath(_SCHEMAS).joinpath(stem)
    if not path.is_file():
        return None
    return json.loads(path.read_text())


@functools.cache
def _definitions() -> dict[str, Manifest]:
    root = resources.files("kubernetes_validate").joinpath(_SCHEMAS)
    return json.loads(root.joinpath("_definitions.json").read_text())["$defs"]


def list_map_keys(definition: str, field: str) -> tuple[str, ...] | None:
    """The keys of an associative list in the Kubernetes schema (``io.k8s.api.core.v1.
    Container``, ``ports`` -> containerPort, protocol); None when it is not one."""
    prop = (_definitions().get(definition, {}).get("properties") or {}).get(field) or {}
    if prop.get("x-kubernetes-list-type") != "map":
        return None
    return tuple(prop.get("x-kubernetes-list-map-keys") or ())
