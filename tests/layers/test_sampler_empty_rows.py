"""A row whose constraints allow no token: the sampler returns NO_TOKEN (not token 0, the argmax
of an all -inf row), its distribution is all zeros (not NaN), and the other rows are untouched."""
from __future__ import annotations

import pytest
import torch

from pagedllm.engine.request import make_generator
from pagedllm.layers.sampler import NO_TOKEN, Sampler, SamplingRow
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.rejection_sampler import best, draw, rejection_sample

VOCAB = 32


def _row(temperature: float, seed: int | None = None, **fields) -> SamplingRow:
    params = SamplingParams(temperature=temperature, seed=seed, **fields)
    return SamplingRow(params, [1, 2, 3], 3, make_generator(seed, 0))


def _empty(temperature: float, seed: int | None = None) -> SamplingRow:
    """allowed_token_ids={5} and a one-token bad word 5: nothing left."""
    row = _row(temperature, seed, allowed_token_ids=[5])
    row.params.bad_words_token_ids = [[5]]
    return row


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_empty_row_samples_no_token_and_leaves_the_others_alone(temperature):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    free = [_row(0.0), _row(1.0, seed=7)]
    alone = Sampler()(logits[1:].clone(), [_row(0.0), _row(1.0, seed=7)])
    out = Sampler()(logits.clone(), [_empty(temperature, seed=3), *free])
    assert out.token_ids[0] == NO_TOKEN
    assert out.token_ids[1:] == alone.token_ids


def test_a_banned_id_that_empties_a_row_is_not_sampled():
    """min_tokens' banned EOS over allowed_token_ids=[EOS]: the row is empty, EOS is not emitted."""
    row = _row(1.0, allowed_token_ids=[2])
    row.banned_token_ids = (2,)
    assert Sampler()(torch.randn(1, VOCAB), [row]).token_ids == [NO_TOKEN]


def test_logprobs_of_an_empty_row_do_not_fail():
    row = _empty(0.0)
    row.params.logprobs = 2
    out = Sampler()(torch.randn(2, VOCAB), [row, _row(0.0, logprobs=2)])
    assert out.token_ids[0] == NO_TOKEN and len(out.top_logprobs[1]) == 2


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_distributions_of_an_empty_row_are_zero(temperature):
    probs, _ = Sampler().distributions(torch.randn(2, VOCAB), [_empty(temperature), _row(temperature)])
    assert probs[0].eq(0).all()
    torch.testing.assert_close(probs[1].sum(), torch.tensor(1.0))


def test_draws_from_all_zero_weights_are_no_token():
    zeros = torch.zeros(VOCAB)
    assert draw(zeros, None) == NO_TOKEN and best(zeros) == NO_TOKEN
    one = zeros.clone()
    one[9] = 0.5
    assert draw(one, None) == 9 and best(one) == 9


def test_rejection_sampling_never_emits_a_token_an_empty_row_forbids():
    p = torch.zeros(3, VOCAB)
    assert rejection_sample(p, [4, 5], None, None) == [NO_TOKEN]  # the first draft is rejected
    p[0, 4] = p[1, 5] = 1.0  # both drafts certain, the bonus row empty
    assert rejection_sample(p, [4, 5], None, None) == [4, 5, NO_TOKEN]
    q = torch.full((2, VOCAB), 1.0 / VOCAB)
    p[1] = 0.0
    assert rejection_sample(p, [4, 5], q, None) == [4, NO_TOKEN]  # residual of an empty row


def test_greedy_takes_the_first_of_tied_maxima():
    """Greedy rows take the lowest id among equal maximal logits, as torch.argmax (and
    transformers' greedy search) does."""
    logits = torch.zeros(3, 40)
    logits[0, [7, 3, 30]] = 2.0
    logits[1, [39, 38]] = 1.0
    logits[2] = torch.arange(40.0).flip(0)  # strictly decreasing: id 0
    rows = [SamplingRow(SamplingParams(temperature=0), [], 0, None, ()) for _ in range(3)]
    assert Sampler("native")(logits, rows).token_ids == [3, 38, 0]
