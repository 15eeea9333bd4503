"""What the simulated engine answers beyond plain text, in the shapes vLLM's OpenAI server gives.

- `response_format` `json_object` / `json_schema`: the answer is a JSON document
  (for a schema, a small value satisfying its common keywords);
- `tools` with `tool_choice` `required`, a named function, or `auto` after a
  user turn: the answer is one tool call whose arguments satisfy the tool's
  parameter schema (`auto` after a tool result answers in text, as an agent
  loop expects);
- `logprobs` / `top_logprobs`: a log-probability for every token, with the
  asked number of alternatives.

The words are synthetic and say nothing; the JSON is valid and the shapes are
the real API's, so clients that parse them can be tested against the pool.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.engines.simulated.synthetic import FillerText, pieces
from shared.openai_protocol import bad_request

MAX_TOP_LOGPROBS = 20
SCHEMA_DEPTH = 8


@dataclass(frozen=True)
class Shape:
    """An answer the engine does not make up word by word: its tokens, and how it ends."""

    tokens: tuple[str, ...]
    tool_name: str | None = None
    """Set when the answer is a tool call (its arguments are the tokens)."""
    call_id: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.tokens)


def _words(filler: FillerText, seed: int) -> Iterator[str]:
    position = 1
    while True:
        yield filler.token(seed, position).decode().strip()
        position += 1


def schema_instance(schema: Any, words: Iterator[str], depth: int = 0) -> Any:
    """A small value satisfying a JSON schema's common keywords (type, properties, required, items,
    enum, const, default, anyOf / oneOf / allOf, minimum, minLength, minItems)."""
    if not isinstance(schema, Mapping) or depth > SCHEMA_DEPTH:
        return None
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    if "default" in schema:
        return schema["default"]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return schema_instance(schema[key][0], words, depth + 1)
    if schema.get("allOf"):
        merged: dict[str, Any] = {}
        for part in schema["allOf"]:
            if isinstance(part, Mapping):
                merged.update(part)
        return schema_instance(merged, words, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "string"
    if kind == "object":
        properties = schema.get("properties") or {}
        names = schema.get("required") or list(properties)
        return {name: schema_instance(properties.get(name, {}), words, depth + 1) for name in names}
    if kind == "array":
        count = min(max(int(schema.get("minItems", 1)), 1), 3)
        return [schema_instance(schema.get("items", {}), words, depth + 1) for _ in range(count)]
    if kind == "string":
        text = next(words)
        return text.ljust(int(schema.get("minLength", 0)), "x")[: schema.get("maxLength") or None]
    if kind == "integer":
        if "minimum" in schema:
            return int(schema["minimum"])
        return int(schema["exclusiveMinimum"]) + 1 if "exclusiveMinimum" in schema else 1
    if kind == "number":
        return float(schema.get("minimum", 0.5))
    if kind == "boolean":
        return True
    return None


def _json_tokens(value: Any) -> tuple[str, ...]:
    """A JSON document cut into token-sized pieces that join back into it exactly."""
    document = json.dumps(value, separators=(", ", ": "))
    cut = pieces(document)
    return tuple(cut) if "".join(cut) == document else tuple(document[i:i + 4] for i in range(0, len(document), 4))


def _response_format(extra: Mapping[str, Any], words: Iterator[str]) -> Shape | None:
    spec = extra.get("response_format")
    if spec is None:
        return None
    if not isinstance(spec, Mapping) or spec.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("response_format.type must be text, json_object or json_schema", param="response_format")
    if spec["type"] == "text":
        return None
    if spec["type"] == "json_object":
        return Shape(_json_tokens({"answer": " ".join(next(words) for _ in range(6))}))
    schema = (spec.get("json_schema") or {}).get("schema") if isinstance(spec.get("json_schema"), Mapping) else None
    if not isinstance(schema, Mapping):
        raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                          param="response_format.json_schema")
    return Shape(_json_tokens(schema_instance(schema, words)))


def _tool_call(extra: Mapping[str, Any], messages: Sequence[Any], words: Iterator[str], seed: int) -> Shape | None:
    tools = extra.get("tools")
    if not tools:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) and isinstance(t.get("function"), Mapping)
                                              and t["function"].get("name") for t in tools):
        raise bad_request("tools must be a list of {type: function, function: {name, parameters}}", param="tools")
    functions = {t["function"]["name"]: t["function"] for t in tools}
    choice = extra.get("tool_choice", "auto")
    if choice == "none":
        return None
    if choice == "auto":
        last = messages[-1].role if messages else "user"
        if last == "tool":
            return None  # the tool answered: the model answers the user
        name = next(iter(functions))
    elif choice == "required":
        name = next(iter(functions))
    elif isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping):
        name = choice["function"].get("name")
        if name not in functions:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    else:
        raise bad_request("tool_choice must be none, auto, required or {type: function, function: {name}}",
                          param="tool_choice")
    arguments = schema_instance(functions[name].get("parameters") or {"type": "object"}, words)
    return Shape(_json_tokens(arguments), tool_name=name, call_id=f"chatcmpl-tool-{seed:08x}")


def shape_of(extra: Mapping[str, Any], messages: Sequence[Any], filler: FillerText, seed: int) -> Shape | None:
    """The shape a chat request asks for; None for plain text. A malformed ask is the client's 400."""
    words = _words(filler, seed)
    call = _tool_call(extra, messages, words, seed)
    return call if call is not None else _response_format(extra, words)


def top_logprobs(extra: Mapping[str, Any]) -> int | None:
    """How many alternatives per token the request wants, or None for no log-probabilities."""
    if not extra.get("logprobs"):
        return None
    k = extra.get("top_logprobs") or 0
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_TOP_LOGPROBS:
        raise bad_request(f"top_logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}", param="top_logprobs")
    return k


def _logprob(seed: int, position: int, rank: int) -> float:
    spread = zlib.crc32(f"{seed}:{position}:{rank}".encode()) % 1000 / 1000
    return round(-(rank * 1.5 + spread * (1.0 if rank == 0 else 0.5)), 4)


def logprob_entry(token: str, seed: int, position: int, k: int, filler: FillerText) -> dict[str, Any]:
    """One token's `logprobs.content` entry: the token first among its alternatives, as vLLM lists them."""
    alternatives = [{"token": token, "logprob": _logprob(seed, position, 0), "bytes": list(token.encode())}]
    for rank in range(1, k):
        other = filler.token(seed + rank * 13, position).decode()
        alternatives.append({"token": other, "logprob": _logprob(seed, position, rank), "bytes": list(other.encode())})
    return {**alternatives[0], "top_logprobs": alternatives[:k]}
