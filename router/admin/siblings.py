"""What a router process shares with its siblings on the same port (:class:`Rows`, written
to a directory every ``SHARE_S``): its own load on each worker, its decisions, its queue
and its event counters, so that any process's ``/metrics`` shows the pod's figures."""

from __future__ import annotations

import contextlib
import os
import time

import msgspec

from ..state.worker import WorkerState

__all__ = ["EVENT_FAMILIES", "FLAG_CAUSES", "SHARE_S", "Rows", "Siblings", "added", "own_rows"]


class Rows(msgspec.Struct):
    """What one router process adds to the pod's figures: its own load on each worker,
    its decisions, its queue. (The rest, what the workers say, every process knows.)"""

    in_flight: dict[str, int] = {}
    queued: dict[str, int] = {}
    decisions: dict[str, dict[str, int]] = {}
    queue: dict[str, int] = {}
    #: the worker's event-stream counters as this process saw them, by family: the pod
    #: reports the highest (every process subscribes; a restarted one counts from 0)
    events: dict[str, dict[str, int]] = {}


class Siblings:
    """The rows of the other router processes on this port (:mod:`.processes`): each
    writes its own file in the shared directory every :data:`SHARE_S`, and the process
    answering a scrape adds the others' to its own."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, f"rows-{os.getpid()}.msgpack")

    def write(self, rows: Rows) -> None:
        self._write(self.path, rows)

    @staticmethod
    def _write(path: str, rows: Rows) -> None:
        with open(path + ".tmp", "wb") as f:
            f.write(msgspec.msgpack.encode(rows))
        os.replace(path + ".tmp", path)  # a reader sees the old rows or the new, never half

    @staticmethod
    def retire(path: str) -> None:
        """A dead process's rows (the supervisor's call): its decisions stay counted (the
        pod's totals never go back), its load and queue go."""
        with contextlib.suppress(OSError, msgspec.DecodeError):
            with open(path, "rb") as f:
                rows = msgspec.msgpack.decode(f.read(), type=Rows)
            Siblings._write(path, Rows(decisions=rows.decisions, events=rows.events))

    def others(self) -> list[Rows]:
        found = []
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if name.startswith("rows-") and name.endswith(".msgpack") and path != self.path:
                with contextlib.suppress(OSError, msgspec.DecodeError):
                    with open(path, "rb") as f:
                        found.append(msgspec.msgpack.decode(f.read(), type=Rows))
        return found


#: how often a router process writes its rows for its siblings' scrapes
SHARE_S = 1.0


def own_rows(workers: list[WorkerState], depth: dict[str, int]) -> Rows:
    now = time.monotonic()
    events: dict[str, dict[str, int]] = {f: {} for f in EVENT_FAMILIES}
    for s in workers:
        stats = s.subscriber.stats if s.subscriber is not None else None
        events["events"][s.id] = s.events_seen
        events["gaps"][s.id] = stats.gaps if stats else 0
        events["resyncs"][s.id] = stats.resyncs if stats else 0
        events["mismatches"][s.id] = s.mismatches
        events["cache_flags"][s.id] = s.cache_flags
        check = s.agreement
        events["cache_flagged"][s.id] = FLAG_CODES[check.cause] if check and check.flagged else 0
    return Rows(
        in_flight={s.id: s.in_flight for s in workers},
        queued={s.id: s.queued_tokens(now) for s in workers},
        decisions={s.id: dict(s.decisions) for s in workers},
        queue=dict(depth),
        events=events,
    )


#: the per-worker counters every process keeps of the same event stream
EVENT_FAMILIES = ("events", "gaps", "resyncs", "mismatches", "cache_flags", "cache_flagged")
#: a flagged worker's cause as a number, so that the processes' verdicts merge by the
#: highest (any process that flags a worker shows it flagged on every process's page)
FLAG_CODES = {"over-predicted": 1, "unseen": 2}
FLAG_CAUSES = {code: cause for cause, code in FLAG_CODES.items()}


def added(rows: Rows, others: list[Rows]) -> Rows:
    for other in others:
        for mine, theirs in (
            (rows.in_flight, other.in_flight),
            (rows.queued, other.queued),
            (rows.queue, other.queue),
        ):
            for key, value in theirs.items():
                mine[key] = mine.get(key, 0) + value
        for worker, counts in other.decisions.items():
            row = rows.decisions.setdefault(worker, {})
            for reason, count in counts.items():
                row[reason] = row.get(reason, 0) + count
        for family, counts in other.events.items():
            mine = rows.events.setdefault(family, {})
            for worker, count in counts.items():
                mine[worker] = max(mine.get(worker, 0), count)
    return rows
