"""benchmarks/probes/quant_kernels.py: every kernel it times agrees with a float32 reference, on a tiny model."""
from __future__ import annotations

import pytest
import torch
from conftest import load_benchmark

from pagedllm.layers import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.usable(torch.zeros(1)), reason="no C compiler")

qk = load_benchmark("pagedllm_bench_quant_kernels", "probes/quant_kernels.py")
TINY = ["--hidden", "128", "--inter", "256", "--layers", "1", "--bandwidth-mib", "4", "--threads", "1"]


@pytest.mark.parametrize("tokens", [1, 9])  # the small-batch kernels, and the panel GEMM's row tail
def test_every_kind_runs_and_matches_the_reference(tokens, capsys):
    ms = qk.main(["--tokens", str(tokens), "--kinds", ",".join(qk.KINDS), *TINY])
    assert list(ms) == list(qk.KINDS) and all(t > 0 for t in ms.values())
    assert len(capsys.readouterr().out.splitlines()) == 2 + len(qk.KINDS)


def test_the_check_catches_a_wrong_kernel(monkeypatch):
    right = qk.apply
    monkeypatch.setattr(qk, "apply", lambda *a: right(*a) * (1 + 1e-4))
    with pytest.raises(AssertionError, match="int4-panel at 3 token"):
        qk.check_kind(qk.bindings.library(), "int4-panel", 3, 1, 64, 256)


def test_unknown_kind_is_refused():
    with pytest.raises(SystemExit):
        qk.main(["--kinds", "int4,int3", *TINY])
