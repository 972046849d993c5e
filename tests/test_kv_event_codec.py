from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    MalformedMessage,
    MalformedPayload,
    UnknownEvent,
    decode_batch,
    encode_batch,
    encode_seq,
    parse_frames,
)

# The positional layout of vLLM's array-like event structs, as documented.
ARRAY_LAYOUT = {
    "BlockStored": [
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ],
    "BlockRemoved": ["block_hashes", "medium"],
    "AllBlocksCleared": [],
}


def _documented_fields(event: list | dict) -> tuple[str, dict]:
    if isinstance(event, list):
        return event[0], dict(zip(ARRAY_LAYOUT[event[0]], event[1:], strict=True))
    return event["type"], {k: v for k, v in event.items() if k != "type"}


def _sample(event_samples: dict, encoding: str) -> dict:
    (found,) = [s for s in event_samples["samples"] if s["name"].startswith(encoding)]
    return found


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_samples_decode_to_the_documented_values(event_samples: dict, encoding: str) -> None:
    sample = _sample(event_samples, encoding)
    ts, events, rank = sample["decoded"]
    batch = decode_batch(bytes.fromhex(sample["msgpack_hex"]))
    assert batch.ts == ts
    assert batch.data_parallel_rank == rank
    assert [type(e).__name__ for e in batch.events] == [_documented_fields(e)[0] for e in events]
    for got, documented in zip(batch.events, events, strict=True):
        _, fields = _documented_fields(documented)
        for name, value in fields.items():
            assert getattr(got, name) == value, (type(got).__name__, name)


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_samples_are_re_encoded_byte_for_byte(event_samples: dict, encoding: str) -> None:
    sample = _sample(event_samples, encoding)
    payload = bytes.fromhex(sample["msgpack_hex"])
    assert encode_batch(decode_batch(payload), encoding) == payload


def test_both_samples_carry_the_same_events(event_samples: dict) -> None:
    array = decode_batch(bytes.fromhex(_sample(event_samples, "array")["msgpack_hex"]))
    mapped = decode_batch(bytes.fromhex(_sample(event_samples, "map")["msgpack_hex"]))
    stored_a, stored_m = array.events[0], mapped.events[0]
    assert isinstance(stored_a, BlockStored) and isinstance(stored_m, BlockStored)
    assert stored_a.block_hashes == stored_m.block_hashes == [3236607068019569386, 11]
    assert stored_a.token_ids == stored_m.token_ids
    assert array.events[1] == mapped.events[1]
    assert array.events[2] == mapped.events[2] == AllBlocksCleared()


hashes = st.lists(st.integers(min_value=0, max_value=2**64 - 1), min_size=1, max_size=5)
opt_text = st.none() | st.text(max_size=6)
stored = st.builds(
    BlockStored,
    block_hashes=hashes,
    parent_block_hash=st.none() | st.integers(min_value=0, max_value=2**64 - 1),
    token_ids=st.lists(st.integers(min_value=0, max_value=2**31), max_size=40),
    block_size=st.integers(min_value=1, max_value=256),
    lora_id=st.none() | st.integers(min_value=0, max_value=1000),
    medium=opt_text,
    lora_name=opt_text,
)
removed = st.builds(BlockRemoved, block_hashes=hashes, medium=opt_text)
events = st.lists(stored | removed | st.just(AllBlocksCleared()), max_size=6)
batches = st.builds(
    EventBatch,
    events=events,
    ts=st.floats(min_value=0, max_value=4e9),
    data_parallel_rank=st.none() | st.integers(min_value=0, max_value=64),
)


@settings(max_examples=150, deadline=None)
@given(batch=batches, encoding=st.sampled_from(["array", "map"]))
def test_any_batch_round_trips_in_both_encodings(batch: EventBatch, encoding: str) -> None:
    payload = encode_batch(batch, encoding)
    assert decode_batch(payload) == batch
    assert encode_batch(decode_batch(payload), encoding) == payload


def test_map_encoding_is_a_tagged_map_and_array_encoding_is_positional() -> None:
    batch = EventBatch(events=[BlockRemoved(block_hashes=[5])], ts=1.0)
    as_map = msgspec.msgpack.decode(encode_batch(batch, "map"))
    as_array = msgspec.msgpack.decode(encode_batch(batch, "array"))
    assert as_map[1][0]["type"] == "BlockRemoved"
    assert as_array[1][0] == ["BlockRemoved", [5], "GPU"]


def _payload(*events: object, extra: tuple = (0,)) -> bytes:
    return msgspec.msgpack.encode([1.5, list(events), *extra])


def test_unknown_extra_fields_are_ignored_in_both_encodings() -> None:
    batch = decode_batch(
        _payload(
            ["BlockRemoved", [1], "GPU", "a-field-from-the-future", 42],
            {"type": "BlockRemoved", "block_hashes": [2], "medium": "CPU", "novel": {"x": 1}},
        )
    )
    assert batch.events == [
        BlockRemoved(block_hashes=[1], medium="GPU"),
        BlockRemoved(block_hashes=[2], medium="CPU"),
    ]


def test_older_array_events_without_trailing_fields_take_defaults() -> None:
    (event,) = decode_batch(_payload(["BlockStored", [7], None, [1, 2], 2, None])).events
    assert event == BlockStored(
        block_hashes=[7], parent_block_hash=None, token_ids=[1, 2], block_size=2
    )


def test_batch_without_data_parallel_rank_is_accepted() -> None:
    batch = decode_batch(_payload(["AllBlocksCleared"], extra=()))
    assert batch.data_parallel_rank is None
    assert batch.events == [AllBlocksCleared()]


def test_block_hashes_as_bytes_use_the_last_eight_bytes_big_endian() -> None:
    digest = bytes(24) + (0xDEADBEEF).to_bytes(8, "big")
    (event,) = decode_batch(
        _payload(["BlockStored", [digest, b"\x01\x02"], digest, [1], 1, None, "GPU", None])
    ).events
    assert event.block_hashes == [0xDEADBEEF, 0x0102]
    assert event.parent_block_hash == 0xDEADBEEF


def test_signed_64_bit_hashes_name_the_same_bits_as_unsigned() -> None:
    (event,) = decode_batch(_payload(["BlockRemoved", [-1, -(2**63)], "GPU"])).events
    assert event.block_hashes == [2**64 - 1, 2**63]


def test_unknown_event_type_is_kept_and_re_encoded_unchanged() -> None:
    future_array = ["BlocksMigrated", [1, 2], "CPU"]
    future_map = {"type": "BlocksMigrated", "block_hashes": [3]}
    payload = _payload(future_array, ["AllBlocksCleared"], future_map)
    batch = decode_batch(payload)
    assert batch.events[1] == AllBlocksCleared()
    assert batch.unknown_events == [
        UnknownEvent(tag="BlocksMigrated", raw=future_array),
        UnknownEvent(tag="BlocksMigrated", raw=future_map),
    ]
    assert encode_batch(batch, "array") == payload


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xc1", "not valid msgpack"),
        (b"", "not valid msgpack"),
        (msgspec.msgpack.encode({"ts": 1}), r"must be an array \[ts"),
        (msgspec.msgpack.encode([1.0]), r"must be an array \[ts"),
        (msgspec.msgpack.encode(["yesterday", []]), "timestamp must be a number"),
        (msgspec.msgpack.encode([1.0, "events"]), "events must be an array"),
        (msgspec.msgpack.encode([1.0, [], "rank"]), "data_parallel_rank must be an integer"),
        (msgspec.msgpack.encode([1.0, [42]]), "event 0: an event must be an array or a map"),
        (msgspec.msgpack.encode([1.0, [[]]]), "must start with its type name"),
        (msgspec.msgpack.encode([1.0, [{"block_hashes": [1]}]]), "needs a string 'type'"),
        (msgspec.msgpack.encode([1.0, [["BlockRemoved", 5]]]), "'block_hashes' must be a list"),
        (msgspec.msgpack.encode([1.0, [["BlockRemoved", ["x"]]]]), "integer or bytes, got str"),
        (msgspec.msgpack.encode([1.0, [["BlockRemoved", [b""]]]]), "empty bytes"),
        (
            msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1], "sixteen"]]]),
            r"event 0 \(BlockStored\).*block_size",
        ),
        (
            msgspec.msgpack.encode([1.0, [["BlockStored", [1], None]]]),
            r"event 0 \(BlockStored\).*token_ids",
        ),
    ],
)
def test_malformed_payloads_are_refused_with_a_precise_message(
    payload: bytes, message: str
) -> None:
    with pytest.raises(MalformedPayload, match=message):
        decode_batch(payload)


def test_frames_are_split_into_topic_sequence_and_payload() -> None:
    assert parse_frames([b"kv", encode_seq(2**40), b"p"]) == (b"kv", 2**40, b"p")
    assert encode_seq(-1) == b"\xff" * 8


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([b"", b"payload"], "expected 3 frames"),
        ([b"", encode_seq(1), b"p", b"extra"], "expected 3 frames"),
        ([b"", b"\x00\x01", b"p"], "sequence frame must be 8 bytes"),
    ],
)
def test_bad_framing_is_refused(frames: list[bytes], message: str) -> None:
    with pytest.raises(MalformedMessage, match=message):
        parse_frames(frames)


def test_unknown_encoding_is_refused() -> None:
    with pytest.raises(ValueError, match="'array' or 'map'"):
        encode_batch([AllBlocksCleared()], "json")  # type: ignore[arg-type]


def test_array_encoding_refuses_map_only_fields_that_would_change_meaning() -> None:
    sliding = BlockRemoved(block_hashes=[1], group_idx=3)
    with pytest.raises(ValueError, match=r"group_idx=3.*use 'map'"):
        encode_batch([sliding], "array")
    assert decode_batch(encode_batch([sliding], "map")).events == [sliding]


def test_damaged_payloads_that_trip_the_msgpack_reader_are_malformed_not_crashes() -> None:
    bad_utf8 = msgspec.msgpack.encode([1.0, [["AllBlocksCleared"]], 0]).replace(
        b"AllBlocksCleared", b"AllBlocks\xffleared"
    )
    with pytest.raises(MalformedPayload, match="not valid msgpack"):
        decode_batch(bad_utf8)
    deep = b"\x91" * 100_000 + b"\xc0"
    with pytest.raises(MalformedPayload):
        decode_batch(deep)
