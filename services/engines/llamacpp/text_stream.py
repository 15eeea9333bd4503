"""Token bytes -> text, with stop sequences that never leak into the output."""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class TextAssembler:
    """Incremental UTF-8 decoding plus stop-sequence detection.

    A suffix of the text that could still grow into a stop sequence is held
    back until it either completes one (and is dropped) or cannot any more (and
    is released), so a streamed answer and a whole answer are the same text.
    """

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = [s for s in stops if s]
        self._held = ""
        self.text = ""
        """All text released so far."""

    def feed(self, piece: bytes) -> tuple[str, bool]:
        """Add one token's bytes; returns (text to release now, whether a stop sequence matched)."""
        pending = self._held + self._decoder.decode(piece)
        if not self._stops:
            self._held = ""
            self.text += pending
            return pending, False
        cut = min((i for i in (pending.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            out = pending[:cut]
            self.text += out
            return out, True
        hold = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(pending)), hold, -1):
                if pending.endswith(stop[:k]):
                    hold = k
                    break
        out = pending[: len(pending) - hold]
        self._held = pending[len(pending) - hold :]
        self.text += out
        return out, False

    def flush(self) -> str:
        """Release what is held back when generation ends without a stop match."""
        out = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        self.text += out
        return out
