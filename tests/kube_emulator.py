"""kmock's Kubernetes emulator, set up as the operator's tests meet it.

No kube-apiserver can be installed here; kmock's ``KubernetesEmulator`` stores objects and
serves list/watch/get/create/patch/delete and API discovery for the resources declared on it.
Every test that runs the operator declares the same API: the built-in kinds the operator
touches (Leases among them: the operator replicas' leader election), and the CRDs the Helm
chart installs (the ``InferencePool``).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART_CRDS = ROOT / "charts" / "kvpool" / "crds"
VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}
# group/version/plural -> (kind, namespaced, subresources)
BUILTIN: dict[str, tuple[str, bool, set[str]]] = {
    "apps/v1/deployments": ("Deployment", True, {"status"}),
    "v1/services": ("Service", True, set()),
    "v1/configmaps": ("ConfigMap", True, set()),
    "v1/serviceaccounts": ("ServiceAccount", True, set()),
    "rbac.authorization.k8s.io/v1/roles": ("Role", True, set()),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", True, set()),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", True, set()),
    "networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", True, set()),
    "v1/secrets": ("Secret", True, set()),
    "v1/pods": ("Pod", True, {"status"}),
    "v1/events": ("Event", True, set()),
    # the operator replicas' leader election (see _emulate_leases)
    "coordination.k8s.io/v1/leases": ("Lease", True, set()),
    # kopf discovers namespaces, and watches CRDs (it waits for that watch to start)
    "v1/namespaces": ("Namespace", False, set()),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, set()),
}


def chart_crds() -> dict[str, dict[str, Any]]:
    """The CRDs the chart installs, by file name."""
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(CHART_CRDS.glob("*.yaml"))}


def _expand_generate_name() -> None:
    """Give a created object without a name one from its ``metadata.generateName``, as the
    API server does (kopf names its Events that way; kmock 0.8 would store them all under
    the name None and answer 409 from the second on). Patched once, for every emulator."""
    import itertools

    from kmock._internal import k8s

    handle = k8s.KubernetesEmulator._handle
    if getattr(handle, "expands_generate_name", False):
        return
    counter = itertools.count(1)

    async def _handle(self: Any, request: Any) -> Any:
        meta = request.data.get("metadata") if isinstance(request.data, dict) else None
        if isinstance(meta, dict) and not meta.get("name") and meta.get("generateName"):
            meta["name"] = f"{meta['generateName']}{next(counter):05d}"
        return await handle(self, request)

    _handle.expands_generate_name = True  # type: ignore[attr-defined]
    k8s.KubernetesEmulator._handle = _handle  # type: ignore[method-assign]


APPLY = "application/apply-patch"


def _without(previous: Any, applied: Any, others: list[Any]) -> Any:
    """``applied`` as a merge patch, with ``None`` (delete) for each key of ``previous`` that
    it lacks and no other manager's last apply (``others``) holds."""
    if not (isinstance(previous, dict) and isinstance(applied, dict)):
        return applied
    out = {
        k: _without(previous.get(k), v, [o.get(k) for o in others if isinstance(o, dict)])
        for k, v in applied.items()
    }
    for key in previous.keys() - applied.keys():
        if not any(isinstance(o, dict) and key in o for o in others):
            out[key] = None
    return out


_APPLIED: dict[int, dict[Any, Any]] = {}  # per emulator: what each manager last applied


def _emulate_server_side_apply() -> None:
    """kmock 0.8 stores an apply patch as a merge patch, answers 404 to one for an object that
    does not exist, and keeps no ``managedFields``. Here, as a real API server: an apply
    creates a missing object; a field that the same manager applied before and applies no
    more is removed unless another manager's last apply has it (what server-side apply does); the
    object lists its appliers in ``managedFields`` (who, not which fields); a created object
    gets a ``metadata.uid``; a JSON patch of
    ``metadata.managedFields`` guarded by a resourceVersion test is honoured."""
    from kmock._internal import enums, k8s

    handle = k8s.KubernetesEmulator._handle
    if getattr(handle, "emulates_apply", False):
        return

    async def _handle(self: Any, request: Any) -> Any:
        kind = request.headers.get("Content-Type", "")
        if request.action == enums.action.CREATE and isinstance(request.data, dict):
            request.data.setdefault("metadata", {}).setdefault("uid", str(uuid.uuid4()))
        if request.action != enums.action.UPDATE or request.name is None or request.subresource:
            return await handle(self, request)
        key = (request.resource, request.namespace, request.name)
        stored = self._objects[key] if key in self._objects else None
        live = None if stored is None or stored.deleted else stored.raw
        if isinstance(request.data, list):  # a JSON patch: only of managedFields
            data: dict[str, Any] = {}
            for op in request.data:
                if op.get("op") == "test" and op.get("path") == "/metadata/resourceVersion":
                    if (live or {}).get("metadata", {}).get("resourceVersion") != op["value"]:
                        from kmock._internal.k8s import KubernetesObjectConflictError

                        raise KubernetesObjectConflictError()
                elif op.get("op") == "replace" and op.get("path") == "/metadata/managedFields":
                    data = {"metadata": {"managedFields": op["value"]}}
            object.__setattr__(request, "data", data)  # kmock's requests are frozen
            return await handle(self, request)
        if not kind.startswith(APPLY) or not isinstance(request.data, dict):
            return await handle(self, request)
        manager = request.params.get("fieldManager", "")
        applied = _APPLIED.setdefault(id(self), {})
        body = json.loads(json.dumps(request.data))
        others = [v for (*k, m), v in applied.items() if tuple(k) == key and m != manager]
        data = _without(applied.get((*key, manager)), body, others) if live is not None else body
        entries = [
            e for e in ((live or {}).get("metadata", {}).get("managedFields") or [])
            if e.get("manager") != manager or e.get("operation") != "Apply"
        ]  # fmt: skip
        data.setdefault("metadata", {})["managedFields"] = [
            *entries, {"manager": manager, "operation": "Apply", "apiVersion": body.get(
                "apiVersion"), "fieldsType": "FieldsV1"},
        ]  # fmt: skip
        if live is None:  # created here, as the emulator creates; then served as a patch
            data["metadata"].setdefault("uid", str(uuid.uuid4()))
            async with self._lock:
                if stored is None:
                    self._objects[key] = data
                else:
                    stored.create(data)
                raw = self._objects[key].last.raw
                await self._buses[request.resource].put({"type": "ADDED", "object": raw})
            data = {}
        object.__setattr__(request, "data", data)
        response = await handle(self, request)
        applied[(*key, manager)] = body
        return response

    _handle.emulates_apply = True  # type: ignore[attr-defined]
    k8s.KubernetesEmulator._handle = _handle  # type: ignore[method-assign]


LEASES = ("coordination.k8s.io", "v1", "leases")


def _emulate_leases() -> None:
    """kmock 0.8 keeps no ``resourceVersion`` and serves no PUT. For Leases (leader election)
    as a real API server: every write gives the object a new ``metadata.resourceVersion``;
    an update (PUT) replaces the object, and is refused with 409 Conflict when the
    ``resourceVersion`` it carries is not the stored one (optimistic concurrency: of two
    replicas that read one version, only the first to write wins)."""
    import datetime
    import itertools
    import uuid

    import aiohttp.web
    from kmock._internal import enums, k8s

    handle = k8s.KubernetesEmulator._handle
    if getattr(handle, "emulates_leases", False):
        return
    versions = itertools.count(1)

    async def _handle(self: Any, request: Any) -> Any:
        res = request.resource
        if res is None or (res.group, res.version, res.plural) != LEASES or request.subresource:
            return await handle(self, request)
        data = request.data if isinstance(request.data, dict) else None
        if request.action == enums.action.CREATE and data is not None:
            meta = data.setdefault("metadata", {})
            meta["resourceVersion"] = str(next(versions))
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = datetime.datetime.now(datetime.UTC).strftime(
                "%Y-%m-%dT%H:%M:%SZ"
            )
            return await handle(self, request)
        if request.action == enums.action.UPDATE and data is not None:  # a patch
            data.setdefault("metadata", {})["resourceVersion"] = str(next(versions))
            return await handle(self, request)
        if request.method != enums.method.PUT or request.name is None or data is None:
            return await handle(self, request)
        key = (res, request.namespace, request.name)
        async with self._lock:
            stored = self._objects[key] if key in self._objects else None
            if stored is None or stored.deleted:
                raise k8s.KubernetesObjectNotFoundError()
            live_meta = stored.raw.get("metadata") or {}
            given = (data.get("metadata") or {}).get("resourceVersion")
            if given is not None and given != live_meta.get("resourceVersion"):
                raise k8s.KubernetesObjectConflictError(
                    reason="Conflict",
                    message="Operation cannot be fulfilled on leases.coordination.k8s.io "
                    f'"{request.name}": the object has been modified; please apply your '
                    "changes to the latest version and try again",
                )
            body = json.loads(json.dumps(data))
            meta = body.setdefault("metadata", {})
            meta.update(
                name=request.name,
                namespace=request.namespace,
                uid=live_meta.get("uid"),
                creationTimestamp=live_meta.get("creationTimestamp"),
                resourceVersion=str(next(versions)),
            )
            stored.create(body)  # a new version of the object, replacing the last one
            raw = stored.raw
            await self._buses[res].put({"type": "MODIFIED", "object": raw})
        return aiohttp.web.json_response(raw)

    _handle.emulates_leases = True  # type: ignore[attr-defined]
    k8s.KubernetesEmulator._handle = _handle  # type: ignore[method-assign]


def declare_resources(emulator: Any) -> None:
    """Declare the built-in kinds and the chart's CRDs (with ``watch`` and ``list``: kopf
    serves nothing it cannot watch)."""
    import kmock

    _expand_generate_name()
    _emulate_server_side_apply()
    _APPLIED[id(emulator)] = {}  # a new emulator (another's may have had its id)
    _emulate_leases()

    for key, (kind, namespaced, subresources) in BUILTIN.items():
        emulator.resources[key] = kmock.ResourceInfo(
            kind=kind, namespaced=namespaced, verbs=VERBS, subresources=subresources
        )
    for crd in chart_crds().values():
        spec = crd["spec"]
        for version in spec["versions"]:
            emulator.resources[f"{spec['group']}/{version['name']}/{spec['names']['plural']}"] = (
                kmock.ResourceInfo(
                    kind=spec["names"]["kind"],
                    namespaced=spec["scope"] == "Namespaced",
                    verbs=VERBS,
                    subresources=set(version.get("subresources") or {}),
                )
            )


def write_kubeconfig(path: Path, server: str) -> Path:
    """A kubeconfig whose one context is the emulator at ``server``."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kmock", "cluster": {"server": server}}],
        "users": [{"name": "kmock", "user": {}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
        "current-context": "kmock",
    }
    path.write_text(yaml.safe_dump(config))
    return path
