"""The operator's hands on the API server: apply, prune, read and patch, with the ``kubernetes``
client (sync; kopf runs sync handlers in its thread pool).

Children are applied the way ``kubectl apply`` does it, without server-side apply or
strategic merge (which not every API server, nor kmock's emulator, speaks): create when
missing; otherwise, when the live object no longer holds what was rendered, a JSON merge
patch with the rendered object, plus ``null`` for every field the last applied version had
and this one drops (kept in the ``kvpool.io/last-applied`` annotation). Fields the server
or other controllers add are left alone, so an unchanged child is never written.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import kubernetes.client
from kubernetes.client.exceptions import ApiException

from kvpool.api import GROUP, PLURAL, VERSION

from .render import MANAGED_BY, POOL_LABEL, Manifest

log = logging.getLogger(__name__)

LAST_APPLIED = "kvpool.io/last-applied"
MERGE_PATCH = "application/merge-patch+json"
REQUEST_TIMEOUT = (5, 30)  # connect, read: a hung API server must not hang a handler forever


@dataclass(frozen=True)
class Kind:
    api: str  # the client's API class
    suffix: str  # read_namespaced_<suffix>, ...


KINDS: dict[tuple[str, str], Kind] = {
    ("v1", "ServiceAccount"): Kind("CoreV1Api", "service_account"),
    ("v1", "ConfigMap"): Kind("CoreV1Api", "config_map"),
    ("v1", "Service"): Kind("CoreV1Api", "service"),
    ("rbac.authorization.k8s.io/v1", "Role"): Kind("RbacAuthorizationV1Api", "role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): Kind("RbacAuthorizationV1Api", "role_binding"),
    ("apps/v1", "Deployment"): Kind("AppsV1Api", "deployment"),
    ("policy/v1", "PodDisruptionBudget"): Kind("PolicyV1Api", "pod_disruption_budget"),
}


def api_client() -> kubernetes.client.ApiClient:
    """In a pod, its service account; elsewhere ``KUBECONFIG`` or ~/.kube/config (as kopf)."""
    import os

    import kubernetes.config

    config = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=config)
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(
            config_file=os.environ.get("KUBECONFIG"), client_configuration=config
        )
    return kubernetes.client.ApiClient(config)


def contains(live: Any, desired: Any) -> bool:
    """Whether ``live`` still holds everything ``desired`` says (extra live fields are fine:
    the API server adds defaults). Scalars compare as text: 8000 and "8000" are one port."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            k in live and contains(live[k], v) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(live) == len(desired)
            and all(contains(a, b) for a, b in zip(live, desired, strict=True))
        )
    if isinstance(desired, bool) or isinstance(live, bool):
        return type(live) is type(desired) and live == desired
    return live == desired or str(live) == str(desired)


def merge_patch(last: Any, desired: Any) -> Any:
    """``desired``, with ``None`` (delete) for each key of ``last`` that ``desired`` dropped."""
    if not (isinstance(last, dict) and isinstance(desired, dict)):
        return copy.deepcopy(desired)
    patch: dict[str, Any] = {k: merge_patch(last.get(k), v) for k, v in desired.items()}
    for key in last.keys() - desired.keys():
        patch[key] = None
    return patch


def _strip(obj: Manifest, paths: Iterable[tuple[str, ...]]) -> Manifest:
    out = copy.deepcopy(obj)
    for path in paths:
        node = out
        for key in path[:-1]:
            node = node.get(key, {})
        node.pop(path[-1], None)
    return out


class Cluster:
    def __init__(self, client: kubernetes.client.ApiClient | None = None) -> None:
        self.client = client or api_client()

    def _call(self, kind: Kind, verb: str, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("_request_timeout", REQUEST_TIMEOUT)
        api = getattr(kubernetes.client, kind.api)(self.client)
        return getattr(api, f"{verb}_namespaced_{kind.suffix}")(*args, **kwargs)

    @staticmethod
    def _json(resp: Any) -> Any:
        return json.loads(resp.data)

    @staticmethod
    def kind_of(obj: Manifest) -> Kind:
        return KINDS[(obj["apiVersion"], obj["kind"])]

    # --- children -------------------------------------------------------------------------

    def read(self, obj: Manifest) -> Manifest | None:
        meta = obj["metadata"]
        try:
            resp = self._call(
                self.kind_of(obj), "read", meta["name"], meta["namespace"], _preload_content=False
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return self._json(resp)

    def apply(self, obj: Manifest, *, unowned: Iterable[tuple[str, ...]] = ()) -> Manifest:
        """Create or patch ``obj``; fields at ``unowned`` paths (a Deployment's replicas when
        the autoscaler owns them) are set on creation only. Returns the live object."""
        kind = self.kind_of(obj)
        meta = obj["metadata"]
        owned = _strip(obj, unowned)
        record = json.dumps(owned, sort_keys=True, separators=(",", ":"))
        live = self.read(obj)
        if live is None:
            body = copy.deepcopy(obj)
            body["metadata"].setdefault("annotations", {})[LAST_APPLIED] = record
            try:
                resp = self._call(kind, "create", meta["namespace"], body, _preload_content=False)
                log.info("created %s %s/%s", obj["kind"], meta["namespace"], meta["name"])
                return self._json(resp)
            except ApiException as exc:
                if exc.status != 409:  # created meanwhile by a concurrent handler: patch it
                    raise
                live = self.read(obj) or {}
        if contains(live, owned):
            return live
        annotations = (live.get("metadata") or {}).get("annotations") or {}
        try:
            last = json.loads(annotations.get(LAST_APPLIED, "{}"))
        except ValueError:
            last = {}
        patch = merge_patch(last, owned)
        patch["metadata"].setdefault("annotations", {})[LAST_APPLIED] = record
        resp = self._call(
            kind,
            "patch",
            meta["name"],
            meta["namespace"],
            patch,
            _content_type=MERGE_PATCH,
            _preload_content=False,
        )
        log.info("patched %s %s/%s", obj["kind"], meta["namespace"], meta["name"])
        return self._json(resp)

    def owned_children(self, namespace: str, pool: str, uid: str) -> list[Manifest]:
        """Every child of the pool that the operator made, of every kind it makes."""
        selector = f"{POOL_LABEL}={pool},app.kubernetes.io/managed-by={MANAGED_BY}"
        found = []
        for (api_version, kind_name), kind in KINDS.items():
            resp = self._call(kind, "list", namespace, label_selector=selector,
                              _preload_content=False)  # fmt: skip
            for item in self._json(resp).get("items", []):
                meta = item.get("metadata") or {}
                labels = meta.get("labels") or {}
                owners = meta.get("ownerReferences") or []
                # Checked here too: not every API server (kmock's) filters by label.
                if labels.get(POOL_LABEL) != pool or not any(o.get("uid") == uid for o in owners):
                    continue
                found.append({**item, "apiVersion": api_version, "kind": kind_name})
        return found

    def prune(self, namespace: str, pool: str, uid: str, keep: list[Manifest]) -> list[str]:
        """Delete the pool's children that are no longer rendered (a role that went away)."""
        wanted = {(o["kind"], o["metadata"]["name"]) for o in keep}
        deleted = []
        for item in self.owned_children(namespace, pool, uid):
            key = (item["kind"], item["metadata"]["name"])
            if key in wanted:
                continue
            try:
                self._call(self.kind_of(item), "delete", key[1], namespace)
            except ApiException as exc:
                if exc.status != 404:
                    raise
            log.info("deleted %s %s/%s: no longer part of pool %s", key[0], namespace, key[1], pool)
            deleted.append(f"{key[0]}/{key[1]}")
        return deleted

    def scale(self, namespace: str, name: str, replicas: int) -> None:
        patch = {"spec": {"replicas": replicas}}
        self._call(KINDS[("apps/v1", "Deployment")], "patch", name, namespace, patch,
                   _content_type=MERGE_PATCH)  # fmt: skip

    def deployment(self, namespace: str, name: str) -> Manifest | None:
        obj = {"apiVersion": "apps/v1", "kind": "Deployment",
               "metadata": {"name": name, "namespace": namespace}}  # fmt: skip
        return self.read(obj)

    # --- pods (metrics) -------------------------------------------------------------------

    def pods(self, namespace: str, pool: str) -> list[Manifest]:
        api = kubernetes.client.CoreV1Api(self.client)
        resp = api.list_namespaced_pod(
            namespace,
            label_selector=f"{POOL_LABEL}={pool}",
            _preload_content=False,
            _request_timeout=REQUEST_TIMEOUT,
        )
        items = self._json(resp).get("items", [])
        return [p for p in items if ((p.get("metadata") or {}).get("labels") or {}).get(
            POOL_LABEL) == pool]  # fmt: skip

    # --- the pool itself ------------------------------------------------------------------

    def pool(self, namespace: str, name: str) -> Manifest | None:
        api = kubernetes.client.CustomObjectsApi(self.client)
        try:
            resp = api.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT,
            )  # fmt: skip
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return self._json(resp)

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        api = kubernetes.client.CustomObjectsApi(self.client)
        api.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": status},
            _content_type=MERGE_PATCH, _request_timeout=REQUEST_TIMEOUT,
        )  # fmt: skip
