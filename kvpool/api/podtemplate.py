"""What a pool's ``podTemplate`` may ask for: the part of a spec the models cannot type.

A template is merged over the pod the operator renders and applied with the operator's
rights, so whoever may create an InferencePool would otherwise get those rights: a
privileged container, the node's network or process namespaces, a directory of the node,
another service account, or the labels by which kvpool's selectors (and the router's
discovery) find the pods of a pool, its own or another's. These checks refuse that before
anything is rendered; the Kubernetes schema of the merged result is checked by the operator
(``kvpool.operator.podcheck``), which needs the schemas this core does not carry.

Host access (privileged containers, host namespaces, hostPath volumes, host ports) may be
allowed by the operator's administrator (``allow_host_access``); a service account and the
protected labels never are: the operator sets them.

Every walk here is iterative: a template nested thousands deep gets a message, not a
RecursionError from the first recursive function to see it.
"""

from __future__ import annotations

from typing import Any

MAX_DEPTH = 64
#: the labels kvpool's selectors read; a template that sets one could join another pool
PROTECTED_LABELS = frozenset({
    "kvpool.io/pool",
    "kvpool.io/group",
    "kvpool.io/role",
    "app.kubernetes.io/component",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/name",
    "app.kubernetes.io/managed-by",
})  # fmt: skip
KVPOOL_PREFIX = "kvpool.io/"  # labels and annotations of kvpool's own (the config hash)
#: a vLLM worker pod's --max-num-seqs, as its args set it: vLLM publishes it nowhere, and the
#: router needs it to fill no worker past its slots before a scrape shows a queue
MAX_NUM_SEQS_ANNOTATION = KVPOOL_PREFIX + "max-num-seqs"
HOST_NAMESPACES = ("hostNetwork", "hostPID", "hostIPC")
CONTAINER_LISTS = ("containers", "initContainers", "ephemeralContainers")
# Lists of objects in a pod spec and a container: checked to be lists of objects, as the
# merge (items by name) and the API server take them.
POD_LISTS = (
    *CONTAINER_LISTS,
    "volumes",
    "tolerations",
    "imagePullSecrets",
    "topologySpreadConstraints",
    "hostAliases",
    "readinessGates",
)
CONTAINER_OBJECT_LISTS = ("ports", "env", "envFrom", "volumeMounts", "volumeDevices")
HOST_ACCESS = "host access, which this operator refuses (its allowHostAccess setting is off)"

Problem = tuple[str, str]  # (path inside the template, message)

HANDLERS = frozenset({"exec", "httpGet", "tcpSocket", "grpc", "sleep"})
#: Kubernetes' one-of groups, by what holds them (core/v1 Probe, LifecycleHandler,
#: VolumeSource, EnvVar, EnvVarSource)
ONE_OF: dict[str, frozenset[str]] = {
    "handler": HANDLERS,
    "volumes": frozenset({
        "emptyDir", "persistentVolumeClaim", "hostPath", "secret", "configMap", "projected",
        "downwardAPI", "csi", "ephemeral", "nfs", "image", "iscsi", "fc", "rbd", "cephfs",
        "cinder", "azureDisk", "azureFile", "awsElasticBlockStore", "gcePersistentDisk",
        "gitRepo", "glusterfs", "flocker", "flexVolume", "vsphereVolume", "quobyte",
        "photonPersistentDisk", "portworxVolume", "scaleIO", "storageos",
    }),
    "env": frozenset({"value", "valueFrom"}),
    "valueFrom": frozenset(
        {"fieldRef", "resourceFieldRef", "configMapKeyRef", "secretKeyRef", "fileKeyRef"}
    ),
}  # fmt: skip
PROBES = ("livenessProbe", "readinessProbe", "startupProbe")


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether ``value`` has objects or lists nested more than ``limit`` levels deep."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth >= limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def template_problems(template: Any, *, allow_host_access: bool = False) -> list[Problem]:
    """Every problem of a partial pod template, as (path, message); none: it may be merged.

    Paths are relative to the template and written as kubectl writes them
    (``spec.containers[0].securityContext.privileged``)."""
    if not isinstance(template, dict):
        return [("", f"must be an object (a partial pod template), not {_kind(template)}")]
    if too_deep(template):
        return [("", f"nested deeper than {MAX_DEPTH} levels")]
    problems: list[Problem] = []
    metadata = _object(template, "metadata", "metadata", problems)
    spec = _object(template, "spec", "spec", problems)
    if metadata is not None:
        _check_metadata(metadata, problems)
    if spec is not None:
        _check_pod_spec(spec, problems, allow_host_access)
    return problems


def describe(problems: list[Problem], prefix: str = "") -> str:
    """Problems as one line, each ``path: message``, paths under ``prefix``."""
    return "; ".join(f"{join_path(prefix, path)}: {message}" for path, message in problems)


def join_path(prefix: str, path: str) -> str:
    if not path or not prefix:
        return prefix or path
    return prefix + path if path.startswith("[") else f"{prefix}.{path}"


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}  # fmt: skip
    return names.get(type(value), type(value).__name__)


def _object(parent: dict[str, Any], key: str, path: str, problems: list[Problem]) -> Any:
    """``parent[key]`` if it is an object; absent or null: None; else a problem, and None."""
    value = parent.get(key)
    if value is None or isinstance(value, dict):
        return value
    problems.append((path, f"must be an object, not {_kind(value)}"))
    return None


def _objects(parent: dict[str, Any], key: str, path: str, problems: list[Problem]) -> list:
    """``parent[key]`` as a list of objects (absent or null: empty); other items: problems."""
    value = parent.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        problems.append((path, f"must be a list of objects, not {_kind(value)}"))
        return []
    found = []
    for i, item in enumerate(value):
        if isinstance(item, dict):
            found.append((f"{path}[{i}]", item))
        else:
            problems.append((f"{path}[{i}]", f"must be an object, not {_kind(item)}"))
    return found


def _check_metadata(metadata: dict[str, Any], problems: list[Problem]) -> None:
    for key in ("labels", "annotations"):
        values = _object(metadata, key, f"metadata.{key}", problems) or {}
        for name in values:
            name = str(name)
            if key == "labels" and name in PROTECTED_LABELS:
                problems.append((f"metadata.labels.{name}", "set by the operator: kvpool's"
                                 " selectors read it"))  # fmt: skip
            elif name.startswith(KVPOOL_PREFIX):
                problems.append((f"metadata.{key}.{name}", f"set by the operator ({KVPOOL_PREFIX}"
                                 " is kvpool's)"))  # fmt: skip


def _check_pod_spec(spec: dict[str, Any], problems: list[Problem], allow_host: bool) -> None:
    for key in ("serviceAccountName", "serviceAccount"):
        if key in spec:
            problems.append((f"spec.{key}", "set by the operator: a pool's pods run as the"
                             " account it gives them"))  # fmt: skip
    host: list[str] = []
    for key in HOST_NAMESPACES:
        if spec.get(key) not in (None, False):
            host.append(f"spec.{key}")
    pod_security = _object(spec, "securityContext", "spec.securityContext", problems)
    if pod_security is not None:
        host += _host_process(pod_security, "spec.securityContext", problems)
    lists = {key: _objects(spec, key, f"spec.{key}", problems) for key in POD_LISTS}
    for path, volume in lists["volumes"]:
        _one_of(volume, "volumes", path, "source", problems)
        if volume.get("hostPath") is not None:
            host.append(f"{path}.hostPath")
    for key in CONTAINER_LISTS:
        for path, container in lists[key]:
            host += _check_container(container, path, problems)
    if not allow_host:
        problems.extend((path, HOST_ACCESS) for path in host)


def _check_container(container: dict[str, Any], path: str, problems: list[Problem]) -> list[str]:
    """The container's shape problems (added) and its asks for host access (returned)."""
    host = []
    lists = {k: _objects(container, k, f"{path}.{k}", problems) for k in CONTAINER_OBJECT_LISTS}
    for port_path, port in lists["ports"]:
        if port.get("hostPort") not in (None, 0):
            host.append(f"{port_path}.hostPort")
    handlers = [(f"{path}.{p}", container.get(p)) for p in PROBES]
    lifecycle = container.get("lifecycle")
    if isinstance(lifecycle, dict):
        handlers += [(f"{path}.lifecycle.{h}", lifecycle.get(h)) for h in ("postStart", "preStop")]
    for where, handler in handlers:
        _one_of(handler, "handler", where, "handler", problems)
    for env_path, env in lists.get("env", ()):
        _one_of(env, "env", env_path, "value", problems)
        _one_of(env.get("valueFrom"), "valueFrom", f"{env_path}.valueFrom", "source", problems)
    security = _object(container, "securityContext", f"{path}.securityContext", problems)
    if security is not None:
        if security.get("privileged") not in (None, False):
            host.append(f"{path}.securityContext.privileged")
        host += _host_process(security, f"{path}.securityContext", problems)
    return host


def _host_process(security: dict[str, Any], path: str, problems: list[Problem]) -> list[str]:
    """A Windows host process container is a privileged one."""
    windows = _object(security, "windowsOptions", f"{path}.windowsOptions", problems)
    if windows is not None and windows.get("hostProcess") not in (None, False):
        return [f"{path}.windowsOptions.hostProcess"]
    return []


def _one_of(value: Any, group: str, path: str, what: str, problems: list[Problem]) -> None:
    """At most one member of a one-of group (:data:`ONE_OF`), as the API server requires."""
    if not isinstance(value, dict):
        return
    # a member given as null, or an env var's empty value, is none (the API server's view)
    given = sorted(
        k for k in ONE_OF[group] & value.keys() if value[k] is not None and value[k] != ""
    )
    if len(given) > 1:
        problems.append((path, f"more than one {what} ({', '.join(given)}): Kubernetes allows one"))
