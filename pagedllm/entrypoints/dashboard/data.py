"""The dashboard's data beside the KV event feed, shared by the server, ``--kv-trace`` and
``pagedllm replay``: the config card, ``/metrics``' samples as JSON, and the SSE framing."""
from __future__ import annotations

import json
import math

from prometheus_client.parser import text_string_to_metric_families

from pagedllm.config import dtype_name
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.plan import load_config, plan_kv

_METRIC_PREFIXES = ("pagedllm:", "vllm:")
_DROPPED_LABELS = ("model_name", "engine")  # the same for every sample of one server


def sse_event(name: str, data) -> str:
    """One named server-sent event with a compact JSON ``data:`` line."""
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def parse_samples(text: str) -> list[list]:
    """``[name, labels, value]`` of a Prometheus text exposition's ``pagedllm:`` / ``vllm:`` samples, named
    without the prefix, each once (``--metrics-names both`` exports most twice)."""
    seen: dict[tuple, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            prefix = next((p for p in _METRIC_PREFIXES if s.name.startswith(p)), None)
            if prefix is None:
                continue
            labels = {k: v for k, v in sorted(s.labels.items()) if k not in _DROPPED_LABELS}
            name = s.name.removeprefix(prefix)
            value = s.value if math.isfinite(s.value) else None  # JSON has no inf / nan
            seen.setdefault((name, tuple(labels.items())), [name, labels, value])
    return list(seen.values())


def build_config_card(engine: LLMEngine) -> dict:
    """Block size, pool sizes, bytes per block, lengths, tiers, dtypes, quantization, parallelism,
    and ``pagedllm plan``'s estimate of the same pool beside what the engine measured."""
    c, ex = engine.config, engine.executor
    bytes_per_block = ex.block_bytes()
    card = {
        "model": c.model.model, "device": str(c.device), "block_size": c.cache.block_size,
        "num_gpu_blocks": ex.num_blocks, "num_cpu_blocks": ex.num_cpu_blocks, "bytes_per_block": bytes_per_block,
        "kv_cache_bytes": ex.num_blocks * bytes_per_block, "max_model_len": c.model.max_model_len,
        "max_num_seqs": c.scheduler.max_num_seqs, "max_num_batched_tokens": c.scheduler.max_num_batched_tokens,
        "dtype": dtype_name(c.model.dtype), "kv_cache_dtype": dtype_name(c.cache.cache_dtype or c.model.dtype),
        "quantization": c.model.quantization, "tensor_parallel_size": c.parallel.tensor_parallel_size,
        "pipeline_parallel_size": c.parallel.pipeline_parallel_size,
        "enable_prefix_caching": c.cache.enable_prefix_caching, "preemption_mode": c.scheduler.preemption_mode,
        "tiers": {"cpu_bytes": c.cache.kv_offload_cpu_bytes, "disk_dir": c.cache.kv_offload_dir,
                  "disk_bytes": c.cache.kv_offload_disk_bytes},
        "speculative": c.speculative is not None,
    }
    card["plan"] = _plan_estimate(c, card)
    return card


def _plan_estimate(c, card: dict) -> dict:
    """``plan_kv`` on the model's config.json for this engine's settings: its bytes per block and
    token, its weights estimate, and how many blocks the engine's measured KV budget holds by it."""
    try:
        plan = plan_kv(load_config(c.model.model), gpu_memory=1 << 50, max_model_len=c.model.max_model_len,
                       block_size=c.cache.block_size, dtype=card["dtype"], kv_cache_dtype=card["kv_cache_dtype"],
                       quantization=c.model.quantization, device="cuda" if c.device.type == "cuda" else "cpu")
    except (ValueError, OSError) as exc:  # a config plan cannot read: the card says why
        return {"error": str(exc)}
    # per rank, as the engine measures it: a rank holds its share of the KV heads (tensor parallel)
    # and of the layers (pipeline parallel)
    per_block = plan.kv_bytes_per_block // (c.parallel.tensor_parallel_size * c.parallel.pipeline_parallel_size)
    return {"bytes_per_block": per_block, "bytes_per_token": plan.kv_bytes_per_token,
            "weights_bytes": plan.weights_bytes, "num_blocks_for_budget": card["kv_cache_bytes"] // per_block}
