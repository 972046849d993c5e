"""Chats rendered as vLLM 0.32 renders them, where its server does more than the template:

* Claude Code begins its system prompt with an ``x-anthropic-billing-header`` line whose
  ``cch`` value changes on every request. vLLM drops that line from system text before
  rendering; the router and kvpool's engine must too, or a coding agent's every request
  would hash a different first block and never be credited its cached history.
* A server's ``--chat-template-content-format`` overrides the format read from the
  template; the router is told it and follows it.
"""

from __future__ import annotations

from pathlib import Path

from kvpool.tokenization import load_tokenizer, render_chat_text

SYSTEM = "You are a coding agent. Read the repository before you change it."


def header(cch: str) -> str:
    return f"x-anthropic-billing-header: cc_version=2.1.0; cc_entrypoint=cli; cch={cch};"


def test_the_billing_line_is_dropped_from_system_text_only(llama_dir: Path) -> None:
    tokenizer = load_tokenizer(llama_dir)

    def render(system: object, user: str = "fix the failing test") -> str:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return render_chat_text(tokenizer, messages)

    plain = render(SYSTEM)
    assert render(f"{header('a1b2c')}\n{SYSTEM}") == plain
    assert render(f"{header('ffff0')}\n{SYSTEM}") == plain  # another request, same prompt
    # as content parts: the header's own part goes; a part after it stays
    parts = [{"type": "text", "text": header("a1b2c")}, {"type": "text", "text": SYSTEM}]
    assert render(parts) == plain
    # only at the start of a system text, never in a user's
    assert header("x") in render(SYSTEM, user=f"{header('x')}\nwhat is this line?")
    assert header("x") in render(f"{SYSTEM}\n{header('x')}")


def test_a_servers_content_format_override_is_followed(llama_dir: Path) -> None:
    """vLLM's --chat-template-content-format overrides what it reads from the template:
    with ``openai`` a template gets each message's content as a list of parts, whatever it
    loops over; the router is told the same (the operator passes the pool's flag on)."""
    import asyncio

    from kvpool.hashing import BlockHasher
    from kvpool.router.proxy.request import read_fields
    from kvpool.router.routing.tokens import PromptKeys
    from kvpool.tokenization import vllm_conversation

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # auto: "string"
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert vllm_conversation(parts, template)[0]["content"] == "a\nb"
    assert vllm_conversation(parts, template, "openai")[0]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "text", "text": "b"},
    ]
    assert vllm_conversation([{"role": "user", "content": "a"}], template, "openai")[0][
        "content"
    ] == [{"type": "text", "text": "a"}]

    tokenizer = load_tokenizer(llama_dir)
    body = {"messages": parts, "chat_template": template}
    counts = {}
    for fmt in ("auto", "openai"):
        keys = PromptKeys(tokenizer, None, BlockHasher(block_size=16), content_format=fmt)
        counts[fmt] = asyncio.run(keys.of(read_fields(body, "chat"), None, None)).num_tokens
    string_text = render_chat_text(tokenizer, parts, chat_template=template)
    openai_text = render_chat_text(
        tokenizer, parts, chat_template=template, content_format="openai"
    )
    assert string_text != openai_text  # the list of parts is what the template prints
    assert counts["auto"] == len(tokenizer.encode(string_text, add_special_tokens=False))
    assert counts["openai"] == len(tokenizer.encode(openai_text, add_special_tokens=False))
