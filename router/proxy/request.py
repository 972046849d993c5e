"""What the router reads of a request body: only what routing needs.

The router is a gateway in front of vLLM and kvpool workers, so it must pass every body
that a worker accepts, including fields it has never heard of. It therefore reads a few
fields (the model, the prompt or messages and everything that shapes their tokens,
``stream``, the session hints), checks only their types, and forwards the body as the
client sent it: refusing a feature is the worker's job.

The prompt is reduced to what the router tokenizes, the way vLLM's OpenAI server does
before its engine sees it:

* chat messages go through the model's chat template with ``tools``, ``documents``,
  ``chat_template``, ``add_generation_prompt``, ``continue_final_message`` and
  ``chat_template_kwargs``; text parts of a message are joined with a newline, and an
  assistant turn's tool-call ``arguments`` (a JSON string on the wire) are given to the
  template as the object they encode;
* content the router cannot tokenize (images, audio, video, files) ends the part of the
  prompt that gets cache credit: its blocks would carry the media's hash in vLLM, and ours
  cannot, so only the text before the first such part is hashed; the text after it, and
  every such part (as the tokens the worker's processor makes of one), still count as
  prompt to prefill;
* a Responses API request (``/v1/responses``) becomes the chat it stands for:
  ``instructions`` a system turn, ``input`` the turns, function calls and their outputs
  assistant tool calls and tool turns;
* a request whose prompt logprobs are asked for reads no prefix cache in vLLM
  (:func:`reads_prefix_cache`): it gets no cache credit anywhere.

Pure functions of the parsed JSON; errors are :class:`~kvpool.openai_api.OpenAIError`
(400) naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

from kvpool.openai_api import OpenAIError, output_limit

__all__ = [
    "MEDIA_SENTINEL",
    "Kind",
    "RoutingFields",
    "parse_body",
    "read_fields",
    "reads_prefix_cache",
]

Kind = Literal["completion", "chat", "responses"]

#: stands in the rendered chat where the first part the router cannot tokenize was
MEDIA_SENTINEL = "\u2063kvpool-media\u2063"

#: content part types that are text
TEXT_PARTS = ("text", "input_text", "output_text", "refusal")


@dataclass
class RoutingFields:
    """The fields of a body the router acts on; the body itself is forwarded unchanged."""

    kind: Kind
    model: str | None
    stream: bool
    #: the client asked for usage on its stream (``stream_options.include_usage``)
    include_usage: bool
    user: str | None = None
    cache_salt: str | None = None
    #: completions: the prompts (text or token ids); the first routes a batch, and each is
    #: prefilled as a request of its own
    prompts: list[str | list[int]] = field(default_factory=list)
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    #: which end ``truncate_prompt_tokens`` keeps: "right" cuts the right (keeps the first
    #: tokens); vLLM's default for generation is "left" (keeps the last)
    truncation_side: str | None = None
    #: chat and responses: the messages as the chat template gets them
    messages: list[dict[str, Any]] = field(default_factory=list)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    #: ``tools``, ``documents``, ``chat_template``: as render_chat_text takes them
    template: dict[str, Any] = field(default_factory=dict)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: the type of the first content part the router cannot tokenize, if any
    media: str | None = None
    #: how many content parts the router cannot tokenize there are (images, audio, ...):
    #: each is prompt the worker prefills, as many tokens as its processor makes of it
    media_parts: int = 0
    #: whether vLLM looks the prompt up in its prefix cache (:func:`reads_prefix_cache`)
    reads_cache: bool = True
    kv_transfer_params: bool = False
    #: Responses API: the stored response this request continues
    previous_response_id: str | None = None
    #: the output limit the request names, as vLLM names it (a chat's
    #: ``max_completion_tokens`` before its ``max_tokens``), and its value
    max_output: tuple[str, int] | None = None
    #: the choices it asks for (``n``; 1 when not given or not readable)
    choices: int = 1


def parse_body(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 that says why not (never a 500: nesting too deep
    for the parser is bad input like any other)."""
    try:
        obj = json.loads(body)
    except RecursionError:
        raise OpenAIError(
            400, "the body is not valid JSON: nested too deeply", code="invalid_json"
        ) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise OpenAIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise OpenAIError(
            400, f"the body must be a JSON object, not {type(obj).__name__}", code="invalid_json"
        )
    return obj


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", code="invalid_value", param=param)


#: scalar fields are read as vLLM's OpenAI server (pydantic, lax) reads them: ``"true"``
#: streams there, ``"5"`` is 5; the body goes on unchanged, so the router must agree
_LAX = {t: TypeAdapter(t) for t in (bool, int, str)}


def _opt(obj: dict[str, Any], name: str, types: type | tuple[type, ...], what: str) -> Any:
    value = obj.get(name)
    if value is None:
        return None
    lax = _LAX.get(types) if isinstance(types, type) else None
    if lax is not None:
        try:
            return lax.validate_python(value)
        except ValidationError as exc:
            raise _validation_error(name, exc) from None
    # bool is an int in Python: a boolean is never a number here
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types)):
        raise _bad(name, f"must be {what} (got {_short(value)})")
    return value


def _validation_error(name: str, exc: ValidationError) -> OpenAIError:
    """A field of the wrong type, refused in the words of vLLM's validation handler (one
    error: the router reads fields one at a time)."""
    err = exc.errors(include_url=False)[0]
    given = err.get("input")
    if isinstance(given, (list, dict)):  # described, not shown, as vLLM does
        shown = f"<{type(given).__name__} of {len(given)} items>"
    else:
        shown = given if isinstance(given, str) else str(given)
        if len(shown) > 200:
            shown = shown[:200] + "...[truncated]"
    entry = {"type": err["type"], "loc": f"body.{name}", "msg": err["msg"], "input": shown}
    return OpenAIError(
        400, f"1 validation error:\n  {entry}", type="Bad Request", code=400, param=f"body.{name}"
    )


def _tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_fields(obj: dict[str, Any], kind: Kind) -> RoutingFields:
    """The routing fields of a parsed body of ``kind``."""
    stream = bool(_opt(obj, "stream", bool, "a boolean"))
    options = _opt(obj, "stream_options", dict, "an object") or {}
    fields = RoutingFields(
        kind=kind,
        model=_opt(obj, "model", str, "a string"),
        stream=stream,
        include_usage=stream and options.get("include_usage") is True,
        user=_opt(obj, "user", str, "a string"),
        cache_salt=_opt(obj, "cache_salt", str, "a string"),
        kv_transfer_params=obj.get("kv_transfer_params") is not None,
        reads_cache=reads_prefix_cache(obj, kind),
    )
    try:
        fields.choices = max(_LAX[int].validate_python(obj.get("n") or 1), 1)
    except ValidationError:
        pass  # the worker's to refuse
    named = output_limit(obj, kind)
    if named is not None:
        try:  # a bad one is the worker's to refuse
            fields.max_output = (named[0], _LAX[int].validate_python(named[1]))
        except ValidationError:
            pass
    if kind == "completion":
        fields.prompts = _prompts(obj)
        fields.add_special_tokens = _flag(obj, "add_special_tokens", True)
        fields.truncate_prompt_tokens = _opt(obj, "truncate_prompt_tokens", int, "an integer")
        fields.truncation_side = _opt(obj, "truncation_side", str, "a string")
        return fields
    if kind == "chat":
        messages = obj.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages", "must be a non-empty list of messages")
        fields.messages, fields.media, fields.media_parts = _messages(messages)
        tools = _tools(_opt(obj, "tools", list, "a list"))
        fields.add_special_tokens = _flag(obj, "add_special_tokens", False)
        fields.truncate_prompt_tokens = _opt(obj, "truncate_prompt_tokens", int, "an integer")
        fields.truncation_side = _opt(obj, "truncation_side", str, "a string")
    else:
        fields.messages, fields.media, fields.media_parts = _responses_input(obj)
        fields.previous_response_id = _opt(obj, "previous_response_id", str, "a string")
        tools = _tools(_responses_tools(_opt(obj, "tools", list, "a list")))
        fields.add_special_tokens = False
    fields.add_generation_prompt = _flag(obj, "add_generation_prompt", True)
    fields.continue_final_message = _flag(obj, "continue_final_message", False)
    kwargs: dict[str, Any] = dict(_opt(obj, "chat_template_kwargs", dict, "an object") or {})
    # The request's own fields win over the same names among its chat_template_kwargs.
    for name in ("add_generation_prompt", "continue_final_message"):
        kwargs.pop(name, None)
    given = {
        "tools": tools,
        "documents": _opt(obj, "documents", list, "a list"),
        "chat_template": _opt(obj, "chat_template", str, "a string"),
    }
    for name, value in given.items():
        if value:
            kwargs[name] = value
        if name in kwargs:
            fields.template[name] = kwargs.pop(name)
    fields.chat_template_kwargs = kwargs
    return fields


def reads_prefix_cache(obj: dict[str, Any], kind: Kind) -> bool:
    """Whether vLLM reads its prefix cache for this body. It does not when it computes the
    prompt's logprobs (``SamplingParams.skip_reading_prefix_cache`` defaults to
    ``prompt_logprobs is not None``: a prefix read from the cache has no logits). A body
    asks for them with ``prompt_logprobs`` (or ``prompt_logprob_token_ids``), or with
    ``echo``, which takes them from a completion's ``logprobs`` (unless null) or a chat's
    ``top_logprobs`` (0, not null, when not given). The worker still writes the prompt's
    blocks; only its hits are none."""
    if obj.get("prompt_logprobs") is not None or obj.get("prompt_logprob_token_ids") is not None:
        return False
    if kind == "responses" or obj.get("echo") is not True:
        return True
    if kind == "completion":
        return obj.get("logprobs") is None
    return "top_logprobs" in obj and obj["top_logprobs"] is None


def _flag(obj: dict[str, Any], name: str, default: bool) -> bool:
    value = _opt(obj, name, bool, "a boolean")
    return default if value is None else value


def _prompts(obj: dict[str, Any]) -> list[str | list[int]]:
    p = obj.get("prompt")
    if isinstance(p, str):
        prompts: list[str | list[int]] = [p]
    elif isinstance(p, list) and p and all(_is_token(t) for t in p):
        prompts = [list(p)]
    elif isinstance(p, list) and p and all(isinstance(t, str) for t in p):
        prompts = list(p)
    elif (
        isinstance(p, list)
        and p
        and all(isinstance(t, list) and all(_is_token(i) for i in t) for t in p)
    ):
        prompts = [list(t) for t in p]
    elif p is None and obj.get("prompt_embeds") is not None:
        return []  # embeddings, not tokens: nothing to hash
    elif p is None:
        raise OpenAIError(
            400, "missing required argument: prompt", code="invalid_value", param="prompt"
        )
    else:
        raise _bad("prompt", "must be a string, a list of strings or a list of token ids")
    if not prompts or not prompts[0]:
        raise _bad("prompt", "must not be empty")
    return prompts


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _messages(messages: list[Any]) -> tuple[list[dict[str, Any]], str | None, int]:
    """The messages as vLLM gives them to a chat template, the type of the first part the
    router cannot tokenize (where :data:`MEDIA_SENTINEL` stands; later ones are left out
    of the text), and how many such parts there are."""
    out: list[dict[str, Any]] = []
    media: str | None = None
    parts = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages.{i}", "must be an object")
        if not isinstance(m.get("role"), str):
            raise _bad(f"messages.{i}.role", "must be a string")
        msg = dict(m)
        msg["content"], first, n = _content(msg.get("content"), f"messages.{i}.content", media)
        media = media or first
        parts += n
        calls = msg.get("tool_calls")
        if isinstance(calls, list):
            msg["tool_calls"] = [_tool_call(c) for c in calls]
        out.append(msg)
    return out, media, parts


def _content(content: Any, param: str, media: str | None) -> tuple[Any, str | None, int]:
    """The content's text parts (rendering joins them with a newline or gives them as a
    list, as vLLM does for the template: :func:`kvpool.tokenization.vllm_conversation`),
    and how many parts are not text. The first untokenizable part of the request becomes a
    text part of the sentinel (``media`` says whether one came before); later ones are left
    out of the text, and only counted."""
    if content is None or isinstance(content, str):
        return content, None, 0
    if not isinstance(content, list):
        raise _bad(param, "must be a string or a list of content parts")
    texts: list[str] = []
    first: str | None = None
    parts = 0
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise _bad(f"{param}.{j}", "must be a content part object")
        kind = part.get("type")
        if kind in TEXT_PARTS:
            text = part.get("text", part.get("refusal"))
            if not isinstance(text, str):
                raise _bad(f"{param}.{j}.text", "must be a string")
            texts.append(text)
            continue
        parts += 1
        if media is None and first is None:
            first = str(kind or "unknown")
            texts.append(MEDIA_SENTINEL)
    return [{"type": "text", "text": t} for t in texts], first, parts


def _tool_call(call: Any) -> Any:
    """vLLM renders a tool call's ``arguments`` as the object its JSON string encodes (the
    templates of Llama 3, Qwen and Hermes expect a mapping); arguments that are not a JSON
    object become an empty one, as there."""
    if not isinstance(call, dict):
        return call
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            args = json.loads(function["arguments"])
        except (ValueError, RecursionError):
            args = {}
        if not isinstance(args, dict):
            args = {}
        return {**call, "function": {**function, "arguments": args}}
    return call


def _tools(tools: list[Any] | None) -> list[Any] | None:
    """Tools as vLLM 0.32 hands them to a template: each parsed into its request model and
    dumped again, so its keys come in the model's order, a missing description or
    parameters is null, ``strict`` and ``defer_loading`` are kept when given (the OpenAI
    SDK sends ``strict``), and other keys are dropped (``tojson`` keeps all of this: it
    changes the tokens). A tool's ``defer_loading`` is its function's when that has none."""
    if not tools:
        return tools
    out = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict):
            out.append(tool)
            continue
        shaped: dict[str, Any] = {
            "name": function.get("name"),
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        defer = tool.get("defer_loading")
        for key, value in (
            ("strict", function.get("strict")),
            ("defer_loading", function.get("defer_loading", defer)),
        ):
            if value is not None:
                shaped[key] = value
        entry: dict[str, Any] = {"type": tool.get("type", "function"), "function": shaped}
        if defer is not None:
            entry["defer_loading"] = defer
        out.append(entry)
    return out


def _responses_input(obj: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None, int]:
    """A Responses API ``input`` (and ``instructions``) as chat messages, and what
    :func:`_messages` says of the parts the router cannot tokenize."""
    messages: list[dict[str, Any]] = []
    instructions = _opt(obj, "instructions", str, "a string")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    given = obj.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
        return messages, None, 0
    if not isinstance(given, list) or not given:
        raise _bad("input", "must be a string or a non-empty list of input items")
    media: str | None = None
    parts = 0
    for i, item in enumerate(given):
        if not isinstance(item, dict):
            raise _bad(f"input.{i}", "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            content, first, n = _content(item.get("content"), f"input.{i}.content", media)
            media = media or first
            parts += n
            messages.append({"role": item.get("role", "user"), "content": content})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            messages.append({"role": "assistant", "content": "", "tool_calls": [_tool_call(call)]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": output if isinstance(output, str) else json.dumps(output),
                }
            )
        elif media is None:  # reasoning, file search results...: text the router cannot place
            media = str(kind)
            messages.append({"role": "user", "content": MEDIA_SENTINEL})
    return messages, media, parts


def _responses_tools(tools: list[Any] | None) -> list[Any] | None:
    """Responses' flat function tools in the chat form templates know."""
    if not tools:
        return tools
    out = []
    for tool in tools:
        if isinstance(tool, dict) and tool.get("type") == "function" and "function" not in tool:
            function = {k: v for k, v in tool.items() if k in ("name", "description", "parameters")}
            out.append({"type": "function", "function": function})
        else:
            out.append(tool)
    return out
