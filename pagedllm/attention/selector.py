"""Picks the attention backend for a device."""
from __future__ import annotations

import logging

import torch

from pagedllm.attention.backend import AttentionBackend

logger = logging.getLogger(__name__)
BACKENDS = ("auto", "torch", "sdpa", "cpu")


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend={name!r} is not one of {BACKENDS}")
    if name == "torch":
        from pagedllm.attention.torch_ref import TorchReferenceBackend
        return TorchReferenceBackend()
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        backend = _try_cpu_kernel()
        if backend is not None:
            return backend
        if name == "cpu":
            raise ValueError("attention_backend='cpu' requested but the C kernel could not be built")
    from pagedllm.attention.sdpa import SdpaBackend
    return SdpaBackend()


def _try_cpu_kernel() -> AttentionBackend | None:
    try:
        from pagedllm.attention.cpu import CpuAttentionBackend
    except ImportError:
        return None
    try:
        return CpuAttentionBackend() if CpuAttentionBackend.is_available() else None
    except Exception as exc:  # a broken toolchain must not stop the engine
        logger.warning("C attention kernel unavailable (%s); falling back to SDPA backend", exc)
        return None
