"""The reference for an fp8 KV cache: transformers' Llama with K rounded to fp8 after rotary and V
after v_proj, at each layer's scale, saturating (the K/V an fp8 cache holds, written out
independently of the engine), checkpoints carrying such per-layer scales, and the test model
whose logits are led by the residual stream rather than by one attention output."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def with_kv_scales(model_dir: str, dst: Path, k_scales: list[float], v_scales: list[float],
                   scalar_k: bool = False) -> str:
    """A copy of the checkpoint at ``dst`` with per-layer ``self_attn.k_scale`` / ``v_scale`` of
    shape ``[1]`` (as compressed-tensors and llm-compressor write them; a list per layer: one per
    KV head, ``[kv_heads, 1, 1]``); ``scalar_k``: K's 0-d, as some vLLM checkpoints have it."""
    shutil.copytree(model_dir, dst)
    state = load_file(str(dst / "model.safetensors"))
    def tensor(scale):  # a list: one scale per KV head, shaped [kv_heads, 1, 1] as compressed-tensors does
        return torch.tensor(scale).reshape(-1, 1, 1) if isinstance(scale, list) else torch.tensor([scale])

    for i, (k, v) in enumerate(zip(k_scales, v_scales)):
        state[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k) if scalar_k else tensor(k)
        state[f"model.layers.{i}.self_attn.v_scale"] = tensor(v)
    save_file(state, str(dst / "model.safetensors"))
    return str(dst)


def with_scaled_embeddings(model_dir: str, dst: Path, factor: float) -> str:
    """A copy of the checkpoint at ``dst`` with ``embed_tokens`` multiplied by ``factor``: the
    residual stream, not one attention output, then carries the logits (why and how much:
    tests/e2e/test_fp8_kv_cache.py's docstring)."""
    shutil.copytree(model_dir, dst)
    state = load_file(str(dst / "model.safetensors"))
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] * factor
    save_file(state, str(dst / "model.safetensors"))
    return str(dst)


def fp8_rounded_transformers(hf, monkeypatch, dtype: torch.dtype, k_scales: list[float], v_scales: list[float]):
    """``hf`` (a Llama) patched in place: layer i's K and V rounded to ``dtype`` at
    ``k_scales[i]`` / ``v_scales[i]`` (a float, or a list with one scale per KV head)."""
    from transformers.models.llama import modeling_llama
    limit, current = torch.finfo(dtype).max, {}

    def rounded(x, scale):
        return (x / scale).clamp(-limit, limit).to(dtype).float() * scale

    def per_head(scale, shape):  # a per-KV-head list of scales broadcast over K [B, kv_heads, T, D]
        return torch.tensor(scale).view(shape) if isinstance(scale, list) else scale

    def round_v(out, scale):  # v_proj's output [B, T, kv_heads * D]: head h's D features take scale[h]
        if isinstance(scale, list):
            scale = torch.tensor(scale).repeat_interleave(out.shape[-1] // len(scale))
        return rounded(out, scale)

    rotary = modeling_llama.apply_rotary_pos_emb

    def rotary_then_round(q, k, cos, sin, *args, **kwargs):
        q, k = rotary(q, k, cos, sin, *args, **kwargs)
        return q, rounded(k, per_head(current["k_scale"], (1, -1, 1, 1)))

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", rotary_then_round)
    for layer, k_scale, v_scale in zip(hf.model.layers, k_scales, v_scales, strict=True):
        layer.self_attn.register_forward_pre_hook(lambda m, a, s=k_scale: current.__setitem__("k_scale", s))
        layer.self_attn.v_proj.register_forward_hook(lambda m, a, out, s=v_scale: round_v(out, s))
    return hf
