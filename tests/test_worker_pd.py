"""The prefill/decode hand-off (contract 4): a prefill worker computes and pins the prompt's
blocks, a decode worker pulls them over HTTP and decodes; any failure of the pull falls back
to a local prefill with the same answer."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpool.signing import TOKEN_FIELD, sign_transfer_params

from conftest import TEST_POOL_SECRET, RunningWorker, WorkerProcess

PROMPT = (
    "A router in front of a pool of inference workers reads every prompt, cuts it into blocks "
    "of sixteen tokens, and hashes each block together with the hash of the block before it."
)


@pytest.fixture
def processes(llama_dir: Path, tmp_path: Path) -> Iterator[Any]:
    started: list[WorkerProcess] = []

    def start(role: str) -> WorkerProcess:
        log = tmp_path / f"{role}-{len(started)}.log"
        worker = WorkerProcess(
            llama_dir,
            engine="kvpool",
            log=log,
            role=role,
            num_blocks=128,
            device="cpu",
            drain_timeout_s=1,
            kv_events_endpoint=None,
            kv_events_replay_endpoint=None,
            pool_secret=TEST_POOL_SECRET,
        )
        started.append(worker)
        worker.wait_healthy()
        return worker

    yield start
    for p in started:
        p.kill()


@pytest.fixture
def pd_worker(start_worker: Any) -> Any:
    """A worker of the test pool: it shares the pool secret that hand-offs need."""
    return lambda **values: start_worker(pool_secret=TEST_POOL_SECRET, **values)


def token(params: dict[str, Any]) -> dict[str, str]:
    """The header that opens a hand-off's pinned blocks."""
    return {"Authorization": f"Bearer {params[TOKEN_FIELD]}"}


def complete(url: str, prompt: str | list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json={**body, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def prefill(url: str, prompt: str | list[int] = PROMPT) -> dict[str, Any]:
    answer = complete(url, prompt, 1, kv_transfer_params={"do_remote_decode": True})
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_request_id"]
    return params


def test_prefill_and_decode_processes_answer_like_one_worker(
    processes: Any, start_worker: Any
) -> None:
    expected = complete(start_worker().url, PROMPT, 24)["choices"][0]["text"]
    p, d = processes("prefill"), processes("decode")
    params = prefill(p.url)
    n_blocks = len(params["remote_block_ids"])
    assert (
        n_blocks
        == len(httpx.post(p.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]) // 16
        > 0
    )
    assert p.metric("kvpool_worker_pinned_requests") == 1
    answer = complete(d.url, PROMPT, 24, kv_transfer_params=params)
    assert answer["choices"][0]["text"] == expected
    assert d.metric("kvpool_worker_kv_transfer_blocks_total", direction="received") == n_blocks
    assert d.metric("kvpool_worker_kv_transfer_fallbacks_total") == 0
    # The pulled blocks served the prompt: only its tail was computed on the decode side.
    assert d.metric("vllm:prefix_cache_hits_total") >= (n_blocks - 1) * 16
    deadline = time.monotonic() + 10  # the decode side releases the pin after its pull
    while p.metric("kvpool_worker_pinned_requests") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.metric("kvpool_worker_pinned_requests") == 0
    assert p.metric("vllm:kv_cache_usage_perc") == 0


def test_a_killed_prefill_worker_leads_to_a_local_prefill(
    processes: Any, start_worker: Any
) -> None:
    expected = complete(start_worker().url, PROMPT, 16)["choices"][0]["text"]
    p, d = processes("prefill"), processes("decode")
    params = prefill(p.url)
    p.kill()
    answer = complete(d.url, PROMPT, 16, kv_transfer_params=params)
    assert answer["choices"][0]["text"] == expected
    assert d.metric("kvpool_worker_kv_transfer_fallbacks_total") == 1
    assert d.metric("kvpool_worker_kv_transfer_blocks_total", direction="received") == 0


class CuttingProxy:
    """Relays one connection to the prefill worker and cuts the response after ``limit``
    bytes, as a prefill worker dying in the middle of a transfer would."""

    def __init__(
        self,
        upstream_port: int,
        limit: int,
        on_cut: Callable[[], None] = lambda: None,
        *,
        after_header: bool = False,
    ) -> None:
        """``after_header``: ``limit`` counts from the end of the KV transfer's header."""
        self.upstream_port, self.limit, self.on_cut = upstream_port, limit, on_cut
        self.after_header = after_header
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.relayed = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        try:
            self._relay_one(client)
        except OSError:  # the upstream is gone (killed): the client sees a closed connection
            client.close()

    def _relay_one(self, client: socket.socket) -> None:
        with client, socket.create_connection(("127.0.0.1", self.upstream_port)) as upstream:
            client.settimeout(5)
            request = client.recv(65536)
            upstream.sendall(request)
            if not request.startswith(b"GET"):
                client.sendall(upstream.recv(65536))
                return
            if self.after_header:  # read up to the transfer header's end, then count
                head = b""
                while (at := head.find(b"KVPB")) < 0 or len(head) < at + 8:
                    head += upstream.recv(1)
                (n,) = struct.unpack(">I", head[at + 4 : at + 8])
                head += _recv_exactly(upstream, n)
                client.sendall(head)
                self.limit += len(head)
                self.relayed = len(head)
            while self.relayed < self.limit:
                data = upstream.recv(min(65536, self.limit - self.relayed))
                if not data:
                    break
                client.sendall(data)
                self.relayed += len(data)
            if self.relayed >= self.limit:
                self.on_cut()

    def close(self) -> None:
        self.sock.close()


def test_a_prefill_worker_killed_mid_transfer_leads_to_a_local_prefill(
    processes: Any, start_worker: Any, pd_worker: Any
) -> None:
    expected = complete(start_worker().url, PROMPT, 16)["choices"][0]["text"]
    p, d = processes("prefill"), pd_worker(role="decode")
    params = prefill(p.url)
    # The pull goes through a relay that kills the prefill process once the response
    # headers, the transfer header and part of the first block have gone through.
    proxy = CuttingProxy(p.port, limit=3000, on_cut=p.kill)
    answer = complete_through(proxy, params, d.url, PROMPT)
    assert proxy.relayed == 3000 and p.proc.poll() is not None
    assert answer["choices"][0]["text"] == expected
    assert d.metric("kvpool_worker_kv_transfer_fallbacks_total") == 1
    assert d.engine.stats.prefix_cache_hits == 0  # nothing half-received was stored


def complete_through(
    proxy: CuttingProxy, params: dict[str, Any], url: str, prompt: str | list[int]
) -> dict[str, Any]:
    """The decode leg of ``params``, its pull going through ``proxy`` (the test stands for
    the pool here: it signs the hand-off that names the relay)."""
    try:
        cut = sign_transfer_params(
            {**params, "remote_port": proxy.port}, TEST_POOL_SECRET, ttl_s=30
        )
        return complete(url, prompt, 16, kv_transfer_params=cut)
    finally:
        proxy.close()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        piece = sock.recv(n - len(data))
        if not piece:
            raise OSError("closed")
        data += piece
    return data


def test_a_pull_cut_short_keeps_the_blocks_that_came_whole(
    processes: Any, start_worker: Any, pd_worker: Any
) -> None:
    """The blocks of a transfer are written into the decode worker's cache as they arrive;
    when the prefill worker dies three and a half blocks into the body, the three whole
    ones stay (cached for the request) and only the rest of the prompt is computed."""
    prompt = [5 + (i * 13) % 400 for i in range(100)]  # 6 full blocks and 4 tokens
    expected = complete(start_worker().url, prompt, 16)["choices"][0]["text"]
    p, d = processes("prefill"), pd_worker(role="decode")
    params = prefill(p.url, prompt)
    block_bytes = d.engine.kv_layout.block_bytes
    proxy = CuttingProxy(p.port, 3 * block_bytes + block_bytes // 2, p.kill, after_header=True)
    answer = complete_through(proxy, params, d.url, prompt)
    assert p.proc.poll() is not None
    assert answer["choices"][0]["text"] == expected
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * 16
    assert d.metric("kvpool_worker_kv_transfer_fallbacks_total") == 1


def test_a_pull_keeps_its_blocks_even_if_the_pin_is_deleted_meanwhile(pd_worker: Any) -> None:
    p = pd_worker(role="prefill")
    params = prefill(p.url)
    rid = params["remote_request_id"]
    engine = p.engine
    pin = engine.open_pinned(rid)  # a pull under way
    assert httpx.delete(f"{p.url}/kv/{rid}", headers=token(params)).status_code == 200
    assert all(engine.pool.blocks[b].ref_count > 0 for b in pin.block_ids)  # still readable
    engine.close_pinned(pin)
    assert engine.stats.kv_usage == 0


def test_pins_that_block_admission_leave_the_engine_thread_idle(pd_worker: Any) -> None:
    import psutil

    # 8 blocks: a pinned prefill of 6 leaves too few for the next prompt until it expires.
    p = pd_worker(role="prefill", num_blocks=8, kv_pin_timeout_s=2.0)
    prefill(p.url, list(range(10, 110)))
    assert p.metric("kvpool_worker_pinned_requests") == 1
    waiting: list[dict[str, Any]] = []
    blocked = list(range(200, 250))  # 4 blocks, with 2 free
    thread = threading.Thread(target=lambda: waiting.append(complete(p.url, blocked, 4)))
    thread.start()
    p.wait_for(lambda: p.metric("vllm:num_requests_waiting") == 1)
    engine_thread = p.worker.loop._thread.native_id

    def cpu() -> float:
        t = next(t for t in psutil.Process().threads() if t.id == engine_thread)
        return t.user_time + t.system_time

    before, start = cpu(), time.monotonic()
    time.sleep(0.5)  # measuring an interval, not waiting for a condition
    busy = (cpu() - before) / (time.monotonic() - start)
    thread.join(timeout=30)
    assert busy < 0.2, f"the engine thread used {busy:.0%} of a core while stuck"
    assert waiting and waiting[0]["usage"]["completion_tokens"] == 4  # served after expiry
    assert p.metric("kvpool_worker_kv_pins_expired_total") == 1


def test_blocks_from_another_hash_seed_are_refused(pd_worker: Any) -> None:
    p = pd_worker(role="prefill", hash_seed="1")
    d = pd_worker(role="decode")
    params = prefill(p.url)
    complete(d.url, PROMPT, 4, kv_transfer_params=params)
    assert d.metric("kvpool_worker_kv_transfer_fallbacks_total") == 1
    assert d.engine.stats.prefix_cache_hits == 0


def test_pinned_blocks_are_freed_on_delete_or_after_the_timeout(pd_worker: Any) -> None:
    p: RunningWorker = pd_worker(role="prefill", kv_pin_timeout_s=1.0)
    params = prefill(p.url)
    url = f"{p.url}/kv/{params['remote_request_id']}"
    assert p.metric("vllm:kv_cache_usage_perc") > 0
    assert httpx.delete(url, headers=token(params)).status_code == 200
    assert httpx.get(url, headers=token(params)).status_code == 403  # the token is spent
    assert p.metric("kvpool_worker_pinned_requests") == 0
    assert p.metric("vllm:kv_cache_usage_perc") == 0

    prefill(p.url)
    assert p.metric("kvpool_worker_pinned_requests") == 1
    p.wait_for(lambda: p.metric("kvpool_worker_pinned_requests") == 0, timeout=10)
    assert p.metric("kvpool_worker_kv_pins_expired_total") == 1
    assert p.metric("vllm:kv_cache_usage_perc") == 0


def test_roles_refuse_the_other_leg(start_worker: Any) -> None:
    d = start_worker(role="decode")
    r = httpx.post(
        d.url + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert r.status_code == 400 and "decode" in r.json()["error"]["message"]
    r = httpx.post(
        d.url + "/v1/completions",
        json={"prompt": PROMPT, "kv_transfer_params": {"do_remote_prefill": True}},
    )
    assert r.status_code == 400 and "remote_host" in r.json()["error"]["message"]
