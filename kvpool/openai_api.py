"""The HTTP contract between clients, the router and workers (contracts 3 and 4).

Request bodies of the OpenAI API as workers and the router accept them (with vLLM's
extensions: ``top_k``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``cache_salt``,
``kv_transfer_params`` ...), the error body, the prefill/decode hand-off parameters, and
the worker's info document. Validation is strict: a wrong type or an unknown field is a
400 that names the field, never a silent default.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "KVEventsInfo",
    "KVTransferParams",
    "OpenAIError",
    "StreamOptions",
    "TokenizeRequest",
    "WorkerInfo",
    "exception_handlers",
    "parse_request",
]

Role = Literal["both", "prefill", "decode"]
M = TypeVar("M", bound=BaseModel)

#: the most alternatives a request may ask for per token (OpenAI's and vLLM's cap)
MAX_LOGPROBS = 20


class OpenAIError(Exception):
    """An error answered with OpenAI's error body and an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
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


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


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


Stop = str | list[str] | None


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_tokens: int = 0
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None  # a 64-bit seed
    stop: Stop = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    kv_transfer_params: KVTransferParams | None = None
    # SGLang's fields, which its router adds to every body it forwards: accepted so that it
    # can front these workers too. The reasoning ones change nothing here (no reasoning
    # parser); the others are refused unless they ask for what is done anyway.
    no_stop_trim: bool = False
    return_hidden_states: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True

    def unsupported(self) -> tuple[str, str] | None:
        """The first accepted-but-unsupported setting, as (field, why)."""
        if self.no_stop_trim:
            return "no_stop_trim", "use include_stop_str_in_output to keep the stop string"
        if self.return_hidden_states:
            return "return_hidden_states", "hidden states are not returned"
        if self.n != 1:
            return "n", "only n=1 is supported; send the request again for more choices"
        if self.presence_penalty or self.frequency_penalty:
            field = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            return field, "penalties are not supported"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed with stream=true"
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            return "stream_options", "continuous_usage_stats is not supported"
        return None


Prompt = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    continue_final_message: bool = False  # SGLang's router sends it with every request

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "only best_of=1 is supported"
        if self.continue_final_message:
            return "continue_final_message", "continue_final_message applies to chat requests"
        return super().unsupported()


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs=true"
        if self.continue_final_message and self.add_generation_prompt:
            return (
                "continue_final_message",
                "continue_final_message needs add_generation_prompt=false",
            )
        return super().unsupported()


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
        return model.model_validate_json(body)
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


#: every field name of the request bodies, to tell them from pydantic's union tags
_FIELDS = {
    name
    for m in (
        CompletionRequest,
        ChatCompletionRequest,
        ChatMessage,
        TextPart,
        StreamOptions,
        TokenizeRequest,
        DetokenizeRequest,
        KVTransferParams,
    )
    for name in m.model_fields
}
