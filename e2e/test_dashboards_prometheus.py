"""Every Grafana panel's PromQL, run against a real Prometheus scraping a real stack.

The setup, once for the module, all real processes on loopback:

* ``kvpool up`` with two tiny-model workers behind the router (the local stack);
* kmock's Kubernetes emulator, holding an ``InferencePool`` whose router and worker pods
  point at the stack's processes (pod IP 127.0.0.1, the ``prometheus.io/port`` of each), so
  the operator (``kvpool operator run``, a subprocess reaching the emulator through
  ``KUBECONFIG``) reconciles it, measures it and advises replicas, as it would in a cluster;
* Debian's ``prometheus`` (fetched by :mod:`kvpool.devtools` when it is not installed),
  scraping the router and workers with the labels a Kubernetes scrape gives them
  (``namespace``, ``pool``, ``pod``, and ``role`` on workers) and the operator with
  ``honor_labels``, as the chart's ServiceMonitor does;
* a short load through the router with the ``openai`` client.

Then each panel's queries are evaluated through Prometheus's HTTP API, with the dashboard
variables set to the pool, and must return data: a query that names a metric nobody exports,
or a label nobody sets, returns nothing and fails its panel's test.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvpool.stack import free_port, stop_process

ROOT = Path(__file__).resolve().parents[1]


def _tests_module(name: str) -> Any:
    """A helper module of ``tests/`` (on the path only when ``tests/`` is collected too)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


kube_emulator = _tests_module("kube_emulator")  # the emulator's API, as the operator tests set it
DASHBOARDS = sorted((ROOT / "charts" / "kvpool" / "dashboards").glob("*.json"))
KVPOOL = [sys.executable, "-c", "import sys; from kvpool.cli import main; sys.exit(main())"]
NS, POOL, ROLE = "llm", "tiny", "both"  # the variables' values
VARIABLES = {"namespace": NS, "pool": POOL, "role": ROLE, "__range": "15m"}

POOL_SPEC: dict[str, Any] = {
    "model": {"name": "tiny", "source": {"builtin": {}}},
    "disaggregation": {"mode": "Aggregated"},
    "decode": {"replicas": 2},
    "slo": {"quantile": 0.9, "ttftMilliseconds": 2000, "itlMilliseconds": 500},
    "autoscaling": {
        "enabled": True,
        "mode": "Advisory",
        "intervalSeconds": 5,
        "windowSeconds": 60,
        "decode": {"minReplicas": 1, "maxReplicas": 4},
    },
}

pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONSAFEPATH": "1", **extra}


def wait_for(check: Any, what: str, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
        except (httpx.HTTPError, OSError, KeyError, ValueError):
            value = None
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


# --- the Kubernetes emulator, served from its own thread -------------------------------------


class Emulator:
    """kmock's KubernetesEmulator on loopback, in a thread with its own event loop, so the
    operator subprocess can reach it while this module's tests run synchronously."""

    def __init__(self) -> None:
        self.url = ""
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    async def _serve(self) -> None:
        import kmock

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
            kube_emulator.declare_resources(emulator)
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> Emulator:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the Kubernetes emulator did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)


# --- the scenario --------------------------------------------------------------------------


@dataclass
class Scenario:
    prometheus: str  # Prometheus's URL
    at: float  # the evaluation time: the stack under load, the operator measuring


def _start_stack(tmp: Path) -> tuple[subprocess.Popen[str], str, list[str], str]:
    model = tmp / "tiny"
    subprocess.run([*KVPOOL, "worker", "make-tiny-model", str(model)], env=_env(), check=True)
    proc = subprocess.Popen(
        [*KVPOOL, "up", "--model", str(model), "--workers", "2", "--port", "0"],
        # Two requests at a time: the load's others wait in the router's queue, so the
        # flow-control panels have something to show.
        env=_env(KVPOOL_ROUTER_MAX_CONCURRENCY="2"),
        stdout=subprocess.PIPE,
        stderr=(tmp / "stack.log").open("w"),  # the router's and workers' logs, for a failure
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "kvpool up: router on URL (...), 2 kvpool worker(s): URLs"
    urls = re.findall(r"http://127\.0\.0\.1:\d+", line)
    if len(urls) < 4:
        stop_process(proc)
        raise RuntimeError(f"kvpool up did not start: {line!r}")
    return proc, urls[0], urls[2:], model.name


def _port(url: str) -> str:
    return url.rsplit(":", 1)[1]


def _kube_objects(kube: httpx.Client, router: str, workers: list[str]) -> None:
    """The pool, and pods for its router and workers that point at the stack."""
    crd = yaml.safe_load((ROOT / "crds" / "inferencepool.yaml").read_text())
    kube.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=crd)
    pool = {
        "apiVersion": "kvpool.io/v1alpha1",
        "kind": "InferencePool",
        "metadata": {"name": POOL, "namespace": NS, "uid": "uid-tiny", "generation": 1},
        "spec": POOL_SPEC,
    }
    r = kube.post(f"/apis/kvpool.io/v1alpha1/namespaces/{NS}/inferencepools", json=pool)
    r.raise_for_status()
    deployments = f"/apis/apps/v1/namespaces/{NS}/deployments"

    def templates() -> dict[str, Any] | None:
        items = {d["metadata"]["name"]: d for d in kube.get(deployments).json().get("items", [])}
        return items if {f"{POOL}-router", f"{POOL}-decode"} <= set(items) else None

    made = wait_for(templates, "the operator to create the pool's Deployments", 60)
    pods = [(f"{POOL}-router", f"{POOL}-router-0", router)]
    pods += [(f"{POOL}-decode", f"{POOL}-decode-{i}", url) for i, url in enumerate(workers)]
    for deployment, name, url in pods:
        template = made[deployment]["spec"]["template"]["metadata"]
        annotations = {**template.get("annotations", {}), "prometheus.io/port": _port(url)}
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": NS,
                "labels": template["labels"],
                "annotations": annotations,
            },
            "spec": {"containers": [{"name": "main", "image": "stack"}]},
            "status": {"phase": "Running", "podIP": "127.0.0.1"},
        }
        kube.post(f"/api/v1/namespaces/{NS}/pods", json=pod).raise_for_status()
    for deployment, replicas in ((f"{POOL}-router", 1), (f"{POOL}-decode", len(workers))):
        status = {
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": replicas,
            "availableReplicas": replicas,
        }
        kube.patch(
            f"{deployments}/{deployment}/status",
            json={"status": status},
            headers={"Content-Type": "application/merge-patch+json"},
        ).raise_for_status()


def _prometheus_config(router: str, workers: list[str], operator_port: int) -> dict[str, Any]:
    def target(url: str) -> str:
        return url.removeprefix("http://")

    pods = [
        {
            "targets": [target(router)],
            "labels": {"namespace": NS, "pool": POOL, "pod": f"{POOL}-router-0"},
        }
    ]
    for i, url in enumerate(workers):
        labels = {"namespace": NS, "pool": POOL, "role": ROLE, "pod": f"{POOL}-decode-{i}"}
        pods.append({"targets": [target(url)], "labels": labels})
    operator = {
        "targets": [f"127.0.0.1:{operator_port}"],
        "labels": {"namespace": "kvpool-system", "pod": "kvpool-operator-0"},
    }
    return {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "5s"},
        "scrape_configs": [
            {"job_name": "kvpool-pods", "static_configs": pods},
            {"job_name": "kvpool-operator", "honor_labels": True, "static_configs": [operator]},
        ],
    }


def _load(router: str, model: str, seconds: float) -> None:
    """Chat requests that share system prompts, streamed and not, one bad request, and
    pairs of streams on a new long document sent together."""
    from openai import NotFoundError, OpenAI

    client = OpenAI(base_url=router + "/v1", api_key="unused", max_retries=0, timeout=120)
    systems = [
        f"You are assistant number {i}. " + "Answer briefly and precisely. " * 12 for i in range(3)
    ]

    def one(i: int) -> None:
        messages = [
            {"role": "system", "content": systems[i % len(systems)]},
            {"role": "user", "content": f"Question {i}: what is a prefix cache?"},
        ]
        if i % 2:
            stream = client.chat.completions.create(
                model=model, messages=messages, max_tokens=12, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            for _ in stream:
                pass
        else:
            client.chat.completions.create(model=model, messages=messages, max_tokens=12)

    with pytest.raises(NotFoundError):
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )

    def document(k: int, question: str) -> None:
        """A stream on a long document nobody has sent before: two at once, and the second
        is held in the router while the first prefills what they share."""
        text = " ".join(f"Section {k}.{j} sets out rule {j} of document {k}." for j in range(60))
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"{text} {question}"}],
            max_tokens=4, stream=True,
        )  # fmt: skip
        for _ in stream:
            pass

    deadline = time.monotonic() + seconds
    i = 0
    with ThreadPoolExecutor(4) as pool:
        while time.monotonic() < deadline:
            list(pool.map(one, range(i, i + 4)))
            i += 4
        for k in range(3):
            list(pool.map(document, [k, k], ["Who wrote it?", "When?"]))


def query(prometheus: str, expr: str, at: float) -> list[dict[str, Any]]:
    r = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr, "time": at}, timeout=30)
    body = r.json()
    if body.get("status") != "success":
        raise AssertionError(f"Prometheus refused {expr!r}: {body.get('error')}")
    return body["data"]["result"]


def substitute(expr: str) -> str:
    """Grafana's variable interpolation, for the values this scenario selects."""
    return re.sub(r"\$(\w+)|\$\{(\w+)\}", lambda m: VARIABLES[m.group(1) or m.group(2)], expr)


def panel_queries() -> list[Any]:
    params = []
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                name = f"{dashboard['uid']}/{panel['title']}/{target['refId']}"
                params.append(pytest.param(target["expr"], id=name))
    return params


def _has_data(prometheus: str, expr: str, at: float) -> bool:
    values = [float(r["value"][1]) for r in query(prometheus, substitute(expr), at)]
    return any(math.isfinite(v) for v in values)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    from kvpool.devtools import prometheus as prometheus_binary

    tmp = tmp_path_factory.mktemp("dashboards")
    binary = prometheus_binary()  # fetched before anything starts: a failure costs nothing
    procs: list[subprocess.Popen[Any]] = []
    with Emulator() as emulator:
        try:
            stack, router, workers, model = _start_stack(tmp)
            procs.append(stack)
            kubeconfig = kube_emulator.write_kubeconfig(tmp / "kubeconfig", emulator.url)
            operator_port = free_port()
            operator_log = (tmp / "operator.log").open("w")
            procs.append(
                subprocess.Popen(
                    [*KVPOOL, "operator", "run"],
                    env=_env(
                        KUBECONFIG=str(kubeconfig),
                        KVPOOL_OPERATOR_METRICS_PORT=str(operator_port),
                        KVPOOL_OPERATOR_RESYNC_INTERVAL_S="5",
                        KVPOOL_OPERATOR_SCRAPE_TIMEOUT_S="2",
                    ),
                    stdout=operator_log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            with httpx.Client(base_url=emulator.url, timeout=10) as kube:
                _kube_objects(kube, router, workers)
            prom_port = free_port()
            (tmp / "prometheus.yml").write_text(
                yaml.safe_dump(_prometheus_config(router, workers, operator_port))
            )
            procs.append(
                subprocess.Popen(
                    [
                        str(binary),
                        f"--config.file={tmp / 'prometheus.yml'}",
                        f"--storage.tsdb.path={tmp / 'tsdb'}",
                        f"--web.listen-address=127.0.0.1:{prom_port}",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=(tmp / "prometheus.log").open("w"),
                    start_new_session=True,
                )
            )
            prom = f"http://127.0.0.1:{prom_port}"
            wait_for(lambda: httpx.get(prom + "/-/ready", timeout=2).status_code == 200,
                     "Prometheus to start", 60)  # fmt: skip
            started = time.time()
            _load(router, model, seconds=30)
            # Every panel, or a minute more: the operator measures every 5 s over a 60 s
            # window, and the attainment subqueries step at whole minutes.
            exprs = [p.values[0] for p in panel_queries()]

            def all_have_data() -> bool:
                now = time.time()
                if now - started < 65:
                    return False
                return all(_has_data(prom, e, now) for e in exprs)

            try:
                wait_for(all_have_data, "every panel to have data", 90)
            except TimeoutError:
                pass  # the panels' own tests say which
            yield Scenario(prom, time.time())
        finally:
            for proc in reversed(procs):
                stop_process(proc)


# --- the tests -----------------------------------------------------------------------------


def test_every_dashboard_is_checked() -> None:
    assert {p.stem for p in DASHBOARDS} == {
        "kvpool-slo", "kvpool-routing", "kvpool-workers", "kvpool-autoscaling",
    }  # fmt: skip
    assert len(panel_queries()) >= 40


def test_every_metric_a_dashboard_names_is_exported(scenario: Scenario) -> None:
    r = httpx.get(f"{scenario.prometheus}/api/v1/label/__name__/values", timeout=30)
    exported = set(r.json()["data"])
    named = set()
    for expr in [p.values[0] for p in panel_queries()]:
        named |= set(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", expr))
    missing = sorted(named - exported)
    assert not missing, f"the dashboards name metrics nothing exports: {missing}"


def test_every_variable_finds_the_pool(scenario: Scenario) -> None:
    expected = {"namespace": NS, "pool": POOL, "role": ROLE}
    for path in DASHBOARDS:
        for variable in json.loads(path.read_text())["templating"]["list"]:
            if variable["type"] != "query":
                continue
            q = variable["query"]["query"]
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", q)
            assert m, f"{path.name}: {variable['name']}: not a label_values query: {q}"
            selector, label = substitute(m.group(1)), m.group(2)
            r = httpx.get(
                f"{scenario.prometheus}/api/v1/label/{label}/values",
                params={"match[]": selector},
                timeout=30,
            )
            values = r.json()["data"]
            assert expected[variable["name"]] in values, f"{path.name}: ${variable['name']}"


@pytest.mark.parametrize("expr", panel_queries())
def test_panel_query_returns_data(scenario: Scenario, expr: str) -> None:
    result = query(scenario.prometheus, substitute(expr), scenario.at)
    assert result, f"no series for {substitute(expr)}"
    values = [float(r["value"][1]) for r in result]
    assert any(math.isfinite(v) for v in values), f"only NaN/Inf for {substitute(expr)}: {result}"
