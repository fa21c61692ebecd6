"""Picks the attention backend for a device."""
from __future__ import annotations

import logging

import torch

from pagedllm.attention.backend import AttentionBackend, check_soft_cap
from pagedllm.attention.cpu import CpuAttentionBackend
from pagedllm.attention.mla import MLABackend
from pagedllm.attention.sdpa import SdpaBackend
from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.native import bindings

logger = logging.getLogger(__name__)
BACKENDS = ("auto", "torch", "sdpa", "cpu", "triton")


def backend_for_soft_cap(name: str, device: torch.device, soft_cap: float | None) -> str:
    """The backend name to build for a model whose attention soft-caps its logits at ``soft_cap``
    (Gemma 2; None: no cap). The C kernel has no soft cap, so ``auto`` on CPU becomes ``sdpa``
    (logged) and ``cpu`` is refused; every other choice implements it and stays."""
    if soft_cap is None or device.type != "cpu" or name not in ("auto", "cpu"):
        return name
    if name == "cpu":
        check_soft_cap(soft_cap, name)  # raises: the C kernel would have to ignore it
    logger.info("the model soft-caps attention logits (%s), which the C kernel does not: using the SDPA "
                "attention backend", soft_cap)
    return "sdpa"


def get_attention_backend(name: str, device: torch.device, kind: str = "full") -> AttentionBackend:
    """``auto``: the C kernel on CPU (SDPA if it cannot be built), the Triton kernels on CUDA
    (SDPA, with a warning, if triton is missing or for a head size / block size / dtype pair
    they do not cover). A named backend that cannot run raises. ``kind``: the model's KV spec
    kind (kv_cache/spec.py); "mla" (DeepSeek) gets the latent backend, attention/mla.py."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend={name!r} is not one of {BACKENDS}")
    if kind == "mla":
        return _mla_backend(name, device)
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        backend = _try_triton(device, required=name == "triton")
        if backend is not None:
            return backend
    if name == "torch":
        return TorchReferenceBackend()
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        backend = _try_cpu_kernel()
        if backend is not None:
            return backend
        if name == "cpu":
            raise ValueError("attention_backend='cpu' requested but the C kernel could not be built")
    return SdpaBackend()


def _mla_backend(name: str, device: torch.device):
    """``auto``: the absorbed (decode) form on the C latent kernel on CPU when it builds, on the
    Triton latent kernel on CUDA when triton imports; ``torch``: torch only."""
    if name not in ("auto", "torch", "cpu"):
        raise ValueError(f"attention_backend={name!r} does not implement multi-head latent attention "
                         "(DeepSeek V2/V3, a kv_lora_rank in the config); use 'auto', 'cpu' or 'torch'")
    if name == "torch":
        return MLABackend()
    if device.type == "cuda":
        from pagedllm.attention.triton import import_error  # optional: triton
        error = import_error()
        if error is None:
            return MLABackend(triton=True)
        logger.warning("multi-head latent attention runs in torch on CUDA: %s", error)
        return MLABackend()
    if device.type != "cpu":
        return MLABackend()
    if bindings.is_available():
        return MLABackend(bindings.library())
    if name == "cpu":
        raise ValueError("attention_backend='cpu' requested but the C kernel could not be built")
    return MLABackend()


def _try_triton(device: torch.device, required: bool) -> AttentionBackend | None:
    from pagedllm.attention.triton import import_error
    error = import_error()
    if error is None:
        from pagedllm.attention.triton.backend import TritonAttentionBackend
        TritonAttentionBackend.check_device(device)
        return TritonAttentionBackend(fallback=None if required else SdpaBackend())
    if required:
        raise ValueError(f"attention_backend='triton' needs triton and numpy: {error}")
    logger.warning("Triton unavailable (%s); using the SDPA attention backend", error)
    return None


def _try_cpu_kernel() -> AttentionBackend | None:
    try:
        return CpuAttentionBackend() if CpuAttentionBackend.is_available() else None
    except Exception as exc:  # a broken toolchain must not stop the engine
        logger.warning("C attention kernel unavailable (%s); falling back to SDPA backend", exc)
        return None
