"""The penalties' persistent token histories (layers/penalty_history.py): the sampler's results
equal a fresh sampler's (every history uploaded whole) step after step, and a steady batch
uploads only each row's new tokens."""
from __future__ import annotations

import torch

from pagedllm import SamplingParams
from pagedllm.layers import sampling_inputs
from pagedllm.layers.sampler import Sampler, SamplingRow

VOCAB = 48


def _rows(histories: list[list[int]], params: list[SamplingParams]) -> list[SamplingRow]:
    return [SamplingRow(p, ids, 3, None) for p, ids in zip(params, histories)]


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, repetition_penalty=1.5),
            SamplingParams(temperature=0.7, frequency_penalty=0.8, presence_penalty=0.4),
            SamplingParams(temperature=1.0, top_k=5),  # no penalty: its row still has a history
            SamplingParams(temperature=1.0, frequency_penalty=-0.5, repetition_penalty=0.8)]


def _uploads(monkeypatch) -> list[dict]:
    """The arrays of every upload the sampler makes, by name."""
    calls, real = [], sampling_inputs.to_device
    monkeypatch.setattr(sampling_inputs, "to_device", lambda arrays, device: calls.append(dict(arrays))
                        or real(arrays, device))
    return calls


def test_persistent_histories_equal_whole_uploads_across_steps_and_batch_changes():
    """40 steps (the output capacity grows past 16 and 32 on the device), two batch changes."""
    g = torch.Generator().manual_seed(0)
    params = _params()
    histories = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 3, 9, 4)]
    persistent = Sampler()
    for step in range(40):
        if step == 12:  # a row finishes: the batch shrinks
            histories, params = histories[1:], params[1:]
        if step == 25:  # a new row joins
            histories, params = histories + [[7, 7, 7, 1]], params + [_params()[0]]
        logits = torch.randn(len(histories), VOCAB, generator=g)
        rows = _rows(histories, params)
        probs, _ = persistent.distributions(logits, rows)
        expected, _ = Sampler().distributions(logits, rows)  # a fresh sampler uploads every history
        torch.testing.assert_close(probs, expected, rtol=0, atol=0)
        for ids in histories:  # each row gains a token (the first row sometimes two, as after a speculation)
            ids += torch.randint(0, VOCAB, (1 + (step % 5 == 0 and ids is histories[0]),), generator=g).tolist()
    assert persistent.penalty_history.rebuilds == 3


def test_a_steady_batch_uploads_only_the_new_tokens(monkeypatch):
    histories = [[4, 5, 6, 1, 2], [9, 9, 8], [3, 3, 3, 3, 3, 3, 3]]
    rows = _rows(histories, _params()[:3])
    sampler = Sampler()
    uploads = _uploads(monkeypatch)
    for _ in range(6):
        sampler(torch.randn(3, VOCAB), rows)
        for ids in histories:
            ids.append(11)
    first, steady = uploads[0], uploads[1:]
    assert "history_output_ids" in first and "history_prompt_ids" in first  # the rebuild
    for arrays in steady:
        assert not any(k.endswith(("output_ids", "prompt_ids", "prompt_mask", "output_mask")) for k in arrays)
        assert arrays["history_new_ids"].tolist() == [11, 11, 11]
        assert arrays["history_new_at"].shape == (2, 3)
    assert sampler.penalty_history.rebuilds == 1
