"""``pagedllm plan``: how much KV cache fits on a GPU, and why paging helps.

Reads only a model's ``config.json`` (local path or Hugging Face Hub id, via the local
cache) and never loads weights. The arithmetic lives in the pure function
:func:`plan_kv`; :func:`register` / :func:`run` wire it into the ``pagedllm`` CLI and
:func:`main` runs it standalone (``python -m pagedllm.entrypoints.plan --model ...``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.config import (
    ALLOWED_BLOCK_SIZES,
    DTYPES,
    KV_CACHE_DTYPES,
    LORA_DTYPES,
    LoRAConfig,
    check_block_size,
    check_memory_utilization,
    default_max_num_batched_tokens,
    dtype_name,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from pagedllm.kv_cache.planning import kv_bytes, mean_blocks_per_sequence
from pagedllm.layers.quantization import (
    LOAD_TIME_METHODS,
    grouped,
    keeps_cpu_panels,
    mxfp4,
    projection_layout,
    refuse_moe,
)
from pagedllm.layers.quantization import METHODS as QUANTIZATION_METHODS
from pagedllm.layers.quantization import resolve_method as resolve_quantization
from pagedllm.models.loader import DEMO_MODEL_NAME, config_dtype, demo_model_path, looks_like_path
from pagedllm.models.shape import ConfigError, ModelShape, model_shape
from pagedllm.multimodal.encoder_cache import encoder_cache_bytes
from pagedllm.utils import format_size, parse_size

__all__ = [
    "ConfigError",
    "add_arguments",
    "format_plan",
    "KVPlan",
    "ModelShape",
    "count_params",
    "load_config",
    "main",
    "model_shape",
    "plan_kv",
    "register",
    "run",
]

PLAN_DEVICES = ("cuda", "cpu")  # the device planned for: it decides what dtype "auto" means
# Families with a learned absolute position-embedding table.
_LEARNED_POSITIONS = {"gpt2", "gpt_bigcode", "opt"}

def projection_params(shape: ModelShape, active: bool = False) -> int:
    """Parameters of the attention and MLP projection matrices, all layers (what int8 quantizes);
    ``active``: only those one token uses (its top-k experts), the FLOPs-relevant count."""
    h, d = shape.hidden_size, shape.head_dim
    attention = h * shape.num_heads * d * 2 + h * shape.num_kv_heads * d * 2  # q, o + k, v
    if shape.mla is not None:
        attention = shape.mla.attention_params(h, shape.num_heads)
    mlp_mats = 3 if shape.gated_mlp else 2
    if not shape.num_experts:
        return shape.num_layers * (attention + mlp_mats * h * shape.intermediate_size)
    experts = shape.experts_per_token if active else shape.num_experts
    moe = experts * mlp_mats * h * shape.intermediate_size + h * shape.num_experts  # + router
    moe += mlp_mats * h * shape.shared_expert_intermediate_size
    dense = mlp_mats * h * shape.dense_intermediate_size
    return shape.num_layers * attention + shape.num_moe_layers * moe + (shape.num_layers - shape.num_moe_layers) * dense


def linear_shapes(shape: ModelShape) -> list[tuple[int, int, int]]:
    """``(out, in, count)`` of the linear layers the engine builds, all layers: q/k/v fused, gate/up
    fused, MoE routers and shared experts (the routed experts are FusedMoE tensors, not linears)."""
    h, d, n = shape.hidden_size, shape.head_dim, shape.num_layers
    attention = [((shape.num_heads + 2 * shape.num_kv_heads) * d, h, n), (h, shape.num_heads * d, n)]
    if shape.mla is not None:
        attention = [(out, in_, n) for out, in_ in shape.mla.linear_shapes(h, shape.num_heads)]

    def mlp(inter: int, count: int) -> list[tuple[int, int, int]]:
        if not inter or not count:
            return []
        return [((2 if shape.gated_mlp else 1) * inter, h, count), (h, inter, count)]
    if not shape.num_experts:
        return attention + mlp(shape.intermediate_size, n)
    moe, shared = shape.num_moe_layers, shape.shared_expert_intermediate_size
    routers = [(shape.num_experts, h, moe)] + ([(1, h, moe)] if shared else [])  # + the shared expert's gate
    return attention + mlp(shape.dense_intermediate_size, n - moe) + routers + mlp(shared, moe)


def lora_slot_shapes(shape: ModelShape) -> list[tuple[int, int, int, int]]:
    """``(out, in, sub-projections, count)`` of the linear layers that take LoRA slots (lora/model.py):
    each decoder layer's fused qkv and o_proj, and the gated MLP's gate_up and down where the layer
    is dense (MoE experts take no adapters)."""
    if shape.mla is not None:
        raise ValueError("enable_lora with an MLA model (its latent attention projections) is not planned: "
                         "the adapter slots' memory is not counted here")
    h, d, n = shape.hidden_size, shape.head_dim, shape.num_layers
    slots = [((shape.num_heads + 2 * shape.num_kv_heads) * d, h, 3, n), (h, shape.num_heads * d, 1, n)]
    dense = n - shape.num_moe_layers if shape.num_experts else n
    inter = shape.dense_intermediate_size if shape.num_experts else shape.intermediate_size
    if shape.gated_mlp and inter and dense:
        slots += [(2 * inter, h, 2, dense), (h, inter, 1, dense)]
    return slots


def lora_adapter_bytes(shape: ModelShape, max_lora_rank: int, itemsize: int) -> int:
    """Bytes of one adapter laid out for the slots: ``A [subs * rank, in]`` and ``B [out, subs * rank]``
    per layer (layers/lora.py's LoRASlots), so ``max_loras`` of it on the device."""
    return sum(count * subs * max_lora_rank * (in_ + out) * itemsize
               for out, in_, subs, count in lora_slot_shapes(shape))


def _panel_bytes(shape: ModelShape, layout: tuple[int, int, int]) -> int:
    """The CPU's panel copy of every group-wise 4/8-bit linear (``grouped.panel_copy_bytes``)."""
    bits, group, _ = layout
    return sum(count * grouped.panel_copy_bytes(out, in_, in_ if group == -1 else group, bits)
               for out, in_, count in linear_shapes(shape))


def count_params(shape: ModelShape, active: bool = False) -> int:
    """Parameter count estimated from the shape: embeddings, attention, MLP, norms, untied lm_head;
    ``active``: with only the top-k experts of each MoE layer (what one token computes with).

    Biases (well under 0.1% of any real model) are ignored.
    """
    h = shape.hidden_size
    embeddings = shape.vocab_size * h
    if shape.model_type in _LEARNED_POSITIONS and shape.max_position_embeddings:
        embeddings += int(shape.max_position_embeddings) * h
    lm_head = 0 if shape.tie_word_embeddings else shape.vocab_size * h
    norms = shape.num_layers * 2 * h + h  # two per block + the final one
    return projection_params(shape, active) + embeddings + norms + lm_head


# --------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class KVPlan:
    """Result of :func:`plan_kv`. All sizes are in bytes."""

    shape: ModelShape
    dtype: str
    dtype_bytes: int
    block_size: int
    max_model_len: int
    mean_len: int
    gpu_memory: int
    gpu_memory_utilization: float
    num_params: int  # all of them: what the weights take in memory
    weights_bytes: int
    weights_estimated: bool
    kv_bytes_per_token: int
    kv_bytes_per_seq: int  # one max_model_len sequence
    kv_bytes_per_block: int
    usable_memory: int  # gpu_memory * utilization
    kv_budget: int  # usable_memory - weights_bytes; negative when the weights do not fit
    num_blocks: int
    max_seqs_contiguous: int  # max_model_len sequences under contiguous pre-allocation
    blocks_per_mean_seq: float  # mean_len / block_size + 0.5 (half-empty last block)
    mean_seqs_paged: int  # mean_len sequences that fit with paging
    notes: tuple[str, ...] = field(default=())
    kv_cache_dtype: str = ""  # the KV storage dtype (the weights' dtype unless set)
    quantization: str | None = None
    device: str = "cuda"  # the device planned for (PLAN_DEVICES)
    active_params: int = 0  # per token (MoE: top-k experts), what FLOPs scale with; = num_params if dense
    panel_bytes: int = 0  # of weights_bytes: the CPU's panel copy of 4/8-bit group-wise codes (grouped.py)
    # a vision-language model's encoder cache (image embeddings), held outside the KV budget
    encoder_cache_bytes: int = 0
    max_num_batched_tokens: int = 0
    lora: LoRAConfig | None = None  # enable_lora: the adapter slots planned for
    lora_bytes: int = 0  # the max_loras device slots, taken from the KV budget
    lora_host_bytes: int = 0  # the max_cpu_loras laid-out adapters kept in host memory (at most)

    @property
    def paging_gain(self) -> float:
        """How many times more sequences paging fits than contiguous pre-allocation."""
        return self.mean_seqs_paged / self.max_seqs_contiguous if self.max_seqs_contiguous else math.inf


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _resolve_lengths(shape: ModelShape, max_model_len: int | None, mean_len: int | None) -> tuple[int, int]:
    """Default max_model_len to the config's context length and mean_len to half of it."""
    if max_model_len is None:
        if shape.max_position_embeddings is None:
            raise ValueError("config.json has no max_position_embeddings; pass max_model_len")
        max_model_len = int(shape.max_position_embeddings)
    _check_positive("max_model_len", max_model_len)
    mean_len = max(1, max_model_len // 2) if mean_len is None else mean_len
    _check_positive("mean_len", mean_len)
    if mean_len > max_model_len:
        raise ValueError(f"mean_len ({mean_len}) must not exceed max_model_len ({max_model_len})")
    return max_model_len, mean_len


def _notes(shape: ModelShape, max_model_len: int, budget: int, max_seqs: int) -> tuple[str, ...]:
    notes = []
    if shape.max_position_embeddings and max_model_len > int(shape.max_position_embeddings):
        notes.append(f"max_model_len {max_model_len} exceeds the config's context length "
                     f"{shape.max_position_embeddings}")
    if shape.num_sliding_layers:
        notes.append(f"{shape.num_sliding_layers} of {shape.num_layers} layers attend to a "
                     f"{shape.sliding_window}-token sliding window; the engine still allocates every layer's KV "
                     "for the whole sequence, "
                     "and so does this plan")
    if budget <= 0:
        notes.append("the weights alone exceed the usable GPU memory: no room for KV cache")
    elif max_seqs == 0:
        notes.append("not even one max-length sequence fits contiguously")
    return tuple(notes)


def _weights_bytes(shape: ModelShape, num_params: int, dtype: torch.dtype,
                   layout: tuple[int, int, int] | None, quantization: str | None = None) -> int:
    """Estimated weight bytes; quantized projections (``layout`` = (bits, group, float bytes per
    group), layers/quantization) take bits / 8 bytes each plus their scales (and zeros); MXFP4
    experts (gpt-oss) half a byte per weight plus a one-byte scale per 32."""
    if quantization == "mxfp4":
        mlp_mats = 3 if shape.gated_mlp else 2
        experts = shape.num_moe_layers * shape.num_experts * mlp_mats * shape.hidden_size * shape.intermediate_size
        return (num_params - experts) * dtype.itemsize + experts // 2 + experts // mxfp4.GROUP
    if layout is None:
        return num_params * dtype.itemsize
    proj = projection_params(shape)
    bits, group, per_group = layout
    groups = proj // (shape.hidden_size if group == -1 else group)  # group -1: per output row, ~hidden_size long
    return (num_params - proj) * dtype.itemsize + proj * bits // 8 + per_group * groups


def _resolve_dtypes(shape: ModelShape, dtype: str, kv_cache_dtype: str, device: str) -> tuple[torch.dtype, torch.dtype]:
    """(weights dtype, KV dtype) as the engine would pick them on ``device`` (config.resolve_dtype)."""
    if device not in PLAN_DEVICES:
        raise ValueError(f"device={device!r} must be one of {PLAN_DEVICES}")
    weights = resolve_dtype(dtype, config_dtype(shape.config_dtype), torch.device(device))
    return weights, resolve_kv_cache_dtype(kv_cache_dtype) or weights


def plan_kv(
    config: dict,
    *,
    gpu_memory: int,
    max_model_len: int | None = None,
    block_size: int = 16,
    dtype: str = "auto",
    mean_len: int | None = None,
    weights_bytes: int | None = None,
    gpu_memory_utilization: float = 0.9,
    kv_cache_dtype: str = "auto",
    quantization: str | None = None,
    device: str = "cuda",
    max_num_batched_tokens: int | None = None,
    lora: LoRAConfig | None = None,
) -> KVPlan:
    """Plan KV-cache capacity for ``config`` (a parsed config.json) on a GPU of ``gpu_memory`` bytes.

    ``max_model_len`` defaults to the config's context length, ``mean_len`` to half of
    ``max_model_len``; ``weights_bytes`` defaults to an estimate from the parameter
    count (projections at 1 byte plus a float32 scale per row with ``quantization="int8"``).
    ``dtype`` and ``kv_cache_dtype`` mean what they mean to the engine running on ``device``
    ("auto" on "cuda": the checkpoint's half type; on "cpu": float32). The per-token and
    per-block bytes come from ``kv_cache.planning``, the functions the engine sizes its pool with.
    A vision-language config (one with ``vision_config``) also holds an encoder cache of
    ``max_num_batched_tokens`` (default: the engine's on ``device``) embedding rows, taken from the
    KV budget as the engine's memory profile does. ``lora`` (enable_lora): its ``max_loras`` adapter
    slots come out of the KV budget, as the engine allocates them before it sizes the pool;
    ``max_cpu_loras`` laid-out adapters are host memory.
    Activations and runtime overhead are not modelled. Raises ``ValueError`` (``ConfigError``
    for config problems) on bad input.
    """
    check_block_size(block_size)
    check_memory_utilization(gpu_memory_utilization)
    _check_positive("gpu_memory", gpu_memory)
    shape = model_shape(config)
    max_model_len, mean_len = _resolve_lengths(shape, max_model_len, mean_len)
    weights_dtype, kv_dtype = _resolve_dtypes(shape, dtype, kv_cache_dtype, device)
    quantization = resolve_quantization(quantization, config)  # a quantized checkpoint's own format
    weights, panels = _planned_weights(config, shape, weights_dtype, quantization, device, weights_bytes)
    usable = int(gpu_memory * gpu_memory_utilization)
    max_batched, encoder, adapter = _side_memory(config, shape, weights_dtype, device, max_num_batched_tokens, lora)
    budget = usable - weights - encoder - (lora.max_loras * adapter if lora else 0)
    per_token = kv_bytes(shape.num_layers, shape.kv_spec, kv_dtype)
    per_block = kv_bytes(shape.num_layers, shape.kv_spec, kv_dtype, block_size)
    num_blocks = max(budget, 0) // per_block
    max_seqs = max(budget, 0) // (per_token * max_model_len)
    blocks_per_mean = mean_blocks_per_sequence(mean_len, block_size)
    return KVPlan(
        shape=shape, dtype=dtype_name(weights_dtype), dtype_bytes=weights_dtype.itemsize, block_size=block_size,
        max_model_len=max_model_len, mean_len=mean_len, gpu_memory=gpu_memory,
        gpu_memory_utilization=gpu_memory_utilization, num_params=count_params(shape),
        weights_bytes=weights, weights_estimated=weights_bytes is None, kv_bytes_per_token=per_token,
        kv_bytes_per_seq=per_token * max_model_len, kv_bytes_per_block=per_block,
        usable_memory=usable, kv_budget=budget, num_blocks=num_blocks,
        max_seqs_contiguous=max_seqs, blocks_per_mean_seq=blocks_per_mean,
        mean_seqs_paged=int(num_blocks // blocks_per_mean),
        notes=_notes(shape, max_model_len, budget, max_seqs),
        kv_cache_dtype=dtype_name(kv_dtype), quantization=quantization, device=device,
        active_params=count_params(shape, active=True), panel_bytes=panels, encoder_cache_bytes=encoder,
        max_num_batched_tokens=max_batched, lora=lora,
        lora_bytes=lora.max_loras * adapter if lora else 0, lora_host_bytes=lora.num_cpu_loras * adapter if lora else 0,
    )


def _side_memory(config: dict, shape: ModelShape, weights_dtype: torch.dtype, device: str,
                 max_num_batched_tokens: int | None, lora: LoRAConfig | None) -> tuple[int, int, int]:
    """(step token budget, encoder cache bytes, bytes of one LoRA slot): what the engine takes from
    the KV budget beside the weights (a vision-language model's encoder cache, the adapter slots)."""
    max_batched = default_max_num_batched_tokens(device) if max_num_batched_tokens is None else max_num_batched_tokens
    _check_positive("max_num_batched_tokens", max_batched)
    encoder = encoder_cache_bytes(max_batched, shape.hidden_size, weights_dtype.itemsize) \
        if "vision_config" in config else 0
    adapter = lora_adapter_bytes(shape, lora.max_lora_rank, lora.slot_dtype(weights_dtype).itemsize) if lora else 0
    return max_batched, encoder, adapter


def _planned_weights(config: dict, shape: ModelShape, weights_dtype: torch.dtype, quantization: str | None,
                     device: str, weights_bytes: int | None) -> tuple[int, int]:
    """(weight bytes, of which CPU panel copies): ``weights_bytes`` as given, else estimated from the
    parameter count in ``quantization``'s layout (MoE models refuse the load-time formats)."""
    if quantization in LOAD_TIME_METHODS and shape.num_experts:
        refuse_moe(quantization, str(shape.model_type))
    if weights_bytes is not None:
        return int(weights_bytes), 0
    layout = projection_layout(quantization, config)
    panels = _panel_bytes(shape, layout) if device == "cpu" and keeps_cpu_panels(quantization, config) else 0
    return _weights_bytes(shape, count_params(shape), weights_dtype, layout, quantization) + panels, panels


# --------------------------------------------------------------------------- config loading


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not contain a JSON object")
    return data


def _download_config(repo_id: str, revision: str | None) -> str:
    """Resolve ``config.json`` of a Hub repo through the local cache (network only if allowed)."""
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError
    except ImportError as e:  # pragma: no cover - huggingface_hub is a hard dependency
        raise ConfigError(f"{repo_id!r} is not a local path and huggingface_hub is unavailable") from e
    try:
        try:  # cache first: instant, and works without network
            return hf_hub_download(repo_id, "config.json", revision=revision, local_files_only=True)
        except LocalEntryNotFoundError:
            print(f"config.json for {repo_id} is not cached; asking the Hub...", file=sys.stderr)
            return hf_hub_download(repo_id, "config.json", revision=revision)
    except LocalEntryNotFoundError as e:
        raise ConfigError(
            f"config.json for {repo_id!r} is not in the local Hugging Face cache and the Hub cannot be "
            "reached (offline or HF_HUB_OFFLINE=1). Pass a local directory or config.json path instead."
        ) from e
    except HFValidationError as e:
        raise ConfigError(f"{repo_id!r} is neither an existing local path nor a valid Hub repo id") from e
    except (HfHubHTTPError, OSError) as e:
        raise ConfigError(f"cannot fetch config.json for {repo_id!r} from the Hub: {e}") from e


def load_config(model: str, revision: str | None = None) -> dict:
    """Load ``config.json`` from a directory, a JSON file path, the bundled demo model, or a Hub repo id.

    Paths and Hub ids are told apart as the engine tells them (``models.loader.looks_like_path``), but
    only ``config.json`` is fetched from the Hub (cache first), never the weights.
    """
    expanded = os.path.expanduser(demo_model_path() if model == DEMO_MODEL_NAME else model)
    if os.path.isdir(expanded):
        path = os.path.join(expanded, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"directory {model!r} has no config.json")
        return _read_json(path)
    if os.path.isfile(expanded):
        return _read_json(expanded)
    if looks_like_path(model) or model.endswith(".json"):
        raise ConfigError(f"no such file or directory: {model!r}")
    return _read_json(_download_config(model, revision))


# --------------------------------------------------------------------------- CLI

_DESCRIPTION = """\
Estimate how much KV cache fits on a GPU for a model, reading only its config.json
(never the weights), and compare contiguous per-sequence pre-allocation with paging."""

_EPILOG = """\
examples:
  pagedllm plan --model meta-llama/Llama-2-7b-hf
  pagedllm plan --model ./models/llama --gpu-memory 24GiB --max-model-len 4096 --mean-len 600
  pagedllm plan --model config.json --dtype bfloat16 --block-size 32 --gpu-memory-utilization 0.85
  pagedllm plan --model Qwen/Qwen2.5-7B-Instruct --gpu-memory 80GB --json

sizes: 80GiB / 512MiB (powers of 1024), 80GB / 4GB (powers of 1000), 1e9 (bytes).
--model may be a directory, a config.json path, or a Hub id resolved through the local
Hugging Face cache (set HF_HUB_OFFLINE=1 to never touch the network).
The weights estimate counts embeddings, attention, MLP, norms and an untied lm_head;
activations, CUDA graphs and allocator overhead are not included."""


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``plan`` options to ``parser``."""
    parser.add_argument("--model", required=True, help="model directory, config.json path, or Hub repo id")
    parser.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit)")
    parser.add_argument("--gpu-memory", type=_size_arg, default=parse_size("80GiB"), metavar="SIZE",
                        help="total GPU memory (default: 80GiB)")
    parser.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9, metavar="FRACTION",
                        help="fraction of GPU memory the engine may use (default: 0.9)")
    parser.add_argument("--max-model-len", type=_positive_int, default=None, metavar="N",
                        help="maximum sequence length (default: the config's max_position_embeddings)")
    parser.add_argument("--block-size", type=int, choices=ALLOWED_BLOCK_SIZES, default=16,
                        help="tokens per KV block (default: 16)")
    parser.add_argument("--device", choices=PLAN_DEVICES, default="cuda",
                        help="device to plan for; decides what --dtype auto means (default: cuda)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="weights dtype; auto = as the engine picks it on --device: the config's "
                             "torch_dtype if half precision, else float16 on cuda; float32 on cpu (default: auto)")
    parser.add_argument("--kv-cache-dtype", choices=tuple(KV_CACHE_DTYPES), default="auto",
                        help="KV cache storage dtype; auto = the weights' dtype (default: auto)")
    parser.add_argument("--quantization", choices=QUANTIZATION_METHODS, default=None,
                        help="weight-only quantized projections (int8, int4; a checkpoint's own format is "
                             "read from its quantization_config): shrinks the weights estimate")
    parser.add_argument("--mean-len", type=_positive_int, default=None, metavar="N",
                        help="average sequence length (prompt + output) for the paged estimate "
                             "(default: half of --max-model-len)")
    parser.add_argument("--max-num-batched-tokens", type=_positive_int, default=None, metavar="N",
                        help="the step's token budget, which sizes a vision-language model's encoder cache "
                             "(default: the engine's, 2048 on cpu, 8192 on cuda)")
    parser.add_argument("--weights-memory", type=_size_arg, default=None, metavar="SIZE",
                        help="use this weights size instead of the estimate from the config")
    parser.add_argument("--enable-lora", action="store_true",
                        help="count LoRA adapter slots (their device memory comes out of the KV budget)")
    parser.add_argument("--max-loras", type=_positive_int, default=1, metavar="N",
                        help="with --enable-lora: adapters resident on the device at once (default: 1)")
    parser.add_argument("--max-lora-rank", type=_positive_int, default=16, metavar="R",
                        help="with --enable-lora: the slots' rank (default: 16)")
    parser.add_argument("--max-cpu-loras", type=_positive_int, default=None, metavar="N",
                        help="with --enable-lora: laid-out adapters kept in host memory (default: --max-loras)")
    parser.add_argument("--lora-dtype", choices=LORA_DTYPES, default="auto",
                        help="with --enable-lora: the slots' dtype; auto = the weights' (default: auto)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``plan`` sub-command to an ``argparse`` subparsers object; returns its parser."""
    parser = subparsers.add_parser(
        "plan", help="estimate KV-cache capacity from a model's config.json",
        description=_DESCRIPTION, epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def _row(label: str, value: str) -> str:
    return f"  {label:<40}{value}"


def format_plan(plan: KVPlan, model: str = "") -> str:
    """Human-readable report of a :class:`KVPlan`."""
    s = plan.shape
    weights_src = "estimated from config" if plan.weights_estimated else "given"
    lines = [
        f"KV cache plan for {model or s.model_type} ({s.model_type}) on {plan.device}",
        _row("layers / heads / KV heads / head_dim",
             f"{s.num_layers} / {s.num_heads} / {s.num_kv_heads} / {s.head_dim}"),
        _row("dtype", f"{plan.dtype} ({plan.dtype_bytes} bytes)"
                      + (f", projections {plan.quantization}" if plan.quantization else "")),
        _row("KV cache dtype", plan.kv_cache_dtype or plan.dtype),
        _row("KV per token and layer", s.kv_spec.describe()),
        _row("parameters", f"{plan.num_params / 1e9:.2f} B"),
        *([_row("active parameters per token (MoE)", f"{plan.active_params / 1e9:.2f} B")]
          if plan.active_params != plan.num_params else []),
        _row(f"weights ({weights_src})", format_size(plan.weights_bytes)
             + (f", {format_size(plan.panel_bytes)} of it the CPU GEMM's panel copy" if plan.panel_bytes else "")),
        _row("GPU memory x utilization", f"{format_size(plan.gpu_memory)} x {plan.gpu_memory_utilization:g}"
                                         f" = {format_size(plan.usable_memory)}"),
        *([_row(f"encoder cache ({plan.max_num_batched_tokens} image rows)", format_size(plan.encoder_cache_bytes))]
          if plan.encoder_cache_bytes else []),
        *([_row(f"LoRA slots ({plan.lora.max_loras} x rank {plan.lora.max_lora_rank})",
                format_size(plan.lora_bytes) + f", and up to {format_size(plan.lora_host_bytes)} of host memory "
                f"for {plan.lora.num_cpu_loras} adapters")] if plan.lora else []),
        _row("memory for KV cache", format_size(plan.kv_budget)),
        "",
        _row("KV per token", f"{format_size(plan.kv_bytes_per_token)} ({plan.kv_bytes_per_token:,} B)"),
        _row(f"KV per {plan.max_model_len}-token sequence", format_size(plan.kv_bytes_per_seq)),
        _row(f"KV per block ({plan.block_size} tokens)", format_size(plan.kv_bytes_per_block)),
        _row("blocks", f"{plan.num_blocks:,}"),
        "",
        _row(f"contiguous, {plan.max_model_len} tokens each", f"{plan.max_seqs_contiguous:,} sequences"),
        _row(f"paged, mean {plan.mean_len} tokens each", f"{plan.mean_seqs_paged:,} sequences"
                                                         f" ({plan.blocks_per_mean_seq:.2f} blocks each)"),
    ]
    if plan.max_seqs_contiguous:
        lines.append(_row("paging gain", f"x{plan.paging_gain:.2f}"))
    lines += [f"note: {n}" for n in plan.notes]
    lines.append("(activations and runtime overhead not included)")
    return "\n".join(lines)


def _with_flag_names(message: str) -> str:
    """Name CLI flags rather than plan_kv parameters in error messages."""
    for name in ("max_model_len", "mean_len", "gpu_memory_utilization", "gpu_memory", "block_size",
                 "max_num_batched_tokens"):
        message = re.sub(rf"\b{name}\b", "--" + name.replace("_", "-"), message)
    return message


def _lora_from_cli(args: argparse.Namespace) -> LoRAConfig | None:
    """--enable-lora's slots; a --max-lora* / --lora-dtype flag without it would be ignored, so it is refused."""
    defaults = {f.name: f.default for f in dataclasses.fields(LoRAConfig)}
    given = {name: getattr(args, name, default) for name, default in defaults.items()}
    if getattr(args, "enable_lora", False):
        return LoRAConfig(**given)
    changed = [name for name in defaults if given[name] != defaults[name]]
    if changed:
        raise ValueError(f"--{changed[0].replace('_', '-')}={given[changed[0]]} applies only with --enable-lora")
    return None


def run(args: argparse.Namespace) -> int:
    """Execute ``pagedllm plan`` for parsed ``args``; returns the process exit code."""
    try:
        config = load_config(args.model, getattr(args, "revision", None))
        plan = plan_kv(
            config, gpu_memory=args.gpu_memory, max_model_len=args.max_model_len,
            block_size=args.block_size, dtype=args.dtype, mean_len=args.mean_len,
            weights_bytes=args.weights_memory, gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization, device=args.device,
            max_num_batched_tokens=getattr(args, "max_num_batched_tokens", None),
            lora=_lora_from_cli(args),
        )
    except ValueError as e:  # includes ConfigError
        print(f"pagedllm plan: error: {_with_flag_names(str(e))}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**dataclasses.asdict(plan), "model": args.model}, indent=2))
    else:
        print(format_plan(plan, args.model))
    return 0 if plan.num_blocks > 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point: ``python -m pagedllm.entrypoints.plan --model ...``."""
    parser = argparse.ArgumentParser(
        prog="pagedllm plan", description=_DESCRIPTION, epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
