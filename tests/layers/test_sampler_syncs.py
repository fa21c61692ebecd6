"""A sampling step makes one device->host transfer and no other host sync (counted on the CPU
by tests/host_syncs.py); the two transfers it uses round-trip every dtype exactly; the grammar
bitmask applied with tensor ops equals xgrammar's own apply."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from host_syncs import count_host_syncs

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.contracts.device_to_host import to_host
from pagedllm.contracts.host_to_device import to_device
from pagedllm.engine import llm_engine, prompt_logprobs
from pagedllm.layers import sampler as sampler_module
from pagedllm.layers import sampling_inputs
from pagedllm.layers.sampler import Sampler, SamplingRow

VOCAB = 64
FETCHES = [(sampler_module, "to_host"), (llm_engine, "to_host")]
UPLOADS = [(sampling_inputs, "to_device"), (prompt_logprobs, "to_device")]


def mixed_rows() -> list[SamplingRow]:
    """Every per-row rule at once: greedy, top-k, top-p, min-p, the three penalties, seeds,
    logprobs, allowed ids, logit bias, bad words and min_tokens' banned ids."""
    gen = lambda seed: torch.Generator().manual_seed(seed)  # noqa: E731
    bad = SamplingParams(temperature=0.7, top_p=0.9, logprobs=2)
    bad.bad_words_token_ids = [[3], [9, 10]]
    params = [(SamplingParams(temperature=0, logprobs=3), None, ()),
              (SamplingParams(temperature=0.8, top_k=5, seed=1), gen(1), (2,)),
              (bad, None, ()),
              (SamplingParams(temperature=1.0, min_p=0.1, presence_penalty=0.5, frequency_penalty=0.3), None, ()),
              (SamplingParams(temperature=0.9, repetition_penalty=1.3, seed=7, logprobs=1), gen(7), ()),
              (SamplingParams(temperature=1.0, allowed_token_ids=[4, 5, 6], logit_bias={5: 3.0}), None, ())]
    history = [1, 9, 10, 9, 4, 4]
    return [SamplingRow(p, history, 2, g, banned) for p, g, banned in params]


@pytest.mark.parametrize("ops", ["native", "triton"])
def test_a_mixed_sampling_step_makes_one_transfer(ops, monkeypatch):
    if ops == "triton":
        pytest.importorskip("triton")
        from pagedllm.layers.triton_ops import sampling as triton_sampling
        kernels = [(triton_sampling, "top_k_top_p_min_p_")]
    else:
        kernels = []
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    with count_host_syncs(monkeypatch, FETCHES, UPLOADS, kernels) as syncs:
        out = Sampler(ops)(logits.clone(), mixed_rows())
    assert syncs.stray == []
    assert (syncs.fetches, syncs.fetch_reads, syncs.uploads) == (1, 1, 1)
    assert syncs.kernels == (ops == "triton")
    assert out.token_ids[0] == int(logits[0].argmax()) and out.token_ids[5] in (4, 5, 6)
    assert out.token_ids[2] not in (3, 10) and out.token_ids[1] != 2
    assert [len(t) for t in out.top_logprobs] == [3, 0, 2, 0, 1, 0]
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs == pytest.approx(raw[torch.arange(6), torch.tensor(out.token_ids)].tolist())


def test_an_all_greedy_step_uploads_nothing_and_fetches_once(monkeypatch):
    rows = [SamplingRow(SamplingParams(temperature=0), [1], 1, None) for _ in range(3)]
    with count_host_syncs(monkeypatch, FETCHES, UPLOADS) as syncs:
        out = Sampler()(torch.randn(3, VOCAB), rows)
    assert syncs.stray == [] and syncs.fetches == 1 and out.top_logprobs is None


def test_engine_steps_fetch_samples_and_prompt_logprobs_in_one_transfer(llama_dir, monkeypatch):
    """Whole engine steps with a grammar row, prompt logprobs and sampled rows: each step's
    sampling epilogue (``LLMEngine._sample``) makes exactly one fetch and no other sync."""
    llm = LLM(llama_dir, block_size=8, num_gpu_blocks_override=64, max_model_len=128)
    params = [SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2, logprobs=1),
              SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3, max_tokens=4, repetition_penalty=1.2),
              SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[ab]+"))]
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10]}, {"prompt_token_ids": [11]}]
    with count_host_syncs(monkeypatch, FETCHES, UPLOADS, armed=False) as syncs:
        syncs.arm_within(monkeypatch, llm_engine.LLMEngine, "_sample")
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert syncs.stray == []
    # one read per fetch, at most one fetch per step (a step whose chunks sample nothing, e.g. while
    # a grammar compiles, fetches nothing)
    assert 4 <= syncs.fetches == syncs.fetch_reads <= syncs.armed_calls
    assert len(outs[0].prompt_logprobs) == 4 and all(len(o.outputs[0].token_ids) == 4 for o in outs[:2])
    assert set(outs[2].outputs[0].text) <= {"a", "b"}
    # the prompt-logprob targets travel in the sampler's upload: at most one upload per step
    assert 4 <= syncs.uploads <= syncs.armed_calls


def test_chosen_logprobs_make_one_upload_and_one_fetch(monkeypatch):
    """Speculative verify's accepted tokens: their logprobs and top logprobs, one copy each way."""
    raw = torch.log_softmax(torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(1)), dim=-1)
    rows = mixed_rows()[:3]  # logprobs 3, None, 2
    with count_host_syncs(monkeypatch, FETCHES, UPLOADS + [(sampler_module, "to_device")]) as syncs:
        logprobs, tops = Sampler.chosen_logprobs(raw, [0, 2, 4], [7, 8, 9], rows)
    assert syncs.stray == [] and (syncs.uploads, syncs.fetches) == (1, 1)
    assert logprobs == pytest.approx(raw[[0, 2, 4], [7, 8, 9]].tolist())
    values, ids = raw[0].topk(3)
    assert tops[0] == pytest.approx(dict(zip(ids.tolist(), values.tolist()))) and tops[1] == {} and len(tops[2]) == 2


@pytest.mark.parametrize("pack", [False, True])
def test_transfers_round_trip_every_dtype(pack):
    arrays = dict(i64=np.arange(5, dtype=np.int64), f32=np.array([[1.5, -2.25]], np.float32),
                  mask=np.array([True, False, True]), i32=np.array([-7], np.int32), empty=np.zeros((0, 3), np.int64),
                  u8=np.array([1, 2, 3], np.uint8))
    dev = to_device(arrays, "cpu", pack=pack)
    back = to_host(dict(dev, strided=torch.arange(10)[::3]))
    for k, a in arrays.items():
        assert back[k].dtype == a.dtype and back[k].shape == a.shape and np.array_equal(back[k], a)
    assert back["strided"].tolist() == [0, 3, 6, 9]
    assert to_host({}) == {}
    with pytest.raises(TypeError, match="'x' has dtype torch.bfloat16"):
        to_host(dict(x=torch.zeros(2, dtype=torch.bfloat16)))


def test_bitmask_applied_with_tensor_ops_equals_xgrammar():
    xgr = pytest.importorskip("xgrammar")
    from pagedllm.structured_output.manager import apply_token_bitmask
    vocab = 70  # not a multiple of 32; the logits have 5 padded columns past it
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32,
                            generator=torch.Generator().manual_seed(0))
    ours, theirs = torch.randn(3, vocab + 5), None
    theirs = ours.clone()
    xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab)
    apply_token_bitmask(ours, bitmask, vocab)
    assert torch.equal(ours, theirs) and torch.isinf(ours).any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bitmask_on_cuda_equals_the_cpu_version_without_a_sync():
    """On CUDA ``apply_token_bitmask`` calls xgrammar's kernel: same result, no host sync."""
    pytest.importorskip("xgrammar")
    from pagedllm.structured_output.manager import apply_token_bitmask
    vocab = 70
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32,
                            generator=torch.Generator().manual_seed(0))
    cpu = torch.randn(3, vocab + 5)
    gpu, gpu_mask = cpu.cuda(), bitmask.cuda()
    apply_token_bitmask(gpu, gpu_mask, vocab)  # warm-up: Triton compiles
    gpu = cpu.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        apply_token_bitmask(gpu, gpu_mask, vocab)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    apply_token_bitmask(cpu, bitmask, vocab)
    assert torch.equal(gpu.cpu(), cpu) and torch.isinf(cpu).any()

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("ops", ["native", "triton"])
def test_a_mixed_sampling_step_syncs_once_on_the_device(ops, monkeypatch):
    """torch's sync debug mode set to "error" raises on any synchronising CUDA call (pageable
    copies included) except inside ``to_host``'s one wait, which this test lets through and counts."""
    from pagedllm.contracts import device_to_host
    waits, wait = [], device_to_host._wait

    def counted_wait(device):
        waits.append(device)
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            wait(device)
        finally:
            torch.cuda.set_sync_debug_mode(mode)
    monkeypatch.setattr(device_to_host, "_wait", counted_wait)
    logits = torch.randn(6, VOCAB, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    sampler = Sampler(ops)
    sampler(logits.clone(), mixed_rows())  # warm-up: Triton compiles, the pinned-memory cache fills
    torch.cuda.synchronize()
    waits.clear()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler(logits.clone(), mixed_rows())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(waits) == 1
    assert out.token_ids[0] == int(logits[0].argmax()) and out.token_ids[5] in (4, 5, 6)


def test_distributions_leave_the_generators_alone():
    """Speculative verification draws from ``distributions``' probs with the request's generator
    itself: computing them must not advance it (nor make sampling noise it never uses)."""
    rows = mixed_rows()
    before = [r.generator.get_state() for r in rows if r.generator is not None]
    probs, _ = Sampler().distributions(torch.randn(len(rows), VOCAB), rows)
    after = [r.generator.get_state() for r in rows if r.generator is not None]
    assert before and all(torch.equal(a, b) for a, b in zip(before, after))
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(len(rows)))
