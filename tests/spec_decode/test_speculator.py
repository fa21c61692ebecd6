"""The speculator's back-off: a request whose drafts are all rejected sits out 2, 4, ... steps,
and an accepted draft resets it."""
from __future__ import annotations

import pytest
import torch

from pagedllm.contracts.scheduler_output import ScheduledChunk
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.speculator import Speculator

VOCAB = 512


@pytest.fixture
def speculator(llama_dir):
    config = EngineArgs(model=llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                             "prompt_lookup_min": 1}).create_engine_config()
    return Speculator(config, num_blocks=64, eos_token_ids=frozenset({2}))


def _decoding_request() -> Request:
    """Tokens 5 6 7 5 6 7 5 6, the last one generated and not yet computed."""
    req = Request("r", [5, 6, 7, 5, 6, 7, 5], SamplingParams(temperature=0, max_tokens=100), frozenset({2}))
    req.append_token(6)
    req.num_computed_tokens = req.num_tokens - 1
    return req


def _verify(speculator: Speculator, req: Request, target: int) -> list[int]:
    """Verifies the request's drafts against logits whose argmax is ``target`` at every position."""
    drafts = req.spec_token_ids
    chunk = ScheduledChunk(req.request_id, req.all_token_ids[-1:] + drafts, req.num_tokens - 1, 0, [], 0,
                           num_spec_tokens=len(drafts))
    logits = torch.zeros(len(drafts) + 1, VOCAB)
    logits[:, target] = 10.0
    (run,) = speculator.verify([chunk], logits, {req.request_id: req})
    return run.token_ids


def _steps_without_drafts(speculator: Speculator, req: Request) -> int:
    n = 0
    while True:
        speculator.propose([req])
        if req.spec_token_ids:
            return n
        n += 1


def test_rejected_drafts_back_off_and_an_accepted_one_resets(speculator):
    req = _decoding_request()
    speculator.propose([req])
    assert req.spec_token_ids == [7, 5, 6]
    assert _verify(speculator, req, target=9) == [9]  # nothing accepted
    assert _steps_without_drafts(speculator, req) == 2
    assert _verify(speculator, req, target=9) == [9]
    assert _steps_without_drafts(speculator, req) == 4
    assert _verify(speculator, req, target=7) == [7, 7]  # one accepted: the back-off is over
    assert _steps_without_drafts(speculator, req) == 0
    metrics = {m.name + "".join(m.labels.values()): m.value for m in speculator.metrics()}
    assert metrics["pagedllm:spec_decode_num_drafts"] == 3
    assert metrics["pagedllm:spec_decode_num_draft_tokens"] == 9
    assert metrics["pagedllm:spec_decode_num_accepted_tokens"] == 1
    assert [metrics[f"pagedllm:spec_decode_num_accepted_tokens_per_pos{j}"] for j in range(3)] == [1, 0, 0]


def test_no_drafts_past_max_tokens_or_for_a_prefilling_request(speculator):
    req = _decoding_request()
    req.params.max_tokens = 3  # one output token may follow the next: room for one draft
    speculator.propose([req])
    assert len(req.spec_token_ids) == 1
    req.num_computed_tokens = 0  # prefilling (e.g. recomputing after a preemption)
    speculator.propose([req])
    assert req.spec_token_ids == []
    prompt_only = Request("p", req.all_token_ids, SamplingParams(temperature=0, max_tokens=100), frozenset({2}))
    prompt_only.num_computed_tokens = prompt_only.num_tokens - 1  # a token budget left the prompt's last token
    speculator.propose([prompt_only])
    assert prompt_only.spec_token_ids == []
