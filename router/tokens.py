"""A prompt's tokens and block keys, as the workers will compute them: the router's share
of tokenizing.

The router needs a prompt's token count (its load on a worker, the context bound) and the
keys of its full blocks (the index lookup and the speculative entries), computed the way
the workers will (:mod:`kvpool.hashing`). What follows a cached beginning is tokenized
(:class:`~kvpool.tokenization.PrefixTokenCache`), a prompt over the context is refused from
its beginning, and a chat's template is rendered first. Long prompts and chats are done in
a thread, so the event loop keeps relaying streams meanwhile. Pure of HTTP: the gateway
(:mod:`.server`) gives it the parsed fields and the workers' context, and gets the figures.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvpool.hashing import BlockHasher
from kvpool.openai_api import OpenAIError
from kvpool.tokenization import (
    PrefixTokenCache,
    PromptTooLong,
    encode_within,
    render_chat_text,
)

from .request import MEDIA_SENTINEL, RoutingFields

__all__ = ["INLINE_PROMPT_SIZE", "PromptKeys"]

#: prompts up to this many characters (or token ids) are tokenized and hashed on the event
#: loop, where a thread hop would cost more; longer ones, and chats, in a thread
INLINE_PROMPT_SIZE = 4000
#: what a tokenizer raises for text it cannot encode (a lone surrogate, say): no cache
#: credit, and the worker says what is wrong with it
_UNTOKENIZABLE = (TypeError, ValueError, UnicodeError)


class PromptKeys:
    """The router's tokenizer, its prefix token cache and the workers' block hasher."""

    def __init__(self, tokenizer: Any, cache: PrefixTokenCache | None, hasher: BlockHasher):
        self.tokenizer = tokenizer
        self.cache = cache
        self.hasher = hasher

    async def of(
        self, fields: RoutingFields, adapter: str | None, limit: int | None
    ) -> tuple[int, list[int], str | None]:
        """The prompt's token count, its block keys and why they cover less than all of
        it. A chat (its template rendered) and a long prompt are done in a thread: hashing
        alone takes ~0.3 ms per 1000 tokens, which would stall every stream relayed.

        A prompt over ``limit`` tokens (the workers' context) is refused (400) from its
        beginning: about a context's worth of it is tokenized, not all of it, and none of it
        is kept. With ``truncate_prompt_tokens`` the worker keeps the prompt's end, so the
        caller gives no limit."""
        cache = self.cache
        tokenizer = self.tokenizer
        truncate = fields.truncate_prompt_tokens
        param = "prompt" if fields.kind == "completion" else "messages"

        def encode(prompt: str | list[int], special: bool) -> list[int]:
            try:
                return encode_within(tokenizer, prompt, limit, cache, add_special_tokens=special)
            except PromptTooLong as exc:
                raise OpenAIError(
                    400, str(exc), code="context_length_exceeded", param=param
                ) from None

        def truncated(tokens: list[int]) -> list[int]:
            if truncate is not None and truncate > 0:
                return tokens[-truncate:]  # vLLM keeps the prompt's last tokens
            return tokens

        def keys_of(tokens: list[int]) -> list[int]:
            return self.hasher.prompt_keys(tokens, lora_name=adapter, cache_salt=fields.cache_salt)

        if fields.kind == "completion":
            if not fields.prompts:
                return 0, [], "prompt embeddings: no tokens to match"
            first = fields.prompts[0]  # a batch of prompts goes to one worker, routed by it

            def work() -> tuple[int, list[int], str | None]:
                try:
                    tokens = encode(first, fields.add_special_tokens)
                except _UNTOKENIZABLE as exc:
                    return 0, [], f"no cache credit: the prompt does not tokenize ({exc})"
                tokens = truncated(tokens)
                return len(tokens), keys_of(tokens), None

            return work() if len(first) <= INLINE_PROMPT_SIZE else await asyncio.to_thread(work)

        def chat() -> tuple[int, list[int], str | None]:
            try:
                text = render_chat_text(
                    tokenizer,
                    fields.messages,
                    add_generation_prompt=fields.add_generation_prompt,
                    continue_final_message=fields.continue_final_message,
                    chat_template_kwargs=fields.chat_template_kwargs,
                    **fields.template,
                )
            except ValueError as exc:  # the worker says what is wrong; no credit meanwhile
                return 0, [], f"no cache credit: {exc}"
            special = fields.add_special_tokens
            try:
                if fields.media is None:
                    tokens = truncated(encode(text, special))
                    return len(tokens), keys_of(tokens), None
                cut = text.find(MEDIA_SENTINEL)
                whole = encode(text.replace(MEDIA_SENTINEL, ""), special)
                # The last token before the part may merge with what stands there for it.
                head = encode(text[:cut], special)[:-1] if cut > 0 else []
            except _UNTOKENIZABLE as exc:
                return 0, [], f"no cache credit: the messages do not tokenize ({exc})"
            note = (
                f"cache credit only for the {len(head)} tokens before the first {fields.media} part"
            )
            return len(whole), keys_of(head), note

        return await asyncio.to_thread(chat)
