from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.cli import parse_token_ids
from kvpool.hashing import (
    BlockHasher,
    HashSchemeMismatch,
    block_key,
    hash_block,
    seed_digest,
)

DATA = Path(__file__).parent / "data"


def _cases(vectors: dict) -> list[dict]:
    return vectors["cases"]


def test_every_published_vector_is_reproduced(hash_vectors: dict) -> None:
    assert _cases(hash_vectors), "the vector file holds no cases"
    for case in _cases(hash_vectors):
        hasher = BlockHasher(block_size=case["block_size"], hash_seed=case["seed"])
        tokens = parse_token_ids(case["token_ids"])
        assert hasher.root.hex() == case["seed_digest_hex"]
        digests = hasher.hash_prompt(tokens)
        assert [d.hex() for d in digests] == [b["digest_hex"] for b in case["blocks"]]
        assert hasher.prompt_keys(tokens) == [b["key_u64"] for b in case["blocks"]]


def test_incremental_chain_reproduces_vectors_token_by_token(hash_vectors: dict) -> None:
    for case in _cases(hash_vectors):
        chain = BlockHasher(case["block_size"], case["seed"]).chain()
        for token in parse_token_ids(case["token_ids"]):
            chain.extend([token])
        assert chain.keys == [b["key_u64"] for b in case["blocks"]]


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=300),
    block_size=st.integers(min_value=1, max_value=64),
    cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=12),
    lora_name=st.none() | st.text(min_size=1, max_size=8),
    cache_salt=st.none() | st.text(min_size=1, max_size=8),
)
def test_whole_prompt_hashing_equals_incremental_hashing(
    tokens: list[int],
    block_size: int,
    cuts: list[int],
    lora_name: str | None,
    cache_salt: str | None,
) -> None:
    hasher = BlockHasher(block_size=block_size, hash_seed="7")
    whole = hasher.hash_prompt(tokens, lora_name=lora_name, cache_salt=cache_salt)

    chain = hasher.chain(lora_name=lora_name, cache_salt=cache_salt)
    completed: list[bytes] = []
    bounds = sorted({0, len(tokens), *(c for c in cuts if c <= len(tokens))})
    for lo, hi in itertools.pairwise(bounds):
        completed.extend(chain.extend(tokens[lo:hi]))

    assert chain.digests == whole
    assert completed == whole  # each block reported once, when it completed
    assert len(whole) == len(tokens) // block_size
    assert chain.pending == tokens[len(whole) * block_size :]
    assert chain.num_tokens == len(tokens)


def test_partial_tail_block_is_not_hashed() -> None:
    hasher = BlockHasher(block_size=16)
    assert hasher.hash_prompt(list(range(15))) == []
    assert len(hasher.hash_prompt(list(range(31)))) == 1


def test_equal_prefixes_share_hashes_and_diverge_after() -> None:
    hasher = BlockHasher(block_size=4)
    a = hasher.prompt_keys([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    b = hasher.prompt_keys([1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0])
    assert a[:2] == b[:2]
    assert a[2] != b[2]


def test_a_different_first_block_changes_every_later_hash() -> None:
    hasher = BlockHasher(block_size=4)
    a = hasher.prompt_keys([1, 2, 3, 4, 5, 6, 7, 8])
    b = hasher.prompt_keys([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[0] != b[0] and a[1] != b[1]


def test_lora_name_is_mixed_into_every_block() -> None:
    hasher = BlockHasher(block_size=4)
    tokens = list(range(12))
    plain = hasher.hash_prompt(tokens)
    lora = hasher.hash_prompt(tokens, lora_name="sql-adapter", lora_path="/a/sql")
    assert all(p != q for p, q in zip(plain, lora, strict=True))
    # Every block, not only the first: block 1 hashed from lora's block 0 still differs
    # unless the adapter is in its own extra keys, tagged as vLLM 0.32 tags it.
    assert lora[1] == hash_block(lora[0], tokens[4:8], (("lora", "sql-adapter", "/a/sql"),))
    assert lora[1] != hash_block(lora[0], tokens[4:8], None)
    # vLLM keys the adapter's path too: a name pointed at another adapter shares nothing
    moved = hasher.hash_prompt(tokens, lora_name="sql-adapter", lora_path="/b/sql")
    assert not set(moved) & set(lora)


def test_cache_salt_is_mixed_into_the_first_block_only() -> None:
    hasher = BlockHasher(block_size=4)
    tokens = list(range(12))
    plain = hasher.hash_prompt(tokens)
    salted = hasher.hash_prompt(tokens, cache_salt="tenant-a")
    assert salted[0] == hash_block(hasher.root, tokens[:4], (("cache_salt", "tenant-a"),))
    assert salted[1] == hash_block(salted[0], tokens[4:8], None)
    assert not set(salted) & set(plain)  # through the chain, no block is shared
    other = hasher.hash_prompt(tokens, cache_salt="tenant-b")
    assert not set(salted) & set(other)


def test_lora_comes_before_cache_salt_and_the_two_never_collide() -> None:
    hasher = BlockHasher(block_size=4)
    tokens = list(range(4))
    both = hasher.hash_prompt(tokens, lora_name="L", cache_salt="S", lora_path="/L")
    assert both[0] == hash_block(hasher.root, tokens, (("lora", "L", "/L"), ("cache_salt", "S")))
    # tagged keys keep an adapter and a salt of one name apart (bare ones did not)
    assert hasher.hash_prompt(tokens, lora_name="X", lora_path="X") != hasher.hash_prompt(
        tokens, cache_salt="X"
    )


def _vllm_cases(kind: str | None = None) -> list[dict]:
    cases = json.loads((DATA / "vllm_hash_vectors.json").read_text())["cases"]
    return [c for c in cases if kind is None or c["name"] == kind]


@pytest.mark.parametrize("case", _vllm_cases(), ids=lambda c: f"{c['name']}-seed-{c['hash_seed']}")
def test_extra_keys_hash_as_vllm_0_32_hashes_them(case: dict) -> None:
    """Vectors computed by vLLM 0.32's own hashing code (tests/data/vllm_hash_vectors.json):
    salted and LoRA prompts, under PYTHONHASHSEED=0 and under vLLM's fixed default seed."""
    hasher = BlockHasher(block_size=case["block_size"], hash_seed=case["hash_seed"])
    tokens = parse_token_ids(case["token_ids"])
    extra = {
        "lora_name": case["lora_name"],
        "lora_path": case["lora_path"],
        "cache_salt": case["cache_salt"],
    }
    assert hasher.prompt_keys(tokens, **extra) == [b["key_u64"] for b in case["blocks"]]
    chain = hasher.chain(**extra)
    for token in tokens:
        chain.extend([token])
    assert chain.keys == [b["key_u64"] for b in case["blocks"]]


def test_the_bare_scheme_of_older_vllms_hashes_the_values_alone() -> None:
    tokens = list(range(1, 97))
    bare = BlockHasher(block_size=32, extra_keys="bare")
    tagged = BlockHasher(block_size=32)
    salted = bare.hash_prompt(tokens, cache_salt="tenant-a")
    assert salted[0] == hash_block(bare.root, tokens[:32], ("tenant-a",))
    (case,) = [c for c in _vllm_cases("salted") if c["hash_seed"] == "0"]
    assert tagged.prompt_keys(tokens, cache_salt="tenant-a") == [
        b["key_u64"] for b in case["blocks"]
    ]
    assert not set(bare.prompt_keys(tokens, cache_salt="tenant-a")) & set(
        tagged.prompt_keys(tokens, cache_salt="tenant-a")
    )
    with pytest.raises(ValueError, match="extra_keys must be one of tagged, bare"):
        BlockHasher(extra_keys="typed")


def test_hash_seed_changes_every_hash() -> None:
    tokens = list(range(32))
    assert not set(BlockHasher(hash_seed="0").prompt_keys(tokens)) & set(
        BlockHasher(hash_seed="1").prompt_keys(tokens)
    )


def test_key_is_last_eight_bytes_big_endian() -> None:
    digest = bytes(range(24)) + bytes.fromhex("0102030405060708")
    assert block_key(digest) == 0x0102030405060708
    assert seed_digest("0").hex().startswith("4e1195df")


def test_scheme_mismatch_is_reported_with_both_sides() -> None:
    ours = BlockHasher(block_size=16, hash_seed="0")
    ours.check_compatible(BlockHasher(block_size=16, hash_seed="0"))
    with pytest.raises(HashSchemeMismatch, match=r"worker-3 .*bs32.* this side uses .*bs16"):
        ours.check_compatible(BlockHasher(block_size=32, hash_seed="0"), what="worker-3")
    with pytest.raises(HashSchemeMismatch):
        ours.check_compatible(BlockHasher(block_size=16, hash_seed="1"))
    assert ours.fingerprint != BlockHasher(hash_seed="1").fingerprint


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, "at least 1"),
        ({"block_size": -4}, "at least 1"),
        ({"block_size": 1.5}, "must be an integer"),
        ({"block_size": True}, "must be an integer"),
        ({"hash_seed": 0}, "must be a string"),
    ],
)
def test_bad_hasher_settings_are_refused_clearly(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BlockHasher(**kwargs)


def test_the_recent_block_cache_is_bounded_in_bytes_at_any_block_size() -> None:
    """A router hashing many distinct prompts keeps at most ~RECENT_BLOCKS_BYTES of
    recent digests, whatever the block size: counted in entries, the same cache held
    ~60 MiB at block size 16 and ~340 MiB at 128."""
    import gc
    import tracemalloc

    from kvpool.hashing import RECENT_BLOCKS_BYTES, _recent_blocks

    hasher = BlockHasher(block_size=128, hash_seed="bounded-cache-test")
    _recent_blocks(128).cache_clear()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for p in range(100):  # 100 prompts of 128 distinct blocks: 12,800 digests
            base = 1_000 + p * 128 * 128  # ids above 256: int objects, as in real prompts
            hasher.hash_prompt(list(range(base, base + 128 * 128)))
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        _recent_blocks(128).cache_clear()
    assert grown <= 1.25 * RECENT_BLOCKS_BYTES, f"{grown / 2**20:.0f} MiB"
    assert _recent_blocks(128).cache_info().maxsize < 12_800
