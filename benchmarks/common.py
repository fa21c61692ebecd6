"""Shared benchmark helpers: the ~34M-parameter random Llama every CPU benchmark uses."""
from __future__ import annotations

import os

CACHE = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".cache")

BENCH_CONFIG = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                    initializer_range=0.05)


def build_bench_model(name: str = "llama-34m", **overrides) -> str:
    """Builds (once) and returns the directory of a random-weight Llama checkpoint."""
    path = os.path.join(CACHE, name)
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    import torch
    import transformers as tf
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**{**BENCH_CONFIG, **overrides}))
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer(path)
    return path


def _tokenizer(path: str) -> None:
    """A small byte-level BPE tokenizer so the checkpoint loads like any HF model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(path)
