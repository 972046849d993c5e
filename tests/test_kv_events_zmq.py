"""KV events over real ZMQ sockets on loopback: publisher, subscriber, replay, faults."""

from __future__ import annotations

import asyncio
import os

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvpool.kv_events import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventPublisher,
    EventSubscriber,
    RankedSubscriber,
    UnknownEvent,
    decode_batch,
    encode_seq,
    offset_endpoint,
    parse_seq,
)

from conftest import consecutive_ports


def stored(i: int) -> BlockStored:
    return BlockStored(block_hashes=[i], parent_block_hash=None, token_ids=[i] * 4, block_size=4)


async def prime(pub, collector, ready=None, timeout: float = 10.0) -> int:
    """Publish probes until the subscriber's connection carries them (ZMQ's slow joiner)
    and ``ready()`` holds, then a marker; returns the sequence number the next batch will
    carry, as the subscriber saw it."""
    ready = ready or (lambda: bool(collector.batches))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not ready():
        assert loop.time() < deadline, "subscriber never became ready"
        pub.publish([AllBlocksCleared()])
        try:
            await collector.wait_until(ready, timeout=0.05)
        except TimeoutError:
            pass
    marker = [BlockRemoved(block_hashes=[0xC0FFEE], medium="marker")]
    pub.publish(marker)
    await collector.wait_until(lambda: collector.batches[-1].batch.events == marker)
    return collector.batches[-1].seq + 1


async def wait_for(condition, timeout: float = 10.0) -> None:
    """Wait for a condition on another thread's state, polling, with a deadline."""
    async with asyncio.timeout(timeout):
        while not condition():  # noqa: ASYNC110 - the state lives on another thread
            await asyncio.sleep(0.01)


def restart_publisher(pub, make_publisher):
    """Close a publisher and start a new one on the same ports, as a restarted worker would."""
    endpoint, replay = pub.endpoint, pub.replay_endpoint
    pub.close()
    return make_publisher(endpoint=endpoint, replay_endpoint=replay)


def after_the_restart_resync(sub) -> list:
    """What the subscriber delivered after its one ResyncNeeded, which must name a restart."""
    (resync,) = sub.resyncs
    assert "restarted" in resync.reason
    return sub.items[sub.items.index(resync) + 1 :]


async def test_ten_thousand_events_arrive_complete_and_in_order(make_publisher, collect) -> None:
    pub = make_publisher()
    sub = collect(EventSubscriber(pub.endpoint, pub.replay_endpoint))
    first = await prime(pub, sub)

    for i in range(10_000):
        pub.publish([stored(i)])
    await sub.wait_until(lambda: sub.batches[-1].seq == first + 9_999, timeout=60)

    tail = sub.batches[-10_000:]
    assert [b.seq for b in tail] == list(range(first, first + 10_000))
    assert [b.batch.events[0].block_hashes[0] for b in tail] == list(range(10_000))
    assert not sub.resyncs
    assert sub.sub.stats.gaps == 0  # loopback with high-water marks loses nothing


async def test_a_late_subscriber_catches_up_through_replay_from_zero(
    make_publisher, collect
) -> None:
    pub = make_publisher()
    for i in range(50):
        pub.publish([stored(i)])
    sub = collect(EventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=0))
    await sub.wait_until(lambda: len(sub.batches) == 50)
    assert sub.seqs == list(range(50))
    assert all(b.replayed for b in sub.batches)
    pub.publish([stored(50)])
    await sub.wait_until(lambda: len(sub.batches) == 51)
    assert sub.seqs == list(range(51))
    assert not sub.resyncs


async def test_a_long_replay_lets_the_event_loop_run_and_says_when_it_is_in(
    make_publisher,
) -> None:
    """A consumer that applies each replayed batch without awaiting anything (the router's
    index) still lets the rest of its event loop run between slices of a long history, and
    ``caught_up`` is set once the history is delivered, not before."""
    pub = make_publisher(buffer_size=5_000)
    for i in range(3_000):
        pub.publish([stored(i)])
    await wait_for(lambda: pub.next_seq == 3_000)
    sub = EventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=0)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    seen_at: list[int] = []  # the ticks counted when each replayed batch was delivered
    early: list[int] = []  # batches delivered after caught_up was set

    async def consume() -> None:
        async for item in sub:
            seen_at.append(ticks)
            if sub.caught_up.is_set():
                early.append(item.seq)

    ticker = asyncio.create_task(tick())
    consumer = asyncio.create_task(consume())
    try:
        await asyncio.wait_for(sub.caught_up.wait(), 30)
        assert len(seen_at) == 3_000 and not early  # set once all of it was delivered
        assert seen_at[-1] > seen_at[0]  # the loop ran while the history was delivered
    finally:
        ticker.cancel()
        consumer.cancel()
        sub.close()
    assert sub.caught_up.is_set()


async def test_dropped_messages_are_recovered_through_replay(
    make_publisher, collect, lossy_proxy
) -> None:
    pub = make_publisher(buffer_size=1000)
    proxy = lossy_proxy(pub.endpoint)
    sub = collect(EventSubscriber(proxy.endpoint, pub.replay_endpoint))
    first = await prime(pub, sub)
    # From here on the hop loses every seventh message and a run of sixty.
    proxy.drop = lambda seq: seq > first and (seq % 7 == 3 or first + 200 <= seq < first + 260)
    for i in range(500):
        pub.publish([stored(i)])
    await sub.wait_until(lambda: sub.seqs[-1] == first + 499)
    await wait_for(lambda: proxy.last_seq == first + 499)  # replay can outrun the lossy hop

    tail = sub.batches[-500:]
    assert [b.seq for b in tail] == list(range(first, first + 500))
    assert [b.batch.events[0].block_hashes[0] for b in tail] == list(range(500))
    assert not sub.resyncs
    replayed = {b.seq for b in tail if b.replayed}
    expected_drops = {s for s in range(first, first + 500) if proxy.drop(s)}
    assert set(proxy.dropped) == expected_drops, sorted(expected_drops - set(proxy.dropped))
    assert expected_drops <= replayed  # all lost, all recovered
    assert sub.sub.stats.gaps >= 1


async def test_a_gap_older_than_the_replay_buffer_signals_resync(
    make_publisher, collect, lossy_proxy
) -> None:
    pub = make_publisher(buffer_size=50)
    proxy = lossy_proxy(pub.endpoint, drop=lambda seq: 100 <= seq < 400)
    sub = collect(EventSubscriber(proxy.endpoint, pub.replay_endpoint))
    first = await prime(pub, sub)
    assert first < 100
    for i in range(first, 420):
        pub.publish([stored(i)])
    await sub.wait_until(lambda: sub.seqs[-1] == 419)

    (resync,) = sub.resyncs
    # The buffer still holds 370..419; 100..369 are gone for good.
    assert (resync.first_lost, resync.last_lost) == (100, 369)
    assert "replay buffer" in resync.reason
    start = sub.seqs[0]
    assert sub.seqs == list(range(start, 100)) + list(range(370, 420))
    after = sub.items[sub.items.index(resync) + 1 :]
    assert [b.seq for b in after] == list(range(370, 420))  # valid again after the signal


async def test_malformed_messages_are_survived_and_the_next_good_one_is_delivered(
    make_publisher, collect, lossy_proxy
) -> None:
    pub = make_publisher()
    proxy = lossy_proxy(pub.endpoint)
    sub = collect(EventSubscriber(proxy.endpoint, pub.replay_endpoint))
    await prime(pub, sub)
    stats = sub.sub.stats

    proxy.inject([b"", b"only two frames"])
    proxy.inject([b"", encode_seq(1), b"payload", b"and a fourth frame"])
    proxy.inject([b"", b"\x01\x02\x03", b"a short sequence frame"])
    pub.publish([stored(1)])
    await sub.wait_until(lambda: sub.batches[-1].batch.events == [stored(1)])
    assert stats.malformed_messages == 3

    # An event type from the future, among known ones, from the publisher itself.
    future = UnknownEvent(tag="BlocksMigrated", raw=["BlocksMigrated", [9], "CPU"])
    pub.publish(EventBatch(events=[future, BlockRemoved(block_hashes=[1])], ts=1.0))
    pub.publish([stored(2)])
    await sub.wait_until(lambda: sub.batches[-1].batch.events == [stored(2)])
    assert stats.unknown_events == 1
    assert sub.batches[-2].batch.events == [future, BlockRemoved(block_hashes=[1])]
    assert not sub.resyncs


async def test_a_payload_damaged_in_transit_is_fetched_again_from_the_publisher(
    make_publisher, collect, lossy_proxy
) -> None:
    pub = make_publisher()
    proxy = lossy_proxy(pub.endpoint)
    sub = collect(EventSubscriber(proxy.endpoint, pub.replay_endpoint))
    first = await prime(pub, sub)
    proxy.corrupt.add(first + 1)
    for i in range(3):
        pub.publish([stored(i)])
    await sub.wait_until(lambda: sub.seqs[-1] == first + 2)

    assert sub.sub.stats.malformed_payloads == 1
    assert not sub.resyncs
    assert [b.batch.events for b in sub.batches[-3:]] == [[stored(0)], [stored(1)], [stored(2)]]
    assert sub.batches[-2].replayed


@pytest.mark.parametrize("replay", [True, False], ids=["with replay", "without replay"])
async def test_duplicated_batches_are_not_taken_for_a_restart(
    make_publisher, collect, lossy_proxy, replay
) -> None:
    pub = make_publisher()
    proxy = lossy_proxy(pub.endpoint)
    sub = collect(EventSubscriber(proxy.endpoint, pub.replay_endpoint if replay else None))
    first = await prime(pub, sub)
    proxy.duplicate |= {first + 1, first + 3}
    for i in range(6):
        pub.publish([stored(i)])
    await sub.wait_until(lambda: sub.seqs[-1] == first + 5)
    # copies sent again much later, out of any replay: the same bytes as batches consumed
    for seq in (first, first + 1, first + 4, first + 2, first + 2, first + 2):
        proxy.inject(proxy.sent[seq])
    pub.publish([stored(6)])
    await sub.wait_until(lambda: sub.seqs[-1] == first + 6)

    assert not sub.resyncs
    assert sub.sub.stats.duplicates == 8
    assert [b.batch.events for b in sub.batches[-7:]] == [[stored(i)] for i in range(7)]


async def test_a_damaged_copy_and_a_damaged_number_are_dropped_without_a_resync(
    make_publisher, collect, lossy_proxy
) -> None:
    pub = make_publisher()
    proxy = lossy_proxy(pub.endpoint)
    sub = collect(EventSubscriber(proxy.endpoint, pub.replay_endpoint))
    first = await prime(pub, sub)
    for i in range(3):
        pub.publish([stored(i)])
    await sub.wait_until(lambda: sub.seqs[-1] == first + 2)
    topic = proxy.sent[first][0]
    other = msgspec.msgpack.encode([1.0, [["BlockRemoved", [77], None]], 0])
    proxy.inject([topic, encode_seq(first + 1), other])  # behind, with other bytes
    proxy.inject([topic, encode_seq(first + 1_000_000), other])  # far ahead: a bad number
    pub.publish([stored(3)])
    await sub.wait_until(lambda: sub.seqs[-1] == first + 3)
    pub.publish([stored(4)])  # read after the stray ones are dealt with
    await sub.wait_until(lambda: sub.seqs[-1] == first + 4)

    assert not sub.resyncs
    assert sub.sub.stats.stale_messages == 2
    assert [b.batch.events for b in sub.batches[-5:]] == [[stored(i)] for i in range(5)]
    assert all(BlockRemoved(block_hashes=[77]) not in b.batch.events for b in sub.batches)


async def test_a_payload_the_publisher_itself_cannot_give_signals_resync(collect) -> None:
    """A raw PUB socket with no replay behind it stands for a broken publisher."""
    ctx = zmq.asyncio.Context.instance()
    raw = ctx.socket(zmq.PUB)
    raw.bind("tcp://127.0.0.1:*")
    good = msgspec.msgpack.encode([1.0, [["AllBlocksCleared"]], 0])
    try:
        sub = collect(EventSubscriber(raw.getsockopt_string(zmq.LAST_ENDPOINT)))
        seq = 0
        while not sub.batches:
            await raw.send_multipart([b"", encode_seq(seq), good])
            seq += 1
            try:
                await sub.wait_until(lambda: bool(sub.batches), timeout=0.05)
            except TimeoutError:
                pass
        last = sub.seqs[-1]
        await raw.send_multipart([b"", encode_seq(last + 1), b"\x93garbage"])
        await raw.send_multipart([b"", encode_seq(last + 2), good])
        await sub.wait_until(lambda: sub.seqs[-1] == last + 2)
        (resync,) = sub.resyncs
        assert (resync.first_lost, resync.last_lost) == (last + 1, last + 1)
        assert "cannot be decoded" in resync.reason
        assert sub.sub.stats.malformed_payloads == 1
    finally:
        raw.close(0)


async def test_a_gap_with_no_replay_endpoint_signals_resync(
    make_publisher, collect, lossy_proxy
) -> None:
    pub = make_publisher()
    proxy = lossy_proxy(pub.endpoint, drop=lambda seq: seq in (120, 121))
    sub = collect(EventSubscriber(proxy.endpoint))  # no replay endpoint
    first = await prime(pub, sub)
    for i in range(first, 130):
        pub.publish([stored(i)])
    await sub.wait_until(lambda: sub.seqs[-1] == 129)
    (resync,) = sub.resyncs
    assert (resync.first_lost, resync.last_lost) == (120, 121)


async def test_an_unanswered_replay_request_signals_resync(
    make_publisher, collect, lossy_proxy
) -> None:
    pub = make_publisher()
    proxy = lossy_proxy(pub.endpoint, drop=lambda seq: seq == 90)
    # A replay endpoint where nothing listens.
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    silent.bind("tcp://127.0.0.1:*")
    try:
        sub = collect(
            EventSubscriber(
                proxy.endpoint, silent.getsockopt_string(zmq.LAST_ENDPOINT), replay_timeout=0.2
            )
        )
        first = await prime(pub, sub)
        for i in range(first, 100):
            pub.publish([stored(i)])
        await sub.wait_until(lambda: sub.seqs[-1] == 99)
        assert sub.sub.stats.replay_failures == 1
        (resync,) = sub.resyncs
        assert (resync.first_lost, resync.last_lost) == (90, 90)
    finally:
        silent.close(0)


async def test_a_restarted_publisher_signals_resync_and_is_read_from_its_start(
    make_publisher, collect
) -> None:
    pub = make_publisher()
    sub = collect(EventSubscriber(pub.endpoint, pub.replay_endpoint))
    await prime(pub, sub)
    # Far enough along that the restarted stream is still behind when the SUB reconnects.
    for i in range(300):
        pub.publish([stored(i)])
    await sub.wait_until(lambda: sub.batches[-1].batch.events == [stored(299)])

    restarted = restart_publisher(pub, make_publisher)
    first = await prime(restarted, sub, ready=lambda: bool(sub.resyncs))
    # The new stream is read from its first batch.
    assert [b.seq for b in after_the_restart_resync(sub)] == list(range(first))


async def test_replay_socket_speaks_vllms_protocol_to_a_req_client(make_publisher) -> None:
    """A client written for vLLM 0.32's publisher (REQ socket) reads our replay unchanged:
    each batch as (topic, sequence, payload), the end as an empty topic and sequence -1."""
    pub = make_publisher(buffer_size=10, encoding="map", topic="kv")
    for i in range(15):
        pub.publish([stored(i)])
    ctx = zmq.asyncio.Context.instance()
    req = ctx.socket(zmq.DEALER)  # a REQ socket sends the same envelope
    req.connect(pub.replay_endpoint)
    try:
        await req.send_multipart([b"", (7).to_bytes(8, "big")])
        seqs = []
        while True:
            assert await req.poll(5000)
            _, topic, seq_frame, payload = await req.recv_multipart()
            seq = parse_seq(seq_frame)
            if seq == END_OF_REPLAY:
                assert (topic, payload) == (b"", b"")
                break
            assert topic == b"kv"
            seqs.append(seq)
            assert decode_batch(payload).events == [stored(seq)]
        assert seqs == list(range(7, 15))  # 5 and 6 already left the 10-message buffer
    finally:
        req.close(0)


def test_publisher_refuses_bad_settings_and_unbindable_endpoints() -> None:
    from kvpool.kv_events import EventPublisher

    with pytest.raises(ValueError, match="buffer_size"):
        EventPublisher(buffer_size=0)
    with pytest.raises(ValueError, match="encoding"):
        EventPublisher(encoding="xml")  # type: ignore[arg-type]
    with pytest.raises(OSError, match="cannot bind"):
        EventPublisher("not-a-transport://x", None).start()
    with pytest.raises(RuntimeError, match="not started"):
        EventPublisher().publish([AllBlocksCleared()])


async def test_a_batch_that_cannot_be_encoded_is_refused_and_publishing_goes_on(
    make_publisher, collect
) -> None:
    pub = make_publisher()
    sub = collect(EventSubscriber(pub.endpoint, pub.replay_endpoint))
    first = await prime(pub, sub)
    with pytest.raises(ValueError, match="cannot be encoded"):
        pub.publish([BlockRemoved(block_hashes=[2**70])])
    pub.publish([stored(7)])
    await sub.wait_until(lambda: sub.batches[-1].batch.events == [stored(7)])
    assert sub.seqs[-1] == first  # the refused batch took no sequence number


def incarnation(tag: int, i: int) -> BlockStored:
    """A batch whose hash tells which run of the publisher sent it."""
    return stored(tag * 100_000 + i)


async def test_a_restart_that_outruns_the_reconnect_is_caught_by_the_continuity_check(
    make_publisher, collect
) -> None:
    """The new run is past our position before the SUB reconnects: its sequence numbers
    alone would look like a plain gap."""
    pub = make_publisher()
    sub = collect(EventSubscriber(pub.endpoint, pub.replay_endpoint))
    first = await prime(pub, sub)
    for i in range(5):
        pub.publish([incarnation(1, i)])
    await sub.wait_until(lambda: sub.seqs[-1] == first + 4)

    restarted = restart_publisher(pub, make_publisher)
    for i in range(first + 40):  # well past where the subscriber stands
        restarted.publish([incarnation(2, i)])
    await sub.wait_until(lambda: bool(sub.resyncs))
    restarted.publish([incarnation(2, first + 40)])
    await sub.wait_until(lambda: sub.seqs[-1] == first + 40)

    after = after_the_restart_resync(sub)
    assert sub.sub.stats.disconnects == 1
    assert [b.seq for b in after] == list(range(first + 41))
    assert [b.batch.events for b in after] == [[incarnation(2, i)] for i in range(first + 41)]


async def test_a_restart_inside_a_replayed_range_is_not_taken_for_duplicates(
    make_publisher, collect
) -> None:
    pub = make_publisher()
    for i in range(50):
        pub.publish([incarnation(1, i)])
    sub = collect(EventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=0))
    await sub.wait_until(lambda: len(sub.batches) == 50)  # all of it through catch-up replay

    restarted = restart_publisher(pub, make_publisher)
    first = await prime(restarted, sub, ready=lambda: bool(sub.resyncs))
    assert [b.seq for b in after_the_restart_resync(sub)] == list(range(first))


async def test_a_tail_lost_while_the_publisher_is_idle_is_recovered(
    make_publisher, collect, lossy_proxy
) -> None:
    pub = make_publisher()
    proxy = lossy_proxy(pub.endpoint)
    sub = collect(EventSubscriber(proxy.endpoint, pub.replay_endpoint, idle_check=0.2))
    first = await prime(pub, sub)
    proxy.drop = lambda seq: seq >= first + 3  # the last two, and then silence
    for i in range(5):
        pub.publish([stored(i)])
    await sub.wait_until(lambda: sub.seqs[-1] == first + 4)
    assert [b.batch.events for b in sub.batches[-5:]] == [[stored(i)] for i in range(5)]
    assert sub.batches[-1].replayed and sub.batches[-2].replayed
    assert not sub.resyncs
    assert sub.sub.stats.continuity_checks >= 1


async def test_a_replay_abandoned_midway_does_not_poison_the_next_one(collect) -> None:
    """A replay endpoint the test controls answers the first request only after the
    subscriber gave up on it; the next request must read its own answers."""
    ctx = zmq.asyncio.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:*")
    live = ctx.socket(zmq.PUB)
    live.bind("tcp://127.0.0.1:*")

    def answer(envelope: list[bytes], tag: int) -> list[list[bytes]]:
        batches = [
            msgspec.msgpack.encode([1.0, [["BlockRemoved", [tag + i], "GPU"]], 0]) for i in range(3)
        ]
        return [[*envelope, encode_seq(i), b] for i, b in enumerate(batches)] + [
            [*envelope, encode_seq(END_OF_REPLAY), b""]
        ]

    try:
        subscriber = EventSubscriber(
            live.getsockopt_string(zmq.LAST_ENDPOINT),
            router.getsockopt_string(zmq.LAST_ENDPOINT),
            start_seq=0,
            replay_timeout=30,
        )
        first_try = collect(subscriber)
        stale_request = await asyncio.wait_for(router.recv_multipart(), 10)
        await first_try.stop()  # cancelled while waiting for the answer
        for frames in answer(stale_request[:-1], tag=666):
            await router.send_multipart(frames)

        second_try = collect(subscriber)
        fresh_request = await asyncio.wait_for(router.recv_multipart(), 10)
        for frames in answer(fresh_request[:-1], tag=1):
            await router.send_multipart(frames)
        await second_try.wait_until(lambda: len(second_try.batches) == 3)
        assert [b.batch.events for b in second_try.batches] == [
            [BlockRemoved(block_hashes=[1 + i])] for i in range(3)
        ]
    finally:
        router.close(0)
        live.close(0)


@pytest.mark.parametrize("framing", ["vllm-0.32", "older"])
async def test_a_replay_in_either_of_vllms_framings_is_read(collect, framing: str) -> None:
    """vLLM 0.32 answers a replay with (topic, sequence, payload) per batch and an empty
    topic before the end; older vLLMs sent no topic frame. A router must read both."""
    ctx = zmq.asyncio.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:*")
    live = ctx.socket(zmq.PUB)
    live.bind("tcp://127.0.0.1:*")
    try:
        sub = collect(
            EventSubscriber(
                live.getsockopt_string(zmq.LAST_ENDPOINT),
                router.getsockopt_string(zmq.LAST_ENDPOINT),
                start_seq=0,
            )
        )
        request = await asyncio.wait_for(router.recv_multipart(), 10)
        envelope = request[:-1]
        for i in range(4):
            payload = msgspec.msgpack.encode([1.0, [["BlockRemoved", [10 + i], "GPU"]], 0])
            topic = [b""] if framing == "vllm-0.32" else []
            await router.send_multipart([*envelope, *topic, encode_seq(i), payload])
        end_topic = [b""] if framing == "vllm-0.32" else []
        await router.send_multipart([*envelope, *end_topic, encode_seq(END_OF_REPLAY), b""])
        await sub.wait_until(lambda: len(sub.batches) == 4)
        assert [b.batch.events for b in sub.batches] == [
            [BlockRemoved(block_hashes=[10 + i])] for i in range(4)
        ]
        assert all(b.replayed for b in sub.batches)
        assert not sub.resyncs
        assert sub.sub.stats.replay_failures == 0
    finally:
        router.close(0)
        live.close(0)


def test_a_closed_publisher_cannot_be_restarted_and_failed_starts_leak_nothing() -> None:
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*").start()
    pub.close()
    with pytest.raises(RuntimeError, match="closed"):
        pub.start()
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish([AllBlocksCleared()])

    fds_before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with pytest.raises(OSError, match="cannot bind"):
            EventPublisher("not-a-transport://x", None).start()
        EventPublisher()  # made, never started
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 2


def test_a_ranks_endpoints_are_where_vllm_puts_them() -> None:
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://10.0.0.7:5557", 3) == "tcp://10.0.0.7:5560"
    assert offset_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint("tcp://127.0.0.1:0", 2) == "tcp://127.0.0.1:0"  # the OS's port
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    with pytest.raises(ValueError, match="only on tcp"):  # vLLM fails to start so
        offset_endpoint("ipc:///tmp/kv", 1)
    assert offset_endpoint("ipc:///tmp/kv", 0) == "ipc:///tmp/kv"


async def test_a_data_parallel_vllms_ranks_are_read_as_one_stream(make_publisher, collect) -> None:
    """vLLM --data-parallel-size 2: rank r publishes at the events port + r and replays
    at the replay port + r, each stream numbered on its own. Both are read, their history
    first (caught up once both are in), and a rank that restarts is named in its resync."""
    events, replay = consecutive_ports(2), consecutive_ports(2)
    pubs = [
        make_publisher(
            endpoint=f"tcp://127.0.0.1:{events + r}",
            replay_endpoint=f"tcp://127.0.0.1:{replay + r}",
            data_parallel_rank=r,
        )
        for r in (0, 1)
    ]
    for r, pub in enumerate(pubs):
        for i in range(5):
            pub.publish([stored(100 * r + i)])
    sub = collect(
        RankedSubscriber(
            f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}", (0, 1), start_seq=0
        )
    )
    await sub.wait_until(lambda: len(sub.batches) == 10)
    await asyncio.wait_for(sub.sub.caught_up.wait(), 10)
    by_rank: dict[int, list[int]] = {}
    for b in sub.batches:
        by_rank.setdefault(b.batch.data_parallel_rank, []).append(b.batch.events[0].block_hashes[0])
    assert by_rank == {0: [0, 1, 2, 3, 4], 1: [100, 101, 102, 103, 104]}  # each in its order
    pubs[1].publish([stored(105)])
    await sub.wait_until(lambda: len(sub.batches) == 11)
    # the history came through replay (and the live batch too, if it was published before
    # the rank's SUB had joined: ZMQ's slow joiner, recovered through replay)
    assert sub.sub.stats.batches == 11 and sub.sub.stats.replayed_batches >= 10

    # rank 1's engine restarts: its stream begins again, and only rank 1 lost anything
    pubs[1] = restart_publisher(pubs[1], make_publisher)
    pubs[1].data_parallel_rank = 1
    pubs[1].publish([stored(200)])
    pubs[0].publish([stored(5)])
    await sub.wait_until(lambda: any(b.batch.events[0].block_hashes[0] == 200 for b in sub.batches))
    assert [r.rank for r in sub.resyncs] == [1]
