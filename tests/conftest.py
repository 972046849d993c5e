from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from kvpool.kv_events import (
    Delivery,
    EventPublisher,
    EventSubscriber,
    Received,
    ResyncNeeded,
    parse_frames,
)
from kvpool.stack import StackError, free_port, wait_healthy

DATA = Path(__file__).parent / "data"

#: the pool secret of test pools whose workers hand off prefills (``pool_secret=...``)
TEST_POOL_SECRET = "test-pool-secret-not-for-production"


@pytest.fixture(scope="session")
def hash_vectors() -> dict[str, Any]:
    return json.loads((DATA / "block_hash_vectors.json").read_text())


@pytest.fixture(scope="session")
def event_samples() -> dict[str, Any]:
    return json.loads((DATA / "kv_event_samples.json").read_text())


@pytest.fixture
def make_publisher() -> Iterator[Callable[..., EventPublisher]]:
    """Start real publishers on free loopback ports; all are closed at the end."""
    started: list[EventPublisher] = []

    def make(**kwargs: Any) -> EventPublisher:
        kwargs.setdefault("endpoint", "tcp://127.0.0.1:*")
        kwargs.setdefault("replay_endpoint", "tcp://127.0.0.1:*")
        pub = EventPublisher(**kwargs).start()
        started.append(pub)
        return pub

    yield make
    for pub in started:
        pub.close()


class Collector:
    """Runs a subscriber's loop in a task and keeps what it delivers, so tests can wait for
    a condition with a deadline instead of sleeping."""

    def __init__(self, sub: EventSubscriber) -> None:
        self.sub = sub
        self.items: list[Delivery] = []
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for item in self.sub:
            self.items.append(item)
            self._changed.set()

    @property
    def batches(self) -> list[Received]:
        return [i for i in self.items if isinstance(i, Received)]

    @property
    def resyncs(self) -> list[ResyncNeeded]:
        return [i for i in self.items if isinstance(i, ResyncNeeded)]

    @property
    def seqs(self) -> list[int]:
        return [b.seq for b in self.batches]

    async def wait_until(self, condition: Callable[[], bool], timeout: float = 20.0) -> None:
        async def waiter() -> None:
            while not condition():
                if self._task.done():
                    self._task.result()  # surface the loop's exception
                    raise AssertionError("subscriber loop ended")
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(waiter(), timeout)

    async def stop(self) -> None:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self.sub.close()


@pytest.fixture
async def collect() -> Any:
    collectors: list[Collector] = []

    def make(sub: EventSubscriber) -> Collector:
        c = Collector(sub)
        collectors.append(c)
        return c

    yield make
    for c in collectors:
        await c.stop()


class LossyProxy:
    """A real ZMQ hop between publisher and subscriber that loses the messages ``drop``
    picks, and can slip raw frames into the stream: the network's faults, on loopback."""

    def __init__(self, upstream: str, drop: Callable[[int], bool] = lambda seq: False) -> None:
        ctx = zmq.Context.instance()
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.connect(upstream)
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 0)
        self._pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.drop = drop
        self.dropped: list[int] = []
        self.forwarded: list[int] = []
        self.last_seq = -1
        self.corrupt: set[int] = set()
        self.duplicate: set[int] = set()  # sent twice, back to back
        self.sent: dict[int, list[bytes]] = {}  # what went out, by sequence number
        self._inject: queue.SimpleQueue[list[bytes]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def inject(self, frames: list[bytes]) -> None:
        self._inject.put(frames)

    def _send_injected(self) -> None:
        while not self._inject.empty():
            self._pub.send_multipart(self._inject.get())

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(10):
                self._send_injected()
                continue
            frames = self._sub.recv_multipart()
            # What was injected before this message was published goes out before it.
            self._send_injected()
            _, seq, _ = parse_frames(frames)
            self.last_seq = seq
            if self.drop(seq):
                self.dropped.append(seq)
                continue
            if seq in self.corrupt:
                frames = [frames[0], frames[1], b"\xc1 damaged in transit"]
            self.forwarded.append(seq)
            self.sent[seq] = frames
            self._pub.send_multipart(frames)
            if seq in self.duplicate:
                self._pub.send_multipart(frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sub.close(0)
        self._pub.close(0)


@pytest.fixture
def lossy_proxy() -> Iterator[Callable[..., LossyProxy]]:
    proxies: list[LossyProxy] = []

    def make(upstream: str, drop: Callable[[int], bool] = lambda seq: False) -> LossyProxy:
        p = LossyProxy(upstream, drop)
        proxies.append(p)
        return p

    yield make
    for p in proxies:
        p.close()


# -- worker models ---------------------------------------------------------------------------
# Small enough that the whole worker suite runs in seconds on 2 cores; GQA (4 heads over 2
# KV heads) so the grouped path is what gets compared with Hugging Face.
TINY_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}


def build_hf_model(model_dir: Path, architecture: str = "llama", **overrides: Any) -> Path:
    """A random model built with transformers' own config and model classes, saved with
    ``save_pretrained``, plus the in-process trained tokenizer."""
    import torch
    from transformers.utils import logging as hf_logging

    from kvpool.worker.tiny import hf_model_classes, write_tokenizer

    hf_logging.disable_progress_bar()
    tokenizer = write_tokenizer(model_dir)
    config_cls, model_cls = hf_model_classes(architecture)
    config = config_cls(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **{**TINY_SHAPE, **overrides},
    )
    torch.manual_seed(1234)
    model = model_cls(config)
    with torch.no_grad():  # spread the weights so greedy choices are clear-cut
        for param in model.parameters():
            param.normal_(0.0, 0.1 if param.dim() > 1 else 0.5)
    model.save_pretrained(str(model_dir))
    return model_dir


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hf_model(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def tiny_model(llama_dir: Path) -> tuple[Any, Any]:
    """The test model and tokenizer, loaded once (engines share the weights)."""
    from kvpool.worker.loader import load_model, load_tokenizer

    return load_model(llama_dir, dtype="float32"), load_tokenizer(llama_dir)


@pytest.fixture(scope="session")
def engine_factory(tiny_model: tuple[Any, Any]) -> Callable[..., Any]:
    """New engines over one loaded model (each with its own KV cache and pool)."""
    from kvpool.worker.engine import EngineConfig, LLMEngine

    model, tokenizer = tiny_model

    def make(event_sink: Any = None, **config: Any) -> LLMEngine:
        config.setdefault("num_blocks", 128)
        return LLMEngine(model, tokenizer, EngineConfig(device="cpu", **config), event_sink)

    return make


def read_metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a server's ``/metrics`` (parsed by prometheus_client), by name and
    labels."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


class RunningServer:
    """A server of ours on 127.0.0.1 (``url``), run by uvicorn in a thread of the test process."""

    url: str
    server: Any
    thread: threading.Thread

    def openai(self, **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, **kwargs)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return read_metrics(self.url)

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def wait_for(self, condition: Callable[[], bool], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError("condition not met in time")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


class RunningWorker(RunningServer):
    """A worker server on 127.0.0.1 in a thread of the test process (its engine is reachable
    as ``.engine`` for checks against the server's answers)."""

    def __init__(self, worker: Any, server: Any) -> None:
        self.worker, self.server = worker, server
        self.thread = threading.Thread(target=server.run, name="test-worker", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not (server.started and (worker.engine is not None or worker.load_error)):
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the worker did not start")
            time.sleep(0.01)
        self.port = worker.port
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def engine(self) -> Any:
        return self.worker.engine

    def metric(self, name: str, **labels: str) -> float:
        labels.setdefault("model_name", self.worker.model_name)
        return super().metric(name, **labels)


@pytest.fixture
def start_worker(
    llama_dir: Path, tiny_model: tuple[Any, Any]
) -> Iterator[Callable[..., RunningWorker]]:
    """Start worker servers (settings as keywords; the test model by default)."""
    from kvpool.worker.engine import LLMEngine
    from kvpool.worker.server import WorkerServer
    from kvpool.worker.serving import uvicorn_server
    from kvpool.worker.settings import WorkerSettings

    running: list[RunningWorker] = []

    def start(engine_factory: Any = None, **values: Any) -> RunningWorker:
        values.setdefault("model", str(llama_dir))
        values.setdefault("port", 0)
        values.setdefault("num_blocks", 128)
        values.setdefault("device", "cpu")
        settings = WorkerSettings(**values)
        if engine_factory is None and settings.engine == "kvpool":
            model, tokenizer = tiny_model

            def engine_factory(sink: Any) -> Any:
                return LLMEngine(model, tokenizer, settings.engine_config(), sink)

        worker = WorkerServer(settings, engine_factory)
        running.append(RunningWorker(worker, uvicorn_server(worker, own_signals=False)))
        return running[-1]

    yield start
    for w in running:
        w.stop()


# -- the router ------------------------------------------------------------------------------


#: ports this test process has handed out: a port the kernel frees when free_port closes
#: its socket can come back from the next bind(0), before the first taker has bound it (two
#: workers of one test were once given the same port)
_GIVEN_PORTS: set[int] = set()


def unique_port() -> int:
    """A free loopback port this process has not handed out before."""
    while (port := free_port()) in _GIVEN_PORTS:
        pass
    _GIVEN_PORTS.add(port)
    return port


def consecutive_ports(n: int) -> int:
    """The first of ``n`` free loopback ports in a row that this process has not handed out
    before (a data-parallel vLLM's ranks publish at a base port plus their rank)."""
    import socket

    for _ in range(200):
        base = unique_port()
        ports = range(base, base + n)
        if any(p in _GIVEN_PORTS for p in ports[1:]):
            continue
        socks = []
        try:
            for port in ports:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        _GIVEN_PORTS.update(ports)
        return base
    raise AssertionError(f"no {n} free ports in a row")


class WorkerProcess:
    """A ``kvpool worker serve`` process (the simulated engine by default): a worker the test
    can kill like a crashed pod. ``log``: a file for its output, shown if it fails to start."""

    def __init__(
        self,
        model: Path,
        engine: str = "sim",
        log: Path | None = None,
        port: int | None = None,
        **flags: Any,
    ) -> None:
        import os
        import subprocess
        import sys

        self.log = log
        self.port = port or unique_port()  # a port given: a restart in the same place
        self.url = f"http://127.0.0.1:{self.port}"
        self.events = f"tcp://127.0.0.1:{unique_port()}"
        self.replay = f"tcp://127.0.0.1:{unique_port()}"
        flags.setdefault("num_blocks", 2048)
        flags.setdefault("kv_events_endpoint", self.events)
        flags.setdefault("kv_events_replay_endpoint", self.replay)
        argv = [sys.executable, "-c", "import sys; from kvpool.cli import main; sys.exit(main())"]
        argv += ["worker", "serve", "--model", str(model), "--engine", engine]
        argv += ["--port", str(self.port)]
        for name, value in flags.items():
            if value is not None:  # None: leave the setting unset (no KV events, say)
                argv += ["--" + name.replace("_", "-"), str(value)]
        env = {**os.environ, "PYTHONSAFEPATH": "1"}
        if log is None:
            self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)
        else:
            with log.open("wb") as out:
                self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 90.0) -> None:
        try:
            wait_healthy(self.url, self.proc, timeout)
        except StackError as exc:
            self.kill()
            output = f"\n{self.log.read_text()}" if self.log else ""
            raise RuntimeError(f"worker {self.url} did not start: {exc}{output}") from None

    def metric(self, name: str, **labels: str) -> float:
        """The first sample of ``name`` whose labels include ``labels`` (0 if none)."""
        for (sample, have), value in read_metrics(self.url).items():
            if sample == name and set(labels.items()) <= set(have):
                return value
        return 0.0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except Exception:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def worker_processes(llama_dir: Path) -> Iterator[Callable[..., list[WorkerProcess]]]:
    """Start ``n`` worker processes (in parallel) and wait until all are healthy."""
    started: list[WorkerProcess] = []

    def start(n: int, **flags: Any) -> list[WorkerProcess]:
        procs = [WorkerProcess(llama_dir, **flags) for _ in range(n)]
        started.extend(procs)
        for p in procs:
            p.wait_healthy()
        return procs

    yield start
    for p in started:
        p.stop()


class RunningRouter(RunningServer):
    """A router on 127.0.0.1 in a thread of the test process."""

    def __init__(self, router: Any, server: Any) -> None:
        self.router, self.server = router, server
        self.thread = threading.Thread(target=server.run, name="test-router", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not (server.started and router.bound_port):
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the router did not start")
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{router.bound_port}"
        #: sent on /debug/* (an admin tenant's key, for a router that checks keys)
        self.debug_headers: dict[str, str] = {}

    def active(self) -> int:
        """Requests past admission that have not ended."""
        return int(self.router.active)

    def workers(self) -> dict[str, dict[str, Any]]:
        resp = httpx.get(self.url + "/debug/workers", headers=self.debug_headers, timeout=10)
        rows = resp.json()["workers"]
        return {w["id"]: w for w in rows}

    def route(self, body: dict[str, Any]) -> dict[str, Any]:
        resp = httpx.post(
            self.url + "/debug/route", json=body, headers=self.debug_headers, timeout=10
        )
        assert resp.status_code == 200, resp.text
        return resp.json()

    def wait_workers_up(self, n: int, timeout: float = 30.0) -> None:
        self.wait_for(
            lambda: sum(w["status"] == "up" for w in self.workers().values()) >= n, timeout
        )


class RouterProcesses(RunningRouter):
    """``kvpool router serve --processes N``: a supervisor process and N router processes
    on one port, driven like :class:`RunningRouter` (but with no ``router`` inside)."""

    def __init__(self, values: dict[str, Any]) -> None:
        import os
        import subprocess
        import sys
        import tempfile

        self.values = values
        port = unique_port()
        argv = [sys.executable, "-c", "import sys; from kvpool.cli import main; sys.exit(main())"]
        argv += ["router", "serve", "--port", str(port)]
        for name, value in values.items():
            for item in value if isinstance(value, list) else [value]:
                argv += ["--" + name.replace("_", "-"), str(item)]
        self.log = tempfile.NamedTemporaryFile(prefix="router-processes-", suffix=".log")
        env = {**os.environ, "PYTHONSAFEPATH": "1"}
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        self.debug_headers = {}
        try:
            wait_healthy(self.url, self.proc, 60.0)
        except StackError as exc:
            self.proc.kill()
            self.log.seek(0)
            output = self.log.read().decode()
            raise RuntimeError(f"the router did not start: {exc}\n{output}") from None

    def active(self) -> int:
        """Requests the router has in flight, summed over its processes (from /metrics)."""
        return int(sum(v for (n, _), v in self.metrics().items() if n == PROCESS_IN_FLIGHT))

    def health_by_process(self, tries: int = 200) -> dict[int, dict[str, Any]]:
        """``/health`` by the process that answered, over ``tries`` new connections."""
        seen = {}
        for _ in range(tries):
            answer = httpx.get(self.url + "/health").json()
            seen[answer["process"]] = answer
        return seen

    def wait_workers_up(self, n: int, timeout: float = 30.0) -> None:
        """Until every process has ``n`` workers in rotation."""
        count = int(self.values.get("processes", 1))

        def up() -> bool:
            seen = self.health_by_process(tries=50)
            return len(seen) == count and all(h["workers_up"] >= n for h in seen.values())

        self.wait_for(up, timeout)

    def terminate(self) -> None:
        import signal

        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout=15)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


PROCESS_IN_FLIGHT = "kvpool_router_worker_in_flight_requests"


@pytest.fixture
def start_router(llama_dir: Path) -> Iterator[Callable[..., RunningRouter]]:
    """Start routers (settings as keywords; ``worker`` a list of specs). ``processes`` > 1
    starts ``kvpool router serve --processes N`` as a process of its own."""
    from kvpool.router.server import Router
    from kvpool.router.serving import uvicorn_server
    from kvpool.router.settings import RouterSettings

    running: list[RunningRouter] = []

    def start(**values: Any) -> RunningRouter:
        values.setdefault("model", str(llama_dir))
        if values.get("processes", 1) > 1:
            running.append(RouterProcesses(values))
            return running[-1]
        values.setdefault("port", 0)
        settings = RouterSettings(**values)
        router = Router(settings)
        running.append(RunningRouter(router, uvicorn_server(router)))
        return running[-1]

    yield start
    for r in running:
        r.stop()


@pytest.fixture
def recording_workers(
    start_router: Callable[..., RunningRouter],
) -> Iterator[Callable[..., Any]]:
    """Start recording workers (tests/recording_worker.py, or a class of its family); they
    stop before the routers (this fixture asks for ``start_router``, so it is torn down
    first)."""
    from recording_worker import RecordingWorker

    started: list[RecordingWorker] = []

    def start(cls: type[RecordingWorker] = RecordingWorker, **kwargs: Any) -> RecordingWorker:
        worker = cls(**kwargs)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()
