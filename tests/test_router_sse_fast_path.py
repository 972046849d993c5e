"""``SSEWatch.feed`` passes a whole delta event on as it is once output flows (the
router's per-chunk fast path, issue 43): for any stream, cut anywhere, it says exactly what
the event-by-event path (``feed_events``) says: the bytes for the client, the outputs, and
the stream's end, error and usage."""

from __future__ import annotations

import itertools
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.router.proxy.sse import SSEWatch


def event(body: Any) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


DELTA = st.builds(
    lambda text: event({"choices": [{"index": 0, "delta": {"content": text}}]}),
    st.text(max_size=6),
)
EVENTS = st.one_of(
    DELTA,
    st.just(event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})),
    st.just(event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})),
    st.just(event({"error": {"message": "x", "code": 400}})),
    st.just(b"data: [DONE]\n\n"),
    st.just(b": a comment\n\n"),
    st.just(b'event: response.output_text.delta\ndata: {"type": "x"}\n\n'),
    st.builds(
        lambda text: b"data:" + json.dumps({"choices": [{"text": text}]}).encode() + b"\n\n",
        st.text(max_size=4),
    ),
)


def run(chunks: list[bytes], fast: bool, strip_usage: bool) -> tuple[Any, ...]:
    watch = SSEWatch(strip_usage)
    feed = watch.feed if fast else watch.feed_events
    said = [feed(chunk) for chunk in chunks]
    return said, watch.done, watch.error, watch.error_status, watch.usage, watch.started


@settings(max_examples=300, deadline=None)
@given(
    events=st.lists(EVENTS, min_size=1, max_size=30),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=10),
    whole=st.booleans(),
    strip_usage=st.booleans(),
)
def test_the_fast_path_says_what_the_event_path_says(
    events: list[bytes], cuts: list[int], whole: bool, strip_usage: bool
) -> None:
    body = b"".join(events)
    if whole:  # a chunk per event, as workers mostly send them
        chunks = events
    else:
        points = sorted({c % (len(body) + 1) for c in cuts} | {0, len(body)})
        chunks = [body[a:b] for a, b in itertools.pairwise(points) if b > a]
    assert run(chunks, True, strip_usage) == run(chunks, False, strip_usage)
