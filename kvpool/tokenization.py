"""Prompt tokenization that the router and the workers must do identically.

Cache-aware routing works only if the router cuts a prompt into the same token ids as the
worker that will serve it: the same tokenizer files and the same chat template, rendered
the same way. Both sides call these functions, so they cannot drift apart. ``transformers``
is imported when a tokenizer is loaded (it needs no torch for tokenizers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["TOKENIZER_FILES", "TokenizerError", "encode_prompt", "load_tokenizer", "render_chat"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


class TokenizerError(ValueError):
    """A model directory's tokenizer is missing or does not load."""


def load_tokenizer(model_dir: str | Path) -> Any:  # -> transformers.PreTrainedTokenizerBase
    """The tokenizer and chat template stored beside the weights."""
    model_dir = Path(model_dir)
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise TokenizerError(
            f"{model_dir}: no tokenizer (expected one of {', '.join(TOKENIZER_FILES)})"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{model_dir}: the tokenizer does not load ({exc})") from None


def encode_prompt(tokenizer: Any, prompt: str | Sequence[int]) -> list[int]:
    """A completion prompt's token ids: text is encoded with the tokenizer's special tokens
    (as vLLM does), token ids are taken as they are."""
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    return list(prompt)


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """A chat's token ids through the model's chat template. Raises :class:`ValueError`
    naming ``messages`` when the template refuses them."""
    plain = []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), list):  # text parts, joined as the worker sees them
            m["content"] = "".join(part["text"] for part in m["content"])
        plain.append(m)
    try:
        text = tokenizer.apply_chat_template(
            plain,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **(chat_template_kwargs or {}),
        )
    except Exception as exc:  # a template raises whatever Jinja raises
        raise ValueError(f"messages: the chat template failed: {exc}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))
