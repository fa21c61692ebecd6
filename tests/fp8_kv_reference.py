"""The reference for an fp8 KV cache: transformers' Llama with K rounded to fp8 after rotary and V
after v_proj, at each layer's scale, saturating (the K/V an fp8 cache holds, written out
independently of the engine), and the check of greedy tokens and logprobs against it."""
from __future__ import annotations

import torch
from conftest import hf_greedy

from pagedllm import SamplingParams


def fp8_rounded_transformers(hf, monkeypatch, dtype: torch.dtype, k_scales: list[float], v_scales: list[float]):
    """``hf`` (a Llama) patched in place: layer i's K and V rounded to ``dtype`` at
    ``k_scales[i]`` / ``v_scales[i]``."""
    from transformers.models.llama import modeling_llama
    limit, current = torch.finfo(dtype).max, {}

    def rounded(x, scale):
        return (x / scale).clamp(-limit, limit).to(dtype).float() * scale

    rotary = modeling_llama.apply_rotary_pos_emb

    def rotary_then_round(q, k, cos, sin, *args, **kwargs):
        q, k = rotary(q, k, cos, sin, *args, **kwargs)
        return q, rounded(k, current["k_scale"])

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", rotary_then_round)
    for layer, k_scale, v_scale in zip(hf.model.layers, k_scales, v_scales, strict=True):
        layer.self_attn.register_forward_pre_hook(lambda m, a, s=k_scale: current.__setitem__("k_scale", s))
        layer.self_attn.v_proj.register_forward_hook(lambda m, a, out, s=v_scale: rounded(out, s))
    return hf


def assert_matches_reference(llm, hf, prompts: list[list[int]], max_new: int, logprob_prompts: int = 4) -> None:
    """Greedy tokens equal ``hf``'s on every prompt; logprobs within 1e-4 on the first ``logprob_prompts``."""
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, max_new) for p in prompts]
    for prompt, out in list(zip(prompts, outs))[:logprob_prompts]:
        gen = out.outputs[0].token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + gen])).logits[0]
        ref = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, torch.tensor(gen)[:, None]).squeeze(1)
        got = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, gen)])
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
