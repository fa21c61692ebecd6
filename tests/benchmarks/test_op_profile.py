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


def test_ab_fused_alternates_decoder_and_module_path_and_restores_the_decoder(llama_dir):
    from pagedllm import LLM
    ps = load_benchmark("pagedllm_bench_profile_step", "profile_step.py")
    llm = LLM(llama_dir, num_gpu_blocks_override=64, max_model_len=256)
    inner = llm.llm_engine.executor.runner.model.model
    if inner.fused_decoder is None:
        import pytest
        pytest.skip("no one-call decoder here (no C compiler)")
    seen = []
    real = inner.fused_decoder.__class__._run  # behind both __call__ and the runner's forward_host

    def spy(self, *a, **k):
        seen.append(len(seen))
        return real(self, *a, **k)

    type(inner.fused_decoder)._run = spy
    try:
        row = ps.ab_fused(llm, 3, 8, 9)  # 8 decode steps after the prefill: 4 through each path
    finally:
        type(inner.fused_decoder)._run = real
    assert row["batch"] == 3 and row["steps"] == 8 and row["fused_ms"] > 0 and row["module_ms"] > 0
    assert len(seen) == 1 + 4  # the 24-token prefill step, then the "on" half of the decode steps
    assert inner.fused_decoder is not None and not llm.llm_engine.has_unfinished_requests()
