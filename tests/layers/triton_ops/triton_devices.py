"""Devices the Triton kernel tests run on: CPU tensors under the interpreter (set up in
tests/conftest.py when there is no GPU) and, marked ``gpu``, the CUDA device."""
from __future__ import annotations

import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]),
]
