"""The cost model (kvpool/cost.py): one prediction of a request's time to first token on a
worker, term by term, used by every decision, its explanation, flow control's saturation
test and the operator's backlog signal; and its constants in one place, each with its
evidence.

The end-to-end test runs a real router on 127.0.0.1 in front of recording workers
(tests/recording_worker.py) and reads what a user would: ``/debug/route``."""

from __future__ import annotations

import ast
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpool.cost import COST, CostSettings, PrefillModel, backlog_seconds, predict_ttft
from kvpool.router.routing.inputs import RouteRequest, WorkerView
from kvpool.router.routing.policy import Policy, saturation

from conftest import RunningRouter
from recording_worker import RecordingWorker

ROOT = Path(__file__).resolve().parents[1]


def test_a_prediction_is_the_sum_of_its_named_terms() -> None:
    model = PrefillModel(rate=1000.0, overhead=0.02)
    e = predict_ttft(model, uncached_tokens=500, queued_tokens=2000, waiting_tokens=1000)
    assert e.terms() == pytest.approx(
        {"overhead_s": 0.02, "queue_s": 2.0, "waiting_s": 1.0, "prefill_s": 0.5}
    )
    assert e.total_s == pytest.approx(3.52)
    # the operator's backlog signal is the queue term, at the same rate
    assert backlog_seconds(2000, model.rate) == pytest.approx(e.queue_s)


def test_a_worker_with_requests_waiting_that_no_router_sent_is_priced_by_them() -> None:
    """vllm:num_requests_waiting beyond what the routers know (someone else's requests, or
    requests preempted when the KV cache filled) delays a new request: before, the
    worker's own queue was read and ignored by every scorer."""
    policy = Policy.named("kvpool")
    req = RouteRequest(num_tokens=800, block_size=16, matched_blocks={})
    calm, busy = WorkerView("calm"), WorkerView("busy", unaccounted_waiting=6)
    for _ in range(20):  # not a tie drawn at random
        decision = policy.decide(req, [busy, calm])
        assert decision.worker == "calm"
    rows = {c.worker: c for c in decision.candidates}
    assert rows["calm"].ttft_terms.waiting_s == 0
    # six requests as long as this one (none of the router's own is there to size them)
    assert rows["busy"].ttft_terms.waiting_s == pytest.approx(
        6 * 800 / COST.prior_rate_tokens_per_s
    )
    # each is as long as the router's requests there are on average, when it has some
    sized = WorkerView("busy", unaccounted_waiting=2, in_flight=1, kv_per_request=3000.0)
    row = {c.worker: c for c in policy.decide(req, [sized, calm], dry_run=True).candidates}
    assert row["busy"].ttft_terms.waiting_s == pytest.approx(
        2 * 3000 / COST.prior_rate_tokens_per_s
    )


def test_a_worker_whose_own_queue_is_long_saturates_as_a_routed_queue_does() -> None:
    """Flow control holds a request rather than send it where it would wait over the bound:
    the worker's own waiting requests count, as the tokens the router queued there do."""
    policy = Policy.named("kvpool")
    req = RouteRequest(num_tokens=800, block_size=16, matched_blocks={})
    swamped = [WorkerView("a", unaccounted_waiting=40), WorkerView("b", unaccounted_waiting=40)]
    assert saturation(policy.decide(req, swamped, dry_run=True), bound_s=1.0) == "ttft"
    idle = [WorkerView("a"), WorkerView("b")]
    assert saturation(policy.decide(req, idle, dry_run=True), bound_s=1.0) is None


def test_every_constant_of_the_cost_model_says_its_evidence() -> None:
    """Each field of CostSettings has a comment saying what it means and whether its value
    is measured, derived or tuned to a benchmark cell."""
    tree = ast.parse((ROOT / "kvpool" / "cost.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CostSettings")
    lines = (ROOT / "kvpool" / "cost.py").read_text().splitlines()
    fields = [n for n in cls.body if isinstance(n, ast.AnnAssign)]
    assert {f.target.id for f in fields} == set(CostSettings.__dataclass_fields__)
    for f in fields:
        comment = []
        i = f.lineno - 2
        while lines[i].strip().startswith("#:"):
            comment.insert(0, lines[i].strip()[2:])
            i -= 1
        text = " ".join(comment)
        assert any(kind in text for kind in ("*Measured*", "*Derived*", "*Tuned*")), f.target.id
    with pytest.raises(ValueError, match="guard_slack"):
        CostSettings(guard_slack=-1.0)


def test_the_route_explains_each_workers_predicted_ttft_term_by_term(
    start_router: Callable[..., RunningRouter],
    recording_workers: Callable[..., RecordingWorker],
) -> None:
    calm, busy = recording_workers(), recording_workers()
    busy.waiting = 5.0  # its /metrics: five requests waiting that this router never sent
    router = start_router(worker=[calm.spec("calm"), busy.spec("busy")])
    router.wait_workers_up(2)
    deadline = time.monotonic() + 15
    while router.workers()["busy"].get("unaccounted_waiting") != 5:
        assert time.monotonic() < deadline, router.workers()["busy"]
        time.sleep(0.2)
    route = router.route({"prompt": "a question " * 40, "max_tokens": 4})
    assert route["worker"] == "calm"
    rows = {c["worker"]: c for c in route["candidates"]}
    for row in rows.values():
        terms = row["ttft_terms"]
        assert set(terms) == {"overhead_s", "queue_s", "waiting_s", "prefill_s"}
        assert sum(terms.values()) == pytest.approx(row["predicted_ttft_s"])
    assert rows["busy"]["ttft_terms"]["waiting_s"] > 0 == rows["calm"]["ttft_terms"]["waiting_s"]
