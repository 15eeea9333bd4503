"""The wire format of a session's KV as engines export and import it on their internal port.

One frame: a 32-byte HMAC-SHA256 of everything after it under the cluster
secret (shared/internal_auth.py), 4 bytes (big-endian) giving the header's
length, the header as JSON, then the engine's own serialisation of the sequence
(llama.cpp's `llama_state_seq_get_data`; empty for the simulated engine, whose
KV is a model). The header says what the state is, whose it is and what it fits:

    {"format": "modelpool-kv/2", "engine": "llama.cpp", "model": "<fingerprint>",
     "session": "<the gateway's session key>", "n_tokens": 812, "tokens": [...], "bytes": 18708480}

An importing engine checks the signature before it parses anything: a frame
some other party made or altered (a forged prefix planted in the cache, or a
state crafted to crash llama.cpp) never reaches the engine.

`bytes` is the KV's size on the wire: the blob's length for a real engine,
the modelled size for the simulated one. The gateway relays frames without
reading them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from typing import Any

FORMAT = "modelpool-kv/2"
MEDIA_TYPE = "application/vnd.modelpool.kv"
_LENGTH = struct.Struct(">I")
_MAC_BYTES = 32


class BadFrame(ValueError):
    """Not a well-formed frame."""


class Incompatible(BadFrame):
    """A well-formed frame from another engine or model: its KV means nothing here."""


class Forged(BadFrame):
    """A frame not signed with this cluster's secret, or altered since."""


def _mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, FORMAT.encode() + body, hashlib.sha256).digest()


def encode(header: dict[str, Any], blob: bytes = b"", *, key: bytes) -> bytes:
    head = json.dumps({"format": FORMAT, **header}, separators=(",", ":")).encode()
    body = _LENGTH.pack(len(head)) + head + blob
    return _mac(key, body) + body


def decode(signed: bytes, *, engine: str, model: str, key: bytes) -> tuple[dict[str, Any], bytes]:
    """The header and blob of a frame, its signature checked first, then its engine and model."""
    if len(signed) < _MAC_BYTES or not hmac.compare_digest(signed[:_MAC_BYTES], _mac(key, signed[_MAC_BYTES:])):
        raise Forged("the KV frame is not signed with this cluster's secret (forged, altered or truncated)")
    frame = signed[_MAC_BYTES:]
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
