"""Llama family (Llama, Mistral, Qwen2, Qwen3): the plain decoder skeleton, plus the one-call
CPU decoder (models/cpu_decode.py), which computes exactly this family's layer."""
from __future__ import annotations

from pagedllm.attention.backend import AttentionBackend
from pagedllm.models.cpu_decode import FusedCpuDecoder, unsupported_reason
from pagedllm.models.decoder import DecoderForCausalLM, DecoderSpec


class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def check_config(cls, cfg) -> None:
        act = getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):  # SwiGLU is all this family (and the C decoder) computes
            raise ValueError(f"hidden_act={act!r} is not supported: this Llama-family MLP is SwiGLU (silu)")

    @classmethod
    def decoder_spec(cls, cfg) -> DecoderSpec:
        bias = bool(getattr(cfg, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(cfg, "mlp_bias", False)))

    def enable_fused_decode(self, backend: AttentionBackend) -> str | None:
        """Routes small float32 CPU batches through the one-call C decoder once the weights are
        loaded; returns why not, or None when enabled."""
        reason = unsupported_reason(self.model, backend)
        if self.ops == "triton":
            reason = "the model is built for the Triton ops (fused_ops='triton')"
        self.model.fused_decoder = None if reason else FusedCpuDecoder(self.model, backend)
        return reason


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, cfg) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True)  # q/k/v biases always, none on o_proj


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, cfg) -> DecoderSpec:
        bias = bool(getattr(cfg, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, qk_norm="head")
