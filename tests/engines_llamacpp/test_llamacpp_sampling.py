"""The greedy sampler reads the logits row in place: it must pick what llama.cpp's own chain picks."""

from __future__ import annotations

import llama_cpp as llama
import numpy as np
import pytest

from services.engines.llamacpp.requests import SamplingParams
from services.engines.llamacpp.scheduler import SeqWork


def chain_pick(backend, batch_index: int, logit_bias: tuple[tuple[int, float], ...]) -> int:  # type: ignore[no-untyped-def]
    """llama.cpp's logit-bias and greedy samplers, the reference."""
    chain = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())
    try:
        if logit_bias:
            biases = (llama.llama_logit_bias * len(logit_bias))()
            for i, (token, bias) in enumerate(logit_bias):
                biases[i].token, biases[i].bias = token, bias
            llama.llama_sampler_chain_add(
                chain, llama.llama_sampler_init_logit_bias(backend.n_vocab, len(logit_bias), biases))
        llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_greedy())
        return int(llama.llama_sampler_sample(chain, backend.ctx, batch_index))
    finally:
        llama.llama_sampler_free(chain)


@pytest.fixture
def logits_of_a_prompt(backend8):  # type: ignore[no-untyped-def]
    prompt = backend8.tokenize("The capital of France is")
    backend8.seq_rm(0, 0)
    (index,) = backend8.decode([SeqWork(0, 0, prompt, 0, True, "prefill")])
    yield index, backend8.logits(index)
    backend8.seq_rm(0, 0)


def test_the_greedy_sampler_picks_what_llama_cpp_s_chain_picks_under_any_bias(backend8, logits_of_a_prompt) -> None:  # type: ignore[no-untyped-def]
    index, row = logits_of_a_prompt
    order = np.argsort(-row, kind="stable")
    top, second, low = int(order[0]), int(order[1]), int(order[-1])
    eog = tuple((t, -100.0) for t in range(backend8.n_vocab) if backend8.is_eog(t))
    cases = {
        "none": (),
        "every end-of-generation token banned": eog,
        "the top token banned": ((top, -100.0),),
        "the top two banned": ((top, -100.0), (second, -100.0)),
        "the least likely token lifted past all": ((low, 100.0),),
        "a lift that falls short": ((second, float(row[top] - row[second]) / 2),),
        "a token named twice, the biases summed": ((top, -60.0), (top, -60.0), (second, -1.0)),
        "banned and lifted at once": (*eog, (top, -100.0), (low, 100.0)),
    }
    for name, bias in cases.items():
        sampler = backend8.new_sampler(SamplingParams(temperature=0.0, logit_bias=bias))
        try:
            assert sampler.chain is None  # the in-place path
            assert sampler.sample(index) == chain_pick(backend8, index, bias), name
        finally:
            sampler.free()
    # The row read in place is left as it was.
    assert np.array_equal(backend8.logits(index), row)


def test_a_tie_goes_to_the_lower_token_id_as_in_llama_cpp(backend8, logits_of_a_prompt) -> None:  # type: ignore[no-untyped-def]
    index, row = logits_of_a_prompt
    top = int(row.argmax())

    def exact_lift(token: int) -> float | None:
        lift = np.float32(row[top]) - np.float32(row[token])
        return float(lift) if np.float32(row[token]) + lift == np.float32(row[top]) else None

    below = next(t for t in range(top - 1, -1, -1) if exact_lift(t) is not None)
    above = next(t for t in range(top + 1, backend8.n_vocab) if exact_lift(t) is not None)
    cases = [
        ((below, exact_lift(below)),),  # a biased token ties the unbiased top from below: it wins
        ((above, exact_lift(above)),),  # from above: the top stays
        ((above, 1e30), (below, 1e30)),  # two biased tokens tie far above everything: the lower wins
    ]
    for bias in cases:
        sampler = backend8.new_sampler(SamplingParams(temperature=0.0, logit_bias=bias))
        try:
            assert sampler.sample(index) == chain_pick(backend8, index, bias)
        finally:
            sampler.free()
    assert [chain_pick(backend8, index, bias) for bias in cases] == [below, top, below]


def test_penalties_and_sampled_decoding_keep_llama_cpp_s_chain(backend8) -> None:  # type: ignore[no-untyped-def]
    for params in (SamplingParams(temperature=0.0, presence_penalty=0.5), SamplingParams(temperature=0.8, seed=1)):
        sampler = backend8.new_sampler(params)
        try:
            assert sampler.chain is not None
        finally:
            sampler.free()


def test_a_step_s_logits_rows_are_those_of_its_outputs_in_batch_order(backend8) -> None:  # type: ignore[no-untyped-def]
    """`output_logits` (one read per step) gives the rows `llama_get_logits_ith` gives per batch index, also when a
    batch mixes prompt chunks without logits, decode tokens and sequences out of id order, and a second step with
    another number of outputs gets its own rows."""
    prompts = {seq: backend8.tokenize(f"Count from {seq} to {seq + 5}:") for seq in (0, 3, 5)}
    for seq in prompts:
        backend8.seq_rm(seq, 0)
    first = [SeqWork(seq, seq, tokens, 0, seq != 3, "prefill") for seq, tokens in prompts.items()]
    out = backend8.decode(first)
    assert out.count(-1) == 1
    rows = backend8.output_logits(2)
    assert [np.array_equal(row, backend8.logits(i)) for row, i in zip(rows, (i for i in out if i >= 0))] == [True, True]
    # The next step: decode tokens on sequences 5 and 0 (in that order), sequence 3 still without logits.
    second = [
        SeqWork(5, 5, [int(rows[1].argmax())], len(prompts[5]), True, "decode"),
        SeqWork(3, 3, [1], len(prompts[3]), False, "prefill"),
        SeqWork(0, 0, [int(rows[0].argmax())], len(prompts[0]), True, "decode"),
    ]
    out = backend8.decode(second)
    rows = backend8.output_logits(2)
    assert np.array_equal(rows[0], backend8.logits(out[0])) and np.array_equal(rows[1], backend8.logits(out[2]))
    assert not np.array_equal(rows[0], rows[1])
    for seq in prompts:
        backend8.seq_rm(seq, 0)
