"""The gateway's own OpenAPI document (`GET /openapi.json`): what its public port serves, and nothing more.

Request bodies are described as the gateway reads them: the fields it routes
by are typed and required, every other field is allowed and passes through to
the engine. `model` lists the aliases the gateway knows when the document is
asked for, so clients and fuzzers reach the engines, not only the 404.
"""

from __future__ import annotations

from typing import Any

from shared.openai_protocol import ErrorResponse, ModelList

ERRORS = {
    "400": "The body is not a request the gateway can route, or the engine refused a field.",
    "401": "An API key is required and was missing or wrong.",
    "404": "No such model.",
    "408": "No slot on an instance freed within the queue timeout.",
    "413": "The body exceeds the gateway's size limit.",
    "429": "The alias's queue is full; see Retry-After.",
    "502": "The instance failed while answering.",
    "503": "No instance could take the request (starting, asleep or unreachable); see Retry-After.",
}


def _error_responses() -> dict[str, Any]:
    return {status: {"description": text, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
            for status, text in ERRORS.items()}


def _completion_path(summary: str, required_field: str, field_schema: dict[str, Any], aliases: list[str]) -> dict[str, Any]:
    model: dict[str, Any] = {"type": "string", "minLength": 1, "description": "A model listed at /v1/models."}
    if aliases:
        model["enum"] = aliases  # the document is made per request: these are the models served right now
    return {
        "post": {
            "summary": summary,
            "security": [{"bearer": []}, {}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object",
                "required": ["model", required_field],
                "properties": {
                    "model": model,
                    required_field: field_schema,
                    "stream": {"type": "boolean", "default": False},
                    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}},
                                       "description": "Only with `stream: true`."},
                },
                "additionalProperties": True,
                "description": "Every other OpenAI field (n, stop, seed, logprobs, response_format, tools, ...) "
                               "passes through to the engine as sent.",
            }}}},
            "responses": {
                "200": {"description": "The engine's answer: JSON, or server-sent events with `stream: true`.",
                        "content": {"application/json": {"schema": {"type": "object"}},
                                    # Each server-sent event, as OpenAPI 3.2 describes an event stream's items.
                                    "text/event-stream": {"schema": {"type": "object", "properties": {
                                        "data": {"type": "string"}, "event": {"type": "string"},
                                        "id": {"type": "string"}, "retry": {"type": "integer"}}}}}},
                **_error_responses(),
            },
        }
    }


def openapi_document(aliases: list[str], require_key: bool) -> dict[str, Any]:
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"type": ["string", "array", "null"]}}, "additionalProperties": True}
    schemas = {
        "ErrorResponse": ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}"),
        "ModelList": ModelList.model_json_schema(ref_template="#/components/schemas/{model}"),
    }
    for model_schema in list(schemas.values()):
        schemas.update(model_schema.pop("$defs", {}))
    return {
        "openapi": "3.1.0",
        "info": {"title": "modelpool gateway", "version": "1",
                 "description": "One OpenAI-compatible endpoint for a pool of llama.cpp and vLLM instances."
                                + (" Every /v1 path needs `Authorization: Bearer <key>`." if require_key else "")},
        "components": {"schemas": schemas, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/v1/chat/completions": _completion_path(
                "Chat completion", "messages", {"type": "array", "minItems": 1, "items": message}, aliases),
            "/v1/completions": _completion_path(
                "Text completion", "prompt", {"anyOf": [
                    {"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
                    {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}]}, aliases),
            "/v1/models": {"get": {
                "summary": "The pool's aliases, with their routing state and backends",
                "security": [{"bearer": []}, {}],
                "responses": {"200": {"description": "The aliases.", "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/ModelList"}}}},
                    "401": _error_responses()["401"]},
            }},
            "/health": {"get": {"summary": "The gateway is up", "responses": {"200": {
                "description": "Up, with the log position its view has reached.",
                "content": {"application/json": {"schema": {"type": "object"}}}}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {
                "description": "Text exposition format.", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        },
    }
