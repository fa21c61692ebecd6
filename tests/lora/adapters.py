"""Tiny random PEFT adapters (lora_B non-zero) over the tiny test models, and their references."""
from __future__ import annotations

import torch

# (rank, alpha, targets, use_rslora): different ranks, scalings and targets, fused ones split
ADAPTERS = (
    (4, 8, ["q_proj", "v_proj"], False),
    (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
    (16, 8, ["k_proj", "o_proj", "up_proj", "down_proj"], False),
)


def make_adapter(base_dir: str, out_dir, rank: int, alpha: float, targets: list[str], rslora: bool = False,
                 seed: int = 0, std: float = 0.15, **extra) -> str:
    """A PEFT LoRA adapter of ``base_dir`` with random A and B (PEFT starts B at zero), saved as safetensors."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model
    base = tf.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                                            lora_dropout=0.0, **extra))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return str(out_dir)


def peft_model(base_dir: str, adapter_dir: str):
    """transformers + PEFT (unmerged), the reference."""
    import transformers as tf
    from peft import PeftModel
    base = tf.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()
