"""kmock's Kubernetes emulator, set up as the operator's tests meet it.

No kube-apiserver can be installed here; kmock's ``KubernetesEmulator`` stores objects and
serves list/watch/get/create/patch/delete and API discovery for the resources declared on it.
Every test that runs the operator declares the same API: the built-in kinds the operator
touches, and the CRDs the Helm chart installs (the ``InferencePool`` and kopf's peerings).
"""

from __future__ import annotations

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


def declare_resources(emulator: Any) -> None:
    """Declare the built-in kinds and the chart's CRDs (with ``watch`` and ``list``: kopf
    serves nothing it cannot watch)."""
    import kmock

    _expand_generate_name()

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
