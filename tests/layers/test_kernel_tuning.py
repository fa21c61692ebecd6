"""The start-up kernel table (layers/kernel_tuning.py): built, cached, reused, invalidated, and
followed by the linear layers; any choice gives transformers' greedy tokens."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import check_greedy_against, random_prompts

from pagedllm.layers import cpu_ops, kernel_tuning

pytestmark = pytest.mark.skipif(not cpu_ops.usable(torch.zeros(1)), reason="no C compiler")


class _Proj(torch.nn.Module):
    def __init__(self, out_features: int, in_features: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(out_features, in_features, generator=g), requires_grad=False)
        self.packed_weight = cpu_ops.pack_weight(self.weight, panels=True)


def _model(*shapes: tuple[int, int]) -> torch.nn.Module:
    return torch.nn.Sequential(*[_Proj(o, i, n) for n, (o, i) in enumerate(shapes)])


def _preferring(kernel: str, calls: list | None = None):
    """A fake timer: ``kernel`` takes 1 us, the others 2 us (records each call in ``calls``)."""
    def timer(name, x, weight, packed, budget):
        if calls is not None:
            calls.append((name, x.shape[0], tuple(weight.shape)))
        return 1e-6 if name == kernel else 2e-6
    return timer


def _refuse(*args):
    raise AssertionError("timed a kernel although the cached table applies")


@pytest.fixture
def tuning(tmp_path, monkeypatch):
    """A fresh cache dir and fast mode; the process-wide table removed afterwards."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PAGEDLLM_KERNEL_TUNING", "fast")
    yield tmp_path
    cpu_ops.set_kernel_table(None)


def test_table_is_measured_cached_and_reused(tuning):
    model = _model((64, 32), (32, 64))
    calls: list = []
    table = kernel_tuning.tune_model(model, _preferring("onednn", calls))
    # every shape at every fast bucket, the oneDNN copy chosen everywhere, the table installed
    assert {(rows, shape) for _, rows, shape in calls} == \
        {(r, s) for r in kernel_tuning.MODE_BUCKETS["fast"] for s in ((64, 32), (32, 64))}
    assert table.choices[(64, 32)] == ("onednn",) * len(kernel_tuning.MODE_BUCKETS["fast"])
    assert cpu_ops.kernel_table() is table
    files = list((tuning / "kernels").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["shapes"] == [[32, 64], [64, 32]]
    # a second start-up with the same key measures nothing and gets the same table
    again = kernel_tuning.tune_model(_model((64, 32), (32, 64)), _refuse)
    assert again.choices == table.choices


@pytest.mark.parametrize("change", ["shapes", "threads", "mode"])
def test_a_key_change_measures_again(tuning, monkeypatch, change):
    kernel_tuning.tune_model(_model((64, 32)), _preferring("mm"))
    shapes = ((64, 32), (96, 32)) if change == "shapes" else ((64, 32),)
    if change == "threads":
        saved = torch.get_num_threads()
        torch.set_num_threads(1 if saved > 1 else 2)
    if change == "mode":
        monkeypatch.setattr(kernel_tuning, "MODE_BUCKETS", {"fast": (1, 4), "full": (1, 4, 16)})
        monkeypatch.setenv("PAGEDLLM_KERNEL_TUNING", "full")
    try:
        calls: list = []
        kernel_tuning.tune_model(_model(*shapes), _preferring("mm", calls))
    finally:
        if change == "threads":
            torch.set_num_threads(saved)
    assert calls
    assert len(list((tuning / "kernels").glob("*.json"))) == 2


def test_off_keeps_the_thresholds(tuning, monkeypatch):
    kernel_tuning.tune_model(_model((64, 32)), _preferring("mm"))
    monkeypatch.setenv("PAGEDLLM_KERNEL_TUNING", "off")
    assert kernel_tuning.tune_model(_model((64, 32)), _refuse) is None
    assert cpu_ops.kernel_table() is None
    assert cpu_ops.decode_panel_min() == cpu_ops.DECODE_PANEL_MIN_ROWS


def test_a_bad_mode_is_refused_by_name(tuning, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_KERNEL_TUNING", "fastest")
    with pytest.raises(ValueError, match="PAGEDLLM_KERNEL_TUNING='fastest'.*off, fast, full"):
        kernel_tuning.tune_model(_model((64, 32)), _preferring("mm"))


@pytest.mark.parametrize("kernel", cpu_ops.GEMM_KERNELS)
@pytest.mark.parametrize("rows", [1, 7, 40, 200])
def test_linear_runs_the_chosen_kernel(tuning, monkeypatch, kernel, rows):
    """cpu_ops.linear runs what the table says (each candidate where this build has it) and every
    candidate computes F.linear."""
    model = _model((64, 48))
    if kernel not in kernel_tuning.candidates(model[0].weight, model[0].packed_weight, rows):
        pytest.skip(f"no {kernel} kernel for {rows} rows in this build")
    kernel_tuning.tune_model(model, _preferring(kernel))
    ran = []
    real = cpu_ops.run_gemm
    monkeypatch.setattr(cpu_ops, "run_gemm", lambda name, *a: ran.append(name) or real(name, *a))
    g = torch.Generator().manual_seed(rows)
    x, b = torch.randn(rows, 48, generator=g), torch.randn(64, generator=g)
    w = model[0].weight
    torch.testing.assert_close(cpu_ops.linear(x, w, b, model[0].packed_weight), F.linear(x, w, b),
                               atol=1e-4, rtol=1e-4)
    assert ran == [kernel]
    # past the measured buckets (fast: 256 rows) the fixed thresholds apply
    assert cpu_ops.kernel_table().choose(64, 48, 257) is None


def test_decoder_switch_from_the_measured_crossover():
    """The decoder's tile/panel switch: the lower bound of the first bucket from which the panel
    GEMM wins summed over its projections; past the tile's buckets when it never does."""
    shapes = [(96, 32), (32, 96)]

    def times(panel_from: int) -> dict:
        return {f"{o}x{i}": {str(r): {"tile": 2.0, "panel": 1.0 if r >= panel_from else 3.0}
                             for r in (1, 4, 16, 32)} for o, i in shapes}
    assert kernel_tuning.decode_panel_min(times(16), shapes) == 9
    assert kernel_tuning.decode_panel_min(times(1), shapes) == 1
    assert kernel_tuning.decode_panel_min(times(1000), shapes) == \
        kernel_tuning.bindings.library().max_decode_tokens + 1
    assert kernel_tuning.decode_panel_min({}, shapes) is None


@pytest.mark.parametrize("kernel", cpu_ops.GEMM_KERNELS)
def test_greedy_equals_transformers_whatever_the_table_chooses(tuning, monkeypatch, llama_dir, hf_models, kernel):
    """An engine whose start-up measured ``kernel`` fastest everywhere (a fake timer) runs it
    (the table says so) and generates transformers' greedy tokens."""
    from pagedllm import LLM
    monkeypatch.setattr(kernel_tuning, "time_kernel", _preferring(kernel))
    llm = LLM(llama_dir, num_gpu_blocks_override=64, max_model_len=256, device="cpu")
    table = cpu_ops.kernel_table()
    assert table is not None
    if kernel in ("tile", "panel"):  # the decoder's switch follows: tile everywhere, or panel from one token
        expected = {"tile": kernel_tuning.bindings.library().max_decode_tokens + 1, "panel": 1}[kernel]
        assert table.decode_panel_min in (None, expected)
    if not any(kernel in kernels for kernels in table.choices.values()):
        pytest.skip(f"no {kernel} kernel for this model's shapes in this build")
    check_greedy_against(llm, hf_models["llama"], random_prompts(4, seed=3), max_new=8, logprob_prompts=0)


def test_the_thresholds_choice_stays_unless_another_wins_by_the_margin():
    """A race within MARGIN keeps the fixed thresholds' kernel (timing noise would flip it from
    one start-up to the next); a clear win replaces it."""
    close = {"panel": 1.0, "onednn": 1.0 + kernel_tuning.MARGIN / 2, "threshold": "onednn"}
    clear = {"panel": 1.0, "onednn": 1.0 + 2 * kernel_tuning.MARGIN, "threshold": "onednn"}
    assert kernel_tuning.pick(close) == "onednn" and kernel_tuning.pick(clear) == "panel"
    packed = cpu_ops.pack_weight(torch.randn(64, 32), panels=True)
    assert cpu_ops.threshold_kernel(packed, 1) in cpu_ops.GEMM_KERNELS
