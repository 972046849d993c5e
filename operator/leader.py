"""Which replica of the operator acts: the one that holds a ``coordination.k8s.io/v1`` Lease.

The rules are client-go's leader election (controller-runtime's, kube-controller-manager's):

* The Lease names its holder (``holderIdentity``), how long a holding lasts without renewal
  (``leaseDurationSeconds``, 15 s by default), when it was taken and renewed, and how many
  times it changed hands (``leaseTransitions``).
* A replica reads the Lease and writes it back with the ``resourceVersion`` it read (an
  update): two replicas that race both read one version, and the API server takes the
  first write and answers 409 Conflict to the second, which reads again later.
* A holder is gone when its Lease has not changed for ``leaseDurationSeconds`` **as this
  replica's own monotonic clock measures it, from when it last saw the record change**;
  ``renewTime`` is never compared with the local wall clock. Two nodes whose clocks
  disagree by minutes therefore still agree on who leads: each only times intervals.
* The holder renews every ``retry_period_s``; a holder whose renewals have not succeeded for
  ``renew_deadline_s`` (shorter than the lease: 10 s) stops acting, and the process exits,
  so that it has stopped before any other replica can judge the lease expired. The margin
  (here 5 s) covers the clocks' rates, not their settings.
* A holder that shuts down cleanly releases the Lease (``holderIdentity`` cleared) and the
  next candidate takes it at its next try instead of waiting for it to expire.

:class:`LeaderElector` is the rule, over a small :class:`LeaseAPI` (a fake one in tests, a
clock and a wall clock given); :class:`Leadership` runs it in a process (wait, renew in a
thread, release); :class:`KubernetesLeaseAPI` is the API server.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

log = logging.getLogger(__name__)

LEASE_GROUP = "coordination.k8s.io"
LEASE_VERSION = "v1"
JITTER_FACTOR = 1.2  # client-go's: a candidate waits retry_period * (1 + rand * 1.2)
LEASE_DURATION_S = 15.0
RENEW_DEADLINE_S = 10.0
RETRY_PERIOD_S = 2.0


def own_identity() -> str:
    """This replica's holder identity: the pod's name (``POD_ID``, from the downward API) or
    the host's, with a random suffix as controller-runtime adds one, so that a restarted
    process never mistakes its predecessor's holding for its own."""
    base = os.environ.get("POD_ID") or socket.gethostname()
    return f"{base}_{uuid.uuid4()}"


def micro_time(when: datetime) -> str:
    """A ``MicroTime`` as the API server writes one (``2026-01-01T12:00:00.000000Z``)."""
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class LeaseRecord:
    """A Lease's spec as leader election reads and writes it. The times are for people
    (``kubectl get lease -o yaml``); no decision reads them."""

    holder: str = ""  # "": nobody
    duration_s: int = int(LEASE_DURATION_S)
    acquire_time: str | None = None
    renew_time: str | None = None
    transitions: int = 0

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any] | None) -> LeaseRecord:
        spec = spec or {}

        def number(key: str, default: int) -> int:
            try:
                return int(spec.get(key) if spec.get(key) is not None else default)
            except (TypeError, ValueError):
                return default

        return cls(
            holder=str(spec.get("holderIdentity") or ""),
            duration_s=number("leaseDurationSeconds", 0),
            acquire_time=spec.get("acquireTime"),
            renew_time=spec.get("renewTime"),
            transitions=number("leaseTransitions", 0),
        )

    def to_spec(self) -> dict[str, Any]:
        return {
            "holderIdentity": self.holder,
            "leaseDurationSeconds": self.duration_s,
            "acquireTime": self.acquire_time,
            "renewTime": self.renew_time,
            "leaseTransitions": self.transitions,
        }


@dataclass(frozen=True)
class Lease:
    """A Lease as read: its record, its ``resourceVersion``, and the object itself (so that
    an update keeps what others wrote in it: labels, annotations, other spec fields)."""

    record: LeaseRecord
    resource_version: str | None
    body: Mapping[str, Any] = field(default_factory=dict, compare=False)


class Conflict(Exception):
    """HTTP 409: the Lease was written (or created) by someone else since it was read."""


class LeaseAPI(Protocol):
    def get(self) -> Lease | None:
        """The Lease, or None where it does not exist."""

    def create(self, record: LeaseRecord) -> Lease:
        """Create it; :class:`Conflict` when it exists."""

    def update(self, read: Lease, record: LeaseRecord) -> Lease:
        """Write ``record`` over ``read``, on the condition of its ``resourceVersion``;
        :class:`Conflict` when someone wrote it since."""


def _utcnow() -> datetime:
    return datetime.now(UTC)


class LeaderElector:
    """One replica's view of the Lease: try to take or renew it, say whether it leads, and
    release it. Not thread-safe for writes (one thread tries, then releases); any thread may
    ask :meth:`is_leader`."""

    def __init__(
        self,
        api: LeaseAPI,
        identity: str,
        lease_duration_s: float = LEASE_DURATION_S,
        renew_deadline_s: float = RENEW_DEADLINE_S,
        retry_period_s: float = RETRY_PERIOD_S,
        jitter: float = JITTER_FACTOR,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = _utcnow,
    ) -> None:
        check_durations(lease_duration_s, renew_deadline_s, retry_period_s, jitter)
        if not identity:
            raise ValueError("leader election needs an identity")
        self.api = api
        self.identity = identity
        self.lease_duration_s = lease_duration_s
        self.renew_deadline_s = renew_deadline_s
        self.retry_period_s = retry_period_s
        self.jitter = jitter
        self.clock = clock
        self.wall = wall
        self._lock = threading.Lock()
        self._observed: Lease | None = None
        self._observed_at: float | None = None  # our clock, when the record last changed
        self._renewed_at: float | None = None  # our clock, when a write that won was sent

    # --- the rule -------------------------------------------------------------------------

    def is_leader(self) -> bool:
        """Whether this replica may act now: the Lease names it, and a renewal sent less than
        ``renew_deadline_s`` ago (by our clock) succeeded."""
        with self._lock:
            return (
                self._observed is not None
                and self._observed.record.holder == self.identity
                and self._renewed_at is not None
                and self.clock() - self._renewed_at < self.renew_deadline_s
            )

    def holds(self) -> bool:
        """Whether the Lease, as last seen, names this replica (leading or not)."""
        with self._lock:
            return self._observed is not None and self._observed.record.holder == self.identity

    def try_acquire_or_renew(self) -> bool:
        """One try: create the Lease, take it (free, or expired by our clock) or renew it.
        True when this replica holds it now."""
        sent = self.clock()
        try:
            lease = self.api.get()
        except Exception as exc:  # the API server away: the next try reads again
            log.warning("lease: cannot read it (%s)", exc)
            return False
        now = self.wall()
        if lease is None:
            record = LeaseRecord(
                holder=self.identity,
                duration_s=self._duration_to_write(),
                acquire_time=micro_time(now),
                renew_time=micro_time(now),
                transitions=0,
            )
            return self._write(lambda: self.api.create(record), sent, "create")
        self._observe(lease)
        old = lease.record
        mine = old.holder == self.identity
        if old.holder and not mine and not self._expired():
            return False  # held by a live replica
        record = LeaseRecord(
            holder=self.identity,
            duration_s=self._duration_to_write(),
            acquire_time=old.acquire_time if mine else micro_time(now),
            renew_time=micro_time(now),
            transitions=old.transitions if mine else old.transitions + 1,
        )
        if not mine:
            log.info("lease: taking it over from %s", old.holder or "nobody (released)")
        return self._write(lambda: self.api.update(lease, record), sent, "update")

    def release(self) -> bool:
        """Give the Lease up (``holderIdentity`` cleared) so that another replica takes it at
        once. Only over the version this replica last wrote: if someone wrote since, theirs
        stands. True when released."""
        with self._lock:
            lease = self._observed
        if lease is None or lease.record.holder != self.identity:
            return False
        now = micro_time(self.wall())
        record = LeaseRecord(
            holder="",
            duration_s=1,
            acquire_time=now,
            renew_time=now,
            transitions=lease.record.transitions,
        )
        with self._lock:
            self._renewed_at = None  # stop acting before the write, not after
        try:
            released = self.api.update(lease, record)
        except Exception as exc:  # the lease then expires on its own
            log.warning("lease: cannot release it (%s); it expires after %ss", exc,
                        lease.record.duration_s)  # fmt: skip
            return False
        self._observe(released)
        log.info("lease: released")
        return True

    # --- inside ---------------------------------------------------------------------------

    def _duration_to_write(self) -> int:
        # leaseDurationSeconds is an integer: round up, never promise less than we wait
        return max(1, int(-(-self.lease_duration_s // 1)))

    def _observe(self, lease: Lease) -> None:
        """Remember the Lease; restart the expiry timer only when the record changed."""
        with self._lock:
            old = self._observed
            if old is None or (old.record, old.resource_version) != (
                lease.record,
                lease.resource_version,
            ):
                self._observed_at = self.clock()
            self._observed = lease

    def _expired(self) -> bool:
        """Whether the holder, as last seen, has not renewed for its lease's duration, by our
        own clock since we saw its record change (never by its renewTime)."""
        with self._lock:
            if self._observed is None or self._observed_at is None:
                return False
            duration = self._observed.record.duration_s
            if duration <= 0:  # a record that does not say: ours
                duration = self.lease_duration_s
            return self.clock() - self._observed_at >= duration

    def _write(self, call: Callable[[], Lease], sent: float, what: str) -> bool:
        try:
            lease = call()
        except Conflict:
            log.debug("lease: %s lost a race (409): someone else wrote it", what)
            return False
        except Exception as exc:  # the next try reads again
            log.warning("lease: cannot %s it (%s)", what, exc)
            return False
        self._observe(lease)
        with self._lock:
            self._renewed_at = sent
        return True

    def wait_for_retry(self) -> float:
        """A candidate's wait between two tries: jittered, so replicas do not try in step."""
        return self.retry_period_s * (1 + random.random() * self.jitter)


def check_durations(
    lease_duration_s: float, renew_deadline_s: float, retry_period_s: float,
    jitter: float = JITTER_FACTOR,
) -> None:  # fmt: skip
    """client-go's checks: the holder must give up before others may take over, and get more
    than one try before it gives up."""
    if min(lease_duration_s, renew_deadline_s, retry_period_s) <= 0:
        raise ValueError("lease duration, renew deadline and retry period must be positive")
    if lease_duration_s <= renew_deadline_s:
        raise ValueError(
            f"the lease duration ({lease_duration_s:g}s) must be longer than the renew "
            f"deadline ({renew_deadline_s:g}s): a holder must stop before others take over"
        )
    if renew_deadline_s <= retry_period_s * jitter:
        raise ValueError(
            f"the renew deadline ({renew_deadline_s:g}s) must be longer than the retry "
            f"period times {jitter:g} ({retry_period_s * jitter:g}s)"
        )


Wait = Callable[[float], bool]  # wait up to so many seconds; True when told to stop


class Leadership:
    """Leader election in a process: :meth:`acquire` blocks until this replica leads;
    :meth:`start_renewing` keeps the Lease in a thread and calls ``on_lost`` when renewals
    have failed past the deadline or another replica took the Lease; :meth:`stop` stops
    renewing and releases it."""

    def __init__(self, elector: LeaderElector, on_lost: Callable[[], None]) -> None:
        self.elector = elector
        self.on_lost = on_lost
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self, wait: Wait | None = None) -> bool:
        """Try until this replica holds the Lease (True) or :meth:`stop` is called (False)."""
        wait = wait or self._stop.wait
        log.info("lease: %s waits to lead", self.elector.identity)
        while not self._stop.is_set():
            if self.elector.try_acquire_or_renew():
                log.info("lease: %s leads", self.elector.identity)
                return True
            if wait(self.elector.wait_for_retry()):
                break
        return False

    def renew(self, wait: Wait | None = None) -> bool:
        """Renew every retry period while leading. Returns True when stopped, False when the
        lead was lost (no successful renewal for the renew deadline, or the Lease names
        another holder); client-go's ``renew`` with a deadline from the last success."""
        wait = wait or self._stop.wait
        elector = self.elector
        while not wait(elector.retry_period_s):
            while not elector.try_acquire_or_renew():
                if not elector.holds() or not elector.is_leader():
                    return False
                if wait(elector.retry_period_s):
                    return True
        return True

    def start_renewing(self) -> None:
        def run() -> None:
            if not self.renew():
                log.critical("lease: leadership lost (no renewal for %ss, or the Lease was "
                             "taken): stopping", self.elector.renew_deadline_s)  # fmt: skip
                self.on_lost()

        self._thread = threading.Thread(target=run, name="kvpool-leader-election", daemon=True)
        self._thread.start()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self, release: bool = True) -> None:
        """Stop trying or renewing, then (by default) release the Lease."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        if release and self.elector.holds():
            self.elector.release()


class KubernetesLeaseAPI:
    """:class:`LeaseAPI` over the ``kubernetes`` client's connection: the Lease ``name`` in
    ``namespace`` (get; create; update with the read ``resourceVersion``, a PUT, as client-go).

    The body is sent as written, not through the client's models: those turn a ``MicroTime``
    into a datetime and back with ``isoformat()``, which drops the fraction when it is zero,
    and the API server refuses a MicroTime without its six digits."""

    PATH = "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"

    def __init__(
        self,
        client: Any,
        namespace: str,
        name: str,
        timeout: tuple[float, float] = (2.0, 5.0),
    ) -> None:
        self.client = client  # a kubernetes.client.ApiClient
        self.namespace = namespace
        self.name = name
        self.timeout = timeout

    def _request(self, method: str, named: bool, body: Mapping[str, Any] | None = None) -> Lease:
        import json

        from kubernetes.client.exceptions import ApiException

        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        request = self.client.param_serialize(
            method=method,
            resource_path=self.PATH + ("/{name}" if named else ""),
            path_params={"namespace": self.namespace, **({"name": self.name} if named else {})},
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.client.call_api(*request, _request_timeout=self.timeout)
        response.read()
        if response.status == 409:
            raise Conflict(f"{method} {self.namespace}/{self.name}: 409 Conflict")
        if not 200 <= response.status <= 299:
            raise ApiException(http_resp=response)
        body = json.loads(response.data)
        meta = body.get("metadata") or {}
        return Lease(LeaseRecord.from_spec(body.get("spec")), meta.get("resourceVersion"), body)

    def get(self) -> Lease | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self._request("GET", named=True)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def create(self, record: LeaseRecord) -> Lease:
        body = {
            "apiVersion": f"{LEASE_GROUP}/{LEASE_VERSION}",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": record.to_spec(),
        }
        return self._request("POST", named=False, body=body)

    def update(self, read: Lease, record: LeaseRecord) -> Lease:
        body = dict(read.body)
        meta = dict(body.get("metadata") or {})
        meta.update(name=self.name, namespace=self.namespace, resourceVersion=read.resource_version)
        body.update(
            apiVersion=f"{LEASE_GROUP}/{LEASE_VERSION}",
            kind="Lease",
            metadata=meta,
            spec={**(body.get("spec") or {}), **record.to_spec()},
        )
        return self._request("PUT", named=True, body=body)
