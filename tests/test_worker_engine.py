"""The engine end to end on the tiny model: batching, chunking, prefix caching, preemption,
aborts, sampling and stopping, and the events it reports."""

from __future__ import annotations

import random
import threading

import pytest
from test_block_pool import replay

from kvpool.hashing import block_key
from kvpool.worker.engine import EngineConfig, LLMEngine
from kvpool.worker.sequence import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def ragged_prompts(n: int, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 90))] for _ in range(n)]


def tokens(engine: LLMEngine, prompts, params=GREEDY) -> list[list[int]]:
    return [done.token_ids for done in engine.generate(prompts, params)]


def test_greedy_output_is_the_same_alone_and_in_a_ragged_batch_of_16(engine_factory) -> None:
    prompts = ragged_prompts(16)
    engine = engine_factory(num_blocks=256)
    alone = [tokens(engine, [p])[0] for p in prompts]
    together = tokens(engine_factory(num_blocks=256), prompts)
    assert together == alone


def test_chunked_prefill_gives_the_same_tokens_as_one_pass(engine_factory) -> None:
    prompts = ragged_prompts(6, seed=1)
    whole = tokens(engine_factory(max_num_batched_tokens=4096), prompts)
    chunked_engine = engine_factory(max_num_batched_tokens=7, max_num_seqs=7)
    chunked = tokens(chunked_engine, prompts)
    assert chunked == whole
    assert chunked_engine.stats.steps > len(whole[0]) + 80 // 7  # prompts really were split


def test_a_prefix_cache_hit_gives_the_same_tokens_and_is_counted(engine_factory) -> None:
    prefix = ragged_prompts(1, seed=2)[0] * 2  # long enough for several blocks
    question = [11, 12, 13]
    cold = engine_factory()
    (expected,) = tokens(cold, [[*prefix, *question]])
    engine = engine_factory()
    tokens(engine, [[*prefix, 99, 98]])  # warms the cache with the shared prefix
    before = engine.stats
    (done,) = engine.generate([[*prefix, *question]], GREEDY)
    after = engine.stats
    assert done.token_ids == expected
    cached = len(prefix) // 16 * 16
    assert done.num_cached_tokens == cached > 0
    assert after.prefix_cache_hits - before.prefix_cache_hits == cached
    assert after.prefix_cache_queries - before.prefix_cache_queries == len(prefix) + 3


def test_the_last_prompt_token_is_recomputed_even_when_every_block_is_cached(
    engine_factory,
) -> None:
    prompt = list(range(10, 42))  # exactly two blocks
    engine = engine_factory()
    (first,) = tokens(engine, [prompt])
    (done,) = engine.generate([prompt], GREEDY)
    assert done.token_ids == first
    assert done.num_cached_tokens == 16  # not 32: the last block holds the token to recompute


def test_a_pool_barely_larger_than_one_request_preempts_and_still_agrees(engine_factory) -> None:
    prompts = ragged_prompts(8, seed=3)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = tokens(engine_factory(num_blocks=256), prompts, params)
    # The longest request needs ceil((90 + 40) / 16) = 9 blocks: give it 10.
    tight = engine_factory(num_blocks=10)
    assert tokens(tight, prompts, params) == expected
    assert tight.stats.preemptions > 0
    assert tight.stats.kv_usage == 0
    tight.pool.check()


def test_abort_frees_the_requests_blocks_at_once(engine_factory) -> None:
    engine = engine_factory()
    stream = engine.add_request(list(range(3, 70)), SamplingParams(max_tokens=100))
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=100), request_id="other")
    engine.step()
    engine.step()
    held = engine.stats.kv_usage
    assert engine.abort(stream.request_id)
    assert engine.stats.kv_usage < held
    assert engine.stats.num_running == 1
    outputs = list(stream)
    assert outputs[-1].finish_reason == "abort"
    assert not engine.abort(stream.request_id)  # already gone
    assert engine.abort("other") and engine.stats.kv_usage == 0


def test_a_waiting_request_can_be_aborted(engine_factory) -> None:
    engine = engine_factory(max_num_seqs=1)
    engine.add_request([4, 5, 6], SamplingParams(max_tokens=5))
    waiting = engine.add_request([7, 8, 9], SamplingParams(max_tokens=5))
    engine.step()
    assert engine.stats.num_waiting == 1
    assert engine.abort(waiting.request_id)
    assert engine.stats.num_waiting == 0


def test_a_seed_makes_sampling_reproducible_whatever_shares_the_batch(engine_factory) -> None:
    prompt = [20, 21, 22, 23]
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    alone = engine_factory().generate([prompt], seeded)[0].token_ids
    others = SamplingParams(max_tokens=20, temperature=1.0)
    engine = engine_factory(seed=123)
    mixed = engine.generate([[5, 6], prompt, [7, 8, 9]], [others, seeded, others])
    assert mixed[1].token_ids == alone
    other_seed = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=8)
    assert engine_factory().generate([prompt], other_seed)[0].token_ids != alone


def test_top_k_one_and_a_tiny_top_p_are_greedy(engine_factory) -> None:
    prompts = ragged_prompts(3, seed=4)
    greedy = tokens(engine_factory(), prompts)
    for params in (
        SamplingParams(max_tokens=24, temperature=1.5, top_k=1, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.7, top_p=1e-6, ignore_eos=True),
    ):
        assert tokens(engine_factory(), prompts, params) == greedy


def test_logprobs_report_the_chosen_token_and_the_top_n(engine_factory) -> None:
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True)
    (done,) = engine_factory().generate([[30, 31, 32]], params)
    assert len(done.logprobs) == 5
    for token, lp in zip(done.token_ids, done.logprobs, strict=True):
        assert lp.token_id == token
        assert len(lp.top) == 3
        assert lp.top[0] == (token, pytest.approx(lp.logprob))  # greedy picks the top one
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert lp.logprob <= 0


def test_stop_token_ids_and_max_tokens_end_a_request(engine_factory) -> None:
    engine = engine_factory()
    (free,) = engine.generate([[40, 41, 42]], GREEDY)
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    (done,) = engine.generate(
        [[40, 41, 42]], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_at])
    )
    assert done.token_ids == free.token_ids[: first + 1]
    assert (done.finish_reason, done.stop_reason) == ("stop", stop_at)
    short = engine.generate([[40, 41, 42]], SamplingParams(max_tokens=3, temperature=0))[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3


def test_a_stop_string_truncates_the_text_and_is_never_streamed(engine_factory) -> None:
    engine = engine_factory()
    (free,) = engine.generate(["A router in front"], GREEDY)
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip() and stop in text
    params = SamplingParams(max_tokens=24, temperature=0, stop=[stop], ignore_eos=True)
    stream = engine.add_request("A router in front", params)
    while engine.has_unfinished():
        engine.step()
    outputs = list(stream)
    streamed = "".join(o.new_text for o in outputs)
    assert streamed == text[: text.index(stop)]
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", stop)
    assert stop not in streamed


def test_the_end_of_sequence_token_stops_unless_ignored(engine_factory) -> None:
    engine = engine_factory()
    prompt = [50, 51, 52]
    (probe,) = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    # Let the model's first greedy token count as end of sequence, as a checkpoint's
    # generation_config.json with several eos ids would.
    engine.eos_token_ids.add(probe.token_ids[0])
    (done,) = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0))
    assert (done.finish_reason, done.stop_reason, len(done.token_ids)) == ("stop", None, 1)
    (ignored,) = engine.generate(
        [prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    )
    assert len(ignored.token_ids) == 10
    (at_least,) = engine.generate(
        [prompt], SamplingParams(max_tokens=10, temperature=0, min_tokens=4)
    )
    assert len(at_least.token_ids) >= 4  # the end token cannot be drawn before min_tokens
    assert not set(at_least.token_ids[:4]) & engine.eos_token_ids


def test_events_rebuild_exactly_the_cached_blocks(engine_factory) -> None:
    batches: list[list] = []
    engine = engine_factory(event_sink=batches.append, num_blocks=12)
    prompts = ragged_prompts(10, seed=5)
    tokens(engine, prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    index: set[int] = set()
    for batch in batches:
        replay(batch, index)
    assert index == {block_key(d) for d in engine.pool.cached_digests}
    assert any(type(e).__name__ == "BlockRemoved" for b in batches for e in b)  # evictions
    assert engine.reset_prefix_cache()
    replay(batches[-1], index)
    assert index == set()


def test_bad_requests_get_clear_errors_and_the_engine_keeps_serving(engine_factory) -> None:
    engine = engine_factory(num_blocks=4)  # a context of 64 tokens
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="not in the vocabulary"):
        engine.add_request([1, 10**6])
    with pytest.raises(ValueError, match="64 tokens; this model's context is 64"):
        engine.add_request(list(range(3, 67)))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="stop token id 1000000 is not in the vocabulary"):
        engine.add_request([3, 4], SamplingParams(min_tokens=2, stop_token_ids=[10**6]))
    engine.add_request([3, 4], request_id="dup")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([3, 4], request_id="dup")
    (done,) = engine.generate([list(range(3, 60))], SamplingParams(max_tokens=50))
    assert done.finish_reason == "length"
    assert len(done.prompt_token_ids) + len(done.token_ids) == 64  # stopped by the context


def test_capacity_from_a_fraction_of_free_memory(engine_factory, monkeypatch) -> None:
    from kvpool.worker import model_runner

    monkeypatch.setattr(model_runner, "free_memory_bytes", lambda device: 2**30)
    engine = engine_factory(num_blocks=None, kv_cache_memory_fraction=0.001)
    c = engine.model.config
    block_bytes = c.num_layers * 2 * 16 * c.num_kv_heads * c.head_dim * 4  # float32
    assert engine.pool.num_blocks == int(2**30 * 0.001) // block_bytes
    assert engine.runner.kv_cache.shape[2] == engine.pool.num_blocks
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        engine_factory(num_blocks=None, kv_cache_memory_fraction=1.5)


def test_text_prompts_and_chat_templates_come_from_the_model_directory(llama_dir) -> None:
    engine = LLMEngine.from_pretrained(llama_dir, EngineConfig(num_blocks=32, device="cpu"))
    chat = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|begin_of_text|><|user|>hello<|eot|><|assistant|>"
    (done,) = engine.generate([chat], SamplingParams(max_tokens=4, temperature=0))
    assert done.prompt_token_ids[0] == engine.tokenizer.bos_token_id
    assert len(done.token_ids) >= 1


def test_min_tokens_keeps_an_early_stop_string_in_the_text(engine_factory) -> None:
    engine = engine_factory()
    varied = SamplingParams(max_tokens=24, min_tokens=24, seed=3)
    (free,) = engine.generate(["A router in front"], varied)
    text = free.text
    early = next(text[i : i + 3] for i in range(len(text)) if text.count(text[i : i + 3]) == 1)
    assert text.index(early) < len(text) // 2
    params = SamplingParams(max_tokens=24, min_tokens=24, seed=3, stop=[early])
    (done,) = engine.generate(["A router in front"], params)
    assert done.text == free.text  # matched too early to count, and not cut out either


def test_a_stop_tokens_own_text_is_left_out(engine_factory) -> None:
    engine = engine_factory()
    (free,) = engine.generate([[60, 61, 62]], GREEDY)
    stop_at = free.token_ids[3]
    cut = free.token_ids.index(stop_at)
    params = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_at])
    (done,) = engine.generate([[60, 61, 62]], params)
    assert done.token_ids[-1] == stop_at
    assert done.text == engine.tokenizer.decode(free.token_ids[:cut])


def test_preempted_requests_are_counted_once_in_the_cache_statistics(engine_factory) -> None:
    engine = engine_factory(num_blocks=8)
    prompts = [list(range(3, 23)), list(range(30, 50))]
    done = engine.generate(prompts, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    stats = engine.stats
    assert stats.preemptions > 0
    assert stats.prefix_cache_queries == stats.prompt_tokens == 40
    assert all(d.num_cached_tokens <= len(d.prompt_token_ids) for d in done)


def test_a_block_computed_twice_at_once_keeps_every_stored_parent_known(engine_factory) -> None:
    """A and B compute the same first block in one step; A finishes and C's allocation
    evicts A's copy. B's later blocks must still name a parent the router holds."""
    batches: list[list] = []
    engine = engine_factory(
        event_sink=batches.append, num_blocks=4, max_num_batched_tokens=33, max_num_seqs=4
    )
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    shared = list(range(100, 116))
    a = engine.add_request([*shared, 116], one)  # 17 tokens: done after one step
    b = engine.add_request([*shared, *range(200, 224)], one)  # 40 tokens: prefilled in chunks
    engine.step()
    engine.add_request(list(range(300, 317)), one)  # needs A's freed blocks
    while engine.has_unfinished():
        engine.step()
    index: set[int] = set()
    for batch in batches:
        replay(batch, index)  # refuses a stored block whose parent is not in the index
    assert index == {block_key(d) for d in engine.pool.cached_digests}
    assert [o.finish_reason for o in a][-1] == [o.finish_reason for o in b][-1] == "length"
    engine.pool.check()


def test_too_many_logprobs_are_refused(engine_factory) -> None:
    with pytest.raises(ValueError, match="logprobs=10000 exceeds the maximum of 20"):
        engine_factory().add_request([3, 4], SamplingParams(logprobs=10_000))


@pytest.mark.parametrize("where", ["model", "sampler"])
def test_a_failed_step_ends_its_requests_in_error_and_the_engine_keeps_serving(
    engine_factory, monkeypatch, where
) -> None:
    from kvpool.worker import engine as engine_module

    batches: list[list] = []
    engine = engine_factory(event_sink=batches.append)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = tokens(engine_factory(), [list(range(3, 40))], params)[0]
    early = engine.add_request(list(range(3, 40)), params)
    engine.step()
    engine.step()  # early is decoding with cached blocks when the failure comes
    late = engine.add_request(list(range(50, 90)), params)
    owner, name = (engine.runner, "execute") if where == "model" else (engine_module, "sample")
    real = getattr(owner, name)

    def broken(*args, **kwargs):
        monkeypatch.setattr(owner, name, real)  # fails once
        raise RuntimeError("device lost")

    monkeypatch.setattr(owner, name, broken)
    assert engine.step() == []
    assert [o.finish_reason for o in early][-1] == "error"
    assert [o.finish_reason for o in late] == ["error"]
    assert engine.stats.kv_usage == 0
    (done,) = engine.generate([list(range(3, 40))], params)
    assert done.token_ids == expected  # and the cache it left behind is sound
    index: set[int] = set()
    for batch in batches:
        replay(batch, index)
    assert index == {block_key(d) for d in engine.pool.cached_digests}


def test_events_a_sink_refused_are_sent_with_the_next_step(engine_factory) -> None:
    received: list = []
    failures = [RuntimeError("publisher busy")]

    def sink(events):
        if failures:
            raise failures.pop()
        received.extend(events)

    engine = engine_factory(event_sink=sink)
    engine.generate([list(range(3, 40))], SamplingParams(max_tokens=2))
    index: set[int] = set()
    replay(received, index)
    assert index == {block_key(d) for d in engine.pool.cached_digests} != set()


def test_an_abort_sends_the_text_held_back_for_a_possible_stop_string(engine_factory) -> None:
    engine = engine_factory()
    params = SamplingParams(max_tokens=50, temperature=0, stop=["\x00never\x00"])
    stream = engine.add_request([70, 71, 72], params)
    for _ in range(8):
        engine.step()
    engine.abort(stream.request_id)
    outputs = list(stream)
    token_ids = [t for o in outputs for t in o.new_token_ids]
    assert "".join(o.new_text for o in outputs) == engine.tokenizer.decode(token_ids)
    assert outputs[-1].new_text  # the held-back tail came with the abort


def _hand_off(prefill: LLMEngine, decode: LLMEngine, prompt: list[int], *, hold: bool = True):
    """Prefill ``prompt`` on one engine with its blocks pinned, import them into the other
    for a request of the same prompt (held for it unless ``hold`` is off); that request,
    prepared and not yet queued."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prepared = prefill.prepare(prompt, params, "leg", pin_blocks=True)
    prefill.submit(prepared, stream := _Sink())
    while prefill.has_unfinished():
        prefill.step()
    pin = prefill.pinned("leg")
    assert pin is not None and stream.done
    data = bytes(prefill.read_blocks(pin.block_ids))
    mine = decode.prepare(prompt, GREEDY, "decode")
    decode.import_blocks(prompt, pin.block_keys, data, hold_for=mine.seq if hold else None)
    return mine


class _Sink:
    def __init__(self) -> None:
        self.outputs: list = []
        self.done = False

    def put(self, output) -> None:
        self.outputs.append(output)
        self.done = self.done or output.finished


def test_a_handed_off_prompt_keeps_its_blocks_and_computes_its_last_token_only(
    engine_factory,
) -> None:
    """The issue's repro: 20 blocks (320 tokens) imported into a 40-block decode pool,
    then a competing request. The imported blocks belong to the request they are for, so
    the competitor cannot evict them; the request finds 319 of its 320 tokens cached and
    answers as a worker that computed it all would."""
    prompt = [3 + (i * 7) % 500 for i in range(320)]
    (expected,) = tokens(engine_factory(num_blocks=64), [prompt])
    for hold, cached in ((True, 319), (False, None)):
        prefill, decode = engine_factory(num_blocks=64), engine_factory(num_blocks=40)
        mine = _hand_off(prefill, decode, prompt, hold=hold)
        rival = [7 + (i * 11) % 500 for i in range(500)]  # 32 blocks: more than is free
        decode.submit(decode.prepare(rival, GREEDY, "rival"), _Sink())
        decode.step()
        decode.submit(mine, sink := _Sink())
        while decode.has_unfinished():
            decode.step()
        out = [o for o in sink.outputs if o.finished][-1]
        got = [t for o in sink.outputs for t in o.new_token_ids]
        if hold:
            assert out.num_cached_tokens == cached
            assert got == expected
        else:  # as before: the rival evicted most of them, and it recomputed silently
            assert out.num_cached_tokens < 304


def test_a_handed_off_request_that_never_runs_gives_its_blocks_back(engine_factory) -> None:
    prompt = list(range(10, 10 + 64))
    prefill, decode = engine_factory(num_blocks=64), engine_factory(num_blocks=40)
    free = decode.pool.num_free
    mine = _hand_off(prefill, decode, prompt)
    assert decode.pool.num_free < free and mine.seq.held_block_ids
    decode.release_held(mine.seq)
    assert not mine.seq.held_block_ids and mine.seq.imported_last is None
    decode.reset_prefix_cache()
    assert decode.pool.num_free == free


def test_a_streamed_import_takes_its_blocks_first_and_lands_while_the_engine_steps(
    engine_factory,
) -> None:
    """The decode side allocates the request's blocks when the transfer's header arrives;
    the bytes are copied in, run by run, on another thread while the engine keeps stepping a
    rival that wants more blocks than are free; the request then finds 319 of its 320
    tokens cached. A pull cut short keeps the runs that came whole and computes the rest.
    Either way the answer is a full computation's, and every block comes back."""
    prompt = [3 + (i * 7) % 500 for i in range(320)]
    (expected,) = tokens(engine_factory(num_blocks=64), [prompt])
    rival = [7 + (i * 11) % 500 for i in range(500)]  # 32 blocks: more than is free
    for arrived, cached in ((20, 319), (7, 7 * 16)):
        prefill, decode = engine_factory(num_blocks=64), engine_factory(num_blocks=40)
        free = decode.pool.num_free
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        prefill.submit(prefill.prepare(prompt, params, "leg", pin_blocks=True), _Sink())
        while prefill.has_unfinished():
            prefill.step()
        pin = prefill.pinned("leg")
        mine = decode.prepare(prompt, GREEDY, "decode")
        plan = decode.begin_import(prompt, pin.block_keys, hold_for=mine.seq)
        assert decode.pool.num_free == free - 20  # allocated before a byte arrived
        decode.submit(decode.prepare(rival, GREEDY, "rival"), rival_sink := _Sink())

        def copy(plan=plan, pin=pin, prefill=prefill, decode=decode, arrived=arrived) -> None:
            for first in range(0, arrived, 3):  # runs of 3 blocks, the last one shorter
                ids = pin.block_ids[first : min(first + 3, arrived)]
                decode.write_import(plan, first, prefill.read_blocks(ids))

        copier = threading.Thread(target=copy)
        copier.start()
        while copier.is_alive():
            decode.step()  # the rival runs meanwhile (it cannot take the import's blocks)
        copier.join()
        assert decode.finish_import(plan) == (20 if arrived == 20 else arrived)
        decode.submit(mine, sink := _Sink())
        while decode.has_unfinished():
            decode.step()
        out = [o for o in sink.outputs if o.finished][-1]
        assert out.num_cached_tokens == cached
        assert [t for o in sink.outputs for t in o.new_token_ids] == expected
        assert rival_sink.done
        decode.reset_prefix_cache()
        assert decode.pool.num_free == free


def test_block_tables_are_only_appended_to_when_two_requests_compute_one_prefix(
    engine_factory,
) -> None:
    """A and B compute the same 48-token prefix in the same steps. Neither's block table is
    rewritten to point at the other's blocks (a kernel may keep tables on the device and
    append only), yet one block per hash is reported, every stored block's parent stays
    known, both answer as they would alone, and every block comes back."""
    batches: list[list] = []
    # both prompts fit one step's budget: both compute the prefix at once, neither hits
    engine = engine_factory(
        event_sink=batches.append, num_blocks=32, max_num_batched_tokens=128, max_num_seqs=4
    )
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    shared = list(range(100, 148))
    prompts = [[*shared, 7, 8, 9], [*shared, 17, 18]]
    alone = [tokens(engine_factory(num_blocks=32), [p], params)[0] for p in prompts]
    streams = [engine.add_request(p, params) for p in prompts]
    tables: dict[str, list[int]] = {}

    def check() -> None:
        for seq in engine.scheduler.running:
            before = tables.get(seq.request_id, [])
            assert seq.block_ids[: len(before)] == before, "a block table was rewritten"
            tables[seq.request_id] = list(seq.block_ids)

    schedule = engine.scheduler.schedule

    def scheduled():  # the tables as the step's kernels see them
        batch = schedule()
        check()
        return batch

    engine.scheduler.schedule = scheduled
    while engine.has_unfinished():
        engine.step()
        check()  # and after the step cached its full blocks
    got = [[t for o in s for t in o.new_token_ids] for s in streams]
    assert got == alone
    index: set[int] = set()
    for batch in batches:
        replay(batch, index)  # refuses a stored block whose parent is not in the index
    assert index == {block_key(d) for d in engine.pool.cached_digests}
    assert len(index) == 3  # the shared prefix's three blocks, once each (tails are partial)
    engine.pool.check()
    engine.reset_prefix_cache()
    assert engine.pool.num_free == 32
