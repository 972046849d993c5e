"""Session affinity only where a session is named: the session header names one; the body's
``user`` field does only when the router is told to (``--session-from-user``), since a
backend that sends one ``user`` for all its traffic would otherwise pin all of it to
whichever worker took its last request.

Real routers on 127.0.0.1 in front of recording workers; what a user would read is what
``/debug/route`` explains (the session, each worker's ``affinity`` score) and where the
requests went.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import RunningRouter
from recording_worker import RecordingWorker

BACKEND = "backend-service"


@pytest.fixture
def pair(
    llama_dir: Path, start_router: Callable[..., RunningRouter]
) -> Iterator[Callable[..., RunningRouter]]:
    """A router (settings as keywords) in front of two recording workers, a and b; the
    workers stop before the routers."""
    started: list[RecordingWorker] = []

    def start(**settings: Any) -> RunningRouter:
        a, b = RecordingWorker(name=llama_dir.name), RecordingWorker(name=llama_dir.name)
        started.extend((a, b))
        router = start_router(worker=[a.spec("a"), b.spec("b")], **settings)
        router.wait_workers_up(2)
        return router

    yield start
    for worker in started:
        worker.stop()


def _send(router: RunningRouter, body: dict[str, Any], **headers: str) -> str:
    body = {"max_tokens": 2, **body}
    resp = httpx.post(router.url + "/v1/completions", json=body, headers=headers, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.headers["x-kvpool-worker"]


def _route(router: RunningRouter, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    resp = httpx.post(router.url + "/debug/route", json=body, headers=headers, timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _affinity(route: dict[str, Any]) -> dict[str, float]:
    return {c["worker"]: c["scores"].get("affinity", 0.0) for c in route["candidates"]}


def test_a_constant_user_field_names_no_session(pair: Callable[..., RunningRouter]) -> None:
    router = pair()
    for i in range(6):  # a backend's traffic: unrelated prompts, one user for all of it
        _send(router, {"prompt": f"job {i}: " + "unrelated words " * (3 + i), "user": BACKEND})

    route = _route(router, {"prompt": "the next job", "user": BACKEND})

    assert route["session"] is None
    assert _affinity(route) == {"a": 0.0, "b": 0.0}  # no worker is favoured for it


def test_the_session_header_still_names_a_session(pair: Callable[..., RunningRouter]) -> None:
    router = pair()
    served = {
        _send(router, {"prompt": f"turn {t} " + "words " * t}, **{"x-session-id": "chat-1"})
        for t in range(4)
    }
    assert len(served) == 1
    route = _route(router, {"prompt": "turn 4", "user": BACKEND}, **{"x-session-id": "chat-1"})
    assert route["session"] == "chat-1"  # the header, not the user field
    assert sorted(_affinity(route).values()) == [0.0, 1.0]


def test_the_user_field_names_a_session_when_the_router_is_told_to(
    pair: Callable[..., RunningRouter],
) -> None:
    router = pair(session_from_user=True)
    served = {_send(router, {"prompt": f"turn {t} " + "x " * t, "user": "alice"}) for t in range(4)}
    assert len(served) == 1
    route = _route(router, {"prompt": "turn 4", "user": "alice"})
    assert route["session"] == "alice"
    assert _affinity(route)[served.pop()] == 1.0
    # a header given too wins
    both = _route(router, {"prompt": "x", "user": "alice"}, **{"x-session-id": "s"})
    assert both["session"] == "s"


def test_session_from_user_is_a_flag_and_a_variable() -> None:
    import argparse

    from kvpool.router.settings import ENV_PREFIX, RouterSettings
    from kvpool.settings_cli import add_settings_arguments, settings_values

    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, RouterSettings, ENV_PREFIX)
    args = parser.parse_args(["--session-from-user", "true"])
    assert settings_values(args, RouterSettings, ENV_PREFIX)["session_from_user"] == "true"
    assert RouterSettings.model_fields["session_from_user"].default is False
