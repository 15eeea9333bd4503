"""The llama.cpp context, through llama-cpp-python's low-level (ctypes) API.

One `LlamaBackend` owns one model and one context. Only the decode thread may
call `decode`, `seq_rm` and the samplers; tokenizing and detokenizing only read
the vocabulary and are safe from any thread.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as llama
import numpy as np

from .requests import SamplingParams
from .scheduler import SeqWork

log = logging.getLogger(__name__)

_backend_init_lock = threading.Lock()
_backend_initialised = False

# ggml log levels: 1 debug, 2 info, 3 warn, 4 error, 5 continuation.
_GGML_WARN, _GGML_ERROR = 3, 4


@llama.llama_log_callback
def _forward_llama_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # llama.cpp logs hundreds of info/debug lines per context; only problems reach our log.
    if level == _GGML_ERROR:
        log.error("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())
    elif level == _GGML_WARN:
        log.warning("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())


def _init_llama_backend() -> None:
    global _backend_initialised
    with _backend_init_lock:
        if not _backend_initialised:
            llama.llama_log_set(_forward_llama_log, ctypes.c_void_p(0))
            llama.llama_backend_init()
            _backend_initialised = True


_logits_address = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(
    ctypes.cast(llama.llama_get_logits, ctypes.c_void_p).value
)
"""`llama_get_logits` returning the buffer's address, and keeping the GIL: the call only puts the rows in batch order
(microseconds), and a GIL dropped mid-step lets the HTTP edge's thread in until it is done."""


class DecodeError(RuntimeError):
    pass


@dataclass(frozen=True)
class LlamaModelConfig:
    model_path: Path
    n_ctx: int
    n_seq_max: int
    n_batch: int = 512
    threads: int = 2


class LlamaBackend:
    def __init__(self, config: LlamaModelConfig) -> None:
        _init_llama_backend()
        self.config = config
        mparams = llama.llama_model_default_params()
        self.model = llama.llama_model_load_from_file(str(config.model_path).encode(), mparams)
        if not self.model:
            raise FileNotFoundError(f"llama.cpp could not load the model at {config.model_path}")
        cparams = llama.llama_context_default_params()
        cparams.n_ctx = config.n_ctx
        cparams.n_batch = config.n_batch
        cparams.n_ubatch = config.n_batch
        cparams.n_seq_max = config.n_seq_max
        cparams.n_threads = config.threads
        cparams.n_threads_batch = config.threads
        # One KV stream per sequence: attention of a sequence only visits its own cells.
        cparams.kv_unified = False
        cparams.no_perf = True
        self.ctx = llama.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            llama.llama_model_free(self.model)
            raise RuntimeError("llama.cpp could not create a context (n_ctx / n_seq_max too large?)")
        self.vocab = llama.llama_model_get_vocab(self.model)
        self.memory = llama.llama_get_memory(self.ctx)
        self.n_vocab = llama.llama_vocab_n_tokens(self.vocab)
        self.n_ctx = llama.llama_n_ctx(self.ctx)
        self.n_ctx_seq = llama.llama_n_ctx_seq(self.ctx)
        self.add_bos = bool(llama.llama_vocab_get_add_bos(self.vocab))
        self._batch = llama.llama_batch_init(config.n_batch, 0, config.n_seq_max)
        self._tok = np.ctypeslib.as_array(self._batch.token, shape=(config.n_batch,))
        self._pos = np.ctypeslib.as_array(self._batch.pos, shape=(config.n_batch,))
        self._nseq = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(config.n_batch,))
        self._logits = np.ctypeslib.as_array(self._batch.logits, shape=(config.n_batch,))
        self._seq_slots = [self._batch.seq_id[i] for i in range(config.n_batch)]
        self._pieces: dict[int, bytes] = {}
        self._output_views: dict[tuple[int, int], np.ndarray] = {}
        """Views of llama.cpp's logits buffer by (address, rows): made once, not on every step."""
        # End-of-generation tokens, read once: asking llama.cpp costs a foreign call on every token decoded.
        self._eog = frozenset(t for t in range(self.n_vocab) if llama.llama_vocab_is_eog(self.vocab, t))
        self._closed = False

    # -- model facts -----------------------------------------------------------
    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(64 * 1024)
        n = llama.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def chat_template(self) -> str | None:
        raw = llama.llama_model_chat_template(self.model, None)
        return raw.decode("utf-8") if raw else None

    def token_text(self, token: int) -> str:
        return self.piece(token, special=True).decode("utf-8", "replace")

    @property
    def bos(self) -> int:
        return llama.llama_vocab_bos(self.vocab)

    @property
    def eos(self) -> int:
        return llama.llama_vocab_eos(self.vocab)

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token takes over all layers (f16 cache)."""
        n_layer = llama.llama_model_n_layer(self.model)
        n_embd = llama.llama_model_n_embd(self.model)
        n_head = max(1, llama.llama_model_n_head(self.model))
        n_head_kv = llama.llama_model_n_head_kv(self.model)
        return n_layer * 2 * (n_embd // n_head) * n_head_kv * 2

    # -- text ------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (llama.llama_token * capacity)()
        n = llama.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:
            capacity = -n
            buf = (llama.llama_token * capacity)()
            n = llama.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int, *, special: bool = False) -> bytes:
        cached = self._pieces.get(token) if not special else None
        if cached is not None:
            return cached
        buf = ctypes.create_string_buffer(64)
        n = llama.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        out = buf.raw[:n]
        if not special:
            self._pieces[token] = out
        return out

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    # -- decoding (decode thread only) -------------------------------------------
    def seq_rm(self, seq_id: int, from_pos: int = 0) -> None:
        if not llama.llama_memory_seq_rm(self.memory, seq_id, from_pos if from_pos > 0 else -1, -1):
            # A partial removal can fail on recurrent models; dropping the whole sequence never does.
            llama.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
            raise DecodeError(f"could not trim sequence {seq_id} to {from_pos} tokens")

    def seq_copy(self, src: int, dst: int) -> None:
        """Make `dst` a copy of `src`. Each sequence has its own KV stream, so llama.cpp copies
        the whole stream buffer at the start of the next llama_decode (cheap next to recomputing)."""
        llama.llama_memory_seq_cp(self.memory, src, dst, -1, -1)

    def export_seq(self, seq_id: int) -> bytes:
        """The state of one sequence (its KV cells and their positions), as llama.cpp serialises it."""
        size = llama.llama_state_seq_get_size(self.ctx, seq_id)
        buf = (ctypes.c_uint8 * size)()
        n = llama.llama_state_seq_get_data(self.ctx, buf, size, seq_id)
        if n == 0:
            raise DecodeError(f"llama.cpp could not export sequence {seq_id}")
        return ctypes.string_at(buf, n)

    def import_seq(self, seq_id: int, state: bytes, n_tokens: int) -> None:
        """Replace sequence `seq_id` with an exported state, keeping its first `n_tokens` positions."""
        llama.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if llama.llama_state_seq_set_data(self.ctx, buf, len(state), seq_id) == 0:
            llama.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
            raise DecodeError("llama.cpp refused the sequence state: it belongs to another model or does not fit")
        # Cells past what the exporter's bookkeeping covers (a trim it had not applied yet) go.
        self.seq_rm(seq_id, n_tokens)

    def apply(self, kv_ops: Sequence[tuple[str, int, int]]) -> None:
        for op, a, b in kv_ops:
            if op == "trim":
                self.seq_rm(a, b)
            elif op == "copy":
                self.seq_copy(a, b)
            else:
                raise ValueError(f"unknown KV operation {op!r}")

    def decode(self, work: Sequence[SeqWork]) -> list[int]:
        """One llama_decode call carrying every sequence's tokens.

        Returns, per work item, the batch index whose logits belong to its last
        token (-1 when it asked for none).
        """
        n = 0
        out_index: list[int] = []
        for item in work:
            k = len(item.tokens)
            if n + k > self.config.n_batch:
                raise DecodeError(f"batch of {n + k} tokens exceeds n_batch {self.config.n_batch}")
            slots = self._seq_slots
            if k == 1:  # a decode token: element writes cost a fraction of slice writes
                self._tok[n] = item.tokens[0]
                self._pos[n] = item.pos0
                self._nseq[n] = 1
                self._logits[n] = 0
                slots[n][0] = item.seq_id
            else:
                self._tok[n : n + k] = item.tokens
                self._pos[n : n + k] = np.arange(item.pos0, item.pos0 + k, dtype=np.int32)
                self._nseq[n : n + k] = 1
                self._logits[n : n + k] = 0
                for i in range(n, n + k):
                    slots[i][0] = item.seq_id
            if item.wants_logits:
                self._logits[n + k - 1] = 1
                out_index.append(n + k - 1)
            else:
                out_index.append(-1)
            n += k
        self._batch.n_tokens = n
        rc = llama.llama_decode(self.ctx, self._batch)
        if rc != 0:
            raise DecodeError(f"llama_decode returned {rc} for a batch of {n} tokens")
        return out_index

    def logits_in_place(self, batch_index: int) -> np.ndarray:
        """The logits row of one batch position of the last decode, where llama.cpp keeps it (valid until the next
        decode; not to be written)."""
        return np.ctypeslib.as_array(llama.llama_get_logits_ith(self.ctx, batch_index), shape=(self.n_vocab,))

    def output_logits(self, n_outputs: int) -> np.ndarray:
        """The last decode's logits, one row per token that asked for them, in batch order (llama.h's contract for
        `llama_get_logits`), where llama.cpp keeps them (valid until the next decode; not to be written).

        One foreign call per step; the numpy view over the buffer is made once per address and row count, since
        making one costs more than the argmax over a row."""
        address = _logits_address(self.ctx)
        if not address:
            raise DecodeError("llama.cpp holds no logits: the last decode produced none")
        view = self._output_views.get((address, n_outputs))
        if view is None:
            if len(self._output_views) >= 4 * self.config.n_seq_max:  # the buffer moved more than once
                self._output_views.clear()
            base = ctypes.cast(address, ctypes.POINTER(ctypes.c_float))
            view = self._output_views[address, n_outputs] = np.ctypeslib.as_array(base, shape=(n_outputs, self.n_vocab))
        return view

    def logits(self, batch_index: int) -> np.ndarray:
        """A copy of the logits row of one batch position of the last decode."""
        return self.logits_in_place(batch_index).copy()

    def new_sampler(self, params: SamplingParams) -> "Sampler":
        return Sampler(self, params)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        llama.llama_batch_free(self._batch)
        llama.llama_free(self.ctx)
        llama.llama_model_free(self.model)


PENALTY_WINDOW = 256
"""Generated tokens the presence/frequency penalties look back over."""


class Sampler:
    """A per-sequence sampler: llama.cpp's chain (top-k, top-p, min-p, temperature, seeded draw, penalties), or, for
    a greedy request without penalties, the argmax of the logits row plus its biases, read in place.

    The chain copies the whole vocabulary into a candidate array on every token (about 250 us for SmolLM2's 49,152
    tokens here, against 15 us for an argmax over the row): per decode step, once per sequence in the batch. The
    greedy path gives the token the chain's greedy sampler would (the first of equal maxima)."""

    def __init__(self, backend: LlamaBackend, params: SamplingParams) -> None:
        self._backend = backend
        self.chain = None
        self._bias: tuple[np.ndarray, np.ndarray] | None = None
        """Greedy path: the biased token ids, ascending, and their summed biases."""
        self._biased: frozenset[int] = frozenset()
        self._only_lowers = False
        """Every bias is <= 0 (a ban, the common use): an unbiased maximum outside the biased tokens stands."""
        penalised = bool(params.presence_penalty or params.frequency_penalty)
        if params.greedy and not penalised:
            if params.logit_bias:
                merged: dict[int, float] = {}
                for token, bias in params.logit_bias:
                    merged[token] = merged.get(token, 0.0) + bias
                tokens = sorted(merged)
                self._bias = (np.array(tokens, dtype=np.intp), np.array([merged[t] for t in tokens], dtype=np.float32))
                self._biased = frozenset(tokens)
                self._only_lowers = all(merged[t] <= 0 for t in tokens)
            return
        self.chain = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())
        if params.logit_bias:
            biases = (llama.llama_logit_bias * len(params.logit_bias))()
            for i, (token, bias) in enumerate(params.logit_bias):
                biases[i].token, biases[i].bias = token, bias
            llama.llama_sampler_chain_add(
                self.chain, llama.llama_sampler_init_logit_bias(backend.n_vocab, len(params.logit_bias), biases)
            )
        if penalised:
            # OpenAI's penalties count tokens generated so far; the chain accepts each sampled token.
            llama.llama_sampler_chain_add(
                self.chain,
                llama.llama_sampler_init_penalties(
                    backend.n_vocab, PENALTY_WINDOW, 1.0, params.frequency_penalty, params.presence_penalty
                ),
            )
        if params.greedy:
            llama.llama_sampler_chain_add(self.chain, llama.llama_sampler_init_greedy())
            return
        if params.top_k > 0:
            llama.llama_sampler_chain_add(self.chain, llama.llama_sampler_init_top_k(params.top_k))
        if params.top_p < 1.0:
            llama.llama_sampler_chain_add(self.chain, llama.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0.0:
            llama.llama_sampler_chain_add(self.chain, llama.llama_sampler_init_min_p(params.min_p, 1))
        llama.llama_sampler_chain_add(self.chain, llama.llama_sampler_init_temp(params.temperature))
        seed = params.seed if params.seed is not None else llama.LLAMA_DEFAULT_SEED
        llama.llama_sampler_chain_add(self.chain, llama.llama_sampler_init_dist(seed & 0xFFFFFFFF))

    def sample(self, batch_index: int, row: np.ndarray | None = None) -> int:
        """The token for batch position `batch_index` of the last decode; `row`, when given, is its logits row
        (from `LlamaBackend.output_logits`), spared a lookup."""
        if self.chain is not None:
            return int(llama.llama_sampler_sample(self.chain, self._backend.ctx, batch_index))
        if row is None:
            row = self._backend.logits_in_place(batch_index)
        best = int(row.argmax())
        if self._bias is None or (self._only_lowers and best not in self._biased):
            # A lowered token scores at most its own logit, at most the maximum; a tie keeps the lower id, `best`.
            return best
        tokens, values = self._bias
        if best in self._biased:
            biased = row.copy()  # the row's own maximum is biased: every token's biased logit is needed
            biased[tokens] += values
            return int(biased.argmax())
        # The unbiased maximum stands unless a biased token now exceeds it (or equals it at a lower id).
        scores = row[tokens] + values
        j = int(scores.argmax())
        top, candidate = float(row[best]), int(tokens[j])
        if scores[j] > top or (scores[j] == top and candidate < best):
            return candidate
        return best

    def free(self) -> None:
        if self.chain:
            llama.llama_sampler_free(self.chain)
            self.chain = None
