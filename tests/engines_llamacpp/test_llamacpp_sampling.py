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
