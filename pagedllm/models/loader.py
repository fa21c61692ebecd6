"""Model loading: resolve a local path or Hub id, build the model, load safetensors by name."""
from __future__ import annotations

import glob
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from pagedllm.attention import kv_quant
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.distributed.pipeline import PipelineStage
from pagedllm.layers import quantization
from pagedllm.layers.linear import default_weight_loader
from pagedllm.models.registry import MODEL_REGISTRY

logger = logging.getLogger(__name__)

DEMO_MODEL_NAME = "pagedllm-demo"
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]
# vLLM's load_format values we honour: "auto" / "safetensors" read *.safetensors (never a pickle),
# "dummy" gives every weight random values (benchmarks, tests of shapes and memory)
LOAD_FORMATS = ("auto", "safetensors", "dummy")


@dataclass(frozen=True)
class HubOptions:
    """How a Hub id is downloaded (vLLM's ``revision``, ``download_dir``, ``hf_token``); a local
    directory ignores them."""

    revision: str | None = None
    download_dir: str | None = None  # None: the Hugging Face cache (HF_HOME)
    token: bool | str | None = None


def demo_model_path() -> str:
    return os.path.join(os.path.dirname(__file__), "demo")


def resolve_model_path(model: str, hub: HubOptions | None = None) -> str:
    """A local directory, the bundled demo model, or a Hub id downloaded into the HF cache (or
    ``hub.download_dir``) at ``hub.revision``."""
    if model == DEMO_MODEL_NAME:
        return demo_model_path()
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"model={model!r} is a directory without config.json; expected a Hugging Face checkpoint")
        return model
    if looks_like_path(model):
        raise ValueError(f"model={model!r} does not exist: pass an existing local directory or a Hub id "
                         "like 'org/name'")
    return _download_from_hub(model, hub or HubOptions())


def looks_like_path(model: str) -> bool:
    """Hub ids are ``name`` or ``org/name``; anything else is meant as a local path."""
    return model.startswith((".", "/", "~")) or model.strip("/").count("/") > 1


def _download_from_hub(repo_id: str, hub: HubOptions) -> str:
    from huggingface_hub import snapshot_download
    options = dict(allow_patterns=_HUB_PATTERNS, revision=hub.revision, cache_dir=hub.download_dir, token=hub.token)
    try:
        return snapshot_download(repo_id, **options)
    except Exception as exc:  # offline, unknown repo, auth: all mean "cannot get it"
        try:
            return snapshot_download(repo_id, local_files_only=True, **options)
        except Exception:
            at = f" at revision={hub.revision!r}" if hub.revision else ""
            raise ValueError(
                f"model={repo_id!r}{at} is not a local directory and could not be fetched from the Hugging Face "
                f"Hub ({type(exc).__name__}: {exc}); when offline it must already be in the HF cache "
                "(HF_HOME, or download_dir); otherwise pass a local path") from exc


def apply_hf_overrides(hf_config, overrides: dict | str | Callable | None):
    """vLLM's ``hf_overrides``: a dict sets config attributes (a dict value for a nested config,
    such as ``text_config``, updates that config's attributes), its JSON text likewise; a callable
    takes the config and returns the config to use."""
    if overrides is None:
        return hf_config
    if callable(overrides):
        return overrides(hf_config)
    if isinstance(overrides, str):
        overrides = json.loads(overrides)
    if not isinstance(overrides, dict):
        raise ValueError(f"hf_overrides={overrides!r} must be a dict, its JSON text, or a function of the config")
    for key, value in overrides.items():
        _override(hf_config, key, value)
    return hf_config


def _override(config: Any, key: str, value: Any) -> None:
    current = getattr(config, key, None)
    if isinstance(value, dict) and hasattr(current, "to_dict"):  # a nested PretrainedConfig
        for sub_key, sub_value in value.items():
            _override(current, sub_key, sub_value)
    else:
        setattr(config, key, value)


def checkpoint_dtype(model_dir: str) -> torch.dtype | None:
    with open(os.path.join(model_dir, "config.json")) as f:
        return config_dtype(json.load(f).get("torch_dtype"))


def config_dtype(name: object) -> torch.dtype | None:
    """A config.json ``torch_dtype`` value ("bfloat16", "torch.float16") as a torch dtype; None if absent or unknown."""
    value = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    return value if isinstance(value, torch.dtype) else None


def build_model(model_cls: type[nn.Module], hf_config, backend, max_position: int, dtype: torch.dtype,
                device: torch.device, tp: TensorParallelGroup, ops: str = "native",
                stage: PipelineStage | None = None) -> nn.Module:
    """The model's modules for this rank (its shard of every parallel layer, the layers of its
    pipeline ``stage``), weights not loaded; ``ops``: the layers' fused-op implementation,
    "native" or "triton" (layers/ops.py)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(hf_config, backend, max_position, tp, ops, stage)
    finally:
        torch.set_default_dtype(prev)
    # rotary tables stay float32 for accuracy; they are cast at use
    for module in model.modules():
        for name in ("cos", "sin"):
            if hasattr(module, name) and isinstance(getattr(module, name), torch.Tensor):
                setattr(module, name, getattr(module, name).float())
    return model.eval()


def iterate_safetensors(model_dir: str):
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir!r} (pickled .bin checkpoints are not loaded)")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def checkpoint_bytes(model_dir: str, dtype: torch.dtype) -> int:
    """Bytes the checkpoint's tensors take once loaded: floating tensors of 2+ bytes in ``dtype``,
    others (FP8 weights, packed quantized codes, indices) as stored. Reads the safetensors headers only."""
    total = 0
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                stored = _SAFETENSORS_DTYPES[tensor.get_dtype()]
                widened = stored.is_floating_point and stored.itemsize > 1  # FP8 weights stay 1 byte
                itemsize = dtype.itemsize if widened else stored.itemsize
                total += math.prod(tensor.get_shape()) * itemsize
    return total


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                       "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def load_weights(model: nn.Module, model_dir: str, load_format: str = "auto", seed: int = 0) -> None:
    """Copies every checkpoint tensor into its parameter (``model.checkpoint_weights`` maps names and
    shards per family).
    A pre-quantized checkpoint (``quantization_config``) first gives the projections its
    tensors' parameters and converts them to the runtime layout at the end.
    ``load_format="dummy"`` reads nothing: every weight gets random values (see fill_dummy_weights)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not supported: one of {LOAD_FORMATS}")
    method = quantization.checkpoint_method(model.config)
    if load_format == "dummy":
        if method is not None:
            raise ValueError(f"load_format='dummy' cannot be combined with a pre-quantized checkpoint ({method}): "
                             "its packed layout comes from the checkpoint's tensors")
        fill_dummy_weights(model, seed)
        return
    if method is not None:
        quantization.create_weights(model, method)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = load_named_weights(model, iterate_safetensors(model_dir))
    if is_bare_checkpoint(model.config) and "lm_head.weight" in params and "lm_head.weight" not in loaded:
        _fill_missing_lm_head(params["lm_head.weight"], params.get("model.embed_tokens.weight"))
        loaded.add("lm_head.weight")
    _check_all_loaded(model, params, loaded)
    if method is not None:
        quantization.process_weights(model, method)


def load_named_weights(model: nn.Module, weights) -> set[str]:
    """Copies ``(checkpoint name, full tensor)`` pairs into their parameters through each
    parameter's weight loader (so a tensor-parallel rank keeps its shard, a pipeline stage its
    layers); returns the parameter names written. Used at load and for weight updates (any
    subset of the checkpoint's tensors)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = set()
    bare = is_bare_checkpoint(model.config)
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue
        if bare:  # a bare decoder's names lack the "model." prefix of *ForCausalLM
            name = "model." + name
        name = kv_quant.checkpoint_scale_name(name)  # (older llm-compressor K/V scale names)
        for target, part, shard in model.checkpoint_weights(name, tensor):  # split / renamed per family
            target = model.stage_weight_name(target)  # pipeline parallelism: another stage's, or renamed
            if target is None:
                continue
            if target not in params:
                if name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False):
                    continue
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
            _load_one(params[target], part, shard)
            loaded.add(target)
    return loaded


def fill_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """vLLM's dummy weights: uniform in [-1e-3, 1e-3] for floating parameters (so activations stay
    finite through every layer), norm weights 1, integers 0; the same on every run with ``seed``."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.dtype.is_floating_point:
                param.zero_()
            elif "norm" in name.rsplit(".", 2)[-2]:
                param.fill_(1.0)
            else:
                values = torch.rand(param.shape, generator=generator, dtype=torch.float32) * 2e-3 - 1e-3
                param.copy_(values.to(param.dtype))


def is_bare_checkpoint(hf_config) -> bool:
    """A ``*Model`` checkpoint (no LM head; only runner="pooling" resolves one, models/registry.py)."""
    archs = getattr(hf_config, "architectures", None) or []
    return bool(archs) and all(a.endswith("Model") for a in archs)


def _fill_missing_lm_head(head: nn.Parameter, embedding: nn.Parameter | None) -> None:
    """A pooling engine samples one dropped token per request (engine/llm_engine.py, process_pooling):
    with no LM head in the checkpoint that row is computed from the tied embedding (zeros if the
    shards differ), so it is finite and means nothing."""
    with torch.no_grad():
        if embedding is not None and embedding.shape == head.shape:
            head.copy_(embedding)
        else:
            head.zero_()


def _load_one(param: nn.Parameter, tensor: torch.Tensor, shard) -> None:
    loader = getattr(param, "weight_loader", default_weight_loader)
    # packed quantized tensors go to their loader as stored (it unpacks them)
    value = tensor if getattr(param, "raw_checkpoint_tensor", False) else tensor.to(param.dtype)
    with torch.no_grad():
        loader(param, value, shard) if shard is not None else loader(param, value)


def _check_all_loaded(model, params: dict, loaded: set) -> None:
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = [n for n, p in params.items() if n not in loaded and not (tied and n == "lm_head.weight")
               and not getattr(p, "optional_in_checkpoint", False)]
    if missing:
        raise ValueError(f"checkpoint is missing weights for: {missing[:8]}{' ...' if len(missing) > 8 else ''}")


def get_model_class(architecture: str) -> type[nn.Module]:
    return MODEL_REGISTRY[architecture]
