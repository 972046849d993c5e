"""A prompt's tokens and block keys, as the workers will compute them: the router's share
of tokenizing.

The router needs a prompt's token count (its load on a worker, the context bound) and the
keys of its full blocks (the index lookup and the speculative entries), computed the way
the workers will (:mod:`kvpool.hashing`). What follows a cached beginning is tokenized
(:class:`~kvpool.tokenization.PrefixTokenCache`), a prompt over the context is refused from
its beginning, and a chat's template is rendered first. Long prompts and chats are done in
a thread, so the event loop keeps relaying streams meanwhile. Pure of HTTP: the gateway
(:mod:`.server`) gives it the parsed fields and the workers' context, and gets the figures.

The count is what the worker will prefill, whatever the prompt's shape:

* a completion's list of prompts (a batch) is as many requests in vLLM, one a prompt, each
  prefilled in turn: the count is their sum, and each later prompt is credited what it
  holds where it goes or shares with an earlier prompt of the batch (:class:`Batch`);
* an image, audio or video part of a message is as many tokens as the model's processor
  makes of it, which the router cannot run: :func:`media_part_tokens` reads the model's
  configuration for the count (a fixed-size vision encoder's), else a typical image's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.hashing import BlockHasher
from kvpool.openai_api import vllm_error
from kvpool.tokenization import (
    PrefixTokenCache,
    PromptTooLong,
    encode_within,
    render_chat_text,
)

from ..proxy.request import MEDIA_SENTINEL, RoutingFields
from .inputs import BatchCredit, most_cached

__all__ = [
    "DEFAULT_MEDIA_PART_TOKENS",
    "INLINE_PROMPT_SIZE",
    "Batch",
    "BatchPrompt",
    "PromptKeys",
    "PromptTokens",
    "media_part_tokens",
]

#: prompts up to this many characters (or token ids) are tokenized and hashed on the event
#: loop, where a thread hop would cost more; longer ones in a thread. So are chats whose
#: messages' text is this short and that give the template no tools or documents: a short
#: chat's rendering, tokenizing and hashing (86 µs for 700 tokens, its prefix cached) costs
#: twice the CPU through a thread (bench/chat_tokens.py), and holds the loop no longer than
#: a prompt of that size does
INLINE_PROMPT_SIZE = 4000
INLINE_CHAT_MESSAGES = 16
#: what a tokenizer raises for text it cannot encode (a lone surrogate, say): no cache
#: credit, and the worker says what is wrong with it
_UNTOKENIZABLE = (TypeError, ValueError, UnicodeError)
#: an image, audio or video part, when the model's configuration names no count: a
#: 336-pixel image through a CLIP ViT-L/14 (LLaVA-1.5's 24 x 24 patches)
DEFAULT_MEDIA_PART_TOKENS = 576

#: the index's answer for a chain of block keys: worker -> (leading blocks held, DP rank)
Match = Callable[[list[int]], Mapping[str, tuple[int, Any]]]


@dataclass(frozen=True, slots=True)
class BatchPrompt:
    """A batch's prompt after its first: vLLM prefills it as a request of its own."""

    tokens: int
    keys: list[int]
    #: its leading blocks an earlier prompt of the batch has too: cached by the time vLLM
    #: comes to it, wherever the batch goes (vLLM enters a block in its prefix cache when
    #: it allocates it, so even a prompt scheduled in the same step finds it)
    shared: int


@dataclass(frozen=True, slots=True)
class Batch:
    """A completion's list of prompts, as the router routes it: by its first prompt (its
    keys are the request's: the index lookup, the speculative entries), with the cache
    the later ones find added to the first's."""

    first_tokens: int
    rest: tuple[BatchPrompt, ...]

    def credit(self, match: Match, block_size: int) -> BatchCredit:
        """The later prompts' cached tokens: those every worker will have (shared with an
        earlier prompt), and per worker those more that its index entries hold. Each
        prompt's credit stops at the whole blocks before its last token, which vLLM always
        computes (:func:`~.policy.most_cached`)."""
        shared = 0
        held: dict[str, int] = {}
        for p in self.rest:
            most = most_cached(p.tokens, block_size)
            own = min(p.shared * block_size, most)
            shared += own
            if p.shared >= len(p.keys):
                continue  # all of it comes from the batch: no worker holds more
            for worker, (blocks, _) in match(p.keys).items():
                more = min(blocks * block_size, most) - own
                if more > 0:
                    held[worker] = held.get(worker, 0) + more
        return BatchCredit(self.first_tokens, shared, held)


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """What the router knows of a request's prompt."""

    #: the prompt tokens the worker prefills, cache aside: a batch's every prompt, a
    #: chat's media parts too
    num_tokens: int
    #: the block keys the request is matched and speculated by (a batch's first prompt's)
    keys: list[int]
    #: why the keys cover less than the prompt (content the router cannot tokenize)
    note: str | None = None
    #: a completion's list of prompts; None for one prompt
    batch: Batch | None = None


class PromptKeys:
    """The router's tokenizer, its prefix token cache and the workers' block hasher."""

    def __init__(
        self,
        tokenizer: Any,
        cache: PrefixTokenCache | None,
        hasher: BlockHasher,
        media_tokens: int = DEFAULT_MEDIA_PART_TOKENS,
        content_format: str = "auto",
    ):
        self.tokenizer = tokenizer
        #: the workers' --chat-template-content-format (auto: the template says)
        self.content_format = content_format
        self.cache = cache
        self.hasher = hasher
        #: the tokens one image, audio or video part counts as (:func:`media_part_tokens`)
        self.media_tokens = media_tokens

    async def of(
        self,
        fields: RoutingFields,
        adapter: str | None,
        limit: int | None,
        adapter_path: str | None = None,
    ) -> PromptTokens:
        """The prompt's token count, its block keys and why they cover less than all of
        it. A long prompt and a long chat (its template rendered) are done in a thread:
        hashing alone takes ~0.3 ms per 1000 tokens, which would stall every stream relayed;
        a short one on the loop, where the thread hop costs more (:data:`INLINE_PROMPT_SIZE`).

        A prompt over ``limit`` tokens (the workers' context) is refused (400) from its
        beginning: about a context's worth of it is tokenized, not all of it, and none of it
        is kept. With ``truncate_prompt_tokens`` the worker keeps the prompt's end, so the
        caller gives no limit. Each prompt of a batch is bounded alone, as vLLM bounds each
        request it makes of one."""
        cache = self.cache
        tokenizer = self.tokenizer
        truncate = fields.truncate_prompt_tokens

        def encode(prompt: str | list[int], special: bool) -> list[int]:
            try:
                return encode_within(tokenizer, prompt, limit, cache, add_special_tokens=special)
            except PromptTooLong as exc:
                raise vllm_error(str(exc), exc.param, exc.value) from None

        def truncated(tokens: list[int]) -> list[int]:
            if truncate is not None and 0 < truncate < len(tokens):
                if fields.truncation_side == "right":
                    return tokens[:truncate]
                return tokens[-truncate:]  # vLLM's default: it keeps the prompt's last tokens
            return tokens

        def keys_of(tokens: list[int]) -> list[int]:
            return self.hasher.prompt_keys(
                tokens, lora_name=adapter, cache_salt=fields.cache_salt, lora_path=adapter_path
            )

        if fields.kind == "completion":
            prompts = fields.prompts
            if not prompts:
                return PromptTokens(0, [], "prompt embeddings: no tokens to match")

            def work() -> PromptTokens:
                counts: list[int] = []
                chains: list[list[int]] = []
                failed: list[tuple[int, Exception]] = []
                for i, prompt in enumerate(prompts):
                    try:
                        tokens = truncated(encode(prompt, fields.add_special_tokens))
                    except _UNTOKENIZABLE as exc:
                        tokens = []  # the worker says what is wrong with it
                        failed.append((i, exc))
                    counts.append(len(tokens))
                    chains.append(keys_of(tokens) if tokens else [])
                if len(prompts) == 1:
                    why = f"the prompt does not tokenize ({failed[0][1]})" if failed else None
                    return PromptTokens(counts[0], chains[0], why and f"no cache credit: {why}")
                note = "no cache credit for what does not tokenize: " + "; ".join(
                    f"prompt {i} ({exc})" for i, exc in failed
                )
                return PromptTokens(
                    sum(counts), chains[0], note if failed else None, _batch(counts, chains)
                )

            size = sum(len(p) for p in prompts)
            return work() if size <= INLINE_PROMPT_SIZE else await asyncio.to_thread(work)

        media = fields.media_parts * self.media_tokens

        def chat() -> PromptTokens:
            try:
                text = render_chat_text(
                    tokenizer,
                    fields.messages,
                    content_format=self.content_format,
                    add_generation_prompt=fields.add_generation_prompt,
                    continue_final_message=fields.continue_final_message,
                    chat_template_kwargs=fields.chat_template_kwargs,
                    **fields.template,
                )
            except ValueError as exc:  # the worker says what is wrong; no credit meanwhile
                return PromptTokens(media, [], f"no cache credit: {exc}")
            special = fields.add_special_tokens
            try:
                if fields.media is None:
                    tokens = truncated(encode(text, special))
                    return PromptTokens(len(tokens), keys_of(tokens))
                cut = text.find(MEDIA_SENTINEL)
                whole = encode(text.replace(MEDIA_SENTINEL, ""), special)
                # The last token before the part may merge with what stands there for it.
                head = encode(text[:cut], special)[:-1] if cut > 0 else []
            except _UNTOKENIZABLE as exc:
                why = f"no cache credit: the messages do not tokenize ({exc})"
                return PromptTokens(media, [], why)
            note = (
                f"cache credit only for the {len(head)} tokens before the first {fields.media} part"
            )
            return PromptTokens(len(whole) + media, keys_of(head), note)

        if _inline_chat(fields):
            return chat()
        return await asyncio.to_thread(chat)

    async def input_tokens(self, obj: Mapping[str, Any]) -> int:
        """The tokens an embeddings request (``/v1/embeddings``) has its worker prefill:
        its ``input`` (a text, texts, token ids or lists of them), tokenized with special
        tokens as vLLM does; 0 for what the router cannot read (the worker judges it)."""
        given = obj.get("input")
        if isinstance(given, str) or (isinstance(given, list) and given and _ids(given)):
            items: list[Any] = [given]
        elif isinstance(given, list):
            items = given
        else:
            return 0
        texts = [t for t in items if isinstance(t, str)]
        total = sum(len(t) for t in items if isinstance(t, list) and _ids(t))
        if not texts:
            return total
        special = obj.get("add_special_tokens", True) is not False

        def count() -> int:
            n = 0
            for text in texts:
                try:
                    n += len(self.tokenizer.encode(text, add_special_tokens=special))
                except _UNTOKENIZABLE:
                    continue
            return n

        size = sum(len(t) for t in texts)
        return total + (count() if size <= INLINE_PROMPT_SIZE else await asyncio.to_thread(count))


def _ids(items: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in items)


def _batch(counts: list[int], chains: list[list[int]]) -> Batch:
    """A batch's prompts after its first, each with the leading blocks it shares with an
    earlier one. Keys are chained hashes: a key equal to one an earlier prompt has at the
    same place means the whole prefix up to it is equal, so a set of the keys seen does."""
    seen: set[int] = set(chains[0])
    rest = []
    for tokens, keys in zip(counts[1:], chains[1:], strict=True):
        shared = 0
        while shared < len(keys) and keys[shared] in seen:
            shared += 1
        seen.update(keys[shared:])
        rest.append(BatchPrompt(tokens, keys, shared))
    return Batch(counts[0], tuple(rest))


def media_part_tokens(model_dir: str | Path) -> int:
    """The prompt tokens one image, audio or video part of a message becomes in the
    worker, as far as the model's files say: a count its configuration names (Gemma 3's
    ``mm_tokens_per_image``, PaliGemma's ``image_seq_length``), or a fixed-size vision
    encoder's patch grid (``vision_config``: ``(image_size / patch_size)^2``, over the
    square of a ``spatial_merge_size``), else :data:`DEFAULT_MEDIA_PART_TOKENS`. A model
    whose processor sizes each image by its pixels (Qwen2-VL) or audio by its length
    counts a typical part; ``--media-part-tokens`` sets the figure instead."""
    root = Path(model_dir)
    configs = []
    for name in ("config.json", "processor_config.json", "preprocessor_config.json"):
        try:
            loaded = json.loads((root / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(loaded, dict):
            configs.append(loaded)
    for config in configs:
        for key in ("mm_tokens_per_image", "image_seq_length", "num_image_tokens"):
            value = config.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    vision = configs[0].get("vision_config") if configs else None
    if isinstance(vision, dict):
        size, patch = vision.get("image_size"), vision.get("patch_size")
        merge = vision.get("spatial_merge_size") or 1
        numbers = (size, patch, merge)
        if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in numbers):
            return max((size // patch) ** 2 // merge**2, 1)
    return DEFAULT_MEDIA_PART_TOKENS


def _inline_chat(fields: RoutingFields) -> bool:
    """Whether a chat is short enough to render, tokenize and hash on the event loop (see
    :data:`INLINE_PROMPT_SIZE`): few messages, little text, no tools or documents."""
    if len(fields.messages) > INLINE_CHAT_MESSAGES or fields.template.get("tools"):
        return False
    if fields.template.get("documents"):
        return False
    size = 0
    for message in fields.messages:
        content = message.get("content")
        if isinstance(content, str):
            size += len(content)
        elif content is not None:
            size += len(str(content))
        if message.get("tool_calls"):
            size += len(str(message["tool_calls"]))
        if size > INLINE_PROMPT_SIZE:
            return False
    return True
