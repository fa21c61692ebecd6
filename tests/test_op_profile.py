"""benchmarks/op_profile.py (profile_step.py --ops): module roles, exclusive times, GEMM methods."""
from __future__ import annotations

import time

import torch
from conftest import load_benchmark
from torch import nn

op = load_benchmark("pagedllm_bench_op_profile", "op_profile.py")


def test_roles_drop_layer_indices():
    assert op.role("model.layers.3.self_attn.qkv_proj") == "self_attn.qkv_proj"
    assert op.role("model.layers.12") == "layers" and op.role("model.norm") == "norm"
    assert op.role("lm_head") == "lm_head" and op.role("") == "forward"


class _Sleep(nn.Module):
    def __init__(self, seconds: float, inner: nn.Module | None = None):
        super().__init__()
        self.seconds, self.inner = seconds, inner
        self.weight = torch.zeros(3, 5)

    def forward(self, x):
        time.sleep(self.seconds)
        return x if self.inner is None else self.inner(x)


def test_module_timer_charges_exclusive_time_per_role_and_rows():
    model = nn.Sequential(_Sleep(0.01, _Sleep(0.2)), _Sleep(0.01))  # roles "0", "0.inner", "1"
    timer = op.ModuleTimer(model)
    model(torch.zeros(7, 5))
    sec = dict(timer.seconds)
    assert set(sec) == {("forward", 7), ("0", 7), ("0.inner", 7), ("1", 7)}
    # exclusive: the outer module's 0.01 s without the inner one's 0.2 s (generous bounds for a loaded machine)
    assert 0.01 <= sec["0", 7] < 0.1 and sec["0.inner", 7] >= 0.2 and sec["forward", 7] < 0.1
    assert timer.shapes["0.inner"] == (5, 3) and timer.calls["1", 7] == 1
    timer.remove()
    model(torch.zeros(7, 5))
    assert timer.calls["1", 7] == 1  # hooks gone


def test_best_gemm_times_every_method_on_one_shape():
    best = op.best_gemm(4, 16, 8, repeats=2)  # each method is checked against F.linear first
    assert {"F.linear", "mm(x, W^T)"} <= set(best) and all(v > 0 for v in best.values())
