"""The HTTP contract between clients, the router and workers (contracts 3 and 4).

Request bodies of the OpenAI API as workers accept them, the error body, the
prefill/decode hand-off parameters, and the worker's info document.

A completion or chat body is read as vLLM 0.32's OpenAI server reads it, so that a client
sees the same API whether its pool runs vLLM or kvpool's own (CPU and development) engine:
every field vLLM knows is known and type-checked (a wrong type is a 400 naming the field);
a field it does not know is accepted, logged and ignored, never refused. What kvpool's
engine cannot do of what vLLM can (structured outputs, tool calls, beam search, prompt
log-probabilities ...) is refused with a 400 in vLLM's error shape that names the field
and says so; a value that turns such a feature off is served.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ContentPart",
    "DetokenizeRequest",
    "KVEventsInfo",
    "KVTransferParams",
    "OpenAIError",
    "StreamOptions",
    "TokenizeRequest",
    "Tool",
    "WorkerInfo",
    "exception_handlers",
    "model_not_found",
    "not_in_kvpool",
    "parse_request",
    "vllm_error",
]

log = logging.getLogger(__name__)

Role = Literal["both", "prefill", "decode"]
M = TypeVar("M", bound=BaseModel)

#: the most alternatives a request may ask for per token (OpenAI's and vLLM's cap)
MAX_LOGPROBS = 20
#: temperatures below this are greedy (vLLM's _SAMPLING_EPS; the engine's SAMPLING_EPS)
GREEDY_TEMPERATURE = 1e-5


class OpenAIError(Exception):
    """An error answered with OpenAI's error body and an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | int | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.code, self.param, self.headers = code, param, headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def exception_handlers(log: logging.Logger) -> dict[Any, Callable[..., Any]]:
    """Starlette exception handlers that answer every error in OpenAI's body: an
    :class:`OpenAIError` as it says, an HTTP error (unknown path, wrong method) with its
    status, and a bug as a 500 (logged). Starlette is imported here, when a component that
    serves HTTP asks: the core itself needs no web framework."""
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse

    async def openai_error(request: Any, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def http_error(request: Any, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = OpenAIError(
            exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind
        )
        return JSONResponse(err.body(), status_code=exc.status_code)

    async def bug(request: Any, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        err = OpenAIError(
            500,
            f"internal error: {type(exc).__name__}: {exc}",
            type="server_error",
            code="internal_error",
        )
        return JSONResponse(err.body(), status_code=500)

    return {OpenAIError: openai_error, HTTPException: http_error, Exception: bug}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Lenient(BaseModel):
    """A body as vLLM's OpenAI server reads it: each field it knows type-checked as pydantic
    does by default (lax: ``"5"`` is 5 there too), and a field it does not know accepted,
    kept aside (``model_extra``) and ignored (:func:`parse_request` logs its name)."""

    model_config = ConfigDict(extra="allow")


def vllm_error(message: str, param: str | None, value: Any = None) -> OpenAIError:
    """A 400 as vLLM answers it: ``{"type": "BadRequestError", "code": 400, ...}``; with
    ``value``, the message ends as vLLM's validation errors do: ``(parameter=.., value=..)``."""
    if value is not None:
        message += f" (parameter={param}, value={value})"
    return OpenAIError(400, message, type="BadRequestError", code=400, param=param)


def output_over_context(name: str, value: int, limit: int) -> OpenAIError:
    """vLLM 0.32's refusal of a request for more output tokens (``name``: the field the
    request gave) than the whole context, which it gives before reading the prompt."""
    return vllm_error(
        f"{name}={value} cannot be greater than max_model_len={limit}. "
        f"Please request fewer output tokens.",
        name,
        value,
    )


def output_limit(obj: Any, kind: str) -> tuple[str, Any] | None:
    """The output limit a request names and the field it names it by, as vLLM reads it: a
    chat's ``max_completion_tokens`` before its ``max_tokens``; a completion's
    ``max_tokens``; a Responses request's ``max_output_tokens``. ``obj``: the body or the
    parsed request."""
    names = {"completion": ("max_tokens",), "chat": ("max_completion_tokens", "max_tokens")}
    for name in names.get(kind, ("max_output_tokens",)):
        value = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
        if value is not None:
            return name, value
    return None


def model_not_found(model: str, served: list[str]) -> OpenAIError:
    """An unknown model, answered word for word as vLLM 0.32 answers it (404,
    ``NotFoundError``), so that a client sees one refusal whoever gives it."""
    return OpenAIError(
        404,
        f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}.",
        type="NotFoundError",
        code=404,
        param="model",
    )


def not_in_kvpool(param: str, what: str, vllm: str) -> OpenAIError:
    """A field vLLM serves and kvpool's engine does not: a 400 that says so and names the
    field, so that a client knows it asked for something only a vLLM pool gives."""
    return vllm_error(
        f"{what} is not supported by kvpool's engine (the CPU and development engine); "
        f"vLLM supports it{f' ({vllm})' if vllm else ''}",
        param,
    )


class StreamOptions(_Lenient):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class KVTransferParams(BaseModel):
    """vLLM's disaggregated-serving fields. Extra fields (a connector's own) pass through."""

    model_config = ConfigDict(extra="allow")

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_block_ids: list[int] | None = None
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    tp_size: int = 1


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: dict[str, Any] | None = None


#: the most stop strings a request may give (vLLM's VLLM_MAX_STOP_STRINGS, OpenAI's limit)
MAX_STOP_STRINGS = 4
#: the most sequences one prompt may ask for (vLLM's VLLM_MAX_N_SEQUENCES)
MAX_N = 16384
INT64 = Field(ge=-(2**63), le=2**63 - 1)
Stop = str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None
#: the keys of vLLM's ``structured_outputs`` that constrain the output (others tune it)
STRUCTURED_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


class _Sampling(_Lenient):
    """What completions and chat completions share: every field vLLM 0.32 knows of both.
    :meth:`unsupported` refuses what kvpool's engine cannot do; the rest is served, or
    changes nothing here as it changes nothing in vLLM without that feature (``priority``
    under first-come-first-served scheduling, ``watermarking`` without a watermark, the
    render-only ``return_token_offsets`` and ``mm_payload`` ...)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None  # a 64-bit seed
    stop: Stop = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # what fast tokenizers do anyway
    n: int | None = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stream_interval: Annotated[int, Field(ge=1)] | None = None  # chunking is the worker's
    use_beam_search: bool = False
    length_penalty: float = 1.0  # beam search's
    watermarking: bool | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=2**63 - 1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    priority: Annotated[int, INT64] = 0
    request_id: str | None = None
    session_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    routed_experts_prompt_start: Annotated[int, Field(ge=0)] = 0
    return_token_offsets: bool | None = False
    mm_payload: Literal["tensors", "none"] = "tensors"
    return_mm_kwargs: bool | None = None
    cache_salt: str | None = None
    kv_transfer_params: KVTransferParams | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    # SGLang's router adds its own fields to every body it forwards: unknown to vLLM, so
    # ignored, but for this one, which asks for what kvpool does (keep the stop string).
    no_stop_trim: bool = False

    @property
    def choices_per_prompt(self) -> int:
        return 1 if self.n is None else self.n

    def unsupported(self) -> OpenAIError | None:
        """The first setting refused, in vLLM's error shape: a value vLLM refuses too, or
        a feature vLLM has and kvpool's engine has not. A value that turns a feature off
        (``n: 1``, ``logit_bias: {}``, ``response_format: {"type": "text"}``) is served."""
        n = self.choices_per_prompt
        if n < 1:
            return vllm_error(f"n must be at least 1, got {n}.", "n")
        if n > MAX_N:
            return vllm_error(f"n must be at most {MAX_N}, got {n}.", "n")
        if n > 1 and self.temperature is not None and self.temperature < GREEDY_TEMPERATURE:
            return vllm_error(f"n must be 1 when using greedy sampling, got {n}.", "n")
        options = self.stream_options
        if (
            options is not None
            and not self.stream
            and (options.model_fields_set or options.model_extra)
        ):
            return vllm_error(
                "Stream options can only be defined when `stream=True`.", "stream_options"
            )
        if self.cache_salt is not None and (
            not self.cache_salt
            or len(self.cache_salt) > 128
            or _CACHE_SALT_FORBIDDEN & set(self.cache_salt)
        ):
            return vllm_error(
                "Parameter 'cache_salt' must be a non-empty string of at most 128 characters "
                "and must not contain '@', '/', '\\\\', or NUL.",
                "cache_salt",
            )
        if self.logit_bias:
            bad = [k for k in self.logit_bias if not _is_int(k)]
            if bad:
                return vllm_error(
                    "logit_bias contains key(s) that cannot be converted to integer token "
                    f"IDs: {bad!r}",
                    "logit_bias",
                )
        if self.use_beam_search:
            return not_in_kvpool("use_beam_search", "Beam search", "use_beam_search=true")
        rf = self.response_format
        if rf is not None and rf.type != "text":
            return not_in_kvpool(
                "response_format",
                f"response_format {{'type': {rf.type!r}}} (structured outputs)",
                "structured outputs with xgrammar or guidance",
            )
        so = self.structured_outputs
        if so and any(so.get(k) not in (None, False) for k in STRUCTURED_CONSTRAINTS):
            return not_in_kvpool(
                "structured_outputs",
                "structured_outputs (output constrained to a schema, regex, choice or grammar)",
                "with xgrammar or guidance",
            )
        if self.prompt_logprobs is not None:
            return not_in_kvpool(
                "prompt_logprobs", "prompt_logprobs (the log-probabilities of the prompt)", ""
            )
        if self.logprob_token_ids:
            return not_in_kvpool(
                "logprob_token_ids", "logprob_token_ids (log-probabilities of chosen tokens)", ""
            )
        if self.repetition_detection is not None:
            return not_in_kvpool(
                "repetition_detection", "repetition_detection (stopping on repeated n-grams)", ""
            )
        if self.thinking_token_budget is not None and self.thinking_token_budget != -1:
            return not_in_kvpool(
                "thinking_token_budget",
                "thinking_token_budget (a cap on reasoning tokens)",
                "with --reasoning-parser",
            )
        return None

    def logit_bias_ids(self) -> dict[int, float]:
        """The logit bias by token id, each bias clamped to [-100, 100] (as vLLM)."""
        return {int(k): min(100.0, max(-100.0, v)) for k, v in (self.logit_bias or {}).items()}


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


Prompt = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(_Sampling):
    prompt: Prompt | None = None
    prompt_embeds: bytes | list[bytes] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = False
    suffix: str | None = None
    add_special_tokens: bool = True

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if p is None:
            return []
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt is the whole answer (as vLLM)."""
        return bool(self.echo) and self.max_tokens == 0

    def unsupported(self) -> OpenAIError | None:
        if self.prompt_embeds is not None:
            return not_in_kvpool("prompt_embeds", "prompt_embeds (prompts as embeddings)", "")
        if self.prompt is None:
            return OpenAIError(
                400, "missing required argument: prompt", code="invalid_value", param="prompt"
            )
        if self.max_tokens is not None and self.max_tokens < 1 and not self.echo_only:
            return vllm_error(
                f"max_tokens must be at least 1, got {self.max_tokens}.",
                "max_tokens",
                self.max_tokens,
            )
        if self.suffix is not None:
            if self.echo:
                return vllm_error("Echo is unsupported with suffix.", "suffix")
            return vllm_error(
                "suffix is only supported for models with FIM completion rendering (kvpool's "
                "engine has none; vLLM renders it for models that define one)",
                "suffix",
            )
        if self.echo and self.logprobs is not None:
            # vLLM then returns the prompt's log-probabilities too
            return not_in_kvpool(
                "echo", "echo with logprobs (the log-probabilities of the prompt)", ""
            )
        return super().unsupported()


class ContentPart(_Lenient):
    type: str
    text: str | None = None
    refusal: str | None = None


#: the content parts that are text (the others are images, audio, video or files)
TEXT_PARTS = ("text", "input_text", "output_text", "refusal")


class ChatMessage(_Lenient):
    """A message; fields beyond these (``tool_calls``, ``tool_call_id``, ``reasoning``
    ...) go to the chat template as they are."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _reasoning(cls, data: Any) -> Any:
        # vLLM's name for it since reasoning_content was deprecated
        if isinstance(data, dict) and data.get("reasoning_content") is not None:
            data = dict(data)
            reasoning = data.pop("reasoning_content")
            data.setdefault("reasoning", reasoning)
        return data

    def text(self) -> str:
        """The content as one string: text parts joined by a newline (as vLLM gives it to
        templates that take a string)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join((p.refusal if p.type == "refusal" else p.text) or "" for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message for the chat template (:func:`kvpool.tokenization.render_chat_text`
        shapes its content as vLLM does), a tool call's ``arguments`` the object its JSON
        encodes, as vLLM gives them."""
        m = self.model_dump(exclude_none=True)
        m.setdefault("content", None)
        if isinstance(self.content, list):  # a refusal part's text is its refusal
            m["content"] = [
                {**p, "text": p["refusal"]} if p["type"] == "refusal" else p for p in m["content"]
            ]
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            m["tool_calls"] = [_parsed_arguments(c) for c in calls]
        return m


def _parsed_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            args = json.loads(function["arguments"])
        except (ValueError, RecursionError):
            args = {}
        return {
            **call,
            "function": {**function, "arguments": args if isinstance(args, dict) else {}},
        }
    return call


class FunctionDefinition(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDefinition
    defer_loading: bool | None = None

    def for_template(self) -> dict[str, Any]:
        """The tool as vLLM 0.32 hands it to a template: its known keys in order, a missing
        description or parameters null, ``strict`` and ``defer_loading`` only when given."""
        f = self.function
        function: dict[str, Any] = {
            "name": f.name,
            "description": f.description,
            "parameters": f.parameters,
        }
        defer = f.defer_loading if f.defer_loading is not None else self.defer_loading
        for key, value in (("strict", f.strict), ("defer_loading", defer)):
            if value is not None:
                function[key] = value
        tool: dict[str, Any] = {"type": self.type, "function": function}
        if self.defer_loading is not None:
            tool["defer_loading"] = self.defer_loading
        return tool


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    function: NamedFunction
    type: Literal["function"] = "function"


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | None
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice = "none"
    parallel_tool_calls: bool | None = True  # no tool is ever called here
    reasoning_effort: ReasoningEffort | None = None
    include_reasoning: bool = True  # no reasoning parser: the reasoning is in the content
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    return_prompt_text: bool | None = None

    @property
    def effective_tool_choice(self) -> ToolChoice:
        """``tool_choice`` as vLLM takes it: ``auto`` when tools are given without one."""
        if "tool_choice" not in self.model_fields_set and self.tools:
            return "auto"
        return self.tool_choice

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's extra arguments: the request's own, then what vLLM adds
        (the reasoning effort, and thinking on or off with it)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
            if "enable_thinking" not in (self.chat_template_kwargs or {}):
                kwargs["enable_thinking"] = self.reasoning_effort != "none"
        return kwargs

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.for_template() for t in self.tools] if self.tools else None

    def echoed(self) -> str:
        """What ``echo`` puts before the answer: the last message's content when it is the
        assistant's own (the answer continues it), as vLLM does."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    def unsupported(self) -> OpenAIError | None:
        for i, m in enumerate(self.messages):
            for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
                if part.type not in TEXT_PARTS:
                    return not_in_kvpool(
                        f"messages.{i}.content.{j}",
                        f"A {part.type!r} content part (a multimodal model's input)",
                        "with a multimodal model",
                    )
                if (part.refusal if part.type == "refusal" else part.text) is None:
                    key = "refusal" if part.type == "refusal" else "text"
                    return vllm_error(
                        f"messages.{i}.content.{j}.{key}: a {part.type!r} part needs its {key}",
                        f"messages.{i}.content.{j}.{key}",
                    )
        for name, value in (
            ("max_tokens", self.max_tokens),
            ("max_completion_tokens", self.max_completion_tokens),
        ):
            if value is not None and value < 1:
                return vllm_error(f"{name} must be at least 1, got {value}.", name, value)
        if self.top_logprobs and not self.logprobs:
            return vllm_error(
                "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
            )
        if self.continue_final_message and self.add_generation_prompt:
            return vllm_error(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                "continue_final_message",
            )
        if (
            self.chat_template is not None
            or (self.chat_template_kwargs or {}).get("chat_template") is not None
        ):
            return vllm_error(
                "Chat template is passed with request, but --trust-request-chat-template is "
                "not set. Refused request with untrusted chat template.",
                "chat_template",
            )
        for name in ("mm_processor_kwargs", "media_io_kwargs"):
            if getattr(self, name):
                return not_in_kvpool(
                    name, f"{name} (multimodal processing)", "with a multimodal model"
                )
        refused = self._tool_refusal()
        if refused is not None:
            return refused
        return super().unsupported()

    def _tool_refusal(self) -> OpenAIError | None:
        """vLLM's checks of tools, then what needs a tool-call parser, which kvpool's engine
        has not: only ``tool_choice: "none"`` (or null) is served, the tools listed in the
        prompt by the chat template and the answer text."""
        if self.tools == []:
            return vllm_error(
                "`tools` must not be an empty array. Either provide at least one tool or "
                "omit the field entirely.",
                "tools",
            )
        choice = self.effective_tool_choice
        if choice is None or choice == "none":
            return None
        if not self.tools:
            return vllm_error("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {t.function.name for t in self.tools}:
                return vllm_error(
                    "The tool specified in `tool_choice` does not match any of the specified "
                    "`tools`",
                    "tool_choice",
                )
            what = f'tool_choice={{"function": {{"name": {choice.function.name!r}}}}}'
        else:
            what = f"tool_choice={choice!r}"
        return not_in_kvpool(
            "tool_choice",
            f"{what} (calling tools needs a tool-call parser)",
            "--enable-auto-tool-choice --tool-call-parser; here send tool_choice='none' to "
            "have the tools listed in the prompt and the answer in text",
        )


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class KVEventsInfo(BaseModel):
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    encoding: Literal["array", "map"] = "array"


class WorkerInfo(BaseModel):
    """What a router checks before it trusts a worker's blocks: ``GET /kvpool/info``."""

    served_model_name: str
    engine: Literal["kvpool", "sim", "vllm"]
    role: Role
    block_size: int
    hash_seed: str
    hash_algo: str
    max_model_len: int
    num_blocks: int
    kv_events: KVEventsInfo | None = None
    kv_transfer_engine_id: str
    version: str
    #: the most requests it runs at once (its scheduler's ``max_num_seqs``): a router knows
    #: from the start when its batch is full, not only once it has been seen queueing
    max_num_seqs: int | None = Field(None, ge=1)
    #: new at each start of the worker's process: a router that sees another one at
    #: registration knows the cache it indexed is gone (a release before sends none)
    boot_id: str | None = None


def parse_request(model: type[M], body: bytes) -> M:
    """Validate a JSON body; raise :class:`OpenAIError` (400) naming the first bad field."""
    try:
        parsed = model.model_validate_json(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise OpenAIError(
                400, f"the body is not valid JSON: {err['msg']}", code="invalid_json"
            ) from None
        # Union members add their type to the location (prompt.str): keep field names only.
        loc = err["loc"]
        if err["type"] != "extra_forbidden":  # an unknown field's own name is not in _FIELDS
            loc = tuple(p for p in loc if isinstance(p, int) or p in _FIELDS)
        param = ".".join(str(p) for p in loc) or None
        if err["type"] == "extra_forbidden":
            message = f"unrecognized request argument: {param}"
        elif err["type"] == "missing":
            message = f"missing required argument: {param}"
        else:
            message = f"{param}: {err['msg']}" if param else err["msg"]
            got = repr(err.get("input"))
            if len(got) <= 80:  # say what was sent, when it is short enough to read
                message += f" (got {got})"
        raise OpenAIError(400, message, code="invalid_value", param=param) from None
    if parsed.model_extra:
        _log_ignored(tuple(sorted(parsed.model_extra)))
    return parsed


#: the sets of ignored fields already warned about (each is logged once as a warning, then
#: at debug level: a client that sends one on every request does not flood the log)
_warned: set[tuple[str, ...]] = set()
#: vLLM's guided-decoding fields, removed in vLLM too: ignored, so unconstrained output
_GUIDED = {
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
}


def _log_ignored(names: tuple[str, ...]) -> None:
    level = logging.DEBUG if names in _warned else logging.WARNING
    if len(_warned) < 1024:
        _warned.add(names)
    log.log(
        level, "The following fields were present in the request but ignored: %s", ", ".join(names)
    )
    guided = sorted(_GUIDED.intersection(names))
    if guided:
        log.log(
            level,
            "Request contains the removed guided-decoding field(s) %s, which are ignored; "
            "output will NOT be constrained (structured outputs are vLLM's, not kvpool's "
            "engine's)",
            guided,
        )


#: every field name of the request bodies, to tell them from pydantic's union tags
_FIELDS = {
    name
    for m in (
        CompletionRequest,
        ChatCompletionRequest,
        ChatMessage,
        ContentPart,
        Tool,
        FunctionDefinition,
        NamedToolChoice,
        NamedFunction,
        ResponseFormat,
        StreamOptions,
        TokenizeRequest,
        DetokenizeRequest,
        KVTransferParams,
    )
    for name in m.model_fields
}
