"""The routing policy's pieces, each on its own, then put together (pure: no servers)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvpool.router.routing.filters import FILTERS
from kvpool.router.routing.inputs import PrefillModel, RouteRequest, WorkerView
from kvpool.router.routing.planner import Planner, SplitConfig, decode_policy_config
from kvpool.router.routing.policy import Policy, PolicyConfig, saturation
from kvpool.router.routing.scorers import SCORERS

CFG = PolicyConfig()
#: the default policy with session affinity, as the router's settings append it
AFFINITY = PolicyConfig(scorers=(*CFG.scorers, ("affinity", 0.3)))


def req(
    num_tokens: int = 1000,
    block_size: int = 16,
    spread_wanted: int = 0,
    spread_depth: int = 0,
    **matched: int,
) -> RouteRequest:
    return RouteRequest(
        num_tokens=num_tokens,
        block_size=block_size,
        matched_blocks=matched,
        spread_wanted=spread_wanted,
        spread_depth=spread_depth,
    )


def workers(n: int, **fields: object) -> list[WorkerView]:
    return [WorkerView(id=f"w{i}", **fields) for i in range(n)]  # type: ignore[arg-type]


# -- filters ---------------------------------------------------------------------------------


def test_healthy_filter_drops_down_draining_and_open_circuits() -> None:
    ws = [
        WorkerView("ok"),
        WorkerView("down", healthy=False),
        WorkerView("draining", draining=True),
        WorkerView("broken", breaker_open=True),
    ]
    dropped = FILTERS["healthy"](req(), ws, CFG)
    assert dropped == {"down": "unhealthy", "draining": "draining", "broken": "circuit_open"}


def test_role_filter_keeps_workers_of_the_requested_roles() -> None:
    ws = [
        WorkerView("b", role="both"),
        WorkerView("p", role="prefill"),
        WorkerView("d", role="decode"),
    ]
    assert set(FILTERS["role"](req(), ws, CFG)) == {"p"}  # aggregated: both or decode
    prefill = RouteRequest(100, 16, {}, roles=("prefill",))
    assert set(FILTERS["role"](prefill, ws, CFG)) == {"b", "d"}


def test_model_filter_drops_workers_serving_another_model() -> None:
    ws = [WorkerView("a", model="llama"), WorkerView("b", model="qwen"), WorkerView("c")]
    r = RouteRequest(100, 16, {}, model="llama")
    assert set(FILTERS["model"](r, ws, CFG)) == {"b"}


def test_model_filter_keeps_only_workers_listing_the_requested_adapter() -> None:
    ws = [
        WorkerView("base", model="llama", models=frozenset({"llama"})),
        WorkerView("sql", model="llama", models=frozenset({"llama", "sql-lora"})),
        WorkerView("old", model="llama"),  # lists nothing: judged by its base model
        WorkerView("unknown"),
    ]
    dropped = FILTERS["model"](RouteRequest(100, 16, {}, model="sql-lora"), ws, CFG)
    assert dropped == {"base": "serves llama", "old": "serves llama"}
    assert FILTERS["model"](RouteRequest(100, 16, {}, model="llama"), ws, CFG) == {}


def test_model_filter_names_a_few_of_many_adapters() -> None:
    many = WorkerView("w", models=frozenset({"base", *(f"lora-{i}" for i in range(10))}))
    (why,) = FILTERS["model"](RouteRequest(100, 16, {}, model="other"), [many], CFG).values()
    assert why == "serves base, lora-0, lora-1 (+8 more)"


def test_an_adapter_request_is_only_routed_to_workers_listing_the_adapter() -> None:
    ws = [
        WorkerView("w0", model="llama", models=frozenset({"llama"})),
        WorkerView("w1", model="llama", models=frozenset({"llama", "chat-lora"})),
        WorkerView("w2", model="llama", models=frozenset({"llama"})),
    ]
    policy = Policy.named("kvpool", rng=random.Random(1))
    r = RouteRequest(1000, 16, {"w0": 60, "w2": 60}, model="chat-lora")  # cache elsewhere
    assert {policy.decide(r, ws).worker for _ in range(20)} == {"w1"}
    d = policy.decide(r, ws)
    assert "w0: filtered (model: serves llama)" in d.explain()


def test_decode_load_guard_drops_workers_far_above_the_mean() -> None:
    ws = [
        WorkerView("hot", in_flight=20),
        WorkerView("a", in_flight=4),
        WorkerView("b", in_flight=4),
    ]
    dropped = FILTERS["decode-load"](req(), ws, CFG)
    assert set(dropped) == {"hot"}  # mean 9.3: limit 1.25 * 9.3 + 2 = 13.7


def test_decode_load_guard_drops_a_full_kv_cache() -> None:
    ws = [WorkerView("full", kv_usage=0.99), WorkerView("a", kv_usage=0.5)]
    assert set(FILTERS["decode-load"](req(), ws, CFG)) == {"full"}


def test_decode_load_guard_never_drops_every_worker() -> None:
    ws = [WorkerView("a", kv_usage=0.99), WorkerView("b", kv_usage=0.99)]
    assert FILTERS["decode-load"](req(), ws, CFG) == {}


# -- scorers ---------------------------------------------------------------------------------


def test_ttft_scorer_prefers_the_cached_worker_when_queues_are_equal() -> None:
    scores = SCORERS["ttft"](req(1000, w0=50), workers(2))
    assert scores["w0"] == 1.0
    assert scores["w1"] < 0.5  # recomputing 1000 tokens vs 200


def test_ttft_scorer_prefers_an_idle_worker_over_a_long_queue_with_the_prefix() -> None:
    ws = [WorkerView("busy", queued_tokens=40_000), WorkerView("idle")]
    scores = SCORERS["ttft"](req(2000, busy=120), ws)
    assert scores["idle"] == 1.0 and scores["busy"] < 1.0


def test_ttft_scorer_gives_no_cache_credit_to_an_incompatible_worker() -> None:
    ws = [WorkerView("odd", compatible=False), WorkerView("ok")]
    scores = SCORERS["ttft"](req(1000, odd=60, ok=10), ws)
    assert scores["ok"] == 1.0 and scores["odd"] < 1.0


def test_prefix_scorer_is_the_cached_fraction() -> None:
    scores = SCORERS["prefix"](req(161, w0=5, w1=10), workers(3))
    assert scores == {"w0": 0.5, "w1": 1.0, "w2": 0.0}


def test_a_prompt_of_whole_blocks_is_credited_all_but_its_last_block() -> None:
    """vLLM and kvpool's engine look up whole blocks of the tokens before the last one (which
    is always computed): a fully cached prompt of 4 blocks of 16 is served 48 tokens from
    the cache, not 63 (found against a real vLLM: 352 of a 384-token prompt)."""
    whole = req(64, w0=4, w1=2)
    assert whole.cached_tokens(WorkerView(id="w0")) == 48
    assert whole.cached_tokens(WorkerView(id="w1")) == 32
    assert req(65, w0=4).cached_tokens(WorkerView(id="w0")) == 64


def test_in_flight_scorer_ranks_by_requests_in_flight() -> None:
    ws = [WorkerView("a", in_flight=0), WorkerView("b", in_flight=3), WorkerView("c", in_flight=1)]
    scores = SCORERS["in-flight"](req(), ws)
    assert scores["a"] > scores["c"] > scores["b"]


def test_kv_usage_scorer_prefers_free_cache() -> None:
    ws = [WorkerView("a", kv_usage=0.9), WorkerView("b", kv_usage=0.1), WorkerView("c")]
    scores = SCORERS["kv-usage"](req(), ws)
    assert scores["b"] > scores["a"] and scores["c"] == 1.0


def test_queue_scorer_prefers_shorter_prefill_queues() -> None:
    ws = [WorkerView("a", queued_tokens=5000), WorkerView("b", queued_tokens=10)]
    scores = SCORERS["queue"](req(), ws)
    assert scores["b"] > scores["a"]


def test_affinity_scorer_marks_the_sessions_last_worker() -> None:
    r = RouteRequest(100, 16, {}, affinity="w1")
    assert SCORERS["affinity"](r, workers(3)) == {"w0": 0.0, "w1": 1.0, "w2": 0.0}
    assert set(SCORERS["affinity"](req(), workers(3)).values()) == {0.0}  # no session


def test_every_scorer_stays_within_zero_and_one() -> None:
    rng = random.Random(7)
    for _ in range(200):
        ws = [
            WorkerView(
                f"w{i}",
                in_flight=rng.randint(0, 50),
                queued_tokens=rng.randint(0, 50_000),
                kv_usage=rng.random(),
            )
            for i in range(rng.randint(1, 6))
        ]
        r = req(rng.randint(1, 5000), **{w.id: rng.randint(0, 300) for w in ws})
        r.affinity = rng.choice([None, "w0", "gone"])
        for name, scorer in SCORERS.items():
            for score in scorer(r, ws).values():
                assert 0.0 <= score <= 1.0, name


# -- the prefill model -----------------------------------------------------------------------


def test_prefill_model_learns_a_worker_rate_from_observed_ttfts() -> None:
    model = PrefillModel()  # prior: 8000 tokens/s
    rng = random.Random(1)
    for _ in range(300):
        tokens = rng.randint(50, 4000)
        model.observe(tokens, 0.02 + tokens / 2000 + rng.gauss(0, 0.002))
    assert model.rate == pytest.approx(2000, rel=0.1)
    assert model.overhead == pytest.approx(0.02, abs=0.01)


def test_prefill_model_keeps_its_prior_rate_without_spread_in_prompt_sizes() -> None:
    model = PrefillModel()
    for _ in range(50):
        model.observe(100, 0.05)
    assert model.rate == 8000.0
    assert model.predict(100) == pytest.approx(0.05, abs=1e-6)


# -- the picker and whole policies -----------------------------------------------------------


def test_max_picker_breaks_ties_at_random() -> None:
    policy = Policy(PolicyConfig(), rng=random.Random(3))
    chosen = Counter(policy.decide(req(), workers(4)).worker for _ in range(400))
    assert set(chosen) == {"w0", "w1", "w2", "w3"}
    assert min(chosen.values()) > 50


def test_kvpool_policy_sends_a_prefix_to_the_worker_that_holds_it() -> None:
    d = Policy.named("kvpool").decide(req(2000, w2=100), workers(4))
    assert (d.worker, d.reason) == ("w2", "prefix")
    assert d.cached_tokens == 1600


def test_kvpool_policy_spills_a_hot_prefix_when_its_holder_is_busy() -> None:
    ws = workers(8, in_flight=4)
    ws[0].in_flight = 24  # 25 over 1.5 * 6.5 + 4, plus 0.96 * (1.5 * 4 + 4)
    d = Policy.named("kvpool").decide(req(2000, w0=120), ws)
    assert d.worker != "w0" and d.reason == "spill"
    why = next(c for c in d.candidates if c.worker == "w0").filtered
    assert why == "decode-load: in_flight 24 over 23.4 (96% cached)"


def test_the_decode_load_bound_yields_to_the_share_of_the_prompt_a_worker_holds() -> None:
    """A holder of most of a long prompt keeps it past the plain bound (computing the
    prefix again elsewhere costs more than one more decode), up to twice the bound for a
    prompt held whole; a worker that holds nothing of it meets the plain bound."""
    ws = workers(8, in_flight=4)
    ws[0].in_flight = 12  # 13 over the plain bound 1.5 * 5 + 4 = 11.5
    held = Policy.named("kvpool").decide(req(8346, w0=520), ws)
    assert held.worker == "w0"  # its bound: 11.5 + 1.0 * (1.5 * 4 + 4)
    assert next(c for c in held.candidates if c.worker == "w0").filtered is None
    cold = Policy.named("kvpool").decide(req(8346, w1=520), ws)
    why = next(c for c in cold.candidates if c.worker == "w0").filtered
    assert why == "decode-load: in_flight 12 over 11.5"
    some = Policy.named("kvpool").decide(req(8346, w0=50), ws)  # 10% held: 11.5 + 0.96
    why = next(c for c in some.candidates if c.worker == "w0").filtered
    assert why == "decode-load: in_flight 12 over 12.5 (10% cached)"


def test_kvpool_policy_spills_when_the_holder_has_a_long_prefill_queue() -> None:
    ws = workers(2)
    ws[0].queued_tokens = 100_000
    d = Policy.named("kvpool").decide(req(2000, w0=120), ws)
    assert (d.worker, d.reason) == ("w1", "spill")


def test_a_copy_is_free_on_an_idle_pool_and_a_prefix_still_computing_earns_little() -> None:
    """The first second of one system prompt for every request: the first request computes
    the 2,000-token prompt on w0 and the second comes before it is done. On an otherwise
    idle pool, a copy on an idle worker costs nobody anything and starts as soon as the
    holder's blocks would be ready: the request goes there. Once the pool is busy, the same
    copy would take an idle worker's time from other requests, and the holder's blocks,
    even those still being computed, keep it there."""

    def second(busy: bool) -> str:
        ws = workers(8, in_flight=1 if busy else 0, queued_tokens=300 if busy else 0)
        ws[0].in_flight, ws[0].queued_tokens = 2, 4500  # the first request, and one more
        r = RouteRequest(
            num_tokens=2190, block_size=16, matched_blocks={"w0": 125},
            computed_blocks={"w0": 0},
        )  # fmt: skip
        return Policy.named("kvpool").decide(r, ws).worker or ""

    assert second(busy=False) != "w0"
    assert second(busy=True) == "w0"


def test_a_held_prefix_is_copied_sooner_while_most_of_the_pool_idles() -> None:
    """The charge for computing again what the holder has is what the pool loses: the
    whole prefill when every worker is busy, a quarter of it when three of four idle. The
    same 3.5 s queue on the holder keeps an 8,000-token prefix there on a busy pool and
    lets an idle worker copy it on a quiet one."""

    def choose(busy: bool) -> str:
        ws = workers(4, in_flight=1 if busy else 0)
        ws[0].in_flight, ws[0].queued_tokens = 1, 28_000  # 3.5 s at the prior rate
        return Policy.named("kvpool").decide(req(8346, w0=520), ws).worker or ""

    assert choose(busy=True) == "w0"
    assert choose(busy=False) != "w0"


def test_a_long_cached_prefix_stays_behind_a_queue_a_short_one_leaves() -> None:
    """Recomputing a prefix another worker holds is charged to the worker that would: the
    same queue that sends a short prompt elsewhere keeps a long one on its holder, whose
    copy would cost the pool as much prefill as the wait (the Mooncake trace's 8k-token
    prefixes were copied this way, at 2 to 3 points of hit ratio each)."""
    ws = workers(2, in_flight=1)  # a busy pool: a copy takes time from other requests
    ws[0].queued_tokens = 20_000  # 2.5 s of prefill at the prior rate
    long = Policy.named("kvpool").decide(req(8346, w0=520), ws)
    assert (long.worker, long.reason) == ("w0", "prefix")
    short = Policy.named("kvpool").decide(req(334, w0=20), ws)
    assert (short.worker, short.reason) == ("w1", "spill")
    # The idle worker would start the long one sooner (the TTFT alone scored the holder
    # 0.42, and the prefix share could not make up for it); charged for computing again the
    # 8,320 tokens the holder has, it costs 0.83 of the holder's.
    idle, held = ws[1].prefill.predict(8346), ws[0].prefill.predict(20_000 + 8346 - 8320)
    assert idle / held == pytest.approx(0.42, abs=0.01)
    scores = SCORERS["ttft"](req(8346, w0=520), ws)
    assert scores == {"w0": pytest.approx(0.83, abs=0.01), "w1": 1.0}


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_hot_prefix_never_piles_onto_one_worker(n: int) -> None:
    """Every request shares one prompt and none finishes: the prefix spreads to other
    workers as its holders fill up, and no worker goes past the decode-load guard's bound
    (for a prompt 96% cached, about twice the plain one), in a pool of two as of eight."""
    policy = Policy.named("kvpool", rng=random.Random(0))
    cfg = policy.config
    ws = workers(n)
    holders = {"w0"}
    for _ in range(200):
        d = policy.decide(req(1000, **dict.fromkeys(holders, 60)), ws)
        chosen = next(w for w in ws if w.id == d.worker)
        chosen.in_flight += 1
        holders.add(chosen.id)  # the chosen worker caches it too
    loads = [w.in_flight for w in ws]
    assert max(loads) <= 2 * (cfg.guard_ratio * sum(loads) / n + cfg.guard_slack)
    assert len(holders) >= 2


def test_no_worker_when_every_worker_is_filtered() -> None:
    d = Policy.named("kvpool").decide(req(), workers(2, healthy=False))
    assert d.worker is None and d.reason == "no_worker"
    assert all(c.filtered for c in d.candidates)


def test_round_robin_visits_workers_in_turn() -> None:
    policy = Policy.named("round-robin")
    seen = [policy.decide(req(w0=60), workers(3)).worker for _ in range(6)]
    assert seen == ["w0", "w1", "w2", "w0", "w1", "w2"]


def test_random_policy_ignores_the_cache() -> None:
    policy = Policy.named("random", rng=random.Random(5))
    chosen = Counter(policy.decide(req(w0=60), workers(3)).worker for _ in range(300))
    assert set(chosen) == {"w0", "w1", "w2"}


def test_least_loaded_policy_ignores_the_cache() -> None:
    ws = [WorkerView("cached", in_flight=3), WorkerView("idle")]
    d = Policy.named("least-loaded").decide(req(w0=60, cached=60), ws)
    assert d.worker == "idle"


def test_prefix_only_policy_ignores_load() -> None:
    ws = [WorkerView("cached", in_flight=50), WorkerView("idle")]
    d = Policy.named("prefix-only").decide(req(cached=60), ws)
    assert d.worker == "cached"


def test_decision_explains_every_worker() -> None:
    ws = [WorkerView("a"), WorkerView("b", healthy=False)]
    d = Policy.named("kvpool").decide(req(500, a=10), ws)
    text = d.explain()
    assert "a: cached 160" in text and "b: filtered (healthy: unhealthy)" in text


def test_unknown_policy_pieces_are_refused_with_the_names_that_exist() -> None:
    with pytest.raises(ValueError, match="scorers are"):
        PolicyConfig(scorers=(("nope", 1.0),))
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        Policy.named("fastest")


def test_duplicate_scorers_are_refused() -> None:
    with pytest.raises(ValueError, match="once"):
        PolicyConfig(scorers=(("ttft", 1.0), ("ttft", 0.5)))


# -- session affinity ------------------------------------------------------------------------


def session_req(affinity: str | None, num_tokens: int = 1000, **matched: int) -> RouteRequest:
    return RouteRequest(num_tokens, 16, matched, affinity=affinity)


def test_the_default_policy_has_no_affinity_and_the_settings_can_add_it() -> None:
    assert PolicyConfig().scorers == (
        ("ttft", 1.0), ("prefix", 0.5), ("kv-load", 0.3), ("spread", 1.5),
    )  # fmt: skip
    policy = Policy.named("kvpool", scorers=AFFINITY.scorers)
    assert dict(policy.config.scorers)["affinity"] == 0.3


def test_a_session_goes_back_to_its_worker_among_equal_workers() -> None:
    policy = Policy(AFFINITY, rng=random.Random(2))
    chosen = {policy.decide(session_req("w1"), workers(2)).worker for _ in range(50)}
    assert chosen == {"w1"}


def test_a_session_leaves_its_worker_when_it_is_over_the_decode_load_guard() -> None:
    ws = workers(3)
    ws[1].in_flight = 20  # the others idle: 21 over 1.5 * 20 / 3 + 4 + 0.96 * 4
    d = Policy(AFFINITY).decide(session_req("w1", w1=60), ws)
    assert d.worker != "w1"
    assert next(c for c in d.candidates if c.worker == "w1").filtered.startswith("decode-load")


def test_a_long_prefill_queue_outweighs_affinity() -> None:
    ws = workers(2)
    ws[1].queued_tokens = 50_000
    d = Policy(AFFINITY).decide(session_req("w1"), ws)
    assert (d.worker, d.reason) == ("w0", "ttft")  # nobody holds any of it: the TTFT decided


def test_affinity_keeps_a_session_over_a_slightly_bigger_prefix_and_says_so() -> None:
    d = Policy(AFFINITY).decide(session_req("w1", w0=2), workers(2))
    assert (d.worker, d.reason) == ("w1", "affinity")
    d = Policy(PolicyConfig()).decide(session_req("w1", w0=2), workers(2))
    assert (d.worker, d.reason) == ("w0", "prefix")  # without the scorer: no pull


def test_the_explanation_shows_the_affinity_score() -> None:
    d = Policy(AFFINITY).decide(session_req("w1"), workers(2))
    rows = {c.worker: c for c in d.candidates}
    assert rows["w1"].scores["affinity"] == 1.0 and rows["w0"].scores["affinity"] == 0.0
    assert (
        "w1: cached 0, queue 0, ttft 1.00 prefix 0.00 kv-load 1.00 spread 0.00 affinity 1.00 "
        "= 1.600" in d.explain()
    )


def test_the_decode_leg_keeps_affinity_and_its_weight() -> None:
    assert "affinity" not in dict(decode_policy_config(CFG).scorers)
    assert dict(decode_policy_config(AFFINITY).scorers)["affinity"] == 0.3
    ws = [WorkerView("p", role="prefill"), WorkerView("d0", role="decode")]
    ws.append(WorkerView("d1", role="decode"))
    planner = Planner(AFFINITY, SplitConfig("Disaggregated"), rng=random.Random(4))
    r = session_req("d1", 4000)
    plan = planner.plan(r, ws)
    assert plan.path == "disaggregated" and plan.prefill.worker == "p"
    assert {planner.decode_decision(r, ws).worker for _ in range(20)} == {"d1"}


# -- saturation (flow control's trigger) ------------------------------------------------------


def test_the_pool_is_saturated_only_when_every_eligible_worker_would_queue_the_request() -> None:
    policy = Policy(CFG)
    slow = PrefillModel(rate=1000.0, overhead=0.0)  # 1000 prompt tokens a second
    # Both workers hold 3 s of prompt tokens: over a 2 s bound.
    busy = workers(2, queued_tokens=3000, prefill=slow)
    assert saturation(policy.decide(req(100), busy), 2.0) == "ttft"
    # One of them has room: not saturated.
    one_free = [busy[0], WorkerView(id="w1", prefill=slow)]
    assert saturation(policy.decide(req(100), one_free), 2.0) is None
    # A long prompt on an idle pool predicts a long TTFT, but waiting would not help.
    idle = workers(2, prefill=slow)
    assert saturation(policy.decide(req(10_000), idle), 2.0) is None
    # A full batch queues even a short prompt; a worker never seen queueing has no bound.
    full = workers(2, in_flight=9, batch_capacity=8)
    assert saturation(policy.decide(req(100), full), 2.0) == "ttft"
    # A learned size may be low: a little over it still goes, to learn a larger one. An
    # announced one is exact: nothing waits at the worker.
    assert (
        saturation(policy.decide(req(100), workers(2, in_flight=8, batch_capacity=8)), 2.0) is None
    )
    exact = workers(2, in_flight=8, batch_capacity=8, batch_announced=True)
    assert saturation(policy.decide(req(100), exact), 2.0) == "ttft"
    assert saturation(policy.decide(req(100), workers(2, in_flight=9)), 2.0) is None
    # Down or other-model workers are not eligible: no saturation, an honest 503.
    down = workers(2, healthy=False, queued_tokens=3000, prefill=slow)
    assert saturation(policy.decide(req(100), down), 2.0) is None
    # Every worker over its decode guard.
    hot = workers(2, kv_usage=0.99)
    assert saturation(policy.decide(req(100), hot), 2.0) == "guard"


# -- reasons ---------------------------------------------------------------------------------


def test_a_prefix_every_worker_holds_is_not_the_reason_the_deciding_scorer_is() -> None:
    ws = workers(3)
    ws[0].queued_tokens = ws[1].queued_tokens = 4000  # w2 is the quickest
    d = Policy.named("kvpool").decide(req(2000, w0=10, w1=10, w2=10), ws)
    assert (d.worker, d.reason) == ("w2", "ttft")
    # all alike: the picker drew
    d = Policy.named("kvpool").decide(req(2000, w0=10, w1=10, w2=10), workers(3))
    assert d.reason == "tie"
    # a worker that could not take it does not make the others' shared prefix a reason
    ws = workers(3)
    ws[2].healthy = False
    d = Policy.named("kvpool").decide(req(2000, w0=10, w1=10), ws)
    assert d.reason == "tie"


def test_prefix_is_the_reason_when_the_chosen_worker_holds_more_than_another() -> None:
    d = Policy.named("kvpool").decide(req(2000, w0=10, w1=10, w2=30), workers(3))
    assert (d.worker, d.reason) == ("w2", "prefix")
    d = Policy.named("kvpool").decide(req(2000, w0=10, w1=10), workers(3))
    assert d.worker in ("w0", "w1") and d.reason == "prefix"  # more than w2's nothing


def test_a_conversation_trace_where_little_could_hit_is_not_labelled_prefix() -> None:
    """Every worker holds the first block (a system prompt); one request in eight
    continues a conversation whose blocks one worker holds. Only those are ``prefix``."""
    rng = random.Random(7)
    policy = Policy.named("kvpool", rng=rng)
    reasons: Counter[str] = Counter()
    for i in range(600):
        ws = workers(8)
        for w in ws:
            w.queued_tokens = rng.randrange(0, 3000)
            w.in_flight = rng.randrange(0, 4)
        matched = {f"w{k}": 1 for k in range(8)}
        follow_up = i % 8 == 0
        if follow_up:
            matched[f"w{rng.randrange(8)}"] = 60
        d = policy.decide(req(2000, **matched), ws)
        reasons[d.reason] += 1
    assert reasons["prefix"] + reasons["spill"] == 75  # the follow-ups, and only they
    assert reasons["ttft"] >= 500


# -- decode load in KV terms, and spreading a hot prefix ------------------------------------


def test_kv_load_weighs_what_the_requests_in_flight_hold_not_their_count() -> None:
    ws = workers(2)
    ws[0].in_flight, ws[0].active_tokens = 10, 10 * 60  # ten one-line questions
    ws[1].in_flight, ws[1].active_tokens = 2, 2 * 32_000  # two 32k-token conversations
    assert Policy.named("least-loaded").decide(req(), ws).worker == "w1"  # counts requests
    d = Policy.named("kvpool").decide(req(), ws)
    assert (d.worker, d.reason) == ("w0", "kv-load")
    rows = {c.worker: c for c in d.candidates}
    assert rows["w1"].active_tokens == 64_000 and rows["w1"].scores["kv-load"] < 0.01


def test_a_hot_prefix_is_copied_while_fewer_workers_hold_it_than_its_share_calls_for() -> None:
    ws = workers(4)
    hot = dict(w0=125)  # one holder of a 125-block system prompt, all the others idle
    d = Policy.named("kvpool").decide(req(2400, **hot, spread_wanted=4, spread_depth=100), ws)
    assert d.worker != "w0" and d.reason == "spread"
    # once enough hold it, the holders win again
    held = dict(w0=125, w1=125, w2=125, w3=125)
    d = Policy.named("kvpool").decide(req(2400, **held, spread_wanted=4, spread_depth=100), ws)
    assert d.reason != "spread"
    # a prefix its traffic does not call for more copies of stays where it is
    d = Policy.named("kvpool").decide(req(2400, **hot, spread_wanted=1, spread_depth=100), ws)
    assert (d.worker, d.reason) == ("w0", "prefix")


# -- a full batch ---------------------------------------------------------------------------


def test_a_worker_whose_announced_batch_is_full_is_passed_over_while_another_has_room() -> None:
    """A burst on a prefix one worker holds: once its announced max_num_seqs are in flight,
    the next request goes where there is a free place, not into its queue, however much of
    the prompt it holds; the reason names the filter."""
    policy = Policy(CFG)
    holder = WorkerView(id="w0", in_flight=16, batch_capacity=16, batch_announced=True)
    other = WorkerView(id="w1", in_flight=3, batch_capacity=16, batch_announced=True)
    d = policy.decide(req(2000, w0=120), [holder, other])
    assert d.worker == "w1"
    row = next(c for c in d.candidates if c.worker == "w0")
    assert row.filtered == "batch-full: batch full (16 in flight of 16)"
    assert saturation(d, 2.0) is None  # the pool has room: nothing waits
    # one place left: the holder keeps its prefix
    holder.in_flight = 15
    assert policy.decide(req(2000, w0=120), [holder, other]).worker == "w0"


def test_a_full_batch_everywhere_drops_no_worker_and_saturates_the_pool() -> None:
    policy = Policy(CFG)
    full = workers(2, in_flight=16, batch_capacity=16, batch_announced=True)
    d = policy.decide(req(2000, w0=120), full)
    assert d.worker is not None and all(c.filtered is None for c in d.candidates)
    assert saturation(d, 2.0) == "ttft"  # the request waits in the router


def test_a_learned_batch_size_does_not_filter() -> None:
    """The most seen running while others waited may be low (a moment of full KV cache):
    it would never grow if it kept requests away, so it only counts toward saturation."""
    policy = Policy(CFG)
    learned = WorkerView(id="w0", in_flight=6, batch_capacity=5)
    d = policy.decide(req(2000, w0=120), [learned, WorkerView(id="w1")])
    assert d.worker == "w0"
    assert all(c.filtered is None for c in d.candidates)


def test_a_data_parallel_vllms_ranks_are_read_from_its_cache_config() -> None:
    from kvpool.router.state.scrape import _engines, info_label_sets

    page = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="32",engine="0",hash="sha256_cbor"} 1.0\n'
        'vllm:cache_config_info{block_size="32",engine="1",hash="sha256_cbor"} 1.0\n'
    )
    labels = info_label_sets(page, "vllm:cache_config_info")
    assert [series["engine"] for series in labels] == ["0", "1"]
    assert _engines(labels) == (0, 1)
    assert _engines([{"block_size": "16"}]) == (0,)  # no engine label: one engine
    assert _engines([{"engine": "²"}]) == (0,)  # not a number: ignored
