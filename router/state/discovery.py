"""How the router learns which workers exist: a static list from the CLI, or pods in Kubernetes.

Both sources report the *full* list of usable workers through ``on_change`` rather than deltas,
so the router never has to reconcile half-applied updates: it swaps its worker set wholesale.

The ``kubernetes`` client is synchronous, so :class:`KubernetesDiscovery` lists and watches in a
dedicated thread and hands raw pod dicts to the event loop; all state lives on the loop side.
The ``kubernetes`` package is imported lazily: a router with static workers does not need it.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import re
import threading
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, get_args
from urllib.parse import urlsplit

from kvpool.api.podtemplate import MAX_NUM_SEQS_ANNOTATION
from kvpool.openai_api import Role

if TYPE_CHECKING:
    import kubernetes.client
    import kubernetes.watch

logger = logging.getLogger(__name__)

ROLES: tuple[str, ...] = get_args(Role)
OnChange = Callable[[list["WorkerEndpoint"]], Awaitable[None] | None]


@dataclass
class WorkerEndpoint:
    """One worker the router may send requests to. ``id`` is stable: pod name, or the URL."""

    id: str
    url: str
    role: Role = "both"
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    draining: bool = False
    #: the requests it runs at once (vLLM's ``--max-num-seqs``), where its deployment says:
    #: vLLM publishes it nowhere, and a kvpool worker says its own
    max_num_seqs: int | None = None


class Discovery(Protocol):
    async def run(self, on_change: OnChange) -> None: ...


async def _call(on_change: OnChange, endpoints: list[WorkerEndpoint]) -> None:
    """Run a sync or async callback; a failing callback is logged, never fatal to discovery."""
    try:
        result = on_change(endpoints)
        if inspect.isawaitable(result):
            await result
    except Exception:
        logger.exception("discovery: on_change failed for %d endpoints", len(endpoints))


# --- static workers -------------------------------------------------------------------------

_SPEC_KEYS = ("role", "events", "replay", "id", "max-num-seqs")


def _check_address(spec: str, key: str, value: str, schemes: tuple[str, ...]) -> str:
    """Refuse a bad address at startup rather than on the first request or subscription."""
    where = f"worker spec {spec!r}: {key} {value!r}"
    parts = urlsplit(value)
    if parts.scheme not in schemes:
        raise ValueError(f"{where}: scheme must be {' or '.join(s + '://' for s in schemes)}")
    if parts.scheme == "ipc":
        return value
    try:
        port = parts.port
    except ValueError as exc:  # urlsplit checks the port only when asked
        raise ValueError(f"{where}: {exc}") from None
    if not parts.hostname or (parts.scheme == "tcp" and port is None):
        raise ValueError(f"{where}: needs a host{' and a port' * (parts.scheme == 'tcp')}")
    if parts.query or parts.fragment:
        raise ValueError(f"{where}: must not have a query or fragment")
    return value


def parse_static_worker(spec: str) -> WorkerEndpoint:
    """Parse ``URL[,role=R][,events=tcp://h:p][,replay=tcp://h:p][,id=NAME]
    [,max-num-seqs=N]`` from the CLI."""
    url, *options = [part.strip() for part in spec.split(",")]
    url = _check_address(spec, "URL", url, ("http", "https")).rstrip("/")
    values: dict[str, str] = {}
    for option in options:
        key, sep, value = (part.strip() for part in option.partition("="))
        if not sep or not key or not value:
            raise ValueError(f"worker spec {spec!r}: expected key=value, got {option!r}")
        if key not in _SPEC_KEYS:
            raise ValueError(
                f"worker spec {spec!r}: unknown key {key!r} (known: {', '.join(_SPEC_KEYS)})"
            )
        if key in values:
            raise ValueError(f"worker spec {spec!r}: duplicate key {key!r}")
        values[key] = value
    role = values.get("role", "both")
    if role not in ROLES:
        raise ValueError(f"worker spec {spec!r}: role {role!r} is not one of {', '.join(ROLES)}")
    if "replay" in values and "events" not in values:
        raise ValueError(f"worker spec {spec!r}: replay= needs events=")
    zmq = ("tcp", "ipc")
    events, replay = values.get("events"), values.get("replay")
    slots = values.get("max-num-seqs")
    if slots is not None and not (slots.isdecimal() and int(slots) >= 1):
        raise ValueError(f"worker spec {spec!r}: max-num-seqs must be a positive integer")
    return WorkerEndpoint(
        # host:port names the worker in metrics and logs; id= when that is not unique
        id=values.get("id") or urllib.parse.urlsplit(url).netloc,
        url=url,
        role=role,  # type: ignore[arg-type]  # checked against ROLES above
        kv_events_endpoint=_check_address(spec, "events", events, zmq) if events else None,
        kv_events_replay_endpoint=_check_address(spec, "replay", replay, zmq) if replay else None,
        max_num_seqs=int(slots) if slots is not None else None,
    )


class StaticDiscovery:
    """A fixed worker list (``--worker`` flags): reported once, never changes."""

    def __init__(self, endpoints: list[WorkerEndpoint]) -> None:
        ids = [endpoint.id for endpoint in endpoints]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise ValueError(f"duplicate worker ids: {', '.join(duplicates)}")
        self.endpoints = list(endpoints)

    async def run(self, on_change: OnChange) -> None:
        await _call(on_change, list(self.endpoints))
        await asyncio.Event().wait()  # until cancelled, like the Kubernetes source


# --- Kubernetes pods ------------------------------------------------------------------------


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip  # IPv6 pod IPs need brackets in URLs


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """Whether the pod's Ready condition is True."""
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def endpoint_from_pod(
    pod: Mapping[str, Any],
    *,
    port: int | str,
    role_label: str = "kvpool.io/role",
    events_port: int | None = None,
    replay_port: int | None = None,
    was_ready: bool = False,
) -> WorkerEndpoint | None:
    """The endpoint for a pod (JSON form) that the router should know now, else None.

    Only Running pods with an IP and no deletionTimestamp qualify (a terminating pod stays
    Ready for a while but must not get new requests), once they are Ready; ``was_ready``:
    it has been Ready since discovery first saw it, and still counts when it is not now. A
    busy worker fails its readiness probe as it fails the router's health check: it leaves
    rotation (the router's own check), not the pool, which would drop its index entries and
    abort its streams. ``port`` is a number or a container port name. Without
    ``events_port`` the router asks the worker's /kvpool/info.
    """
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    name = meta.get("name", "?")
    ip = status.get("podIP")
    ready = pod_ready(pod)
    if status.get("phase") != "Running" or not ip or meta.get("deletionTimestamp"):
        return None
    if not (ready or was_ready):
        return None
    role = (meta.get("labels") or {}).get(role_label, "both")
    if role not in ROLES:
        logger.warning("pod %s: label %s=%r is not a known role; ignored", name, role_label, role)
        return None
    if isinstance(port, str) and port.isdigit():
        port = int(port)
    if isinstance(port, str):
        ports = [
            p
            for c in (pod.get("spec") or {}).get("containers") or []
            for p in c.get("ports") or []
            if p.get("name") == port
        ]
        if not ports:
            logger.warning("pod %s: no container port named %r; ignored", name, port)
            return None
        port = int(ports[0]["containerPort"])
    host = _host(ip)
    slots = (meta.get("annotations") or {}).get(MAX_NUM_SEQS_ANNOTATION)
    if slots is not None and not (isinstance(slots, str) and slots.isdecimal() and int(slots)):
        logger.warning(
            "pod %s: annotation %s=%r is not a count; ignored", name, MAX_NUM_SEQS_ANNOTATION, slots
        )
        slots = None
    return WorkerEndpoint(
        id=name,
        url=f"http://{host}:{port}",
        role=role,
        kv_events_endpoint=f"tcp://{host}:{events_port}" if events_port else None,
        kv_events_replay_endpoint=f"tcp://{host}:{replay_port}" if replay_port else None,
        max_num_seqs=int(slots) if slots is not None else None,
    )


_SET_TERM = re.compile(r"^([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)$")


def label_selector_matches(selector: str, labels: Mapping[str, str]) -> bool:
    """Client-side check of a Kubernetes label selector (equality-, set- and existence-based).

    The API server filters already; this guards against servers that do not: kmock 0.8's
    emulator, used by the tests, ignores ``labelSelector`` on both list and watch.
    """
    for term in re.split(r",(?![^()]*\))", selector):
        term = term.strip()
        if not term:
            continue
        if m := _SET_TERM.match(term):
            found = labels.get(m[1]) in {v.strip() for v in m[3].split(",")}
            ok = found if m[2] == "in" else not found
        elif "!=" in term:
            key, _, value = term.partition("!=")
            ok = labels.get(key.strip()) != value.strip()
        elif "=" in term:
            key, _, value = term.replace("==", "=").partition("=")
            ok = labels.get(key.strip()) == value.strip()
        elif term.startswith("!"):
            ok = term[1:].strip() not in labels
        else:
            ok = term in labels
        if not ok:
            return False
    return True


def _default_api_client() -> kubernetes.client.ApiClient:
    """In a pod, the service account; elsewhere (a developer's router), ~/.kube/config."""
    import kubernetes.client
    import kubernetes.config

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    return kubernetes.client.ApiClient()


class KubernetesDiscovery:
    """Worker pods in one namespace, matched by a label selector, kept current by list + watch.

    The thread relists on start, on 410 Gone and after errors (with backoff); a watch that
    the server ends after ``watch_timeout`` resumes from the last resourceVersion. A server
    that ignores timeoutSeconds (kmock) is cut by a client read timeout instead, and a relist
    follows. The bounded watches let the thread see its stop flag; cancelling :meth:`run`
    also shuts the watch socket down at once. One :meth:`run` at a time per instance.
    """

    def __init__(
        self,
        namespace: str,
        label_selector: str,
        port: int | str,
        *,
        role_label: str = "kvpool.io/role",
        events_port: int | None = None,
        replay_port: int | None = None,
        api_client: kubernetes.client.ApiClient | None = None,
        watch_timeout: int = 5,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
    ) -> None:
        self.namespace = namespace
        self.label_selector = label_selector
        self.port = port
        self.role_label = role_label
        self.events_port = events_port
        self.replay_port = replay_port
        self.api_client = api_client if api_client is not None else _default_api_client()
        self.watch_timeout = watch_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.pods: dict[str, WorkerEndpoint | None] = {}  # pod name -> endpoint, None: not usable
        self._was_ready: set[str] = set()  # pods (uids) seen Ready: known while they are not
        self._stop = threading.Event()
        self._watch: kubernetes.watch.Watch | None = None

    def _endpoint(self, pod: Mapping[str, Any]) -> WorkerEndpoint | None:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if not label_selector_matches(self.label_selector, labels):
            return None
        uid = meta.get("uid") or meta.get("name", "")
        if pod_ready(pod):
            self._was_ready.add(uid)
        return endpoint_from_pod(
            pod,
            port=self.port,
            role_label=self.role_label,
            events_port=self.events_port,
            replay_port=self.replay_port,
            was_ready=uid in self._was_ready,
        )

    def _apply(self, message: tuple[str, Any]) -> None:
        kind, payload = message
        if kind == "RESET":
            uids = {p["metadata"].get("uid") or p["metadata"]["name"] for p in payload}
            self._was_ready &= uids
            self.pods = {pod["metadata"]["name"]: self._endpoint(pod) for pod in payload}
        elif kind == "DELETED":
            meta = payload["metadata"]
            self._was_ready.discard(meta.get("uid") or meta["name"])
            self.pods.pop(meta["name"], None)
        else:  # ADDED, MODIFIED
            self.pods[payload["metadata"]["name"]] = self._endpoint(payload)

    def endpoints(self) -> list[WorkerEndpoint]:
        return sorted((e for e in self.pods.values() if e is not None), key=lambda e: e.id)

    async def run(self, on_change: OnChange) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def post(kind: str, payload: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (kind, payload))
            except RuntimeError:  # the loop is closed: nobody left to report to
                self._stop.set()

        self._stop.clear()
        thread = threading.Thread(target=self._loop, args=(post,), name="kvpool-discovery")
        thread.daemon = True
        thread.start()
        last: list[WorkerEndpoint] | None = None
        try:
            while True:
                self._apply(await queue.get())
                while not queue.empty():  # coalesce a burst (a relist) into one update
                    self._apply(queue.get_nowait())
                current = self.endpoints()
                if current != last:
                    last = current
                    logger.info("discovery: %d usable worker pods", len(current))
                    await _call(on_change, current)
        finally:
            self._stop.set()
            # Watch.stop() shuts the socket down, unblocking a read in progress. Repeat it: a
            # watch whose response has not arrived yet has no socket to shut down. A blocked
            # list ends by its own timeout; the thread is a daemon if we stop waiting first.
            deadline = loop.time() + self.watch_timeout + 5
            while thread.is_alive() and loop.time() < deadline:
                if (watch := self._watch) is not None:
                    watch.stop()
                await asyncio.sleep(0.02)

    def _loop(self, post: Callable[[str, Any], None]) -> None:
        """Thread body: relist, then watch until the stream needs a relist; back off on errors."""
        import kubernetes.client
        import urllib3

        api = kubernetes.client.CoreV1Api(self.api_client)
        delay = self.backoff_initial
        while not self._stop.is_set():
            try:
                resp = api.list_namespaced_pod(
                    self.namespace,
                    label_selector=self.label_selector,
                    _preload_content=False,
                    _request_timeout=(5, 30),
                )
                listing = json.loads(resp.data)
                post("RESET", listing.get("items") or [])
                version = (listing.get("metadata") or {}).get("resourceVersion")
                delay = self.backoff_initial
                while version and not self._stop.is_set():
                    # Each watch ends after watch_timeout; resume from the last resourceVersion.
                    version = self._watch_once(api, version, post)
            except kubernetes.client.ApiException as exc:
                if exc.status == 410:
                    logger.info("discovery: watch expired (410 Gone); relisting")
                    continue
                self._failed(f"HTTP {exc.status} {exc.reason}", delay)
                delay = min(delay * 2, self.backoff_max)
            except urllib3.exceptions.ReadTimeoutError:
                # A server that ignores timeoutSeconds (kmock) ends the watch this way.
                # Relisting is the safe way back: the stream's last version is unknown.
                continue
            except Exception as exc:
                self._failed(repr(exc), delay)
                delay = min(delay * 2, self.backoff_max)
            finally:
                self._watch = None

    def _watch_once(self, api: Any, version: str, post: Callable[[str, Any], None]) -> str:
        """One watch request from ``version``; returns the last resourceVersion it saw."""
        import kubernetes.watch

        self._watch = kubernetes.watch.Watch()
        stream = self._watch.stream(
            api.list_namespaced_pod,
            self.namespace,
            label_selector=self.label_selector,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=self.watch_timeout,
            _request_timeout=(5, self.watch_timeout + 2),
        )
        try:
            for event in stream:
                obj = event["raw_object"]
                version = (obj.get("metadata") or {}).get("resourceVersion") or version
                if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                    post(event["type"], obj)
                if self._stop.is_set():
                    break
        finally:
            stream.close()  # releases the connection even when we broke out early
        return version

    def _failed(self, error: str, delay: float) -> None:
        if not self._stop.is_set():  # errors while stopping are the stop itself: no noise
            logger.warning(
                "discovery: pods in %s: %s; retrying in %.1fs", self.namespace, error, delay
            )
            self._stop.wait(delay)
