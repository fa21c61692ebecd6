"""Multi-LoRA offline: greedy outputs and logprobs equal transformers + PEFT (unmerged), each
adapter alone and all mixed with base-model requests in one generate call (the decode steps with
adapter tokens through the one-call C decoder, which is checked to have run them); refusals."""
from __future__ import annotations

import json
import os

import pytest
import torch
from adapters import ADAPTERS, make_adapter, peft_model
from conftest import hf_greedy, make_model_dir, random_prompts, token_logprobs

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.layers.lora import LoRABatch, lora_shrink_expand

pytest.importorskip("peft")
MAX_NEW = 8


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tmp_path_factory):
    """A tiny model of the family, three adapters of ranks 4 / 8 (rsLoRA) / 16 and an engine."""
    base = make_model_dir(tmp_path_factory.mktemp(request.param), request.param)
    loras = [LoRARequest(f"adapter-{i}", i + 1, make_adapter(base, tmp_path_factory.mktemp(f"a{i}"), *spec, seed=i))
             for i, spec in enumerate(ADAPTERS)]
    llm = LLM(base, enable_lora=True, max_loras=3, max_lora_rank=16, max_num_seqs=16)
    yield base, loras, llm
    llm.shutdown()


def _c_decoder_lora_steps(llm: LLM) -> int:
    """Steps with adapter tokens the one-call C decoder ran (models/cpu_decode.py)."""
    decoder = llm.llm_engine.executor.runner.model.model.fused_decoder
    assert decoder is not None, "the one-call C decoder is off"
    return decoder.lora_steps


def _params(logprobs: bool = True) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0 if logprobs else None)


def test_each_adapter_alone_equals_peft(setup):
    base, loras, llm = setup
    prompts = random_prompts(3, seed=1, lo=4, hi=30)
    for lora in loras:
        ref = peft_model(base, lora.lora_path)
        before = _c_decoder_lora_steps(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(), lora_request=lora, use_tqdm=False)
        assert _c_decoder_lora_steps(llm) - before >= MAX_NEW - 1  # every decode step ran in C
        for prompt, out in zip(prompts, outs):
            gen = out.outputs[0].token_ids
            assert gen == hf_greedy(ref, prompt, MAX_NEW), lora.lora_name
            got = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, gen)])
            torch.testing.assert_close(got, token_logprobs(ref, prompt, gen), atol=1e-4, rtol=0)


def test_mixed_batch_with_base_requests_equals_each_reference(setup):
    """Adapters and the base model in one generate call (one batch per step): each prompt's
    output equals its own reference, and the adapters do change the outputs."""
    import transformers as tf
    base, loras, llm = setup
    prompts = random_prompts(8, seed=2, lo=4, hi=40)
    choice = [loras[i % 3] if i % 4 != 3 else None for i in range(len(prompts))]
    before = _c_decoder_lora_steps(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(False), lora_request=choice,
                        use_tqdm=False)
    assert _c_decoder_lora_steps(llm) - before >= MAX_NEW - 1  # mixed decode steps (3 adapters + base) in C
    refs = {None: tf.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval()}
    refs.update({lora.lora_int_id: peft_model(base, lora.lora_path) for lora in loras})
    differs = 0
    for prompt, lora, out in zip(prompts, choice, outs):
        expected = hf_greedy(refs[lora and lora.lora_int_id], prompt, MAX_NEW)
        assert out.outputs[0].token_ids == expected, lora
        differs += lora is not None and expected != hf_greedy(refs[None], prompt, MAX_NEW)
    assert differs >= 4  # the adapters are not no-ops


def test_beam_search_takes_the_adapter(setup):
    base, loras, llm = setup
    from pagedllm import BeamSearchParams
    prompt = random_prompts(1, seed=3, lo=6, hi=7)[0]
    ref = peft_model(base, loras[1].lora_path)
    with torch.no_grad():
        hf = ref.generate(input_ids=torch.tensor([prompt]), num_beams=2, max_new_tokens=4, min_new_tokens=4,
                          do_sample=False, early_stopping=True, length_penalty=1.0, pad_token_id=0)
    out = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=2, max_tokens=4,
                                                                          ignore_eos=True), lora_request=loras[1])
    assert out[0].sequences[0].tokens[len(prompt):] == hf[0, len(prompt):].tolist()


def test_lora_op_matches_per_token_reference():
    g = torch.Generator().manual_seed(0)
    slots, rank, fan_in, fan_out, tokens = 3, 6, 10, 7, 13
    a, b = torch.randn(slots, rank, fan_in, generator=g), torch.randn(slots, fan_out, rank, generator=g)
    x, y = torch.randn(tokens, fan_in, generator=g), torch.randn(tokens, fan_out, generator=g)
    token_slots = torch.randint(-1, slots, (tokens,), generator=g).numpy()
    batch = LoRABatch()
    batch.set(token_slots, x.device)
    got = lora_shrink_expand(x, y.clone(), a, b, batch)  # adds into its y in place
    want = y.clone()
    for t, s in enumerate(token_slots):
        if s >= 0:
            want[t] += b[s] @ (a[s] @ x[t])
    torch.testing.assert_close(got, want)
    batch.set(torch.full((tokens,), -1).numpy(), x.device)
    assert lora_shrink_expand(x, y, a, b, batch) is y  # base tokens only: nothing runs
    batch.set(torch.full((tokens,), 2).numpy(), x.device)  # one adapter for all: no gather
    torch.testing.assert_close(lora_shrink_expand(x, y.clone(), a, b, batch), y + x @ a[2].T @ b[2].T)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    base = make_model_dir(tmp_path_factory.mktemp("base"), "llama")
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=8)
    yield base, llm, tmp_path_factory
    llm.shutdown()


def _refused(llm, lora: LoRARequest, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate("hello", SamplingParams(max_tokens=1), lora_request=lora, use_tqdm=False)


def test_adapters_that_cannot_run_are_refused_naming_why(small):
    base, llm, tmp = small
    big = make_adapter(base, tmp.mktemp("big"), 16, 16, ["q_proj"])
    _refused(llm, LoRARequest("big", 1, big), r"r=16 exceeds max_lora_rank=8")
    other = make_model_dir(tmp.mktemp("other"), "llama", intermediate_size=96)
    wrong = make_adapter(other, tmp.mktemp("wrong"), 4, 8, ["up_proj"])
    _refused(llm, LoRARequest("wrong", 2, wrong), r"model\.layers\.0\.mlp\.up_proj")
    saved = make_adapter(base, tmp.mktemp("saved"), 4, 8, ["q_proj"], modules_to_save=["lm_head"])
    _refused(llm, LoRARequest("saved", 3, saved), r"modules_to_save")
    embed = make_adapter(base, tmp.mktemp("embed"), 4, 8, ["q_proj", "embed_tokens"])
    _refused(llm, LoRARequest("embed", 4, embed), r"embed_tokens|embedding")
    dora = make_adapter(base, tmp.mktemp("dora"), 4, 8, ["q_proj"], use_dora=True)
    _refused(llm, LoRARequest("dora", 5, dora), r"use_dora")
    _refused(llm, LoRARequest("missing", 6, str(tmp.mktemp("empty"))), r"no adapter_config\.json")
    ok = make_adapter(base, tmp.mktemp("ok"), 4, 8, ["q_proj"])
    llm.generate("hello", SamplingParams(max_tokens=1), lora_request=LoRARequest("ok", 7, ok), use_tqdm=False)
    _refused(llm, LoRARequest("other-name", 7, ok), r"lora_int_id=7 already names adapter 'ok'")
    assert not llm.llm_engine.has_unfinished_requests()


def test_pickled_adapters_are_never_loaded(small):
    base, llm, tmp = small
    path = tmp.mktemp("bin")
    json.dump({"peft_type": "LORA", "r": 4, "lora_alpha": 8}, open(os.path.join(path, "adapter_config.json"), "w"))
    open(os.path.join(path, "adapter_model.bin"), "wb").write(b"not loaded")
    _refused(llm, LoRARequest("bin", 9, str(path)), r"no adapter_model\.safetensors.*never loaded")


def test_lora_arguments_are_checked(llama_dir):
    with pytest.raises(ValueError, match="needs an engine started with enable_lora=True"):
        llm = LLM(llama_dir)
        try:
            llm.generate("hi", lora_request=LoRARequest("a", 1, "/nowhere"), use_tqdm=False)
        finally:
            llm.shutdown()
    for kwargs, match in (({"max_loras": 0}, "max_loras=0"), ({"max_lora_rank": -1}, "max_lora_rank=-1"),
                          ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras=2 must be"),
                          ({"lora_dtype": "int8"}, "lora_dtype='int8'"),
                          ({"pipeline_parallel_size": 2}, "pipeline_parallel_size")):
        with pytest.raises(ValueError, match=match):
            LLM(llama_dir, enable_lora=True, **kwargs)
    with pytest.raises(ValueError, match="lora_int_id=0"):
        LoRARequest("a", 0, "/x")


def test_embed_with_an_adapter_equals_peft_hidden_state(small):
    base, _, tmp = small
    path = make_adapter(base, tmp.mktemp("embed-lora"), 4, 8, ["q_proj", "o_proj", "up_proj"], seed=7)
    ref = peft_model(base, path)
    prompts = random_prompts(2, seed=8, lo=5, hi=20)
    with LLM(base, runner="pooling", enable_lora=True, max_loras=1) as llm:
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts], lora_request=[LoRARequest("e", 1, path), None],
                         use_tqdm=False)
    with torch.no_grad():
        last = ref.base_model.model.model(torch.tensor([prompts[0]])).last_hidden_state[0, -1]
        with ref.disable_adapter():
            plain = ref.base_model.model.model(torch.tensor([prompts[1]])).last_hidden_state[0, -1]
    for out, want in zip(outs, (last, plain)):
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), torch.nn.functional.normalize(want, dim=0),
                                   atol=2e-5, rtol=1e-4)


def test_speculative_decoding_verifies_with_the_adapter(small):
    """n-gram drafts are verified by the target with the request's adapter: outputs unchanged."""
    base, llm, tmp = small
    path = make_adapter(base, tmp.mktemp("spec-lora"), 8, 16, ["q_proj", "v_proj", "down_proj"], seed=9)
    lora = LoRARequest("spec", 11, path)
    prompts = [{"prompt_token_ids": (p * 4)[:40]} for p in random_prompts(3, seed=10, lo=5, hi=9)]  # repetitive
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=lora, use_tqdm=False)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with LLM(base, enable_lora=True, max_loras=1, max_lora_rank=8, speculative_config=spec) as fast:
        got = [o.outputs[0].token_ids for o in fast.generate(prompts, params, lora_request=lora, use_tqdm=False)]
        drafted = {m.name: m.value for m in fast.get_metrics() if not m.labels}
    assert got == want
    assert drafted.get("pagedllm:spec_decode_num_draft_tokens", 0) > 0


def test_slots_the_c_decoder_cannot_read_leave_adapter_steps_to_the_module_path(small):
    """bfloat16 slots on a float32 model: the one-call C decoder runs the base-only steps and never
    an adapter step (which would drop the adapter); the adapter still changes the output."""
    base, llm, tmp = small
    path = make_adapter(base, tmp.mktemp("bf16-lora"), 8, 16, ["q_proj", "down_proj"], seed=12)
    prompt = {"prompt_token_ids": random_prompts(1, seed=13, lo=6, hi=7)[0]}
    params = _params(False)
    with LLM(base, enable_lora=True, max_loras=1, max_lora_rank=8, lora_dtype="bfloat16") as half:
        plain = half.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        tuned = half.generate([prompt], params, lora_request=LoRARequest("h", 1, path), use_tqdm=False)
        assert _c_decoder_lora_steps(half) == 0
    with torch.no_grad():
        want = hf_greedy(peft_model(base, path), prompt["prompt_token_ids"], MAX_NEW)
    assert tuned[0].outputs[0].token_ids == want != plain
