"""The router's OpenAPI document: the OpenAI endpoints it serves, for tools that read it.

The generation endpoints are plain Starlette routes (FastAPI's per-request dependency
machinery would cost more CPU than the rest of the router's path), so FastAPI cannot see
them; this module describes them. A request body lists the fields the router reads and
allows any other: the router forwards the body as it is, and the worker validates it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["openapi_schema"]

_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}

_STREAM = {
    "stream": {"type": "boolean", "default": False},
    "stream_options": {
        "type": "object",
        "properties": {
            "include_usage": {"type": "boolean"},
            "continuous_usage_stats": {"type": "boolean"},
        },
        "additionalProperties": True,
    },
}
_COMMON = {
    "model": {"type": "string", "description": "a served model or LoRA adapter (/v1/models)"},
    "user": {
        "type": "string",
        "description": "a session key for affinity, with --session-from-user",
    },
    "cache_salt": {"type": "string"},
}
_CHAT_TEMPLATE = {
    "tools": {"type": "array", "items": {"type": "object"}},
    "chat_template_kwargs": {"type": "object"},
    "add_generation_prompt": {"type": "boolean", "default": True},
    "continue_final_message": {"type": "boolean", "default": False},
    "documents": {"type": "array", "items": {"type": "object"}},
}
_TOKENS = {"type": "array", "items": {"type": "integer"}}

_BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {
        "properties": {
            **_COMMON,
            **_STREAM,
            "prompt": {
                "oneOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "string"}},
                    _TOKENS,
                    {"type": "array", "items": _TOKENS},
                ]
            },
            "max_tokens": {"type": "integer"},
        },
        "required": ["prompt"],
    },
    "/v1/chat/completions": {
        "properties": {
            **_COMMON,
            **_STREAM,
            **_CHAT_TEMPLATE,
            "messages": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "properties": {
                        "role": {"type": "string"},
                        "content": {
                            "oneOf": [
                                {"type": "string"},
                                {"type": "array", "items": {"type": "object"}},
                                {"type": "null"},
                            ]
                        },
                        "tool_calls": {"type": "array", "items": {"type": "object"}},
                        "tool_call_id": {"type": "string"},
                    },
                    "required": ["role"],
                },
            },
            "max_completion_tokens": {"type": "integer"},
        },
        "required": ["messages"],
    },
    "/v1/responses": {
        "properties": {
            **_COMMON,
            **_STREAM,
            "input": {
                "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]
            },
            "instructions": {"type": "string"},
            "tools": {"type": "array", "items": {"type": "object"}},
        },
        "required": ["input"],
    },
    "/v1/embeddings": {
        "properties": {**_COMMON, "input": {}},
        "required": ["input"],
    },
    "/tokenize": {"properties": {**_COMMON, "prompt": {"type": "string"}, "messages": {}}},
    "/detokenize": {"properties": {**_COMMON, "tokens": _TOKENS}, "required": ["tokens"]},
}

_SUMMARIES = {
    "/v1/completions": "Text completion, routed to the worker holding most of the prompt",
    "/v1/chat/completions": "Chat completion, routed to the worker holding most of the chat",
    "/v1/responses": "Responses API (vLLM's), routed like a chat",
    "/v1/embeddings": "Embeddings, passed to a healthy worker of the model",
    "/tokenize": "Tokenize, passed to a healthy worker of the model",
    "/detokenize": "Detokenize, passed to a healthy worker of the model",
}

_ERRORS = {
    "400": "Bad request (the router's checks, or the worker's, as it sent it)",
    "404": "Unknown model or adapter",
    "413": "Body too large",
    "429": "Router at its concurrency limit, or every worker overloaded",
    "502": "Every worker tried failed before answering",
    "503": "No worker can take the request",
    "504": "No answer (or first token) before the time limit",
}


def _error_responses() -> dict[str, Any]:
    return {
        code: {
            "description": text,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        for code, text in _ERRORS.items()
    }


def _post(path: str) -> dict[str, Any]:
    body = {"type": "object", "additionalProperties": True, **_BODIES[path]}
    ok: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if "stream" in body["properties"]:
        ok["text/event-stream"] = {"schema": {"type": "string"}}
    return {
        "post": {
            "summary": _SUMMARIES[path],
            "operationId": path.strip("/").replace("/", "_"),
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {"200": {"description": "The worker's answer", "content": ok}}
            | _error_responses(),
        }
    }


def _get(summary: str, media: str = "application/json") -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "responses": {"200": {"description": summary, "content": {media: {"schema": {}}}}},
        }
    }


def openapi_schema(app: Any) -> dict[str, Any]:
    """The document FastAPI serves at ``/openapi.json`` (built once, then cached)."""
    if app.openapi_schema:
        return app.openapi_schema
    paths = {path: _post(path) for path in _BODIES}
    paths["/v1/models"] = _get("Every model and LoRA adapter the workers serve")
    paths["/health"] = _get(
        "200 while at least one worker is in rotation, once the workers known at start are "
        "registered and their KV event history replayed (503 `syncing` until then)"
    )
    paths["/metrics"] = _get("Prometheus metrics (kvpool_router_*)", "text/plain")
    app.openapi_schema = {
        "openapi": "3.1.0",
        "info": {"title": app.title, "version": app.version},
        "paths": paths,
        "components": {"schemas": {"Error": _ERROR}},
    }
    return app.openapi_schema
