"""The start-up kernel table (layers/kernel_tuning.py): built, cached, reused, invalidated, and
followed by the linear layers; any choice gives transformers' greedy tokens."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import check_greedy_against, random_prompts

from pagedllm.attention.cpu import CpuAttentionBackend
from pagedllm.attention.testing import dense_attention_f64, make_paged_batch
from pagedllm.layers import cpu_ops, kernel_tuning
from pagedllm.native import bindings

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


_real_busy_reason = kernel_tuning.busy_reason


@pytest.fixture
def tuning(tmp_path, monkeypatch):
    """A fresh cache dir and fast mode; the process-wide table removed afterwards."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PAGEDLLM_KERNEL_TUNING", "fast")
    monkeypatch.setattr(kernel_tuning, "busy_reason", lambda: None)  # whatever the test machine's load
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
    monkeypatch.setattr(kernel_tuning, "time_attention", _attention_preferring(2048, 2, 1 << 16))
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


# --------------------------------------------------------------------------- attention's split


class _FakeBackend:
    name = "cpu"
    parallel_work = CpuAttentionBackend.DEFAULT_PARALLEL_WORK


def _attention_model() -> torch.nn.Module:
    """A packed projection (so there is a table) and a first layer with an attention shape."""
    model = _model((64, 32))
    attn = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=16)
    model.model = SimpleNamespace(layers=[SimpleNamespace(self_attn=attn)])
    return model


def _attention_preferring(tile_rows: int, items: int, team_from: int, calls: list | None = None):
    """A fake attention timer: ``tile_rows`` and ``items`` 1 us, other splits 2 us; the team
    1 us from ``team_from`` work on (one thread 2 us there), 3 us below it."""
    def timer(case, shape, budget):
        if calls is not None:
            calls.append(case)
        if case.tile_rows or case.decode_items:
            return 1e-6 if case.tile_rows == tile_rows or case.decode_items == items else 2e-6
        work = case.requests * shape[0] * case.context * shape[2]
        if case.parallel_work == kernel_tuning.NEVER:
            return 2e-6
        return 1e-6 if work >= team_from else 3e-6
    return timer


@pytest.fixture
def split_calls(monkeypatch):
    """Records every split set in the C kernel (and sets it)."""
    calls = []
    real = bindings.NativeLibrary.set_attention_split
    monkeypatch.setattr(bindings.NativeLibrary, "set_attention_split",
                        lambda self, rows, items: calls.append((rows, items)) or real(self, rows, items))
    yield calls
    bindings.library().set_attention_split(0, 0)


@pytest.fixture
def two_threads():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


def test_attention_split_is_measured_cached_and_used(tuning, split_calls, two_threads):
    heads, head_dim = 4, 16
    team_from = 1 * heads * 1024 * head_dim  # the ladder's (1 request, 1024 keys) step on
    timed: list = []
    backend = _FakeBackend()
    table = kernel_tuning.tune_model(_attention_model(), _preferring("mm"), backend,
                                     _attention_preferring(2048, 2, team_from, timed))
    assert table.attention == kernel_tuning.AttentionSplit(team_from, 2048, 2)
    assert {c.tile_rows for c in timed} >= set(kernel_tuning.TILE_ROWS)
    assert {c.decode_items for c in timed} >= set(kernel_tuning.DECODE_ITEMS)
    # used: the kernel's split set process-wide, the backend's team threshold replaced
    assert split_calls[-1] == (2048, 2) and backend.parallel_work == team_from
    cached = json.loads(next((tuning / "kernels").glob("*.json")).read_text())
    assert cached["key"]["attention"] == [4, 2, 16, kernel_tuning.ATTN_BLOCK] and "tile_rows" in cached["attention"]
    # the next start-up reads it from the cache: nothing timed, the same split applied
    again = _FakeBackend()
    table2 = kernel_tuning.tune_model(_attention_model(), _refuse, again, _refuse)
    assert table2.attention == table.attention and again.parallel_work == team_from
    assert split_calls[-1] == (2048, 2)


def test_defaults_stand_in_a_close_race_and_the_team_threshold_follows_the_ladder():
    close = {"tile_rows": {"1024": 1.0, "4096": 1.0 + kernel_tuning.MARGIN / 2}, "decode_items": {"1": 1.0, "2": 0.5}}
    split = kernel_tuning.build_attention(close)
    assert (split.tile_rows, split.decode_items_per_thread, split.parallel_work) == (4096, 2, None)
    ladder = [[100, 2.0, 3.0], [200, 2.0, 1.0], [400, 2.0, 3.0], [800, 2.0, 1.0], [1600, 2.0, 1.0]]
    assert kernel_tuning.team_threshold(ladder) == 800  # from where the team wins every larger step
    assert kernel_tuning.team_threshold([[100, 1.0, 2.0], [200, 1.0, 2.0]]) == 400  # never: past the ladder


def test_off_restores_the_kernel_defaults_and_other_backends_are_not_timed(tuning, split_calls, monkeypatch):
    torch_backend = SimpleNamespace(name="torch", parallel_work=5)
    table = kernel_tuning.tune_model(_attention_model(), _preferring("mm"), torch_backend, _refuse)
    assert table.attention is None and torch_backend.parallel_work == 5
    monkeypatch.setenv("PAGEDLLM_KERNEL_TUNING", "off")
    assert kernel_tuning.tune_model(_attention_model(), _refuse, _FakeBackend(), _refuse) is None
    assert split_calls[-1] == (0, 0)


@pytest.mark.parametrize("tile_rows,items", [(1024, 4), (8192, 1), (2048, 2)])
def test_every_split_computes_the_same_attention(split_calls, tile_rows, items):
    """The kernel under each candidate split (prefill chunks cut into other item sizes, decode
    heads spread over more items) against the float64 oracle on a ragged batch."""
    batch = make_paged_batch([(40, 1), (0, 37), (65, 5), (8, 1), (0, 130)], num_heads=8, num_kv_heads=2, head_dim=64,
                             block_size=16, seed=tile_rows)
    backend = CpuAttentionBackend(num_threads=2, parallel_work=0)
    bindings.library().set_attention_split(tile_rows, items)
    kc, vc = batch.fresh_caches()
    out = backend.forward(batch.query, batch.key, batch.value, kc, vc, batch.meta, batch.scale)
    torch.testing.assert_close(out.double(), dense_attention_f64(batch), atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="decode_items_per_thread=-1"):
        bindings.library().set_attention_split(0, -1)


def test_a_table_measured_on_a_busy_machine_is_used_but_not_cached(tuning, monkeypatch, caplog):
    load = iter([(1.0, 0, 0), (9.0, 0, 0)])  # quiet when measuring starts, busy when it ends
    monkeypatch.setattr(kernel_tuning.os, "getloadavg", lambda: next(load))
    monkeypatch.setattr(kernel_tuning.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(kernel_tuning, "busy_reason", _real_busy_reason)
    with caplog.at_level("WARNING", logger=kernel_tuning.logger.name):
        table = kernel_tuning.tune_model(_model((64, 32)), _preferring("onednn"))
    assert cpu_ops.kernel_table() is table and table.choices[(64, 32)][0] == "onednn"
    assert not list((tuning / "kernels").glob("*.json")) and "load average 9.0 on 2 cores" in caplog.text
    calls: list = []  # the next start-up measures again
    monkeypatch.setattr(kernel_tuning.os, "getloadavg", lambda: (2.5, 0, 0))  # 2 cores + 1: not busy
    kernel_tuning.tune_model(_model((64, 32)), _preferring("onednn", calls))
    assert calls and len(list((tuning / "kernels").glob("*.json"))) == 1
