"""Paged attention in Triton (``attention_backend="triton"``).

``kernels.py`` holds the kernels, ``plan.py`` the tile shapes and the split-KV heuristic,
``launch.py`` the launches as data, ``backend.py`` the ``AttentionBackend``, ``aot.py``
ahead-of-time compilation for GPU targets (run by the CI test).

On CUDA the kernels are compiled. On CPU they run in Triton's interpreter (numpy; slow, for
tests), which Triton only enables for a whole process: ``TRITON_INTERPRET=1`` must be in the
environment before triton is first imported.
"""
from __future__ import annotations

import functools
from types import ModuleType


def import_error() -> str | None:
    """Why the Triton backend cannot run here (triton or numpy missing), or None."""
    try:
        import numpy  # noqa: F401 - the interpreter computes with it
        import triton  # noqa: F401
    except ImportError as exc:
        return f"{exc} (install triton and numpy)"
    return None


@functools.cache
def load_kernels() -> ModuleType:
    from pagedllm.attention.triton import kernels
    return kernels


def interpreting() -> bool:
    """Whether the kernels were built for Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(load_kernels().paged_attention_kernel, InterpretedFunction)
