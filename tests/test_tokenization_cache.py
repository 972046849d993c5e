"""The router's prefix token cache: texts that begin like an earlier one must get exactly
the ids the tokenizer gives them, whatever the tokenizer; tokenizers whose pieces can cross
a word boundary are not cut at all."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.tokenization import (
    CHARS_PER_TOKEN_BOUND,
    PrefixTokenCache,
    PromptTooLong,
    encode_within,
    load_tokenizer,
    max_chars_per_token,
)

CORPUS = [
    "the order ships within two days unless the item is made to order",
    "returns are accepted for thirty days with the original receipt, don't worry",
    "Café naïve résumé 東京 and 12345 numbers; punctuation!? (yes) [1] {x: 2}",
    "  indented\n\tlines\r\nwith   spaces  ",
] * 20


def _train(pre_tokenizer: Any, normalizer: Any, decoder: Any, path: Path) -> Any:
    from tokenizers import Tokenizer, models, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoder
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    from tokenizers import processors

    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))
    return load_tokenizer(path)  # through the real loading code


@pytest.fixture(scope="module")
def tokenizers_by_kind(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    from kvpool.worker.tiny import write_tokenizer

    tiny_dir = tmp_path_factory.mktemp("tiny")
    write_tokenizer(tiny_dir)
    llama3_split = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    return {
        "tiny (byte-level)": load_tokenizer(tiny_dir),
        "llama3-style (regex split + byte-level)": _train(
            pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(llama3_split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            ),
            None,
            decoders.ByteLevel(),
            tmp_path_factory.mktemp("llama3"),
        ),
        "sentencepiece-style (metaspace)": _train(
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always"),
            normalizers.NFKC(),
            decoders.Metaspace(),
            tmp_path_factory.mktemp("metaspace"),
        ),
        "no pre-tokenizer": _train(
            None, None, decoders.ByteLevel(), tmp_path_factory.mktemp("whole")
        ),
    }


def test_tokenizers_that_start_a_piece_at_each_word_are_cut_and_others_are_not(
    tokenizers_by_kind: dict[str, Any],
) -> None:
    enabled = {k: PrefixTokenCache(t).enabled for k, t in tokenizers_by_kind.items()}
    assert enabled == {
        "tiny (byte-level)": True,
        "llama3-style (regex split + byte-level)": True,
        # Metaspace does not prepend a second "▁" to a tail that starts with a space
        "sentencepiece-style (metaspace)": True,
        # a BPE over the whole text has pieces across words: cutting would change them
        "no pre-tokenizer": False,
    }


def test_a_shared_system_prompt_is_tokenized_once(tokenizers_by_kind: dict[str, Any]) -> None:
    tokenizer = tokenizers_by_kind["tiny (byte-level)"]
    cache = PrefixTokenCache(tokenizer)
    system = " ".join(CORPUS[:12])
    for i in range(20):
        text = f"{system} Question {i}: does the order ship {i} days late?"
        assert cache.encode(text) == tokenizer.encode(text)
    assert cache.misses == 1 and cache.hits == 19


LETTERS = "abcdefghij klmn opq  \n\t.,!?'\"0123éü東京"


@pytest.mark.parametrize(
    "kind",
    [
        "tiny (byte-level)",
        "llama3-style (regex split + byte-level)",
        "sentencepiece-style (metaspace)",
        "no pre-tokenizer",
    ],
)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    bases=st.lists(st.text(LETTERS, min_size=200, max_size=1400), min_size=1, max_size=3),
    picks=st.lists(
        st.tuples(
            st.integers(0, 2), st.integers(0, 1400), st.text(LETTERS, max_size=500), st.booleans()
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_ids_are_the_tokenizers_for_texts_sharing_beginnings(
    tokenizers_by_kind: dict[str, Any],
    kind: str,
    bases: list[str],
    picks: list[tuple[int, int, str, bool]],
) -> None:
    tokenizer = tokenizers_by_kind[kind]
    cache = PrefixTokenCache(tokenizer, capacity_bytes=64 * 1024)
    for which, keep, tail, special in picks:
        text = bases[which % len(bases)][:keep] + tail
        assert cache.encode(text, add_special_tokens=special) == tokenizer.encode(
            text, add_special_tokens=special
        )


def test_the_cache_stays_within_its_bytes_and_counts_them_right(
    tokenizers_by_kind: dict[str, Any],
) -> None:
    tokenizer = tokenizers_by_kind["tiny (byte-level)"]
    cache = PrefixTokenCache(tokenizer, capacity_bytes=48 * 1024)
    texts = [f"Document {i}: " + " ".join(CORPUS[i % 4 :][:40]) for i in range(60)]
    for text in texts:
        assert cache.encode(text) == tokenizer.encode(text)
        assert 0 < cache.bytes <= cache.capacity_bytes
        # the count is what the entries really hold: each text's ids once, 4 bytes an id
        arrays = {id(v[1]): v[1] for v in cache._entries.values()}
        held = sum(4 * len(a) + 64 for a in arrays.values())
        assert cache.bytes == held + len(cache._entries) * cache.ENTRY_BYTES
    assert cache.misses == 60
    # the latest texts are still there; the first ones went
    hits = cache.hits
    cache.encode(texts[-1] + " and more")
    assert cache.hits == hits + 1
    cache.encode(texts[0] + " and more")
    assert cache.hits == hits + 1


def test_a_text_bigger_than_the_cache_is_not_kept(tokenizers_by_kind: dict[str, Any]) -> None:
    tokenizer = tokenizers_by_kind["tiny (byte-level)"]
    cache = PrefixTokenCache(tokenizer, capacity_bytes=4 * 1024)
    text = " ".join(CORPUS)
    assert cache.encode(text) == tokenizer.encode(text)
    assert cache.bytes == 0 and not cache._entries


class _CountingTokenizer:
    """A tokenizer that counts the characters it was given to encode."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.chars = inner, 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.chars += len(text)
        return self.inner.encode(text, add_special_tokens=add_special_tokens)


def test_a_prompt_far_over_the_context_is_refused_from_its_beginning(
    tokenizers_by_kind: dict[str, Any],
) -> None:
    tokenizer = _CountingTokenizer(tokenizers_by_kind["tiny (byte-level)"])
    huge = " ".join(CORPUS) * 200  # ~1.6 MB
    with pytest.raises(PromptTooLong) as err:
        encode_within(tokenizer, huge, 512)
    # vLLM's words: a text is counted to one token past the context
    assert str(err.value) == (
        "This model's maximum context length is 512 tokens. However, your prompt contains "
        "at least 513 input tokens, which exceeds this limit even without any output "
        "tokens. Please reduce the length of the input prompt."
    )
    assert (err.value.param, err.value.value) == ("input_tokens", 513)
    # about a context's worth of characters was tokenized, not the text
    assert tokenizer.chars <= 512 * CHARS_PER_TOKEN_BOUND
    # a prompt within the context is tokenized whole, exactly
    text = " ".join(CORPUS[:8])
    assert encode_within(tokenizer, text, 512) == tokenizer.inner.encode(text)
    # just over: refused with its real count
    over = tokenizer.inner.encode(text)
    with pytest.raises(PromptTooLong, match=f"contains at least {len(over)} input tokens"):
        encode_within(tokenizer, text, len(over) - 1)
    # token ids are counted, not tokenized
    with pytest.raises(PromptTooLong, match="contains 600 input tokens"):  # exactly
        encode_within(tokenizer, list(range(600)), 512)
    # one over: vLLM cannot tell it from a longer prompt cut there, and words it so
    with pytest.raises(PromptTooLong, match="contains at least 513 input tokens"):
        encode_within(tokenizer, list(range(513)), 512)
    assert encode_within(tokenizer, [1, 2, 3], 512) == [1, 2, 3]


class _LongTokens:
    """A tokenizer whose every token covers 100 characters (runs of spaces or of '=' do
    in real vocabularies): a text far longer than the context in characters fits in it."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(range(-(-len(text) // 100)))


def test_a_long_text_of_long_tokens_within_the_context_is_not_refused() -> None:
    text = "=" * 40_000  # 400 tokens, 100 times the context's count in characters
    assert len(text) > 500 * CHARS_PER_TOKEN_BOUND
    assert len(encode_within(_LongTokens(), text, 500)) == 400
    with pytest.raises(PromptTooLong, match="contains at least 400 input tokens"):
        encode_within(_LongTokens(), text, 399)


class _CountingWithVocabulary(_CountingTokenizer):
    def get_vocab(self) -> dict[str, int]:
        return self.inner.get_vocab()


def test_a_text_longer_than_the_context_could_hold_is_refused_untokenized(
    tokenizers_by_kind: dict[str, Any],
) -> None:
    """vLLM's first check: more characters than the context's tokens of the vocabulary's
    longest entry, refused before any of it is tokenized, in vLLM's words."""
    inner = tokenizers_by_kind["tiny (byte-level)"]
    tokenizer = _CountingWithVocabulary(inner)
    most = max(len(t) for t in inner.get_vocab())
    assert max_chars_per_token(tokenizer) == most
    text = "w" * (64 * most + 1)
    with pytest.raises(PromptTooLong) as err:
        encode_within(tokenizer, text, 64)
    assert str(err.value) == (
        f"This model's maximum context length is 64 tokens. However, your prompt contains "
        f"{len(text)} characters (more than {64 * most} characters, which is the upper bound "
        f"for 64 input tokens). Please reduce the length of the input prompt."
    )
    assert (err.value.param, err.value.value) == ("input_text", len(text))
    assert tokenizer.chars == 0
    # one character fewer is tokenized, and refused by its tokens
    with pytest.raises(PromptTooLong, match="contains at least 65 input tokens"):
        encode_within(tokenizer, text[1:], 64)
