"""The operator's hands on the API server: apply, prune, read and patch, with the ``kubernetes``
client (sync; kopf runs sync handlers in its thread pool).

Children are written with **server-side apply** (field manager ``kvpool-operator``): the API
server records which fields the operator owns, leaves every other field to its own manager
(an HPA's or KEDA's replicas, a VPA's resources, a webhook's sidecar) and removes a field the
operator rendered before and no longer does. An API server that does not speak it (HTTP 415)
gets what ``kubectl apply`` did before it: a JSON merge patch, with ``null`` for each field
that the last applied version had (kept in the ``kvpool.io/last-applied`` annotation).

Either way nothing is written when nothing changed: the live object is compared with the
rendered one the way the API server stores it (quantities by value, "0.5" is "500m"; empty
lists and maps as absent; extra fields and extra named list items as someone else's), and
with the record of the last apply, so a second sync of an unchanged pool sends no write.

A worker Deployment's ``spec.replicas`` is never part of that apply: it has its own field
manager (``kvpool-operator-replicas``), written only when the operator decides a count (see
:mod:`.handlers`), so handing the count to an HPA or KEDA never resets it to a default.

The pool secret is the exception: :meth:`Cluster.create_once` creates it, with a random key,
and nothing ever writes it again, so the key stays the one every pod of the pool started
with (and the operator needs no right to change a Secret).

Objects that exist but are not the pool's (another controller's, or nobody's) are never
taken: :func:`foreign_owner` says whose they are, and the caller leaves them alone.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from typing import Any

import kubernetes.client
from kubernetes.client.exceptions import ApiException
from kubernetes.utils import parse_quantity

from kvpool.api import GROUP, PLURAL, VERSION

from .render import MANAGED_BY, POOL_LABEL, Manifest

log = logging.getLogger(__name__)

LAST_APPLIED = "kvpool.io/last-applied"
MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
FIELD_MANAGER = "kvpool-operator"
REPLICAS_MANAGER = "kvpool-operator-replicas"
UNREAD: Any = object()  # apply(): the caller did not read the object
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
    ("networking.k8s.io/v1", "NetworkPolicy"): Kind("NetworkingV1Api", "network_policy"),
    ("v1", "Secret"): Kind("CoreV1Api", "secret"),
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


# Maps whose values the API server stores as canonical quantities ("0.5" -> "500m").
_QUANTITY_MAPS = {"requests", "limits", "capacity", "hard"}
_QUANTITY_KEYS = {"sizeLimit", "storage"}


def _same_quantity(live: Any, desired: Any) -> bool:
    try:
        return bool(parse_quantity(live) == parse_quantity(desired))
    except (ValueError, TypeError, ArithmeticError):
        return False


def _empty(value: Any) -> bool:
    """What the API server does not store: it omits empty and zero values of many fields
    (``hostNetwork: false``, ``initialDelaySeconds: 0``, an env ``value: ""``)."""
    return (
        value is None
        or value in ({}, [], "")
        or value is False
        or (type(value) is int and value == 0)
    )


def contains(live: Any, desired: Any, key: str = "", parent: str = "") -> bool:
    """Whether ``live`` still holds everything ``desired`` says, read the way the API server
    stores it: extra live fields are someone else's (defaults, other controllers); extra
    items of a list of named things (containers, env, volumes) too; an empty list or map
    is an absent one; scalars compare as text (8000 and "8000" are one port), quantities by
    value ("1024Mi" and "1Gi" are one size)."""
    if isinstance(desired, dict):
        if live is None:
            return all(_empty(v) for v in desired.values())
        return isinstance(live, dict) and all(
            contains(live.get(k), v, k, key) if k in live else _empty(v) for k, v in desired.items()
        )
    if isinstance(desired, list):
        if live is None:
            return not desired
        if not isinstance(live, list):
            return False
        if desired and all(isinstance(i, dict) and "name" in i for i in desired):
            by_name = {i.get("name"): i for i in live if isinstance(i, dict)}
            names = [i["name"] for i in desired]
            in_order = [n for n in by_name if n in set(names)]
            return in_order == names and all(
                contains(by_name[i["name"]], i, key, parent) for i in desired
            )
        return len(live) == len(desired) and all(
            contains(a, b, key, parent) for a, b in zip(live, desired, strict=True)
        )
    if desired is None:
        return live is None
    if isinstance(desired, bool) or isinstance(live, bool):
        return type(live) is type(desired) and live == desired
    if live == desired or str(live) == str(desired):
        return True
    return (parent in _QUANTITY_MAPS or key in _QUANTITY_KEYS) and _same_quantity(live, desired)


def merge_patch(last: Any, desired: Any) -> Any:
    """``desired``, with ``None`` (delete) for each key of ``last`` that ``desired`` dropped."""
    if not (isinstance(last, dict) and isinstance(desired, dict)):
        return copy.deepcopy(desired)
    patch: dict[str, Any] = {k: merge_patch(last.get(k), v) for k, v in desired.items()}
    for key in last.keys() - desired.keys():
        patch[key] = None
    return patch


def _removals(patch: Any) -> Any:
    """The deletions (``null``s) of a merge patch, and nothing else; None when it has none."""
    if not isinstance(patch, dict):
        return None
    out = {}
    for key, value in patch.items():
        if value is None:
            out[key] = None
        elif (inner := _removals(value)) is not None:
            out[key] = inner
    return out or None


def foreign_owner(live: Manifest, pool: str, uid: str) -> str | None:
    """Who holds ``live`` when it is not this pool's to manage, in words; None when it is:
    the pool is its controller, or it has no controller and says it is the pool's (labels
    the operator put there: left behind by ``kubectl delete --cascade=orphan``)."""
    meta = live.get("metadata") or {}
    owners = meta.get("ownerReferences") or []
    controller = next((o for o in owners if isinstance(o, dict) and o.get("controller")), None)
    if controller is not None:
        if controller.get("uid") == uid:
            return None
        return (f"controlled by {controller.get('kind', '?')} {controller.get('name', '?')}"
                f" (uid {controller.get('uid', '?')})")  # fmt: skip
    labels = meta.get("labels") or {}
    if labels.get(POOL_LABEL) == pool and labels.get("app.kubernetes.io/managed-by") == MANAGED_BY:
        return None
    manager = next(
        (f["manager"] for f in meta.get("managedFields") or [] if isinstance(f, dict) and
         f.get("manager")), None,
    )  # fmt: skip
    return "not made by kvpool" + (f" (managed by {manager})" if manager else "")


def _last_applied(live: Manifest | None) -> Any:
    annotations = ((live or {}).get("metadata") or {}).get("annotations") or {}
    try:
        return json.loads(annotations.get(LAST_APPLIED, "{}"))
    except ValueError:
        return {}


def _check_owner(live: Manifest, obj: Manifest) -> None:
    """Raise :class:`AlreadyOwned` when ``live`` is not the object's pool's to manage (the
    pool as ``obj`` names it: its controller owner reference and pool label)."""
    meta = obj["metadata"]
    owner = next((o for o in meta.get("ownerReferences") or [] if o.get("controller")), {})
    pool = (meta.get("labels") or {}).get(POOL_LABEL, "")
    if (who := foreign_owner(live, pool, owner.get("uid", ""))) is not None:
        raise AlreadyOwned(obj, who)


class AlreadyOwned(Exception):
    """A child's name is taken by an object that is not the pool's."""

    def __init__(self, obj: Manifest, owner: str) -> None:
        self.kind = obj["kind"]
        self.name = obj["metadata"]["name"]
        self.owner = owner
        super().__init__(f"{self.kind} {self.name} exists and is {owner}: left alone")


class Cluster:
    def __init__(
        self, client: kubernetes.client.ApiClient | None = None, server_side: bool = True
    ) -> None:
        self.client = client or api_client()
        # False after the API server refused server-side apply once (or when told to)
        self.server_side = server_side

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

    def record(self, obj: Manifest) -> str:
        """What :meth:`apply` keeps of ``obj`` on the object (``kvpool.io/last-applied``)."""
        return json.dumps(obj, sort_keys=True, separators=(",", ":"))

    def converged(self, live: Manifest | None, obj: Manifest) -> bool:
        """Whether writing ``obj`` would change nothing: ``live`` holds all of it and was last
        applied from this very rendering (so no field was dropped since)."""
        if live is None:
            return False
        annotations = (live.get("metadata") or {}).get("annotations") or {}
        return annotations.get(LAST_APPLIED) == self.record(obj) and contains(live, obj)

    def apply(
        self, obj: Manifest, live: Any = UNREAD, create_replicas: int | None = None
    ) -> Manifest:
        """Make the object hold ``obj`` (create it, or apply the fields ``obj`` has); nothing
        is sent when it already does. ``live``: the object as just read (None: missing);
        left out, it is read here. ``create_replicas``: a Deployment's replicas when this
        creates it (not part of the record: later applies leave them to :meth:`scale`).
        Returns the live object."""
        kind = self.kind_of(obj)
        meta = obj["metadata"]
        record = self.record(obj)
        if live is UNREAD:
            live = self.read(obj)
        if self.converged(live, obj):
            return live
        body = copy.deepcopy(obj)
        body["metadata"].setdefault("annotations", {})[LAST_APPLIED] = record
        if live is None and create_replicas is not None:
            body["spec"]["replicas"] = create_replicas
        last = _last_applied(live)
        if self.server_side and live is not None:
            # Fields an earlier rendering had and this one drops go first, by merge patch:
            # server-side apply removes only fields no other manager holds, and objects
            # written before it (by an operator without it) list another manager for all.
            removals = _removals(merge_patch(last, obj))
            if isinstance((removals or {}).get("spec"), dict):  # replicas: their own manager
                removals["spec"].pop("replicas", None)
                removals = _removals(removals)
            if removals is not None:
                self._call(kind, "patch", meta["name"], meta["namespace"], removals,
                           field_manager=FIELD_MANAGER, _content_type=MERGE_PATCH,
                           _preload_content=False)  # fmt: skip
        if self.server_side:
            try:
                resp = self._call(kind, "patch", meta["name"], meta["namespace"], body,
                                  field_manager=FIELD_MANAGER, force=True,
                                  _content_type=APPLY_PATCH, _preload_content=False)  # fmt: skip
                log.info("applied %s %s/%s", obj["kind"], meta["namespace"], meta["name"])
                return self._json(resp)
            except ApiException as exc:
                if exc.status == 415:  # no server-side apply here: as kubectl apply did
                    log.warning("the API server refuses server-side apply (%s): children are "
                                "written with JSON merge patches", exc.reason)  # fmt: skip
                    self.server_side = False
                elif exc.status != 404:  # an API server that does not create on apply
                    raise
        if live is None:
            try:
                resp = self._call(kind, "create", meta["namespace"], body,
                                  field_manager=FIELD_MANAGER, _preload_content=False)  # fmt: skip
                log.info("created %s %s/%s", obj["kind"], meta["namespace"], meta["name"])
                return self._json(resp)
            except ApiException as exc:
                if exc.status != 409:  # created meanwhile: patch it, if it is the pool's
                    raise
                live = self.read(obj) or {}
                _check_owner(live, obj)
                last = _last_applied(live)
        patch = merge_patch(last, obj)
        patch["metadata"].setdefault("annotations", {})[LAST_APPLIED] = record
        resp = self._call(kind, "patch", meta["name"], meta["namespace"], patch,
                          field_manager=FIELD_MANAGER, _content_type=MERGE_PATCH,
                          _preload_content=False)  # fmt: skip
        log.info("patched %s %s/%s", obj["kind"], meta["namespace"], meta["name"])
        return self._json(resp)

    def create_once(self, obj: Manifest) -> Manifest:
        """Create ``obj`` as it is, unless it exists; never change it (the pool secret, whose
        key must stay the one the pool's pods started with). Returns the live object; raises
        :class:`AlreadyOwned` when one that is not the pool's has its name. Nothing of the
        object's data is logged."""
        kind = self.kind_of(obj)
        meta = obj["metadata"]
        try:
            resp = self._call(kind, "create", meta["namespace"], obj,
                              field_manager=FIELD_MANAGER, _preload_content=False)  # fmt: skip
        except ApiException as exc:
            if exc.status != 409:
                raise
            live = self.read(obj) or {}  # made meanwhile: by a sync of ours, or by another
            _check_owner(live, obj)
            return live
        log.info("created %s %s/%s", obj["kind"], meta["namespace"], meta["name"])
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

    def scale(self, namespace: str, name: str, replicas: int) -> Manifest:
        """Set a Deployment's replicas, as their own field manager (never the apply's)."""
        kind = KINDS[("apps/v1", "Deployment")]
        if self.server_side:
            body = {"apiVersion": "apps/v1", "kind": "Deployment",
                    "metadata": {"name": name, "namespace": namespace},
                    "spec": {"replicas": replicas}}  # fmt: skip
            try:
                resp = self._call(kind, "patch", name, namespace, body,
                                  field_manager=REPLICAS_MANAGER, force=True,
                                  _content_type=APPLY_PATCH, _preload_content=False)  # fmt: skip
                return self._json(resp)
            except ApiException as exc:
                if exc.status != 415:
                    raise
                self.server_side = False
        resp = self._call(kind, "patch", name, namespace, {"spec": {"replicas": replicas}},
                          field_manager=REPLICAS_MANAGER, _content_type=MERGE_PATCH,
                          _preload_content=False)  # fmt: skip
        return self._json(resp)

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
