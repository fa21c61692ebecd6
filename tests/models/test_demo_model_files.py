"""The bundled demo model (pagedllm/models/demo) is present, small and loadable.

It is produced by scripts/train_demo_model.py; see its README.md.
"""

import json
import struct
from pathlib import Path

import pytest

DEMO_DIR = Path(__file__).resolve().parents[2] / "pagedllm" / "models" / "demo"
TEXT = "In the beginning God created the heaven and the earth."


def test_files_exist():
    for name in ["config.json", "model.safetensors", "generation_config.json",
                 "tokenizer.json", "tokenizer_config.json", "README.md"]:
        assert (DEMO_DIR / name).is_file(), name


def test_weights_small():
    size = (DEMO_DIR / "model.safetensors").stat().st_size
    assert size < 10 * 1024 * 1024, size


def test_config_is_llama():
    cfg = json.loads((DEMO_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["hidden_act"] == "silu"
    assert cfg["hidden_size"] % cfg["num_attention_heads"] == 0
    assert cfg["head_dim"] == cfg["hidden_size"] // cfg["num_attention_heads"]
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert cfg["max_position_embeddings"] >= 512
    assert "rope_theta" in cfg and "rms_norm_eps" in cfg


def test_safetensors_header_matches_config():
    """Parse the safetensors header directly (no torch needed) and check shapes."""
    cfg = json.loads((DEMO_DIR / "config.json").read_text())
    with open(DEMO_DIR / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    emb = header["model.embed_tokens.weight"]
    assert emb["shape"] == [cfg["vocab_size"], cfg["hidden_size"]]
    kv_dim = cfg["num_key_value_heads"] * cfg["head_dim"]
    assert header["model.layers.0.self_attn.k_proj.weight"]["shape"] == [kv_dim, cfg["hidden_size"]]
    n_layers = {k.split(".")[2] for k in header if k.startswith("model.layers.")}
    assert len(n_layers) == cfg["num_hidden_layers"]
    n_params = sum(_numel(v["shape"]) for v in header.values())
    assert 1_000_000 < n_params < 6_000_000, n_params


def _numel(shape):
    out = 1
    for s in shape:
        out *= s
    return out


def test_tokenizer_round_trip():
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(DEMO_DIR))
    assert tok.bos_token == tok.eos_token == "<|endoftext|>"
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_token_id  # bos is prepended, as for Llama
    assert tok.decode(ids, skip_special_tokens=True) == TEXT
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert tok.decode(ids) == TEXT
    assert max(ids) < len(tok)
    assert len(ids) < len(TEXT) // 2  # real BPE merges, not bytes


def test_model_loads_and_runs():
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    tok = transformers.AutoTokenizer.from_pretrained(str(DEMO_DIR))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(DEMO_DIR), dtype=torch.float32)
    enc = tok("And God said", return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (1, enc["input_ids"].shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
