"""OpenTelemetry traces for the router and the workers: optional, and free when off.

Tracing is on only when the SDK is installed (``pip install kvpool[tracing]``) and the
standard variables ask for it: ``OTEL_TRACES_EXPORTER`` (``otlp`` or ``console``) or an OTLP
endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``).
``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` keeps it off. Everything else the
SDK reads itself: the endpoint, headers and protocol of the exporter, ``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``.

When off, :func:`tracer` is ``None`` and every call site tests that one value before doing
any span work, so a request pays one attribute read. Trace context crosses processes as W3C
``traceparent``: the router injects it into each upstream attempt and workers continue it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

log = logging.getLogger(__name__)

__all__ = [
    "activated",
    "child_context",
    "configure",
    "end_span",
    "extract",
    "inject",
    "record_span",
    "span",
    "start_span",
    "tracer",
    "use_provider",
    "wall_ns",
]

_tracer: Any = None  # an opentelemetry Tracer while tracing is on
_own_provider: Any = None  # the provider configure() made (shut down when replaced)

#: wall clock minus monotonic clock, taken once: engines time requests on the monotonic
#: clock, spans want nanoseconds since the epoch
_MONOTONIC_TO_WALL_NS = time.time_ns() - time.monotonic_ns()


def wall_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` reading as nanoseconds since the epoch (a span's time)."""
    return int(monotonic_s * 1e9) + _MONOTONIC_TO_WALL_NS


def tracer() -> Any:
    """The tracer while tracing is on, else None."""
    return _tracer


def _wanted(env: Mapping[str, str]) -> str | None:
    """The exporter the environment asks for, or None (tracing off)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = [n.strip() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if names:
        return None if names == ["none"] else names[0]
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return "otlp"
    return None


def configure(service_name: str, env: Mapping[str, str] | None = None) -> bool:
    """Turn tracing on if the environment asks for it; True if it is on. A component calls
    this once at start-up; a bad setting is logged and leaves tracing off, never stops the
    component. Once on, it stays as it is: several components in one process (a simulated
    fleet, a test) share the first one's provider."""
    global _own_provider
    env = os.environ if env is None else env
    exporter_name = _wanted(env)
    if exporter_name is None or _tracer is not None:
        return _tracer is not None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        log.warning(
            "tracing: OTEL_* variables ask for traces but the OpenTelemetry SDK is not "
            "installed (pip install 'kvpool[tracing]'); tracing stays off"
        )
        return False
    if exporter_name == "console":
        exporter: Any = ConsoleSpanExporter()
    elif exporter_name == "otlp":
        protocol = (
            env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "http/protobuf"
        ).strip()
        try:
            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter,
                )
            elif protocol == "http/protobuf":
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
            else:
                log.warning(
                    "tracing: OTLP protocol %r is not one kvpool sends (http/protobuf, grpc); "
                    "tracing stays off",
                    protocol,
                )
                return False
        except ImportError:
            package = "grpc" if protocol == "grpc" else "http"
            log.warning(
                "tracing: the OTLP %s exporter is not installed (pip install "
                "opentelemetry-exporter-otlp-proto-%s); tracing stays off",
                protocol,
                package,
            )
            return False
        exporter = OTLPSpanExporter()  # reads OTEL_EXPORTER_OTLP_* itself
    else:
        log.warning(
            "tracing: OTEL_TRACES_EXPORTER=%s is not one kvpool knows (otlp, console, none); "
            "tracing stays off",
            exporter_name,
        )
        return False
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME") or service_name})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    use_provider(provider)
    _own_provider = provider
    log.info("tracing on: %s exporter, service %s", exporter_name, service_name)
    return True


def use_provider(provider: Any | None) -> None:
    """Trace through this provider (tests pass one with an in-memory exporter); None turns
    tracing off again."""
    global _tracer, _own_provider
    if _own_provider is not None and _own_provider is not provider:
        old, _own_provider = _own_provider, None
        old.shutdown()  # flushes what it holds and ends its export thread
    _tracer = None if provider is None else provider.get_tracer("kvpool")


def inject(headers: MutableMapping[str, str]) -> None:
    """Add the current span's ``traceparent`` (and ``tracestate``) to outgoing headers."""
    if _tracer is None:
        return
    from opentelemetry.propagate import inject as _inject

    _inject(headers)


def extract(headers: Mapping[str, str]) -> Any:
    """The trace context that incoming headers carry (None when tracing is off)."""
    if _tracer is None:
        return None
    from opentelemetry.propagate import extract as _extract

    return _extract(dict(headers))


@contextlib.contextmanager
def span(
    name: str,
    attributes: Mapping[str, Any] | None = None,
    *,
    context: Any = None,
    start_time: int | None = None,
) -> Iterator[Any]:
    """A span, current inside the block, or nothing at all when tracing is off (the block
    gets None). ``context``: a parent from :func:`extract`; ``start_time``: nanoseconds since
    the epoch, for a span of something that began earlier."""
    if _tracer is None:
        yield None
        return
    with _tracer.start_as_current_span(
        name,
        context=context,
        attributes=dict(attributes) if attributes else None,
        start_time=start_time,
        record_exception=True,
        set_status_on_exception=True,
    ) as current:
        yield current


def record_span(
    name: str,
    start_ns: int,
    end_ns: int,
    attributes: Mapping[str, Any] | None = None,
    *,
    context: Any = None,
    error: str | None = None,
) -> Any:
    """A span of something already over (a worker's queue, prefill or decode phase, timed by
    the engine): started and ended at the times given, marked as an error with ``error``'s
    text. Returns the span (None when off), the parent of others through
    :func:`child_context`."""
    if _tracer is None:
        return None
    s = _tracer.start_span(
        name,
        context=context,
        attributes=dict(attributes) if attributes else None,
        start_time=start_ns,
    )
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        s.set_status(Status(StatusCode.ERROR, error))
    s.end(end_time=max(end_ns, start_ns))
    return s


def child_context(parent: Any) -> Any:
    """A context whose current span is ``parent`` (a span from :func:`record_span`)."""
    if parent is None:
        return None
    from opentelemetry.trace import set_span_in_context

    return set_span_in_context(parent)


def start_span(
    name: str, attributes: Mapping[str, Any] | None = None, *, context: Any = None
) -> Any:
    """A span that outlives one block (a streamed answer's goes on after its handler
    returns): None when tracing is off. Make it current with :func:`activated`; end it
    with :func:`end_span`."""
    if _tracer is None:
        return None
    return _tracer.start_span(
        name, context=context, attributes=dict(attributes) if attributes else None
    )


@contextlib.contextmanager
def activated(current: Any) -> Iterator[Any]:
    """Make ``current`` (from :func:`start_span`) the parent of spans started in the block,
    without ending it; nothing when it is None."""
    if current is None:
        yield None
        return
    from opentelemetry.trace import use_span

    with use_span(
        current, end_on_exit=False, record_exception=False, set_status_on_exception=False
    ):
        yield current


def end_span(current: Any, error: str | None = None, **attributes: Any) -> None:
    """End a span from :func:`start_span`, marked as an error with ``error``'s text."""
    if current is None:
        return
    if attributes:
        current.set_attributes(attributes)
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        current.set_status(Status(StatusCode.ERROR, error))
    current.end()
