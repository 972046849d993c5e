"""Worker endpoints that only the pool may use (issue 20, item 6): each attack found by
probing a worker on loopback, replayed here, now fails.

* prompts from the KV event sockets: they answer only the pool's credential;
* KV blocks from ``GET /kv/{id}``: only for the hand-off's one-time token, once;
* forged ``kv_transfer_params``: a decode worker honours only a hand-off signed with the
  pool secret, so it neither connects to a host a client names nor caches its blocks;
* admin endpoints: only with the admin token; a drain can be undone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import zmq

from kvpool.kv_events import BlockStored, EventPublisher, EventSubscriber, encode_seq
from kvpool.signing import (
    EXPIRES_FIELD,
    SIGNATURE_FIELD,
    TOKEN_FIELD,
    InvalidSignature,
    admin_token,
    bearer_token,
    check_secret,
    constant_time_equal,
    derive_credential,
    kv_events_credential,
    sign_transfer_params,
    verify_transfer_params,
)

from conftest import TEST_POOL_SECRET, RunningWorker

SECRET = TEST_POOL_SECRET
OTHER_SECRET = "an-attackers-own-pool-secret"
PROMPT = (
    "Patient record: Jane Roe, social security number 078-05-1120, seen on the fourth of "
    "May for a follow-up visit about the results of her blood tests and a new prescription."
)
KVPOOL = [sys.executable, "-c", "import sys; from kvpool.cli import main; sys.exit(main())"]


def hand_off(**fields: Any) -> dict[str, Any]:
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_host": "10.0.0.7",
        "remote_port": 8000,
        "remote_request_id": "req-1",
        "remote_block_ids": [3, 4, 5],
        "remote_engine_id": "engine-a",
        TOKEN_FIELD: "one-time",
    }
    return {**params, **fields}


# -- the signing core, pure ------------------------------------------------------------------


def test_a_signed_hand_off_verifies_until_it_expires() -> None:
    signed = sign_transfer_params(hand_off(), SECRET, ttl_s=30, now=1000.0)
    verify_transfer_params(signed, SECRET, now=1000.0)
    verify_transfer_params(signed, SECRET, now=signed[EXPIRES_FIELD])
    with pytest.raises(InvalidSignature, match="expired"):
        verify_transfer_params(signed, SECRET, now=signed[EXPIRES_FIELD] + 1)


@pytest.mark.parametrize(
    "forge",
    [
        lambda p: {**p, "remote_host": "attacker.example"},
        lambda p: {**p, "remote_port": 9999},
        lambda p: {**p, "remote_request_id": "someone-elses"},
        lambda p: {**p, "remote_block_ids": [1, 2, 3]},
        lambda p: {**p, TOKEN_FIELD: "guessed"},
        lambda p: {**p, EXPIRES_FIELD: p[EXPIRES_FIELD] + 3600},  # a longer life
        lambda p: {k: v for k, v in p.items() if k != "remote_engine_id"},  # a field dropped
        lambda p: {k: v for k, v in p.items() if k != SIGNATURE_FIELD},  # unsigned
        lambda p: sign_transfer_params(p, OTHER_SECRET, ttl_s=30),  # another pool's
    ],
)
def test_an_altered_or_foreign_hand_off_does_not_verify(forge: Any) -> None:
    signed = sign_transfer_params(hand_off(), SECRET, ttl_s=30)
    with pytest.raises(InvalidSignature):
        verify_transfer_params(forge(signed), SECRET)


def test_fields_outside_the_signature_do_not_matter() -> None:
    signed = sign_transfer_params(hand_off(), SECRET, ttl_s=30)
    verify_transfer_params({**signed, "tp_size": 1, "some_connector_field": "x"}, SECRET)


def test_each_purpose_has_its_own_credential_and_none_is_the_secret() -> None:
    creds = {admin_token(SECRET), kv_events_credential(SECRET), derive_credential(SECRET, "x")}
    assert len(creds) == 3 and SECRET not in creds
    assert admin_token(SECRET) == admin_token(SECRET) != admin_token(OTHER_SECRET)
    assert constant_time_equal("abc", "abc") and not constant_time_equal("abc", "abd")
    assert not constant_time_equal(None, "abc") and not constant_time_equal("abc", None)


def test_bearer_tokens_are_read_from_the_authorization_header() -> None:
    assert bearer_token("Bearer abc") == "abc" == bearer_token("bearer  abc ")
    assert bearer_token(None) is None and bearer_token("Basic abc") is None
    assert bearer_token("Bearer ") is None


def test_a_short_pool_secret_is_refused(llama_dir: Any) -> None:
    from kvpool.worker.settings import WorkerSettings

    with pytest.raises(ValueError, match="at least 16 characters"):
        check_secret("short")
    with pytest.raises(ValueError, match="at least 16 characters"):
        WorkerSettings(model=str(llama_dir), pool_secret="short")


def test_the_pool_secret_can_come_from_a_file(llama_dir: Any, tmp_path: Any) -> None:
    from kvpool.worker.settings import WorkerSettings

    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")  # as `kubectl create secret --from-file` keeps it
    settings = WorkerSettings(model=str(llama_dir), pool_secret_file=str(path))
    assert settings.secret == SECRET
    assert SECRET not in repr(settings) and SECRET not in str(settings.model_dump())
    with pytest.raises(ValueError, match="not both"):
        WorkerSettings(model=str(llama_dir), pool_secret_file=str(path), pool_secret=SECRET)
    with pytest.raises(ValueError, match="cannot read"):
        WorkerSettings(model=str(llama_dir), pool_secret_file=str(tmp_path / "missing"))


# -- helpers over real workers -----------------------------------------------------------------


def post(url: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=60, **kwargs)


def prefill(worker: RunningWorker, prompt: str = PROMPT) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    r = post(worker.url, body)
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def decode(worker: RunningWorker, params: dict[str, Any] | None) -> httpx.Response:
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    if params is not None:
        body["kv_transfer_params"] = params
    return post(worker.url, body)


def cached_tokens(answer: httpx.Response) -> int:
    assert answer.status_code == 200, answer.text
    return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def attacker_host() -> Iterator[socket.socket]:
    """A listening socket standing for a host the attacker names: it records connections."""
    sock = socket.create_server(("127.0.0.1", 0))
    yield sock
    sock.close()


def connections_arrived(sock: socket.socket, wait: float = 0.5) -> bool:
    """Whether anyone connected to ``sock`` (a pull happens before the worker answers, so
    by then a connection would be queued; ``wait`` is a margin, not the mechanism)."""
    readable, _, _ = select.select([sock], [], [], wait)
    return bool(readable)


# -- attack: KV blocks from /kv/{id} -------------------------------------------------------------


def test_kv_blocks_are_handed_only_for_the_one_time_token(start_worker: Any) -> None:
    p = start_worker(role="prefill", pool_secret=SECRET)
    params = prefill(p)
    url = f"{p.url}/kv/{params['remote_request_id']}"

    anyone = httpx.get(url)  # the attack: only the request id, from the prefill answer
    assert anyone.status_code == 401 and anyone.json()["error"]["code"] == "kv_token_required"
    assert len(anyone.content) < 1000  # an error body, no blocks
    wrong = httpx.get(url, headers=bearer("guessed-" + params[TOKEN_FIELD][:8]))
    assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "invalid_kv_token"
    admin = httpx.get(url, headers=bearer(admin_token(SECRET)))  # admin frees, never reads
    assert admin.status_code == 403
    assert p.metric("kvpool_worker_pinned_requests") == 1  # refusals spend nothing

    pulled = httpx.get(url, headers=bearer(params[TOKEN_FIELD]))
    assert pulled.status_code == 200 and pulled.content.startswith(b"KVPB")
    again = httpx.get(url, headers=bearer(params[TOKEN_FIELD]))
    assert again.status_code == 403  # one pull per token
    p.wait_for(lambda: p.metric("kvpool_worker_pinned_requests") == 0)  # and no pin stays
    assert p.metric("vllm:kv_cache_usage_perc") == 0


def test_a_pin_is_freed_by_its_token_or_the_admin_token_only(start_worker: Any) -> None:
    p = start_worker(role="prefill", pool_secret=SECRET)
    first, second = prefill(p), prefill(p, PROMPT + " Again.")
    for params in (first, second):
        url = f"{p.url}/kv/{params['remote_request_id']}"
        assert httpx.delete(url).status_code == 401  # someone else's hand-off: not freed
    assert p.metric("kvpool_worker_pinned_requests") == 2
    url = f"{p.url}/kv/{first['remote_request_id']}"
    assert httpx.delete(url, headers=bearer(first[TOKEN_FIELD])).status_code == 200
    url = f"{p.url}/kv/{second['remote_request_id']}"
    assert httpx.delete(url, headers=bearer(admin_token(SECRET))).status_code == 200
    assert p.metric("kvpool_worker_pinned_requests") == 0


# -- attack: forged kv_transfer_params (SSRF and cache poisoning) -------------------------------


def test_a_decode_worker_never_connects_to_a_host_a_client_names(
    start_worker: Any, attacker_host: socket.socket
) -> None:
    d = start_worker(role="decode", pool_secret=SECRET)
    _, port = attacker_host.getsockname()
    forged = hand_off(remote_host="127.0.0.1", remote_port=port)
    attempts = {
        "unsigned": forged,
        "signed by another pool": sign_transfer_params(forged, OTHER_SECRET, ttl_s=30),
        "altered after signing": {
            **sign_transfer_params(hand_off(), SECRET, ttl_s=30),
            "remote_host": "127.0.0.1",
            "remote_port": port,
        },
        "expired": sign_transfer_params(forged, SECRET, ttl_s=-60),
    }
    for what, params in attempts.items():
        r = decode(d, params)
        assert r.status_code == 400, (what, r.text)
        err = r.json()["error"]
        assert (err["code"], err["param"]) == ("invalid_kv_transfer_params", "kv_transfer_params")
    assert not connections_arrived(attacker_host)
    assert d.metric("kvpool_worker_kv_transfer_fallbacks_total") == 0  # nothing was tried
    assert cached_tokens(decode(d, None)) == 0  # and it still serves


def test_a_worker_without_a_pool_secret_refuses_every_hand_off(
    start_worker: Any, attacker_host: socket.socket
) -> None:
    d = start_worker(role="decode")
    _, port = attacker_host.getsockname()
    params = sign_transfer_params(
        hand_off(remote_host="127.0.0.1", remote_port=port), SECRET, ttl_s=30
    )
    r = decode(d, params)
    assert r.status_code == 400 and r.json()["error"]["code"] == "kv_transfer_disabled"
    assert not connections_arrived(attacker_host)
    p = start_worker(role="prefill")
    body = {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    r = post(p.url, body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "kv_transfer_disabled"
    assert p.metric("kvpool_worker_pinned_requests") == 0


def test_forged_blocks_are_not_cached_for_the_victim(start_worker: Any) -> None:
    # The attacker runs a prefill worker of its own (its own secret) that holds blocks for
    # the victim's prompt, and sends its hand-off straight to the pool's decode worker.
    rogue = start_worker(role="prefill", pool_secret=OTHER_SECRET)
    d = start_worker(role="decode", pool_secret=SECRET)
    for params in (prefill(rogue), {**prefill(rogue), SIGNATURE_FIELD: None}):
        assert decode(d, params).status_code == 400
    assert rogue.metric("kvpool_worker_pinned_requests") == 2  # nobody pulled them
    assert d.metric("kvpool_worker_kv_transfer_blocks_total", direction="received") == 0
    # The victim's own request afterwards finds nothing cached from the forgery.
    assert cached_tokens(decode(d, None)) == 0
    assert d.metric("vllm:prefix_cache_hits_total") == 0


def test_a_pool_hand_off_still_moves_the_blocks(start_worker: Any) -> None:
    p = start_worker(role="prefill", pool_secret=SECRET)
    d = start_worker(role="decode", pool_secret=SECRET)
    params = prefill(p)
    n = len(params["remote_block_ids"])
    assert cached_tokens(decode(d, params)) == n * 16
    assert d.metric("kvpool_worker_kv_transfer_blocks_total", direction="received") == n
    p.wait_for(lambda: p.metric("kvpool_worker_pinned_requests") == 0)
    # The same hand-off again (a replay): the token is spent, so nothing is pulled twice.
    assert cached_tokens(decode(d, params)) == n * 16  # from its own cache, not a pull
    assert d.metric("kvpool_worker_kv_transfer_blocks_total", direction="received") == n


# -- attack: the admin endpoints ----------------------------------------------------------------


def test_admin_endpoints_need_the_admin_token_and_a_drain_can_be_undone(
    start_worker: Any,
) -> None:
    w = start_worker(pool_secret=SECRET, drain_timeout_s=1)
    for path in ("/drain", "/undrain", "/reset_prefix_cache"):
        r = httpx.post(w.url + path)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "admin_token_required"
        r = httpx.post(w.url + path, headers=bearer(SECRET))  # the secret itself is no token
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token"
    assert httpx.get(w.url + "/health").status_code == 200  # nothing happened

    token = bearer(admin_token(SECRET))
    assert httpx.post(w.url + "/drain", headers=token).json()["drained"] is True
    assert httpx.get(w.url + "/health").status_code == 503
    assert decode(w, None).status_code == 503
    assert httpx.post(w.url + "/undrain", headers=token).status_code == 200
    assert httpx.get(w.url + "/health").status_code == 200
    assert cached_tokens(decode(w, None)) == 0
    assert cached_tokens(decode(w, None)) > 0
    assert httpx.post(w.url + "/reset_prefix_cache", headers=token).json() == {"reset": True}
    assert cached_tokens(decode(w, None)) == 0

    w.worker.stopping = True  # what SIGTERM sets: that drain is for good
    r = httpx.post(w.url + "/undrain", headers=token)
    assert r.status_code == 409 and r.json()["error"]["code"] == "shutting_down"


def test_without_a_pool_secret_admin_answers_loopback_only(start_worker: Any) -> None:
    from kvpool.worker.server import _loopback

    w = start_worker(drain_timeout_s=1)
    assert httpx.post(w.url + "/drain").json()["drained"] is True  # from 127.0.0.1
    assert httpx.post(w.url + "/undrain").status_code == 200
    assert all(_loopback(a) for a in ("127.0.0.1", "127.0.0.6", "::1", "::ffff:127.0.0.1"))
    assert not any(_loopback(a) for a in ("10.0.0.7", "::ffff:10.0.0.7", "fe80::1", None, "x"))


def test_the_prestop_drain_command_sends_the_admin_token(start_worker: Any) -> None:
    """``kvpool worker drain --port N``, as the pod's preStop hook runs it: the container's
    environment has the pool secret."""
    w = start_worker(pool_secret=SECRET, drain_timeout_s=1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_POOL_SECRET")}
    env.update(PYTHONSAFEPATH="1", KVPOOL_POOL_SECRET=SECRET)
    drain = [*KVPOOL, "worker", "drain", "--port", str(w.port)]
    done = subprocess.run(drain, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert httpx.get(w.url + "/health").status_code == 503


def test_the_admin_commands_read_the_secret_as_the_worker_does(
    start_worker: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvpool.worker.cli import main

    w = start_worker(pool_secret=SECRET, drain_timeout_s=1)
    port = str(w.port)
    monkeypatch.delenv("KVPOOL_POOL_SECRET", raising=False)
    monkeypatch.delenv("KVPOOL_POOL_SECRET_FILE", raising=False)
    assert main(["drain", "--port", port]) == 1  # no secret: refused
    assert "admin_token_required" in capsys.readouterr().out
    assert httpx.get(w.url + "/health").status_code == 200

    assert main(["drain", "--port", port, "--pool-secret", SECRET]) == 0
    assert httpx.get(w.url + "/health").status_code == 503
    monkeypatch.setenv("KVPOOL_POOL_SECRET", SECRET)
    assert main(["undrain", "--port", port]) == 0
    assert httpx.get(w.url + "/health").status_code == 200
    capsys.readouterr()
    assert main(["admin-token"]) == 0
    assert capsys.readouterr().out.strip() == admin_token(SECRET)
    monkeypatch.delenv("KVPOOL_POOL_SECRET")
    with pytest.raises(SystemExit) as exit_:
        main(["admin-token"])  # no secret: a clear error, status 2
    assert exit_.value.code == 2 and "no pool secret" in capsys.readouterr().err


# -- attack: prompts from the KV event sockets ----------------------------------------------------


def raw_replay(endpoint: str, credential: str | None, timeout_ms: int = 1500) -> list[list[bytes]]:
    """Ask a replay socket for everything from 0, as an attacker's script would (a DEALER,
    vLLM's frames); what came back before the end-of-replay marker or the timeout."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if credential is not None:
        sock.setsockopt(zmq.PLAIN_USERNAME, b"kvpool")
        sock.setsockopt(zmq.PLAIN_PASSWORD, credential.encode())
    sock.connect(endpoint)
    got: list[list[bytes]] = []
    try:
        try:  # never waits: a connection refused before the send is gone for good
            sock.send_multipart([b"", encode_seq(0)], flags=zmq.NOBLOCK)
        except zmq.Again:
            return got
        while sock.poll(timeout_ms):
            frames = sock.recv_multipart()
            if frames[-1] == b"":
                break
            got.append(frames)
    finally:
        sock.close(0)
    return got


async def test_a_workers_events_are_read_only_with_the_pools_credential(
    start_worker: Any, collect: Any
) -> None:
    w = start_worker(
        pool_secret=SECRET,
        kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
    )
    info = await asyncio.to_thread(httpx.get, w.url + "/kvpool/info")
    events = info.json()["kv_events"]
    answer = await asyncio.to_thread(decode, w, None)
    assert answer.status_code == 200
    tokenized = await asyncio.to_thread(httpx.post, w.url + "/tokenize", json={"prompt": PROMPT})
    prompt_ids = tokenized.json()["tokens"]

    # The attack: ask the replay socket for everything, and subscribe to the live stream.
    assert await asyncio.to_thread(raw_replay, events["replay_endpoint"], None) == []
    assert await asyncio.to_thread(raw_replay, events["replay_endpoint"], "wrong") == []
    spy = collect(EventSubscriber(events["endpoint"], events["replay_endpoint"], start_seq=0))
    # The pool's own subscriber (the router's) reads the prompt's blocks, replayed from 0.
    credential = kv_events_credential(SECRET)
    assert await asyncio.to_thread(raw_replay, events["replay_endpoint"], credential)
    router = collect(
        EventSubscriber(
            events["endpoint"], events["replay_endpoint"], start_seq=0, credential=credential
        )
    )

    def stored_tokens(c: Any) -> list[int]:
        return [
            t
            for b in c.batches
            for e in b.batch.events
            if isinstance(e, BlockStored)
            for t in e.token_ids
        ]

    await router.wait_until(lambda: len(stored_tokens(router)) >= 16)
    assert stored_tokens(router) == prompt_ids[: len(stored_tokens(router))]
    # Meanwhile the spy, without the credential, was refused at every handshake.
    await until(lambda: spy.sub.stats.handshake_failures > 0)
    assert spy.batches == [] and stored_tokens(spy) == []


async def until(condition: Any, timeout: float = 10.0) -> None:
    """Wait for a condition on another thread's state, polling, with a deadline."""
    async with asyncio.timeout(timeout):
        while not condition():  # noqa: ASYNC110 - the state lives on another thread
            await asyncio.sleep(0.02)


async def test_a_publisher_with_a_credential_admits_only_it(
    make_publisher: Any, collect: Any, caplog: pytest.LogCaptureFixture
) -> None:
    credential = kv_events_credential(SECRET)
    pub: EventPublisher = make_publisher(credential=credential)
    secret_ids = [78, 5, 1120]
    pub.publish(
        [BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=secret_ids, block_size=3)]
    )
    good = collect(
        EventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=0, credential=credential)
    )
    wrong = collect(
        EventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=0, credential="nope" * 8)
    )
    await good.wait_until(lambda: bool(good.batches))
    assert good.batches[0].batch.events[0].token_ids == secret_ids
    # Its catch-up replay is refused first (at once, or after the 2 s replay timeout when
    # its request went out before the refusal), then its subscription.
    await until(lambda: pub.refused > 0 and wrong.sub.stats.handshake_failures > 0)
    assert wrong.batches == []
    assert credential not in caplog.text


async def test_a_replay_connection_refused_before_its_request_does_not_stall_the_subscriber(
    make_publisher: Any, collect: Any
) -> None:
    """On a loaded machine the publisher can refuse a replay connection between the
    subscriber's connect and its request: libzmq never connects that socket again, and a
    request that waited for a connection waited for ever, before the subscriber read the
    refusal of its subscription (the flake of the test above). The request fails at once;
    the subscriber goes on and sees the refusal."""
    pub: EventPublisher = make_publisher(credential=kv_events_credential(SECRET))
    sub = EventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=0, credential="nope" * 8)
    # The catch-up's replay socket, connected ahead and refused before it asks anything:
    # until it has no connection left to send on (reading its events takes the news in).
    replay = sub._replay_socket()
    await until(lambda: not replay.get(zmq.EVENTS) & zmq.POLLOUT)
    collector = collect(sub)
    await until(lambda: sub.caught_up.is_set() and sub.stats.handshake_failures > 0)
    assert sub.stats.replay_failures == 1
    assert collector.batches == []


# -- no secret in any log -----------------------------------------------------------------------


def test_no_secret_or_token_is_logged(start_worker: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    p = start_worker(role="prefill", pool_secret=SECRET)
    d = start_worker(role="decode", pool_secret=SECRET)
    params = prefill(p)
    assert decode(d, params).status_code == 200
    assert decode(d, params).status_code == 200  # a replayed hand-off: a failed pull, logged
    httpx.post(d.url + "/drain", headers=bearer("wrong-token"))
    httpx.post(d.url + "/reset_prefix_cache", headers=bearer(admin_token(SECRET)))
    logged = caplog.text
    assert "remote prefill unusable" in logged  # the log was captured
    for secret in (SECRET, admin_token(SECRET), kv_events_credential(SECRET), params[TOKEN_FIELD]):
        assert secret not in logged
