"""Prompt tokenization that the router and the workers must do identically.

Cache-aware routing works only if the router cuts a prompt into the same token ids as the
worker that will serve it: the same tokenizer files and the same chat template, rendered
the same way. Both sides call these functions, so they cannot drift apart. ``transformers``
is imported when a tokenizer is loaded (it needs no torch for tokenizers).
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = [
    "TOKENIZER_FILES",
    "PrefixTokenCache",
    "PromptTooLong",
    "TokenizerError",
    "chat_content_format",
    "check_text_length",
    "encode_prompt",
    "encode_within",
    "load_tokenizer",
    "max_chars_per_token",
    "render_chat",
    "render_chat_text",
]

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


def encode_prompt(
    tokenizer: Any,
    prompt: str | Sequence[int],
    cache: PrefixTokenCache | None = None,
    *,
    add_special_tokens: bool = True,
) -> list[int]:
    """A prompt's token ids: text is encoded (with the tokenizer's special tokens unless
    told otherwise, as vLLM does for a completion), token ids are taken as they are."""
    if isinstance(prompt, str):
        if cache is not None:
            return cache.encode(prompt, add_special_tokens=add_special_tokens)
        return list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
    return list(prompt)


class PromptTooLong(ValueError):
    """A prompt over the model's context, refused in vLLM 0.32's words (``param`` and
    ``value`` as vLLM names them): by its characters, when a text has more than the
    context's tokens times the tokenizer's longest token (``input_text``), or by its tokens
    (``input_tokens``). vLLM tokenizes a text only to one token past the context, so a text
    over it "contains at least" that many; token ids are counted exactly (and said "at
    least" when just one over, as vLLM words it)."""

    def __init__(self, message: str, param: str, value: int) -> None:
        self.param, self.value = param, value
        super().__init__(message)

    @classmethod
    def tokens(cls, limit: int, count: int, *, text: bool) -> PromptTooLong:
        if text:
            count = limit + 1  # vLLM counts a text to its context + 1
        # vLLM cannot tell a prompt of exactly that many from a longer one cut there
        qualifier = "at least " if count == limit + 1 else ""
        return cls(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"contains {qualifier}{count} input tokens, which exceeds "
            f"this limit even without any output tokens. Please reduce the length of the "
            f"input prompt.",
            "input_tokens",
            count,
        )

    @classmethod
    def chars(cls, limit: int, chars: int, bound: int) -> PromptTooLong:
        return cls(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"contains {chars} characters (more than {bound} characters, which is the upper "
            f"bound for {limit} input tokens). Please reduce the length of the input prompt.",
            "input_text",
            chars,
        )


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The characters of the tokenizer's longest vocabulary entry, as vLLM measures it to
    bound a text's length before tokenizing it; None for a tokenizer with no vocabulary."""
    try:
        return _MAX_CHARS[tokenizer]
    except (KeyError, TypeError):
        pass
    get_vocab = getattr(tokenizer, "get_vocab", None)
    most = max(map(len, get_vocab()), default=None) if get_vocab is not None else None
    try:
        _MAX_CHARS[tokenizer] = most
    except TypeError:  # not weakly referable: measured each time
        pass
    return most


_MAX_CHARS: weakref.WeakKeyDictionary[Any, int | None] = weakref.WeakKeyDictionary()


def check_text_length(tokenizer: Any, text: str, limit: int) -> None:
    """Refuse a text longer in characters than ``limit`` tokens of the tokenizer's
    longest entry could be (vLLM's first check, made before tokenizing)."""
    most = max_chars_per_token(tokenizer)
    if most is not None and len(text) > limit * most:
        raise PromptTooLong.chars(limit, len(text), limit * most)


#: a text this many times longer, in characters, than the context is in tokens is counted
#: from its beginning first: a prompt far over the context is refused for the cost of
#: tokenizing about a context's worth of it (and nothing of it is kept), not all of it
CHARS_PER_TOKEN_BOUND = 8


def encode_within(
    tokenizer: Any,
    prompt: str | Sequence[int],
    limit: int | None,
    cache: PrefixTokenCache | None = None,
    *,
    add_special_tokens: bool = True,
) -> list[int]:
    """:func:`encode_prompt`, raising :class:`PromptTooLong` for a prompt of more than
    ``limit`` tokens (``None``: no limit), as vLLM refuses it. A text longer than ``limit``
    times :data:`CHARS_PER_TOKEN_BOUND` characters is tokenized a growing beginning at a
    time, so the work done to refuse it is bounded by the context, not by the text. The
    beginnings are cut anywhere: the count of a beginning may differ from the text's own
    count of those characters by the one token the cut splits, so a beginning must have
    more than ``limit`` + 1 tokens to refuse the text."""
    if limit is None:
        return encode_prompt(tokenizer, prompt, cache, add_special_tokens=add_special_tokens)
    if not isinstance(prompt, str):
        if len(prompt) > limit:
            raise PromptTooLong.tokens(limit, len(prompt), text=False)
        return list(prompt)
    check_text_length(tokenizer, prompt, limit)
    head = limit * CHARS_PER_TOKEN_BOUND
    while len(prompt) > head:
        counted = len(tokenizer.encode(prompt[:head], add_special_tokens=add_special_tokens))
        if counted > limit + 1:
            raise PromptTooLong.tokens(limit, counted, text=True)
        head *= 4
    ids = encode_prompt(tokenizer, prompt, cache, add_special_tokens=add_special_tokens)
    if len(ids) > limit:
        raise PromptTooLong.tokens(limit, len(ids), text=True)
    return ids


def _unwrapped(node: Any) -> Any:
    """What a Jinja expression reads, through filters, tests and slices
    (``messages | reverse``, ``messages[1:]``)."""
    import jinja2.nodes as n

    while True:
        if isinstance(node, n.Filter | n.Test) and node.node is not None:
            node = node.node
        elif isinstance(node, n.Getitem) and isinstance(node.arg, n.Slice):
            node = node.node
        else:
            return node


def _reads(node: Any, names: set[str], key: str | None = None) -> bool:
    """Whether ``node`` is one of ``names`` or, with ``key``, its ``.key`` / ``['key']``."""
    import jinja2.nodes as n

    node = _unwrapped(node)
    if key is None:
        return isinstance(node, n.Name) and node.name in names
    if isinstance(node, n.Getattr):
        return node.attr == key and _reads(node.node, names)
    if isinstance(node, n.Getitem):
        return isinstance(node.arg, n.Const) and node.arg.value == key and _reads(node.node, names)
    return False


def _loops_over(tree: Any, names: set[str], key: str | None = None) -> Iterator[Any]:
    import jinja2.nodes as n

    for loop in tree.find_all(n.For):
        if _reads(loop.iter, names, key):
            yield loop


@lru_cache(maxsize=32)
def chat_content_format(template: str) -> str:
    """How vLLM (0.32) gives a template its messages' content: ``"openai"`` (a list of
    ``{"type": "text", "text": ...}`` parts) when the template loops over a message's
    content, else ``"string"`` (the text parts joined with a newline). The test is the
    template's syntax tree, as vLLM reads it: messages are what ``messages`` (or a name set
    from it) is looped into; a loop over one's ``content`` (or over a name ``content``)
    makes the format "openai". A template that does not parse is taken as "string"."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes as n

    class _Generation(jinja2.ext.Extension):  # transformers' {% generation %} blocks
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return n.Scope(body).set_lineno(lineno)

    env = jinja2.Environment(extensions=[jinja2.ext.loopcontrols, _Generation])
    try:
        tree = env.parse(template)
    except Exception:
        return "string"
    aliases = {"messages"}
    grown = True
    while grown:  # names set from messages, and from those
        grown = False
        for assign in tree.find_all(n.Assign):
            target = assign.target
            if (
                isinstance(target, n.Name)
                and target.name not in aliases
                and _reads(assign.node, aliases)
            ):
                aliases.add(target.name)
                grown = True
    message_names = {
        loop.target.name for loop in _loops_over(tree, aliases) if isinstance(loop.target, n.Name)
    }
    if any(True for _ in _loops_over(tree, message_names, "content")):
        return "openai"
    macro_loops: set[int] = set()
    for macro in tree.find_all(n.Macro):
        # a macro given a message's content (``render(message.content)``, or by keyword):
        # a loop over that parameter inside it is a loop over the content
        params = [arg.name for arg in macro.args]
        given: set[str] = set()
        for call in tree.find_all(n.Call):
            if not (isinstance(call.node, n.Name) and call.node.name == macro.name):
                continue
            given |= {
                params[i]
                for i, arg in enumerate(call.args[: len(params)])
                if _reads(arg, message_names, "content")
            }
            given |= {
                kw.key
                for kw in call.kwargs
                if kw.key in params and _reads(kw.value, message_names, "content")
            }
        for loop in macro.find_all(n.For):
            macro_loops.add(id(loop))
            if given and _reads(loop.iter, given):
                return "openai"
    content_loops = (loop for loop in _loops_over(tree, {"content"}) if id(loop) not in macro_loops)
    return "openai" if any(True for _ in content_loops) else "string"


def _template_text(tokenizer: Any, chat_template: str | None, tools: Any) -> str | None:
    """The template a chat is rendered with: the request's, else the tokenizer's (a named
    set: ``tool_use`` for a request with tools where there is one, else ``default``)."""
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if isinstance(template, dict):
        if tools and "tool_use" in template:
            return template["tool_use"]
        return template.get("default")
    return template if isinstance(template, str) else None


def _text_of(parts: Sequence[Any]) -> list[str]:
    return [
        part if isinstance(part, str) else part["text"]
        for part in parts
        if isinstance(part, str) or "text" in part
    ]


#: the line Claude Code begins its system prompt with: its ``cch`` value changes on every
#: request, so vLLM 0.32 drops the line from system text (a prompt that kept it would miss
#: the prefix cache from there on)
BILLING_HEADER = "x-anthropic-billing-header"


def _without_billing_header(parts: Sequence[Any]) -> list[Any]:
    """System content parts without a leading :data:`BILLING_HEADER` line, as vLLM reads
    them (a part that is only that line goes)."""
    out = []
    for part in parts:
        text = (
            part
            if isinstance(part, str)
            else part.get("text")
            if isinstance(part, Mapping) and part.get("type") == "text"
            else None
        )
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def vllm_conversation(
    messages: Sequence[Mapping[str, Any]], template: str | None, content_format: str = "auto"
) -> list[dict[str, Any]]:
    """Messages as vLLM 0.32 gives them to ``template``, each rebuilt from the keys vLLM
    keeps: ``role`` and ``content``; an assistant's ``tool_calls`` (an empty list dropped)
    and its reasoning, as both ``reasoning`` and ``reasoning_content`` (the request may name
    either); a tool message's ``tool_call_id``; a string ``name`` or ``task``; a developer
    message's ``tools``; a system message's text without Claude Code's billing-header
    line. The content format is ``content_format`` (a vLLM server's
    ``--chat-template-content-format``), or, for ``auto``, the template's. In the "string"
    content format a message's text parts are joined
    with a newline (empty ones left out) and no content is ``""``; in the "openai" format
    content is a list of text parts (a string becomes one), except a tool message's, which
    is joined again. Where the template knows no ``developer`` role, developer messages
    become system messages, all merged into one at the start."""
    if content_format == "auto":  # read from the template, as vLLM does by default
        content_format = chat_content_format(template) if template is not None else "string"
    openai = content_format == "openai"
    out = []
    for m in messages:
        role = m.get("role")
        content = m.get("content")
        parts = [] if content is None else [content] if isinstance(content, str) else content
        if role == "system":
            parts = _without_billing_header(parts)
        msg: dict[str, Any] = {"role": role}
        if openai and role != "tool":
            msg["content"] = [
                {"type": "text", "text": p} if isinstance(p, str) else dict(p) for p in parts
            ]
        else:
            msg["content"] = "\n".join(t for t in _text_of(parts) if t)
        if role == "assistant":
            calls = m.get("tool_calls")
            if calls:
                msg["tool_calls"] = list(calls)
            reasoning = m.get("reasoning")
            if reasoning is None:
                reasoning = m.get("reasoning_content")
            if reasoning is not None:
                msg["reasoning"] = msg["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        for key in ("name", "task"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        if role == "developer":
            msg["tools"] = m.get("tools")
        out.append(msg)
    if template is not None and any(m.get("role") == "developer" for m in out):
        if '"developer"' not in template and "'developer'" not in template:
            out = _developer_as_system(out)
    return out


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    converted = []
    for m in messages:
        if m.get("role") == "developer":
            m = {k: v for k, v in m.items() if k != "tools"}
            m["role"] = "system"
        converted.append(m)
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if not systems or systems == [0]:
        return converted
    texts = []
    for i in systems:
        content = converted[i].get("content")
        text = content if isinstance(content, str) else "\n".join(_text_of(content or []))
        if text:
            texts.append(text)
    rest = [m for m in converted if m["role"] != "system"]
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]


def render_chat_text(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Any] | None = None,
    documents: Sequence[Any] | None = None,
    chat_template: str | None = None,
    content_format: str = "auto",
) -> str:
    """A chat rendered through the model's chat template (or ``chat_template``), with the
    messages and arguments vLLM's OpenAI server gives it (:func:`vllm_conversation`).
    Raises :class:`ValueError` naming ``messages`` when the template refuses them."""
    template = _template_text(tokenizer, chat_template, tools)
    plain = vllm_conversation(messages, template, content_format)
    extra = dict(chat_template_kwargs or {})
    for name, value in (("tools", tools), ("documents", documents)):
        if value is not None:
            extra[name] = value
    if chat_template is not None:
        extra["chat_template"] = chat_template
    try:
        return tokenizer.apply_chat_template(
            plain,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **extra,
        )
    except Exception as exc:  # a template raises whatever Jinja raises
        raise ValueError(f"messages: the chat template failed: {exc}") from None


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    cache: PrefixTokenCache | None = None,
    add_special_tokens: bool = False,
    **template: Any,
) -> list[int]:
    """A chat's token ids through the model's chat template (``template``: ``tools``,
    ``documents``, ``chat_template``, as :func:`render_chat_text` takes them). The
    rendered text is encoded without special tokens unless asked (vLLM's default for
    chat: the template writes them)."""
    text = render_chat_text(
        tokenizer,
        messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        chat_template_kwargs=chat_template_kwargs,
        **template,
    )
    return encode_prompt(tokenizer, text, cache, add_special_tokens=add_special_tokens)


#: texts the cache checks a tokenizer against before it trusts cutting text at a word
_PROBES = (
    "Hello world, it's  fine.\n\nYes: 12345 apples cost $3.50 (or 4 euros) don't they?",
    "You are a helpful assistant.\tAnswer in English; cite sources [1] and [2].\n- a\n- b",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u6771\u4eac and \u0645\u0631\u062d\u0628\u0627"
    " words\r\nmixed   spacing   here",
    "<|im_start|>system\nYou are kvpool's tester.<|im_end|>\n<|im_start|>user\nhi there",
)


class PrefixTokenCache:
    """Token ids of texts that begin like a recently tokenized one, without tokenizing the
    shared beginning again.

    Prompts repeat their beginnings: a system prompt, a document, the turns of a chat so
    far. Tokenizing is most of what the router spends on a request, and the shared part's
    ids are already known. A text is cut at word boundaries (a space after a non-space,
    before a letter: where the byte-level pre-tokenizers of GPT-2, Llama 3, Qwen and
    others always start a new piece, so no token spans the cut); the ids before the last
    such cut inside the longest recently seen beginning (in steps of :attr:`CHUNK`
    characters) are reused and only the rest is tokenized.

    That holds only for tokenizers that cut text this way. Each tokenizer is checked when
    the cache is built, on probe texts cut at every such boundary. One that fails (a BPE
    without a pre-tokenizer, whose pieces cross words, or one that appends an end token)
    is used plainly, and so is any tokenizer without a ``tokenizers`` backend.
    """

    CHUNK = 256
    #: what an entry costs beside its ids: the key's tuple and digest, the value's tuple
    #: and the ordered dict's links, about
    ENTRY_BYTES = 240

    def __init__(self, tokenizer: Any, capacity_bytes: int = 64 * 2**20) -> None:
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.capacity_bytes = capacity_bytes
        # (add_special_tokens, digest of text[:chunk end]) -> (cut, ids of a text, tokens
        # before the cut). The entries of one text share its ids, kept once, 4 bytes each.
        self._entries: OrderedDict[tuple[bool, bytes], tuple[int, array[int], int]] = OrderedDict()
        self._shared: dict[int, list[Any]] = {}  # id(ids) -> [ids, entries holding them]
        #: what the entries and their ids take, in bytes (counted, not measured)
        self.bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        # What the tokenizer puts before a text's own tokens (a BOS), with and without its
        # special tokens: the cache checks it adds nothing after them
        self._prefix: dict[bool, list[int]] = {}
        self.enabled = self.backend is not None and self._cuts_cleanly()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not self.enabled or len(text) < 2 * self.CHUNK:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        keys = self._chunk_keys(text)
        with self._lock:
            hit = None
            for i in range(len(keys) - 1, -1, -1):
                hit = self._entries.get((add_special_tokens, keys[i][1]))
                if hit is not None:
                    self._entries.move_to_end((add_special_tokens, keys[i][1]))
                    break
        if hit is None:
            self.misses += 1
            ids, start, done = list(self._prefix[add_special_tokens]), 0, 0
        else:
            self.hits += 1
            cut, cached, count = hit
            ids, start, done = cached[:count].tolist(), cut, cut + 1
        # Cut the rest at a word start near each chunk's end and tokenize the pieces in one
        # batch: the Rust tokenizer spreads them over its threads, without the GIL, and
        # each cut's token count is the length so far (no offsets to read back).
        cuts = []
        for end, key in keys:
            if end > done:
                b = _word_cut(text, end - 2, max(end - self.CHUNK, done))
                if b is not None:
                    cuts.append((key, b))
        bounds = [start, *(b for _, b in cuts), len(text)]
        pieces = [text[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)]
        encodings = self.backend.encode_batch(pieces, add_special_tokens=False)
        entries = []
        for (key, b), enc in zip(cuts, encodings, strict=False):  # the piece before each cut
            ids += enc.ids
            entries.append(((add_special_tokens, key), (b, len(ids))))
        ids += encodings[-1].ids
        if entries:
            self._keep(entries, ids)
        return ids

    def _keep(
        self, entries: list[tuple[tuple[bool, bytes], tuple[int, int]]], ids: list[int]
    ) -> None:
        """Remember a text's cuts, its ids stored once; the least recently used entries go
        while the whole is over ``capacity_bytes`` (a text too big for it is not kept)."""
        size = self._ids_bytes(len(ids))
        if size + self.ENTRY_BYTES > self.capacity_bytes:
            return
        try:
            stored = array("I", ids)
        except OverflowError:  # an id beyond 32 bits: no tokenizer has one, but then no cache
            return
        with self._lock:
            shared = [stored, 0]
            self._shared[id(stored)] = shared
            self.bytes += size
            for key, (cut, count) in entries:
                old = self._entries.pop(key, None)
                if old is not None:
                    self._release(old[1])
                self._entries[key] = (cut, stored, count)
                shared[1] += 1
                self.bytes += self.ENTRY_BYTES
            while self.bytes > self.capacity_bytes and self._entries:
                self._release(self._entries.popitem(last=False)[1][1])

    @staticmethod
    def _ids_bytes(count: int) -> int:
        """What a text's ids take once kept: 4 bytes an id, and the array's own header."""
        return 4 * count + 64

    def _release(self, ids: array[int]) -> None:
        self.bytes -= self.ENTRY_BYTES
        shared = self._shared[id(ids)]
        shared[1] -= 1
        if not shared[1]:
            del self._shared[id(ids)]
            self.bytes -= self._ids_bytes(len(ids))

    def _chunk_keys(self, text: str) -> list[tuple[int, bytes]]:
        h = hashlib.blake2b(digest_size=16)
        keys = []
        for end in range(self.CHUNK, len(text) + 1, self.CHUNK):
            h.update(text[end - self.CHUNK : end].encode("utf-8", "surrogatepass"))
            keys.append((end, h.copy().digest()))
        return keys

    def _cuts_cleanly(self) -> bool:
        """Whether every word boundary of the probe texts cuts their ids in two."""
        assert self.backend is not None
        self._prefix = {
            special: self.backend.encode("", add_special_tokens=special).ids
            for special in (True, False)
        }
        for text in _PROBES:
            plain = self.backend.encode(text, add_special_tokens=False).ids
            for special in (True, False):
                whole = list(self.tokenizer.encode(text, add_special_tokens=special))
                enc = self.backend.encode(text, add_special_tokens=special)
                if enc.ids != whole or whole != self._prefix[special] + plain:
                    return False
                starts = [o[0] for o in enc.offsets]
                if starts != sorted(starts):
                    return False
                for b in range(1, len(text) - 1):
                    if _word_cut(text, b, b) != b:
                        continue
                    tail = self.backend.encode(text[b:], add_special_tokens=False).ids
                    if whole[: bisect_left(starts, b)] + tail != whole:
                        return False
        return True


def _word_cut(text: str, last: int, first: int) -> int | None:
    """The last position in [first, last] where a word starts after a space: ``text[b]``
    is a space, the character before it is not whitespace and the one after is a letter."""
    for b in range(min(last, len(text) - 2), max(first, 1) - 1, -1):
        if text[b] == " " and text[b + 1].isalpha() and not text[b - 1].isspace():
            return b
    return None
