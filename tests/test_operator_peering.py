"""Two replicas of the operator: which one acts (kopf's peering rule), and the hand-over.

The rule is checked as a table; then two real ``kvpool operator run`` processes share a
ClusterKopfPeering on kmock's emulator: the one of higher priority is active (handlers,
loop and ``kvpool_operator_active``), and when it is killed the other takes over.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvpool.operator import handlers
from kvpool.operator.peering import PeeringReader, is_active, live_peers
from kvpool.stack import free_port

from kube_emulator import declare_resources, write_kubeconfig
from test_operator_kopf import POOL_SPEC, Kube, eventually

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def seen(seconds_ago: float, priority: int, lifetime: int = 60) -> dict[str, Any]:
    stamp = (NOW - timedelta(seconds=seconds_ago)).isoformat()
    return {"priority": priority, "lifetime": lifetime, "lastseen": stamp}


# --- the rule -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "priority", "expected"),
    [
        pytest.param({}, 10, True, id="no record at all: alone"),
        pytest.param(None, 10, True, id="no status yet"),
        pytest.param({"me": seen(1, 10)}, 10, True, id="only my own record"),
        pytest.param({"other": seen(1, 5)}, 10, True, id="no record of self yet, lower other"),
        pytest.param({"me": seen(1, 10), "other": seen(1, 20)}, 10, False, id="higher wins"),
        pytest.param({"me": seen(1, 20), "other": seen(1, 10)}, 20, True, id="lower yields"),
        pytest.param({"me": seen(1, 10), "other": seen(1, 10)}, 10, False, id="tie freezes"),
        pytest.param({"other": seen(61, 20)}, 10, True, id="dead higher peer ignored"),
        pytest.param({"other": seen(6, 20, lifetime=5)}, 10, True, id="dead by its lifetime"),
        pytest.param({"other": seen(4, 20, lifetime=5)}, 10, False, id="alive by its lifetime"),
        pytest.param({"other": {"priority": 20}}, 10, False, id="no lastseen: seen now"),
        pytest.param({"other": {"lastseen": NOW.isoformat()}}, 0, False, id="no priority: 0"),
        pytest.param({"me": seen(1, 99), "other": seen(1, 5)}, 10, True, id="own record ignored"),
        pytest.param({"other": None}, 10, True, id="a removed record"),
        pytest.param(
            {"a": seen(100, 50), "b": seen(1, 5), "c": seen(2, 30)}, 30, False, id="many, tie"
        ),
    ],
)
def test_a_replica_is_active_unless_a_live_other_has_priority_as_high(
    status: dict[str, Any] | None, priority: int, expected: bool
) -> None:
    assert is_active(status, "me", priority, NOW) is expected


def test_without_a_known_identity_only_a_higher_peer_pauses() -> None:
    status = {"someone": seen(1, 10)}  # perhaps this very replica
    assert is_active(status, None, 10, NOW) is True
    assert is_active({**status, "other": seen(1, 11)}, None, 10, NOW) is False


def test_lastseen_as_kopf_and_kubernetes_write_it() -> None:
    status = {
        "a": {"priority": 1, "lifetime": 60, "lastseen": "2026-01-01T11:59:30+00:00"},
        "b": {"priority": 1, "lifetime": 60, "lastseen": "2026-01-01T11:58:00Z"},
        "c": {"priority": 1, "lifetime": 60, "lastseen": "2026-01-01T11:59:59.5"},
    }
    assert sorted(live_peers(status, NOW)) == ["a", "c"]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_reader_caches_needs_every_namespace_and_survives_a_short_outage() -> None:
    objects: dict[str | None, Any] = {
        "a": {"status": {"me": seen(1, 10)}},
        "b": {"status": {"me": seen(1, 10), "other": seen(1, 20)}},
    }
    calls: list[str | None] = []

    def fetch(namespace: str | None) -> Any:
        calls.append(namespace)
        obj = objects[namespace]
        if isinstance(obj, Exception):
            raise obj
        return obj

    clock = Clock()
    reader = PeeringReader(
        fetch, "me", 10, namespaces=["a", "b"], lifetime_s=5, ttl_s=1, clock=clock, wall=lambda: NOW
    )
    assert reader.active() is False  # paused in b, so paused
    objects["b"] = {"status": {"me": seen(1, 10)}}
    assert reader.active() is False  # cached
    assert calls == ["a", "b"]
    clock.t = 1.0
    assert reader.active() is True
    objects["a"] = ConnectionError("API server away")
    clock.t = 3.0
    assert reader.active() is True  # the last answer stands for a while
    clock.t = 6.5
    assert reader.active() is False  # no answer for a lifetime: the other replica takes over


def test_missing_peering_object_pauses_only_when_peering_is_mandatory() -> None:
    def absent(namespace: str | None) -> None:
        return None

    assert PeeringReader(absent, "me", 10, mandatory=True).active() is False
    assert PeeringReader(absent, "me", 10, mandatory=False).active() is True


def test_the_loop_runs_no_round_while_paused(monkeypatch: pytest.MonkeyPatch) -> None:
    class Paused:
        def active(self) -> bool:
            return False

    ticks: list[tuple[str, str]] = []
    monkeypatch.setattr(handlers, "_peering", Paused())
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
        monkeypatch.setattr(handlers, "_peering", None)  # standalone: always active
        deadline = time.monotonic() + 5
        while not ticks and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ticks == [("ns", "p")]
        assert handlers.metrics_snapshot().active is True
    finally:
        handlers._loop_stop.set()
        thread.join(timeout=5)


# --- two operator processes, one peering ----------------------------------------------------

PEERING = "kvpool-test"
LIFETIME_S = 5


@pytest.fixture
async def emulator(kmock: Any, tmp_path: Path) -> AsyncIterator[tuple[Kube, Path]]:
    """The emulator with the CRD, the kopf.dev peering resources and the peering object."""
    declare_resources(kmock)  # the chart's CRDs: kopf's peerings among them
    url = str(kmock.url).rstrip("/")
    path = write_kubeconfig(tmp_path / "kubeconfig", url)
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        crd = yaml.safe_load((Path(__file__).parents[1] / "crds/inferencepool.yaml").read_text())
        r = await client.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=crd)
        assert r.status_code in (200, 201), r.text
        peering = {
            "apiVersion": "kopf.dev/v1",
            "kind": "ClusterKopfPeering",
            "metadata": {"name": PEERING},
        }
        r = await client.post("/apis/kopf.dev/v1/clusterkopfpeerings", json=peering)
        assert r.status_code in (200, 201), r.text
        yield Kube(client, kmock), path


class Replica:
    """One ``kvpool operator run`` process, its log in a file."""

    def __init__(self, name: str, priority: int, kubeconfig: Path, log_dir: Path) -> None:
        self.name = name
        self.port = free_port()
        self.log = log_dir / f"{name}.log"
        env = {
            **os.environ,
            "PYTHONSAFEPATH": "1",
            "KUBECONFIG": str(kubeconfig),
            "POD_ID": name,
            "KVPOOL_OPERATOR_PEERING": PEERING,
            "KVPOOL_OPERATOR_PRIORITY": str(priority),
            "KVPOOL_OPERATOR_PEERING_LIFETIME_S": str(LIFETIME_S),
            "KVPOOL_OPERATOR_METRICS_PORT": str(self.port),
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

    async def active(self) -> float | None:
        """``kvpool_operator_active`` from its /metrics, None while it does not answer."""
        try:
            async with httpx.AsyncClient(timeout=2) as client:
                r = await client.get(f"http://127.0.0.1:{self.port}/metrics")
        except httpx.HTTPError:
            return None
        for family in text_string_to_metric_families(r.text):
            if family.name == "kvpool_operator_active":
                return family.samples[0].value
        return None

    def tail(self) -> str:
        return f"--- {self.name} ---\n" + self.log.read_text(errors="replace")[-3000:]

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
async def replicas(emulator: tuple[Kube, Path]) -> AsyncIterator[list[Replica]]:
    started: list[Replica] = []
    yield started
    # From threads: the emulator runs on this loop and must answer their goodbyes.
    await asyncio.gather(*(asyncio.to_thread(r.stop) for r in started))


@pytest.mark.slow
async def test_only_the_higher_priority_replica_acts_and_the_other_takes_over(
    emulator: tuple[Kube, Path], replicas: list[Replica], tmp_path: Path
) -> None:
    kube, kubeconfig = emulator
    high = Replica("op-high", 20, kubeconfig, tmp_path)
    low = Replica("op-low", 10, kubeconfig, tmp_path)
    replicas += [high, low]

    async def both_report() -> tuple[float | None, float | None] | None:
        states = (await high.active(), await low.active())
        return states if states == (1.0, 0.0) else None

    try:
        await eventually(both_report, "op-high active and op-low paused", timeout=30)
        await kube.create_pool("tiny", POOL_SPEC)
        await eventually(lambda: kube.child("Deployment", "tiny-decode"), "the pool's children")
        assert "kvpool.operator.cluster" not in low.log.read_text(), "op-low wrote while paused"

        high.stop(signal.SIGKILL)  # no goodbye: its record stays until its lifetime ends
        killed = time.monotonic()
        await eventually(low.active, "op-low active", timeout=LIFETIME_S + 10)
        took_over = time.monotonic() - killed

        await kube.change_spec("tiny", {"decode": {"replicas": 3}})

        async def scaled() -> bool:
            dep = await kube.child("Deployment", "tiny-decode")
            return bool(dep) and dep["spec"]["replicas"] == 3

        await eventually(scaled, "op-low to apply decode replicas 3", timeout=15)
    except BaseException:
        print("\n".join(r.tail() for r in replicas))
        raise
    print(f"op-low took over {took_over:.1f}s after op-high was killed")
    assert took_over <= LIFETIME_S + 5, f"took over after {took_over:.1f}s"
    assert await low.active() == 1.0
