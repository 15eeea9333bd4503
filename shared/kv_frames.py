"""The wire format of a session's KV as engines export and import it on their internal port.

One frame: 4 bytes (big-endian) giving the header's length, the header as
JSON, then the engine's own serialisation of the sequence (llama.cpp's
`llama_state_seq_get_data`; empty for the simulated engine, whose KV is a
model). The header says what the state is and what it fits:

    {"format": "modelpool-kv/1", "engine": "llama.cpp", "model": "<fingerprint>",
     "n_tokens": 812, "tokens": [...], "bytes": 18708480}

`bytes` is the KV's size on the wire: the blob's length for a real engine,
the modelled size for the simulated one. The gateway relays frames without
reading them.
"""

from __future__ import annotations

import json
import struct
from typing import Any

FORMAT = "modelpool-kv/1"
MEDIA_TYPE = "application/vnd.modelpool.kv"
_LENGTH = struct.Struct(">I")


class BadFrame(ValueError):
    """Not a well-formed frame."""


class Incompatible(BadFrame):
    """A well-formed frame from another engine or model: its KV means nothing here."""


def encode(header: dict[str, Any], blob: bytes = b"") -> bytes:
    head = json.dumps({"format": FORMAT, **header}, separators=(",", ":")).encode()
    return _LENGTH.pack(len(head)) + head + blob


def decode(frame: bytes, *, engine: str, model: str) -> tuple[dict[str, Any], bytes]:
    """The header and blob of a frame, checked against the importing engine and model."""
    if len(frame) < _LENGTH.size:
        raise BadFrame("the KV frame is shorter than its length prefix")
    (n,) = _LENGTH.unpack_from(frame)
    if _LENGTH.size + n > len(frame):
        raise BadFrame(f"the KV frame's header claims {n} bytes, but only {len(frame) - _LENGTH.size} follow")
    try:
        header = json.loads(frame[_LENGTH.size : _LENGTH.size + n])
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadFrame(f"the KV frame's header is not JSON: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise BadFrame(f"not a {FORMAT} frame")
    if header.get("engine") != engine:
        raise Incompatible(f"the KV was exported by a {header.get('engine')!r} engine; this one is {engine!r}")
    if header.get("model") != model:
        raise Incompatible(f"the KV belongs to model {header.get('model')!r}; this engine serves {model!r}")
    n_tokens = header.get("n_tokens")
    if not isinstance(n_tokens, int) or n_tokens <= 0:
        raise BadFrame("the KV frame's n_tokens must be a positive integer")
    return header, frame[_LENGTH.size + n :]
