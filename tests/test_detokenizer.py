"""Incremental detokenization with tokenizers that are not byte-level BPE."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kvpool.hashing import BlockHasher
from kvpool.worker.detokenizer import Detokenizer, DetokenizerState
from kvpool.worker.sequence import SamplingParams, Sequence


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style (Metaspace) tokenizer, as Llama 2 and Mistral use."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁The": 3, "▁capital": 4, "▁is": 5, "▁Paris": 6}
    vocab["."] = 7
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def test_the_first_output_word_keeps_its_leading_space() -> None:
    tokenizer = metaspace_tokenizer()
    prompt = [1, 3, 4, 5]
    seq = Sequence("r", list(prompt), len(prompt), SamplingParams(), BlockHasher().chain())
    detok = Detokenizer(tokenizer)
    state = DetokenizerState.for_prompt(len(prompt))
    streamed = ""
    for token in (6, 7):
        seq.append_token(token)
        detok.update(seq, state, stops=True)
        streamed += detok.take_delta(seq, state)
    assert streamed == " Paris."


def test_a_short_stop_string_before_min_tokens_is_not_found_later() -> None:
    """Each stop string is searched only where it could end in new text."""
    tokenizer = metaspace_tokenizer()
    prompt = [1, 3]
    params = SamplingParams(stop=["Paris", "ZZZZZZZZZZZZ"], min_tokens=2)
    seq = Sequence("r", list(prompt), len(prompt), params, BlockHasher().chain())
    detok = Detokenizer(tokenizer)
    state = DetokenizerState.for_prompt(len(prompt))
    hits = []
    for n, token in enumerate((6, 4, 5), start=1):  # " Paris capital is"
        seq.append_token(token)
        hits.append(detok.update(seq, state, stops=n >= params.min_tokens))
    assert hits == [None, None, None]
    assert state.text == " Paris capital is"
