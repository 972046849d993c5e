"""The operator's hands on the API server: apply, prune, read and patch, with the ``kubernetes``
client (sync; kopf runs sync handlers in its thread pool).

Children are written with **server-side apply** (field manager ``kvpool-operator``): the API
server records which fields the operator owns, leaves every other field to its own manager
(an HPA's or KEDA's replicas, a VPA's resources, a webhook's sidecar) and removes a field the
operator applied before and no longer does, in the same request: one spec change is one
write, so one Deployment revision. Fields an operator before server-side apply wrote (an
Update in ``managedFields``) are first handed to the apply's manager by a JSON patch of
``managedFields`` alone, as ``kubectl apply --server-side`` does when it takes over from
client-side apply. An API server that does not speak server-side apply (HTTP 415) gets what
``kubectl apply`` did before it: a JSON merge patch, with ``null`` for each field that the
last applied version had (kept in the ``kvpool.io/last-applied`` annotation).

Nothing is written when nothing changed: the live object is compared with the rendered one
the way the API server stores it (quantities by value, "0.5" is "500m"; empty lists and maps
as absent; extra fields and extra named list items as someone else's), and with the record
of the last apply, so a second sync of an unchanged pool sends no write. A mutating
admission webhook (a registry rewrite, Kyverno) stores something other than what was sent:
the fields as they were right after the operator's own write are remembered, and finding
them so is no reason to write again.

Reads come from the watches: kopf delivers every event of the children's kinds, which
:class:`ChildCache` keeps, so a sync of a steady pool reads nothing from the API server and
prune lists nothing (it asks the API server only for an object the cache has not seen).

A worker Deployment's ``spec.replicas`` is never part of that apply: it has its own field
manager (``kvpool-operator-replicas``), written only when the operator decides a count (see
:mod:`.handlers`), so handing the count to an HPA or KEDA never resets it to a default.

The pool secret is the exception: :meth:`Cluster.create_once` creates it, with a random key,
and nothing ever writes it again, so the key stays the one every pod of the pool started
with. The operator may create Secrets and delete the one it made (by name, with its uid as
a precondition); it can neither read nor list them (see :func:`handlers._ensure_pool_secret`).

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
JSON_PATCH = "application/json-patch+json"
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
# The kinds prune looks for: not Secrets, which the operator may only create (least
# privilege: it can neither read nor list the cluster's Secrets). The pool secret goes with
# its pool (garbage collection, by its owner reference), or by name (:meth:`delete_made`).
PRUNED = {key: kind for key, kind in KINDS.items() if key != ("v1", "Secret")}


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


# Managers whose Update-owned fields are this operator's: its own name, and the placeholder
# the API server gives fields written before it tracked managers.
_OWN_UPDATERS = {FIELD_MANAGER, "before-first-apply"}


def _union(a: Any, b: Any) -> Any:
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return copy.deepcopy(b if b is not None else a)
    out = copy.deepcopy(a)
    for key, value in b.items():
        out[key] = _union(out.get(key), value)
    return out


def adopted_managed_fields(entries: list[Any], api_version: str) -> list[Any] | None:
    """``managedFields`` with the fields the operator holds by Update (of the object itself,
    not a subresource) moved into its Apply entry; None when it holds none by Update."""

    def own_update(e: Any) -> bool:
        return (isinstance(e, dict) and e.get("manager") in _OWN_UPDATERS
                and e.get("operation") == "Update" and not e.get("subresource"))  # fmt: skip

    updates = [e for e in entries if own_update(e)]
    if not updates:
        return None
    apply_entry = next(
        (e for e in entries if isinstance(e, dict) and e.get("manager") == FIELD_MANAGER
         and e.get("operation") == "Apply" and not e.get("subresource")), None,
    )  # fmt: skip
    fields: Any = copy.deepcopy((apply_entry or {}).get("fieldsV1") or {})
    for entry in updates:
        written = copy.deepcopy(entry.get("fieldsV1") or {})
        # A Deployment's replicas are never the apply's (see the module docstring): taken
        # into it, the next apply, which has none, would reset them to the default.
        (written.get("f:spec") or {}).pop("f:replicas", None)
        fields = _union(fields, written)
    merged = {
        **(apply_entry or {"manager": FIELD_MANAGER, "operation": "Apply",
                          "apiVersion": api_version, "fieldsType": "FieldsV1"}),
        "fieldsV1": fields,
    }  # fmt: skip
    kept = [e for e in entries if not own_update(e) and e is not apply_entry]
    return [*kept, merged]


def project(live: Any, desired: Any) -> Any:
    """The part of ``live`` at the places ``desired`` sets (named list items by name): what
    the operator's fields hold now, whoever gave them their values."""
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return live
        return {k: project(live.get(k), v) for k, v in desired.items()}
    if isinstance(desired, list) and isinstance(live, list):
        if desired and all(isinstance(i, dict) and "name" in i for i in desired):
            by_name = {i.get("name"): i for i in live if isinstance(i, dict)}
            return [project(by_name.get(i["name"]), i) for i in desired] + [
                n for n in by_name if n not in {i["name"] for i in desired}
            ]
        if len(live) == len(desired):
            return [project(a, b) for a, b in zip(live, desired, strict=True)]
    return live


class ChildCache:
    """The pools' children as the operator's watches last showed them (kopf hands every
    event of the watched kinds to :func:`handlers.child_changed`, which puts it here), so
    that a sync reads nothing from the API server when nothing changed and prune lists
    nothing: at 200 pools, a list per kind per resync was about 80 requests a second."""

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._objects: dict[tuple[str, str, str], Manifest] = {}

    @staticmethod
    def key(obj: Manifest) -> tuple[str, str, str]:
        meta = obj.get("metadata") or {}
        return obj.get("kind", ""), meta.get("namespace", ""), meta.get("name", "")

    def seen(self, obj: Manifest, deleted: bool = False) -> None:
        """An object as a watch event (or a write's answer) shows it. A deletion removes
        only that very object (by uid: the DELETED of an old object may come after the
        ADDED of a new one of its name); an older version of the object than the one kept
        (a smaller resourceVersion, where both are numbers, as etcd's are) changes nothing."""
        key = self.key(obj)
        meta = obj.get("metadata") or {}
        with self._lock:
            kept = self._objects.get(key)
            kept_meta = (kept or {}).get("metadata") or {}
            same = kept is not None and kept_meta.get("uid") == meta.get("uid")
            if deleted:
                if kept is not None and (same or not meta.get("uid")):
                    del self._objects[key]
                return
            if same and _older(meta.get("resourceVersion"), kept_meta.get("resourceVersion")):
                return
            self._objects[key] = copy.deepcopy(obj)

    def forget(self, namespace: str, pool: str, uid: str) -> None:
        """Drop what is kept of a pool's children: the next reads ask the API server (what
        a watch missed while it was re-listed, kopf does not say)."""
        with self._lock:
            for key in [k for k, o in self._objects.items() if _of_pool(o, namespace, pool, uid)]:
                del self._objects[key]

    def clear(self) -> None:
        with self._lock:
            self._objects.clear()

    def get(self, obj: Manifest) -> Manifest | None:
        with self._lock:
            found = self._objects.get(self.key(obj))
        return copy.deepcopy(found) if found is not None else None

    def of_pool(self, namespace: str, pool: str, uid: str) -> list[Manifest]:
        with self._lock:
            objects = list(self._objects.values())
        return [copy.deepcopy(o) for o in objects if _of_pool(o, namespace, pool, uid)]


def _older(version: Any, than: Any) -> bool:
    try:
        return int(version) < int(than)
    except (TypeError, ValueError):
        return False


def _of_pool(obj: Manifest, namespace: str, pool: str, uid: str) -> bool:
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    owners = meta.get("ownerReferences") or []
    return (
        meta.get("namespace") == namespace
        and labels.get(POOL_LABEL) == pool
        and labels.get("app.kubernetes.io/managed-by") == MANAGED_BY
        and any(isinstance(o, dict) and o.get("uid") == uid for o in owners)
    )


def _digest(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


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
        self,
        client: kubernetes.client.ApiClient | None = None,
        server_side: bool = True,
        cache: ChildCache | None = None,
    ) -> None:
        self.client = client or api_client()
        # False after the API server refused server-side apply once (or when told to)
        self.server_side = server_side
        # The watches' view of the children (None: every read and prune asks the API server)
        self.cache = cache
        # What each child's fields held right after this operator's last write of it, with
        # the rendering written: a mutating webhook (a registry rewrite, Kyverno) changes
        # what is stored from what was sent, and that is no reason to write again.
        self._written: dict[tuple[str, str, str], tuple[str, str]] = {}

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

    def read_cached(self, obj: Manifest, fresh: bool = False) -> Manifest | None:
        """The object as the watches last showed it, else (or ``fresh``) as the API server
        has it now."""
        if not fresh and self.cache is not None and (found := self.cache.get(obj)) is not None:
            return found
        live = self.read(obj)
        if live is not None and self.cache is not None:
            self.cache.seen({**live, "apiVersion": obj["apiVersion"], "kind": obj["kind"]})
        return live

    def record(self, obj: Manifest) -> str:
        """What :meth:`apply` keeps of ``obj`` on the object (``kvpool.io/last-applied``)."""
        return json.dumps(obj, sort_keys=True, separators=(",", ":"))

    def converged(self, live: Manifest | None, obj: Manifest) -> bool:
        """Whether writing ``obj`` would change nothing: ``live`` holds all of it and was last
        applied from this very rendering (so no field was dropped since)."""
        if live is None:
            return False
        annotations = (live.get("metadata") or {}).get("annotations") or {}
        record = self.record(obj)
        if annotations.get(LAST_APPLIED) != record:
            return False
        if contains(live, obj):
            return True
        # Not as rendered, but as it was right after our write of this very rendering: an
        # admission webhook's doing, which another write would only repeat.
        return self._written.get(ChildCache.key(obj)) == (record, _digest(project(live, obj)))

    def _remember(self, obj: Manifest, live: Manifest) -> Manifest:
        self._written[ChildCache.key(obj)] = (self.record(obj), _digest(project(live, obj)))
        if self.cache is not None and live.get("kind") and live.get("metadata"):
            self.cache.seen(live)  # what was just written, before its watch event comes
        return live

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
            # One write: server-side apply removes what this rendering dropped of the fields
            # the operator applied. Fields an operator before server-side apply wrote (as
            # an Update) are first handed to the apply's manager, in the object's
            # managedFields only: a separate patch of the fields would roll a Deployment
            # twice, once to a template nobody wrote.
            self._adopt_updated_fields(kind, live)
        if self.server_side:
            try:
                resp = self._call(kind, "patch", meta["name"], meta["namespace"], body,
                                  field_manager=FIELD_MANAGER, force=True,
                                  _content_type=APPLY_PATCH, _preload_content=False)  # fmt: skip
                log.info("applied %s %s/%s", obj["kind"], meta["namespace"], meta["name"])
                return self._remember(obj, self._json(resp))
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
                return self._remember(obj, self._json(resp))
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
        return self._remember(obj, self._json(resp))

    def _adopt_updated_fields(self, kind: Kind, live: Manifest) -> None:
        """Hand the fields this operator wrote by Update (before it used server-side apply,
        or on an API server without it) to its apply manager, as ``kubectl apply
        --server-side`` does when it takes over from client-side apply: a JSON patch of
        ``metadata.managedFields`` alone, guarded by the object's resourceVersion. Nothing
        is sent when the operator holds no field by Update."""
        meta = live.get("metadata") or {}
        entries = meta.get("managedFields") or []
        moved = adopted_managed_fields(entries, live.get("apiVersion", ""))
        if moved is None:
            return
        ops = [
            {"op": "test", "path": "/metadata/resourceVersion",
             "value": meta.get("resourceVersion")},
            {"op": "replace", "path": "/metadata/managedFields", "value": moved},
        ]  # fmt: skip
        try:
            self._call(kind, "patch", meta["name"], meta["namespace"], ops,
                       _content_type=JSON_PATCH, _preload_content=False)  # fmt: skip
        except ApiException as exc:
            if exc.status not in (409, 422):
                raise
            # Changed meanwhile (the test failed) or refused: the apply goes ahead, and a
            # field the old writes left is removed at a later sync, or stays someone's.
            log.info("managedFields of %s %s not taken over (%s %s)", live.get("kind"),
                     meta.get("name"), exc.status, exc.reason)  # fmt: skip

    def create_once(self, obj: Manifest) -> Manifest | None:
        """Create ``obj`` as it is, unless it exists; never change it (the pool secret, whose
        key must stay the one the pool's pods started with). Returns the object made, or
        None when one of its name exists: the operator cannot read Secrets (least
        privilege), so the caller decides from its own records whether it is the pool's.
        Nothing of the object's data is logged."""
        kind = self.kind_of(obj)
        meta = obj["metadata"]
        try:
            resp = self._call(kind, "create", meta["namespace"], obj,
                              field_manager=FIELD_MANAGER, _preload_content=False)  # fmt: skip
        except ApiException as exc:
            if exc.status != 409:
                raise
            return None
        log.info("created %s %s/%s", obj["kind"], meta["namespace"], meta["name"])
        return self._json(resp)

    def delete_made(self, obj: Manifest, uid: str) -> bool:
        """Delete the object that :meth:`create_once` made, by name, only if it is still that
        very object (a uid precondition: a Secret of the same name made since by someone
        else is left alone). Whether it was deleted."""
        meta = obj["metadata"]
        try:
            self._call(self.kind_of(obj), "delete", meta["name"], meta["namespace"],
                       body={"preconditions": {"uid": uid}})  # fmt: skip
        except ApiException as exc:
            if exc.status in (404, 409):  # gone already, or another object by now
                return False
            raise
        log.info("deleted %s %s/%s", obj["kind"], meta["namespace"], meta["name"])
        return True

    def owned_children(
        self, namespace: str, pool: str, uid: str, fresh: bool = False
    ) -> list[Manifest]:
        """Every child of the pool that the operator made, of every kind prune looks for:
        from the watches' cache when there is one (and not ``fresh``), else listed (one
        request per kind)."""
        if self.cache is not None and not fresh:
            pruned = {kind for _, kind in PRUNED}
            return [o for o in self.cache.of_pool(namespace, pool, uid) if o.get("kind") in pruned]
        selector = f"{POOL_LABEL}={pool},app.kubernetes.io/managed-by={MANAGED_BY}"
        found = []
        for (api_version, kind_name), kind in PRUNED.items():
            resp = self._call(kind, "list", namespace, label_selector=selector,
                              _preload_content=False)  # fmt: skip
            for item in self._json(resp).get("items", []):
                item = {**item, "apiVersion": api_version, "kind": kind_name}
                # Checked here too: not every API server (kmock's) filters by label.
                if _of_pool({**item, "metadata": {"namespace": namespace,
                                                   **(item.get("metadata") or {})}},
                            namespace, pool, uid):  # fmt: skip
                    found.append(item)
        return found

    def prune(
        self, namespace: str, pool: str, uid: str, keep: list[Manifest], fresh: bool = False
    ) -> list[str]:
        """Delete the pool's children that are no longer rendered (a role that went away),
        each only if it is still the object found (its uid as a precondition)."""
        wanted = {(o["kind"], o["metadata"]["name"]) for o in keep}
        deleted = []
        for item in self.owned_children(namespace, pool, uid, fresh):
            key = (item["kind"], item["metadata"]["name"])
            if key in wanted:
                continue
            found = (item.get("metadata") or {}).get("uid")
            body = {"preconditions": {"uid": found}} if found else None
            try:
                self._call(self.kind_of(item), "delete", key[1], namespace, body=body)
            except ApiException as exc:
                if exc.status not in (404, 409):  # gone, or another object of its name
                    raise
            if self.cache is not None:
                self.cache.seen(item, deleted=True)
            self._written.pop(ChildCache.key(item), None)
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
