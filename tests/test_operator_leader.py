"""Two replicas of the operator: which one acts (leader election by a Lease), and the hand-over.

The rule (:class:`~kvpool.operator.leader.LeaderElector`) runs against an in-memory API
server (one Lease, a resourceVersion per write, 409 on a stale write) with a clock and a
wall clock per replica, so that skewed clocks and dead holders can be staged exactly. Then
the Kubernetes side runs against kmock's emulator: the elector over the real client, and
three real ``kvpool operator run`` processes sharing one Lease, of which only the holder
acts; a clean stop hands over at once, a lost Lease stops the process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvpool.operator import handlers
from kvpool.operator import settings as operator_settings
from kvpool.operator.leader import (
    Conflict,
    KubernetesLeaseAPI,
    LeaderElector,
    Leadership,
    Lease,
    LeaseRecord,
)
from kvpool.stack import free_port

from kube_emulator import declare_resources, write_kubeconfig
from test_operator_kopf import POOL_SPEC, Kube, eventually

EPOCH = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
LEASE_S, RENEW_S, RETRY_S = 15.0, 10.0, 2.0  # client-go's defaults


# --- an API server and clocks ---------------------------------------------------------------


class FakeLeaseAPI:
    """The API server's part: one Lease, a new resourceVersion at each write, 409 Conflict on
    a create of an existing Lease or an update of a version that is not the latest."""

    def __init__(self) -> None:
        self.lease: Lease | None = None
        self.version = 0
        self.down = False
        self.before_write: Callable[[], None] | None = None  # runs once, before the next write

    def _check(self) -> None:
        if self.down:
            raise ConnectionError("API server away")

    def _hook(self) -> None:
        hook, self.before_write = self.before_write, None
        if hook is not None:
            hook()

    def _store(self, record: LeaseRecord) -> Lease:
        self.version += 1
        self.lease = Lease(record, str(self.version))
        return self.lease

    def get(self) -> Lease | None:
        self._check()
        return self.lease

    def create(self, record: LeaseRecord) -> Lease:
        self._check()
        self._hook()
        if self.lease is not None:
            raise Conflict("exists")
        return self._store(record)

    def update(self, read: Lease, record: LeaseRecord) -> Lease:
        self._check()
        self._hook()
        if self.lease is None or read.resource_version != self.lease.resource_version:
            raise Conflict("modified")
        return self._store(record)


class World:
    """Real time, which no replica sees: each has a monotonic clock (its own origin and
    rate) and a wall clock (its own error)."""

    def __init__(self) -> None:
        self.t = 0.0

    def monotonic(self, origin: float, rate: float = 1.0) -> Callable[[], float]:
        return lambda: origin + self.t * rate

    def wall(self, skew_s: float) -> Callable[[], datetime]:
        return lambda: EPOCH + timedelta(seconds=self.t + skew_s)


def replica(
    api: FakeLeaseAPI, name: str, world: World, origin: float = 0.0, rate: float = 1.0,
    skew_s: float = 0.0,
) -> LeaderElector:  # fmt: skip
    return LeaderElector(
        api, name, LEASE_S, RENEW_S, RETRY_S, jitter=0.0,
        clock=world.monotonic(origin, rate), wall=world.wall(skew_s),
    )  # fmt: skip


def run(
    world: World,
    schedule: dict[LeaderElector, float],
    until: float,
    step: float = 0.1,
    alive: Callable[[LeaderElector, float], bool] = lambda e, t: True,
) -> list[tuple[float, list[str]]]:
    """Each replica tries every retry period from its phase (as both client-go loops do)
    while ``alive``; returns who leads after every step, never more than one."""
    timeline = []
    for i in range(round(until / step) + 1):
        world.t = i * step
        for elector, phase in schedule.items():
            ticks = (world.t - phase) / RETRY_S
            if world.t >= phase and abs(ticks - round(ticks)) < 1e-6 and alive(elector, world.t):
                elector.try_acquire_or_renew()
        leading = [e.identity for e in schedule if e.is_leader()]
        assert len(leading) <= 1, f"two leaders at t={world.t:.1f}s: {leading}"
        timeline.append((world.t, leading))
    return timeline


def longest_gap(timeline: list[tuple[float, list[str]]], after: float) -> float:
    gap, since = 0.0, None
    for t, leading in timeline:
        if t < after:
            continue
        if leading:
            since = None
        else:
            since = t if since is None else since
            gap = max(gap, t - since)
    return gap


# --- the rule -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "skew_s", [3600.0, -3600.0, LEASE_S + 1, -(LEASE_S + 1)], ids=["ahead 1h", "behind 1h",
                                                                   "ahead 16s", "behind 16s"]
)  # fmt: skip
def test_replicas_with_clocks_skewed_past_the_lease_never_both_lead_and_one_leads(
    skew_s: float,
) -> None:
    """b's wall clock is off by more than a lease: comparing a's renewTime with it would
    call a live holder dead (two leaders) or a dead one alive (none). Here a also stalls
    for 40 s and comes back; the monotonic clocks have other origins and rates."""
    world, api = World(), FakeLeaseAPI()
    a = replica(api, "a", world, origin=5000.0, rate=1.002)
    b = replica(api, "b", world, origin=-7.0, rate=0.998, skew_s=skew_s)
    stalled = (30.0, 70.0)

    def alive(e: LeaderElector, t: float) -> bool:
        return e is not a or not stalled[0] <= t < stalled[1]

    timeline = run(world, {a: 0.0, b: 0.7}, until=150.0, alive=alive)
    leaders = {round(t, 1): who for t, who in timeline}
    assert leaders[10.0] == ["a"], "the first to try leads"
    assert leaders[29.0] == ["a"], "b never takes a live holder's Lease"
    assert leaders[150.0] == ["b"], "b took over the stalled holder's Lease and keeps it"
    # without a leader only between the holder's renew deadline and the lease's expiry
    assert longest_gap(timeline, after=1.0) <= LEASE_S - RENEW_S + 2 * RETRY_S
    assert api.lease is not None and api.lease.record.transitions == 1


def test_a_dead_holder_is_replaced_after_the_lease_by_the_candidates_own_clock() -> None:
    """a's wall clock is an hour ahead: its renewTime looks like the future to b, which a
    rule on timestamps would wait out. b counts from when it saw the Lease last change."""
    world, api = World(), FakeLeaseAPI()
    a = replica(api, "a", world, skew_s=3600.0)
    b = replica(api, "b", world, origin=123.0)
    died = 20.0
    views: list[tuple[float, str | None]] = []  # b's clock at each try, the version it read
    took_over: float | None = None
    for i in range(600):
        world.t = i * 0.1
        if i % 20 == 0 and world.t < died:
            a.try_acquire_or_renew()
        if i % 20 == 5 and took_over is None:
            version = api.lease.resource_version if api.lease else None
            if b.try_acquire_or_renew():
                took_over = b.clock()
            else:
                views.append((b.clock(), version))
        assert not (a.is_leader() and b.is_leader()), world.t
    assert took_over is not None, "b never took over"
    last = views[-1][1]  # a's last renewal, as b read it
    first_seen = min(clock for clock, version in views if version == last)
    assert took_over - first_seen >= LEASE_S, "taken before the lease ran out on b's clock"
    assert took_over - first_seen <= LEASE_S + RETRY_S, "b waited longer than a lease"
    assert api.lease is not None
    assert api.lease.record.holder == "b"
    assert api.lease.record.transitions == 1
    assert a.is_leader() is False


def test_a_released_lease_is_taken_at_the_next_try() -> None:
    world, api = World(), FakeLeaseAPI()
    a = replica(api, "a", world)
    b = replica(api, "b", world)
    assert a.try_acquire_or_renew() and a.is_leader()
    world.t = 1.0
    assert not b.try_acquire_or_renew()
    world.t = 2.0
    assert a.try_acquire_or_renew()
    assert a.release() is True
    assert a.is_leader() is False, "a stops acting when it releases"
    assert api.lease is not None
    assert api.lease.record.holder == "" and api.lease.record.transitions == 0
    world.t = 3.0  # one second after the last renewal: far from expired
    assert b.try_acquire_or_renew() and b.is_leader()
    assert api.lease.record.holder == "b"
    assert api.lease.record.transitions == 1
    assert a.release() is False, "a holds nothing to release"


def test_of_two_racing_candidates_the_first_write_wins_and_the_other_reads_again() -> None:
    world, api = World(), FakeLeaseAPI()
    a = replica(api, "a", world)
    b = replica(api, "b", world)
    # both find no Lease; b creates it while a is between its read and its create
    api.before_write = lambda: b.try_acquire_or_renew()
    assert a.try_acquire_or_renew() is False, "a's create answered 409"
    assert b.is_leader() and not a.is_leader()
    # both read the released Lease; a writes first, b's write of the same version loses
    assert b.release()
    api.before_write = lambda: a.try_acquire_or_renew()
    world.t = 1.0
    assert b.try_acquire_or_renew() is False
    assert a.is_leader() and not b.is_leader()
    assert api.lease is not None and api.lease.record.holder == "a"
    world.t = 3.0
    assert b.try_acquire_or_renew() is False, "b read again: a holds it, not expired"


def test_a_renewal_keeps_the_acquire_time_and_moves_the_renew_time() -> None:
    world, api = World(), FakeLeaseAPI()
    a = replica(api, "a", world)
    a.try_acquire_or_renew()
    world.t = 2.0
    assert a.try_acquire_or_renew()
    assert api.lease.record.acquire_time == "2026-01-01T12:00:00.000000Z", "kept on renewal"
    assert api.lease.record.renew_time == "2026-01-01T12:00:02.000000Z"


def test_the_holder_stops_after_the_renew_deadline_without_a_renewal() -> None:
    world, api = World(), FakeLeaseAPI()
    a = replica(api, "a", world)
    leadership = Leadership(a, on_lost=lambda: None)

    def wait(seconds: float) -> bool:
        world.t += seconds
        if world.t >= 7.0:
            api.down = True  # the API server away from t=7 s on
        return world.t > 120

    assert leadership.acquire(wait)
    assert leadership.renew(wait) is False, "lost"
    # the last renewal that succeeded was sent at t=6 s: the deadline ran out at 16 s
    assert 6.0 + RENEW_S <= world.t <= 6.0 + RENEW_S + RETRY_S
    assert a.is_leader() is False


def test_the_holder_stops_at_once_when_another_took_the_lease() -> None:
    world, api = World(), FakeLeaseAPI()
    a = replica(api, "a", world)
    leadership = Leadership(a, on_lost=lambda: None)
    assert leadership.acquire(lambda s: False)

    def wait(seconds: float) -> bool:
        world.t += seconds
        if world.t == 4.0:  # someone else writes the Lease
            assert api.lease is not None
            api._store(LeaseRecord("intruder", 15, None, None, 3))
        return world.t > 60

    assert leadership.renew(wait) is False
    assert world.t == 4.0
    assert not a.is_leader()


def test_a_stopped_candidate_stops_waiting_and_a_stopped_holder_releases() -> None:
    world, api = World(), FakeLeaseAPI()
    holder = replica(api, "holder", world)
    holder.try_acquire_or_renew()
    waiting = Leadership(replica(api, "b", world), on_lost=lambda: None)
    calls = []

    def wait(seconds: float) -> bool:
        calls.append(seconds)
        if len(calls) == 3:
            waiting.stop()
        return waiting.stopping

    assert waiting.acquire(wait) is False
    assert len(calls) == 3
    leading = Leadership(holder, on_lost=lambda: None)
    leading.stop()
    assert api.lease is not None and api.lease.record.holder == ""


def test_durations_are_checked_as_client_go_does() -> None:
    with pytest.raises(ValueError, match="longer than the renew deadline"):
        LeaderElector(FakeLeaseAPI(), "a", lease_duration_s=10, renew_deadline_s=10)
    with pytest.raises(ValueError, match="longer than the retry period"):
        LeaderElector(FakeLeaseAPI(), "a", renew_deadline_s=2.3, retry_period_s=2)
    with pytest.raises(ValueError, match="identity"):
        LeaderElector(FakeLeaseAPI(), "")


def test_the_settings_name_the_lease_and_check_its_durations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key in list(os.environ):
        if key.startswith(operator_settings.ENV_PREFIX):
            monkeypatch.delenv(key)
    assert operator_settings.from_environment().lease() is None, "no election by default"
    monkeypatch.setenv("KVPOOL_OPERATOR_LEASE_NAME", "kvpool")
    with pytest.raises(ValueError, match="lease_namespace"):
        operator_settings.from_environment()
    monkeypatch.setenv("KVPOOL_OPERATOR_LEASE_NAMESPACE", "ops")
    settings = operator_settings.from_environment()
    assert settings.lease() == ("ops", "kvpool")
    assert (settings.lease_duration_s, settings.renew_deadline_s, settings.retry_period_s) == (
        15, 10, 2,
    )  # fmt: skip
    monkeypatch.setenv("KVPOOL_OPERATOR_RENEW_DEADLINE_S", "20")
    with pytest.raises(ValueError, match="longer than the renew deadline"):
        operator_settings.from_environment()


def test_the_loop_runs_no_round_while_another_replica_leads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world, api = World(), FakeLeaseAPI()
    other = replica(api, "other", world)
    me = replica(api, "me", world)
    other.try_acquire_or_renew()
    me.try_acquire_or_renew()
    ticks: list[tuple[str, str]] = []
    monkeypatch.setattr(handlers, "LEADER", me)
    monkeypatch.setattr(handlers, "_active", False)
    monkeypatch.setattr(handlers, "tick", lambda ns, name: ticks.append((ns, name)) or 60.0)
    monkeypatch.setitem(handlers._due, ("ns", "p"), 0.0)
    handlers._loop_stop.clear()
    thread = handlers.threading.Thread(target=handlers._loop, daemon=True)
    thread.start()
    try:
        time.sleep(1.2)
        assert ticks == []
        assert handlers.metrics_snapshot().active is False
        assert other.release()
        me.try_acquire_or_renew()  # world.t stays 0: within the renew deadline
        deadline = time.monotonic() + 5
        while not ticks and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ticks == [("ns", "p")]
        assert handlers.metrics_snapshot().active is True
        world.t = RENEW_S  # no renewal for the renew deadline: this replica stops at once
        assert handlers.active() is False
    finally:
        handlers._loop_stop.set()
        thread.join(timeout=5)


# --- against the emulator -------------------------------------------------------------------

LEASE = "kvpool-test"
LEASE_NS = "kvpool-system"
LEASES = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NS}/leases"
EMU_LEASE_S, EMU_RENEW_S, EMU_RETRY_S = 4.0, 3.0, 0.5  # short, for a quick test


@pytest.fixture
async def emulator(kmock: Any, tmp_path: Path) -> AsyncIterator[tuple[Kube, Path]]:
    """The emulator with the InferencePool CRD (and Leases among its kinds)."""
    declare_resources(kmock)
    url = str(kmock.url).rstrip("/")
    path = write_kubeconfig(tmp_path / "kubeconfig", url)
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        crd = yaml.safe_load((Path(__file__).parents[1] / "crds/inferencepool.yaml").read_text())
        r = await client.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=crd)
        assert r.status_code in (200, 201), r.text
        yield Kube(client, kmock), path


async def test_the_lease_api_over_the_kubernetes_client(
    emulator: tuple[Kube, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """create, get, update with the read resourceVersion (PUT), and 409 on a stale one."""
    from kvpool.operator.cluster import api_client

    kube, kubeconfig = emulator
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    api = KubernetesLeaseAPI(api_client(), LEASE_NS, LEASE)
    t0, t1 = "2026-01-01T12:00:00.000000Z", "2026-01-01T12:00:02.000000Z"

    def create() -> None:
        assert api.get() is None
        api.create(LeaseRecord("a", 15, t0, t0, 0))
        with pytest.raises(Conflict):
            api.create(LeaseRecord("b", 15, t0, t0, 0))

    def update() -> None:
        read = api.get()
        assert read is not None
        second = api.update(read, LeaseRecord("a", 15, t0, t1, 0))
        assert second.resource_version != read.resource_version
        with pytest.raises(Conflict):
            api.update(read, LeaseRecord("b", 15, t1, t1, 1))  # a stale version
        assert api.get() == second

    await asyncio.to_thread(create)
    labels = {"metadata": {"labels": {"someone": "else"}}}  # kept by the update
    merge = {"Content-Type": "application/merge-patch+json"}
    r = await kube.http.patch(f"{LEASES}/{LEASE}", json=labels, headers=merge)
    assert r.status_code == 200, r.text
    await asyncio.to_thread(update)
    lease = (await kube.http.get(f"{LEASES}/{LEASE}")).json()
    assert lease["metadata"]["labels"] == {"someone": "else"}
    assert lease["spec"] == {
        "holderIdentity": "a", "leaseDurationSeconds": 15, "acquireTime": t0,
        "renewTime": t1, "leaseTransitions": 0,
    }  # fmt: skip


class Replica:
    """One ``kvpool operator run`` process with leader election, its log in a file."""

    def __init__(self, name: str, kubeconfig: Path, log_dir: Path) -> None:
        self.name = name
        self.port = free_port()
        self.health = free_port()
        self.log = log_dir / f"{name}.log"
        env = {
            **os.environ,
            "PYTHONSAFEPATH": "1",
            "KUBECONFIG": str(kubeconfig),
            "POD_ID": name,
            "KVPOOL_OPERATOR_LEASE_NAME": LEASE,
            "KVPOOL_OPERATOR_LEASE_NAMESPACE": LEASE_NS,
            "KVPOOL_OPERATOR_LEASE_DURATION_S": str(EMU_LEASE_S),
            "KVPOOL_OPERATOR_RENEW_DEADLINE_S": str(EMU_RENEW_S),
            "KVPOOL_OPERATOR_RETRY_PERIOD_S": str(EMU_RETRY_S),
            "KVPOOL_OPERATOR_METRICS_PORT": str(self.port),
            "KVPOOL_OPERATOR_LIVENESS_PORT": str(self.health),
            "KVPOOL_OPERATOR_RESYNC_INTERVAL_S": "2",
            "KVPOOL_OPERATOR_SCRAPE_TIMEOUT_S": "1",
        }
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvpool.cli", "operator", "run"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    async def get(self, port: int, path: str) -> httpx.Response | None:
        try:
            async with httpx.AsyncClient(timeout=2) as client:
                return await client.get(f"http://127.0.0.1:{port}{path}")
        except httpx.HTTPError:
            return None

    async def active(self) -> float | None:
        """``kvpool_operator_active`` from its /metrics, None while it does not answer."""
        r = await self.get(self.port, "/metrics")
        if r is None:
            return None
        for family in text_string_to_metric_families(r.text):
            if family.name == "kvpool_operator_active":
                return family.samples[0].value
        return None

    async def healthy(self) -> bool:
        r = await self.get(self.health, "/healthz")
        return r is not None and r.status_code == 200

    def started_kopf(self) -> bool:
        """Whether its log shows kopf started (its handlers and the operator's loop)."""
        return "Activity 'start_loop'" in self.log.read_text(errors="replace")

    def tail(self) -> str:
        return f"--- {self.name} ---\n" + self.log.read_text(errors="replace")[-3000:]

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture
async def replicas(emulator: tuple[Kube, Path]) -> AsyncIterator[list[Replica]]:
    started: list[Replica] = []
    yield started
    # From threads: the emulator runs on this loop and must answer their goodbyes.
    await asyncio.gather(*(asyncio.to_thread(r.stop) for r in started))


@pytest.mark.slow
async def test_only_the_lease_holder_acts_a_clean_stop_hands_over_and_a_lost_lease_stops(
    emulator: tuple[Kube, Path], replicas: list[Replica], tmp_path: Path
) -> None:
    kube, kubeconfig = emulator

    async def holder() -> str:
        r = await kube.http.get(f"{LEASES}/{LEASE}")
        return (r.json().get("spec") or {}).get("holderIdentity") or "" if r.is_success else ""

    async def held_by(name: str) -> bool:
        return (await holder()).startswith(f"{name}_")

    a = Replica("op-a", kubeconfig, tmp_path)
    replicas.append(a)
    try:
        await eventually(lambda: held_by("op-a"), "op-a to take the Lease", timeout=30)
        await eventually(lambda: a.active(), "op-a active", timeout=30)
        b = Replica("op-b", kubeconfig, tmp_path)
        replicas.append(b)
        await eventually(b.healthy, "op-b's /healthz while it waits", timeout=30)
        assert await b.active() == 0.0, "op-b's /metrics while it waits"

        # only the holder acts
        await kube.create_pool("tiny", POOL_SPEC)
        await eventually(lambda: kube.child("Deployment", "tiny-decode"), "the pool's children")
        assert await held_by("op-a") and await b.active() == 0.0
        assert a.started_kopf() and not b.started_kopf(), "op-b ran kopf while it waited"

        # a clean stop releases the Lease: op-b takes it at once, not after the lease
        assert await asyncio.to_thread(a.stop) == 0, "op-a's clean stop"
        stopped = time.monotonic()
        await eventually(lambda: held_by("op-b"), "op-b to take the released Lease", timeout=10)
        handed_over = time.monotonic() - stopped
        # released: at B's next try (retry period, jittered); not: a lease after A's last renewal
        assert handed_over < EMU_LEASE_S / 2, f"taken {handed_over:.1f}s after op-a stopped"
        assert "lease: released" in a.log.read_text(errors="replace")
        await eventually(lambda: b.active(), "op-b active", timeout=30)
        await kube.change_spec("tiny", {"decode": {"replicas": 3}})

        async def scaled() -> bool:
            dep = await kube.child("Deployment", "tiny-decode")
            return bool(dep) and dep["spec"]["replicas"] == 3

        await eventually(scaled, "op-b to apply decode replicas 3", timeout=20)

        # someone else takes the Lease: op-b stops (exit 1); op-c waits the lease out first
        c = Replica("op-c", kubeconfig, tmp_path)
        replicas.append(c)
        await eventually(c.healthy, "op-c's /healthz while it waits", timeout=30)
        lease = (await kube.http.get(f"{LEASES}/{LEASE}")).json()
        lease["spec"]["holderIdentity"] = "intruder"
        r = await kube.http.put(f"{LEASES}/{LEASE}", json=lease)
        assert r.status_code == 200, r.text
        written = time.monotonic()
        await eventually(lambda: b.proc.poll() is not None, "op-b to exit", timeout=EMU_RENEW_S + 5)
        assert b.proc.returncode == 1, "op-b's exit when it lost the Lease"
        await eventually(lambda: held_by("op-c"), "op-c to take the lapsed Lease", timeout=15)
        took_over = time.monotonic() - written
        assert took_over >= EMU_LEASE_S - 0.2, f"op-c took it {took_over:.1f}s after the write"
        await eventually(lambda: c.active(), "op-c active", timeout=30)

        # a waiting replica stops at once and cleanly, and leaves the Lease alone
        d = Replica("op-d", kubeconfig, tmp_path)
        replicas.append(d)
        await eventually(d.healthy, "op-d's /healthz while it waits", timeout=30)
        assert await asyncio.to_thread(d.stop) == 0, "op-d's stop while it waited"
        assert await held_by("op-c")
    except BaseException:
        print("\n".join(r.tail() for r in replicas))
        raise
    if os.environ.get("SHOW_LOGS"):
        print("\n".join(r.tail() for r in replicas))
    print(f"op-b took the released Lease in {handed_over:.1f}s; op-c the lapsed one in "
          f"{took_over:.1f}s (lease {EMU_LEASE_S:g}s)")  # fmt: skip
    lease = (await kube.http.get(f"{LEASES}/{LEASE}")).json()
    assert lease["spec"]["leaseTransitions"] == 2  # a -> b, (b -> intruder by hand), -> c
