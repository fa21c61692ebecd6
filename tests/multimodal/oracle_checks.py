"""Checks shared by the vision-language model tests (LLaVA, Gemma 3, ...): pagedllm's outputs against
transformers' on the same tiny checkpoint."""
from __future__ import annotations

import torch

from pagedllm import LLM, SamplingParams


def vlm_engine(model_dir: str, max_num_batched_tokens: int, max_images: int) -> LLM:
    """The engine a VLM test module shares: a 4 MiB KV cache of 8-token blocks, context 256, the
    step's token budget (where chunk boundaries fall) and up to ``max_images`` images a prompt."""
    return LLM(model=model_dir, max_model_len=256, kv_cache_memory=2**22, max_num_batched_tokens=max_num_batched_tokens,
               block_size=8, limit_mm_per_prompt={"image": max_images})


def assert_preemption_keeps_outputs_exact(model_dir: str, hf, cases: list, max_tokens: int = 24, **engine_kwargs):
    """Generate every ``(prompt, images)`` case in one batch on an engine built with ``engine_kwargs`` (a KV cache
    too small for all of them at once), assert the scheduler preempted, and that each output equals
    transformers' greedy tokens (``hf`` is the oracle's ``(model, processor)``)."""
    engine = LLM(model=model_dir, **engine_kwargs)
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = engine.generate([{"prompt": t, "multi_modal_data": {"image": imgs}} for t, imgs in cases], params,
                               use_tqdm=False)
        assert engine.llm_engine.scheduler.stats.num_preemptions > 0
        model, processor = hf
        for (text, images), out in zip(cases, outs):
            inputs = processor(text=text, images=images, return_tensors="pt")
            with torch.no_grad():
                ref = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
            assert list(out.outputs[0].token_ids) == ref[0, inputs["input_ids"].shape[1]:].tolist(), text
    finally:
        engine.llm_engine.shutdown()
