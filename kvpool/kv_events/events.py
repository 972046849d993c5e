"""KV cache events and their wire format: contract 2 of the architecture.

A worker tells the router which blocks it holds with three events, sent in batches
``[timestamp, [events], data_parallel_rank]``, msgpack-encoded. vLLM has shipped two
encodings of an event, and a router in front of mixed fleets meets both:

* positional (array): ``["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name]``;
* tagged map: ``{"type": "BlockStored", "block_hashes": ..., ...}``.

:func:`encode_batch` writes either; :func:`decode_batch` reads both, ignores fields it does
not know, takes block hashes as integers or as digests (bytes: the last 8 bytes,
big-endian), and keeps events of an unknown type as :class:`UnknownEvent` so nothing is lost.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

__all__ = [
    "END_OF_REPLAY",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Encoding",
    "EventBatch",
    "KVCacheEvent",
    "MalformedMessage",
    "MalformedPayload",
    "UnknownEvent",
    "decode_batch",
    "encode_batch",
    "encode_seq",
    "parse_frames",
    "parse_seq",
]

Encoding = Literal["array", "map"]

_U64 = (1 << 64) - 1


class BlockStored(msgspec.Struct, tag=True):
    """Blocks that became reusable: ``block_hashes`` in chain order, ``parent_block_hash``
    the block before the first (``None`` at the start of a prompt)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    # Fields of the map encoding only (vLLM after its PR 42892).
    extra_keys: list[Any] | None = None
    group_idx: int = 0
    kv_cache_spec_kind: str = "full_attention"


class BlockRemoved(msgspec.Struct, tag=True):
    """Blocks evicted from ``medium``."""

    block_hashes: list[int]
    medium: str | None = "GPU"
    group_idx: int = 0


class AllBlocksCleared(msgspec.Struct, tag=True):
    """The worker dropped its whole prefix cache."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared

_EVENT_TYPES: dict[str, type[msgspec.Struct]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}

# The positional encoding's field order, as vLLM's array-like structs lay them out.
_ARRAY_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


_MAP_ONLY_MEANINGFUL = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}


@dataclass(frozen=True)
class UnknownEvent:
    """An event whose type this version does not know, kept as it arrived (array or map) so
    that a relay re-encodes it unchanged and a consumer can count and skip it."""

    tag: str
    raw: Any


@dataclass
class EventBatch:
    """Events published together; ``ts`` is the publisher's wall clock in seconds."""

    events: list[KVCacheEvent | UnknownEvent]
    ts: float = 0.0
    data_parallel_rank: int | None = 0

    @property
    def unknown_events(self) -> list[UnknownEvent]:
        return [e for e in self.events if isinstance(e, UnknownEvent)]


class MalformedPayload(ValueError):
    """A payload that is not a valid event batch; the message says what is wrong."""


class MalformedMessage(ValueError):
    """A ZMQ message without the three frames ``[topic, sequence, payload]``."""


def _event_to_wire(event: KVCacheEvent | UnknownEvent, encoding: Encoding) -> Any:
    if isinstance(event, UnknownEvent):
        return event.raw
    if encoding == "map":
        return event  # msgspec writes a tagged struct as a map with "type" first
    tag = type(event).__name__
    # Fields the positional layout has no place for may be dropped only while they mean
    # nothing (extra_keys only restates what the hashes already carry).
    for name, default in _MAP_ONLY_MEANINGFUL.items():
        value = getattr(event, name, default)
        if value != default:
            raise ValueError(
                f"{tag} has {name}={value!r}, which the array encoding cannot carry: use 'map'"
            )
    return [tag, *(getattr(event, name) for name in _ARRAY_FIELDS[tag])]


def encode_batch(batch: EventBatch | Sequence[KVCacheEvent], encoding: Encoding = "array") -> bytes:
    """msgpack bytes of ``[ts, [events], data_parallel_rank]`` in the chosen encoding."""
    if encoding not in ("array", "map"):
        raise ValueError(f"encoding must be 'array' or 'map', got {encoding!r}")
    if not isinstance(batch, EventBatch):
        batch = EventBatch(events=list(batch), ts=time.time())
    events = [_event_to_wire(e, encoding) for e in batch.events]
    return msgspec.msgpack.encode([float(batch.ts), events, batch.data_parallel_rank])


def _hash_to_int(value: Any, where: str) -> int:
    """Block hashes arrive as unsigned or signed 64-bit integers, or as digests in bytes."""
    if isinstance(value, bool):
        raise MalformedPayload(f"{where}: block hash must be an integer or bytes, got a boolean")
    if isinstance(value, int):  # msgpack integers always fit in 64 bits
        return value & _U64  # a signed int64 names the same 64 bits
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        if not raw:
            raise MalformedPayload(f"{where}: block hash is empty bytes")
        return int.from_bytes(raw[-8:], "big")
    raise MalformedPayload(
        f"{where}: block hash must be an integer or bytes, got {type(value).__name__}"
    )


def _decode_event(raw: Any, where: str) -> KVCacheEvent | UnknownEvent:
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise MalformedPayload(f"{where}: an array-encoded event must start with its type name")
        tag = raw[0]
        if tag not in _EVENT_TYPES:
            return UnknownEvent(tag=tag, raw=raw)
        # Fields past the known ones come from a newer publisher: ignored. Missing trailing
        # fields come from an older one: their defaults apply.
        fields = dict(zip(_ARRAY_FIELDS[tag], raw[1:], strict=False))
    elif isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise MalformedPayload(f"{where}: a map-encoded event needs a string 'type' field")
        if tag not in _EVENT_TYPES:
            return UnknownEvent(tag=tag, raw=raw)
        fields = {k: v for k, v in raw.items() if k != "type"}
    else:
        raise MalformedPayload(
            f"{where}: an event must be an array or a map, got {type(raw).__name__}"
        )

    if tag != "AllBlocksCleared":
        hashes = fields.get("block_hashes")
        if not isinstance(hashes, list):
            raise MalformedPayload(f"{where} ({tag}): 'block_hashes' must be a list")
        fields["block_hashes"] = [_hash_to_int(h, f"{where} ({tag})") for h in hashes]
        parent = fields.get("parent_block_hash")
        if parent is not None:
            fields["parent_block_hash"] = _hash_to_int(parent, f"{where} ({tag}) parent")
    try:
        return msgspec.convert(fields, _EVENT_TYPES[tag])
    except msgspec.ValidationError as exc:
        raise MalformedPayload(f"{where} ({tag}): {exc}") from None


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one event batch in either encoding; raise :class:`MalformedPayload` otherwise."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise MalformedPayload(f"payload is not valid msgpack: {exc}") from None
    except RecursionError:
        raise MalformedPayload("payload is nested too deeply to be an event batch") from None
    if not isinstance(raw, list) or len(raw) < 2:
        raise MalformedPayload("an event batch must be an array [ts, [events], dp_rank]")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 else None
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise MalformedPayload(f"batch timestamp must be a number, got {type(ts).__name__}")
    if not isinstance(events, list):
        raise MalformedPayload(f"batch events must be an array, got {type(events).__name__}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise MalformedPayload(f"data_parallel_rank must be an integer, got {type(rank).__name__}")
    decoded = [_decode_event(e, f"event {i}") for i, e in enumerate(events)]
    return EventBatch(events=decoded, ts=float(ts), data_parallel_rank=rank)


# ---- ZMQ framing: [topic, 8-byte big-endian signed sequence number, payload] ----

_SEQ = struct.Struct(">q")
END_OF_REPLAY = -1


def encode_seq(seq: int) -> bytes:
    return _SEQ.pack(seq)


def parse_frames(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """Split a published message into (topic, sequence number, payload)."""
    if len(frames) != 3:
        raise MalformedMessage(f"expected 3 frames [topic, sequence, payload], got {len(frames)}")
    topic, seq_frame, payload = frames
    return bytes(topic), parse_seq(seq_frame), bytes(payload)


def parse_seq(frame: bytes) -> int:
    """The sequence number in an 8-byte frame."""
    if len(frame) != _SEQ.size:
        raise MalformedMessage(f"sequence frame must be {_SEQ.size} bytes, got {len(frame)}")
    return _SEQ.unpack(frame)[0]
