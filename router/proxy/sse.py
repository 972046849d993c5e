"""Reading a worker's server-sent events as they pass through the router.

The router relays a stream event by event (a half event is held until it is whole), and
watches it for what it needs: the first output (text, reasoning, a tool call or a finish;
until then a failure can still be retried elsewhere), its usage (the realised cache hit
ratio counts every answer), its end, and an error. Chat and completion streams
(``data: {...}`` chunks, ``data: [DONE]``) and Responses API streams (``event: <type>``
with ``data: {"type": ...}``, ending at ``response.completed``) are both read.

Events after the first output are parsed only when they may carry usage or an error; the
rest are counted as output, cheaply.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["SSEWatch", "has_output"]

#: Responses API events that end a stream
_FINAL_TYPES = frozenset({"response.completed", "response.incomplete"})
_ERROR_TYPES = frozenset({"error", "response.failed"})


class SSEWatch:
    """Feed it the stream's bytes; it returns the whole events to pass on.

    ``strip_usage``: the router asked for usage the client did not; the usage-only chunk
    (``"choices": []``) is read and not passed on.
    """

    def __init__(self, strip_usage: bool = False) -> None:
        self.strip_usage = strip_usage
        self.buffer = b""
        self.started = False  # an event with output has been seen
        self.done = False
        self.error = False
        #: an error event's HTTP status (its ``code``), when it gave one: 4xx is the client's
        self.error_status: int | None = None
        self.usage: dict[str, Any] | None = None
        #: a Responses API stream's response id (``previous_response_id`` of a later turn)
        self.response_id: str | None = None

    @property
    def client_error(self) -> bool:
        """The stream carried an error the worker marked as the client's (a 4xx code)."""
        return self.error and self.error_status is not None and 400 <= self.error_status < 500

    def feed(self, chunk: bytes) -> tuple[bytes, int]:
        """The whole events completed by ``chunk`` that go on to the client, and how many
        events with output were among them."""
        if (
            self.started
            and not self.buffer
            and chunk.startswith(b"data: ")
            and chunk.find(b"\n") == len(chunk) - 2
            and chunk.endswith(b"\n\n")
            and b'"usage"' not in chunk
            and b'"error"' not in chunk
            and chunk != b"data: [DONE]\n\n"
        ):
            # the common case once output flows: one whole delta event, passed on as it is
            # (what feed_events gives it, without splitting and joining)
            return chunk, 1
        return self.feed_events(chunk)

    def feed_events(self, chunk: bytes) -> tuple[bytes, int]:
        """:meth:`feed`, event by event, for any chunk."""
        buffer = self.buffer + chunk if self.buffer else chunk
        out: list[bytes] = []
        outputs = 0
        start = 0
        while True:
            end = buffer.find(b"\n\n", start)
            if end < 0:
                break
            event = buffer[start : end + 2]
            start = end + 2
            keep, output = self._event(event)
            if keep:
                out.append(event)
            outputs += output
        self.buffer = buffer[start:]
        return b"".join(out), outputs

    def _event(self, event: bytes) -> tuple[bool, bool]:
        lines = event.split(b"\n")
        data = b"\n".join(line[5:].lstrip() for line in lines if line.startswith(b"data:"))
        if not data:
            return True, False
        if data == b"[DONE]":
            self.done = True
            return True, False
        named = lines[0].startswith(b"event:")
        if self.started and b'"usage"' not in data and b'"error"' not in data:
            # the common case once output flows: a delta, counted without parsing
            return True, (not named or b".delta" in lines[0])
        try:
            body = json.loads(data)
        except (ValueError, RecursionError):
            return True, False
        if not isinstance(body, dict):
            return True, False
        if "error" in body and body.get("type") in (None, "error"):
            self.error = True
            error = body["error"]
            code = error.get("code") if isinstance(error, dict) else None
            if isinstance(code, int) and not isinstance(code, bool):
                self.error_status = code
            return True, False
        kind = body.get("type")
        if isinstance(kind, str):  # the Responses API
            response = body.get("response")
            if isinstance(response, dict) and isinstance(response.get("id"), str):
                self.response_id = self.response_id or response["id"]
            if kind in _ERROR_TYPES:
                self.error = True
            elif kind in _FINAL_TYPES:
                # an answer, even one with no delta: it has ended as the worker meant it to
                self.done = self.started = True
                if isinstance(response, dict) and isinstance(response.get("usage"), dict):
                    self.usage = response["usage"]
            elif kind.startswith("response.") and kind.endswith(".delta"):
                self.started = True
                return True, True
            return True, False
        usage = body.get("usage")
        choices = body.get("choices") or ()
        if isinstance(usage, dict):
            self.usage = usage
            if self.strip_usage and not choices:
                return False, False
        if any(has_output(c) for c in choices):
            self.started = True
            return True, True
        return True, False


def has_output(choice: Any) -> bool:
    """Whether a streamed choice carries output: text, reasoning, a tool call, or its end
    (a stream that finishes with nothing generated has answered all the same)."""
    if not isinstance(choice, dict):
        return False
    if choice.get("text") or choice.get("finish_reason"):
        return True
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return False
    return bool(
        delta.get("content")
        or delta.get("tool_calls")
        or delta.get("reasoning_content")
        or delta.get("reasoning")
    )
