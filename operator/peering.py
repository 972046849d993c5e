"""Which replica of the operator is the active one, by kopf's peering rule.

Two replicas run with one peering name; kopf pauses its handlers on all but the replica of
the highest priority among the live peers (and on every one of them when two share the
highest priority). The operator's own loop (autoscaling and resync) is not a kopf handler,
so it asks the same question here, of the same peering object, and runs only when the
answer is yes: two replicas must never both scale a pool.

:func:`is_active` is the rule, a pure function of the peering object's ``status`` (peer id ->
``{priority, lifetime, lastseen}``, as kopf writes it), this replica's identity and priority,
and the time. :class:`PeeringReader` fetches the object(s) and caches the answer briefly.
"""

from __future__ import annotations

import getpass
import logging
import os
import random
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

log = logging.getLogger(__name__)

PEERING_GROUP = "kopf.dev"
PEERING_VERSION = "v1"
CLUSTER_PEERINGS = "clusterkopfpeerings"
NAMESPACED_PEERINGS = "kopfpeerings"
DEFAULT_LIFETIME_S = 60  # what kopf assumes of a peer that does not say


def own_identity() -> str:
    """This replica's peer id: ``POD_ID`` when set (as kopf reads it), else made unique
    the way kopf makes it (user@host/time/random)."""
    pod = os.environ.get("POD_ID")
    if pod:
        return pod
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for the uid, as in many images
        user = "kvpool"
    stamp = datetime.now(UTC).strftime("%Y%m%d%H%M%S")
    rnd = "".join(random.choices("abcdefhijklmnopqrstuvwxyz0123456789", k=3))
    return f"{user}@{socket.gethostname()}/{stamp}/{rnd}"


def _parse_time(text: Any, now: datetime) -> datetime:
    if text is None:
        return now  # kopf: a peer that does not say when it was seen was seen now
    seen = datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    return seen if seen.tzinfo is not None else seen.replace(tzinfo=UTC)


def live_peers(status: Mapping[str, Any] | None, now: datetime) -> dict[str, int]:
    """The peers whose keep-alive has not yet expired, with their priorities."""
    live = {}
    for peer, info in (status or {}).items():
        if not isinstance(info, Mapping):
            continue  # a record removed (null) or not kopf's: not a peer
        try:
            priority = int(info.get("priority", 0))
            lifetime = timedelta(seconds=int(info.get("lifetime", DEFAULT_LIFETIME_S)))
            seen = _parse_time(info.get("lastseen"), now)
        except (TypeError, ValueError):
            log.warning("peering: unreadable record of peer %s ignored: %r", peer, info)
            continue
        if seen + lifetime > now:
            live[peer] = priority
    return live


def is_active(
    status: Mapping[str, Any] | None, identity: str | None, priority: int, now: datetime
) -> bool:
    """kopf's rule: active unless another live peer has a priority >= ours (a tie pauses
    both). Our own record, and whether it is there yet, does not matter. Without a known
    identity, a peer of equal priority may be ourselves: then only a higher one pauses us."""
    for peer, theirs in live_peers(status, now).items():
        if peer == identity:
            continue
        if theirs > priority or (theirs == priority and identity is not None):
            return False
    return True


Fetch = Callable[[str | None], Mapping[str, Any] | None]


class PeeringReader:
    """Whether this replica is the active one now, read from the peering object(s).

    ``namespaces``: None for the cluster-wide object (``clusterkopfpeerings``), else the
    namespaces whose ``kopfpeerings`` object of this name counts (active only if active
    in every one). ``fetch(namespace)`` returns the object, or None where it does not
    exist. An answer is kept ``ttl_s``; when the API server cannot be read, the last
    answer stands until ``lifetime_s`` has passed without one, then: inactive (our own
    keep-alives likely fail as well, and the other replica takes over).
    """

    def __init__(
        self,
        fetch: Fetch,
        identity: str | None,
        priority: int,
        namespaces: Iterable[str] | None = None,
        mandatory: bool = True,
        lifetime_s: float = DEFAULT_LIFETIME_S,
        ttl_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.fetch = fetch
        self.identity = identity
        self.priority = priority
        self.namespaces: list[str | None] = list(namespaces) if namespaces is not None else [None]
        self.mandatory = mandatory
        self.lifetime_s = lifetime_s
        self.ttl_s = ttl_s
        self.clock = clock
        self.wall = wall
        self._answer = False
        self._checked: float | None = None
        self._read: float | None = None  # when the API server last answered

    def active(self) -> bool:
        now = self.clock()
        if self._checked is not None and now - self._checked < self.ttl_s:
            return self._answer
        self._checked = now
        try:
            answer = all(self._active_in(ns) for ns in self.namespaces)
        except Exception as exc:  # the API server is away: see the class docstring
            stale = self._read is None or now - self._read >= self.lifetime_s
            log.warning("peering: cannot read the peering object (%s); %s", exc,
                        "inactive" if stale else "keeping the last answer")  # fmt: skip
            answer = False if stale else self._answer
        else:
            self._read = now
        if answer != self._answer:
            log.info("peering: this replica (%s, priority %d) is now %s", self.identity,
                     self.priority, "active" if answer else "paused")  # fmt: skip
        self._answer = answer
        return answer

    def _active_in(self, namespace: str | None) -> bool:
        body = self.fetch(namespace)
        if body is None:  # kopf, too, pauses when mandatory peering has no object
            return not self.mandatory
        return is_active(body.get("status"), self.identity, self.priority, self.wall())


def kubernetes_fetch(client: Callable[[], Any], name: str) -> Fetch:
    """``fetch`` over the ``kubernetes`` client (``client()`` gives the ApiClient of this
    run): the kopf.dev/v1 peering object ``name``."""
    import kubernetes.client
    from kubernetes.client.exceptions import ApiException

    def fetch(namespace: str | None) -> Mapping[str, Any] | None:
        api = kubernetes.client.CustomObjectsApi(client())
        try:
            if namespace is None:
                return api.get_cluster_custom_object(
                    PEERING_GROUP, PEERING_VERSION, CLUSTER_PEERINGS, name,
                    _request_timeout=(2, 5),
                )  # fmt: skip
            return api.get_namespaced_custom_object(
                PEERING_GROUP, PEERING_VERSION, namespace, NAMESPACED_PEERINGS, name,
                _request_timeout=(2, 5),
            )  # fmt: skip
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    return fetch
