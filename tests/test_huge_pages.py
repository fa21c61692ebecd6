"""CPU tensors in 2 MiB pages (platform.py): placement, values, ties, and the engine's use of them."""
from __future__ import annotations

import threading

import pytest
import torch

from pagedllm.layers import cpu_ops
from pagedllm.platform import (
    HUGE_PAGE,
    huge_page_copies,
    huge_page_empty,
    huge_pages_supported,
    module_to_huge_pages,
    populate_range,
)


def _kernel_populates() -> bool:
    import mmap
    area = mmap.mmap(-1, 4096)
    return populate_range(torch.frombuffer(area, dtype=torch.uint8).data_ptr(), 4096)


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_empty_is_aligned_writable_and_advised():
    t = huge_page_empty((3, 1000, 7), torch.bfloat16)
    assert (t.shape, t.dtype, t.is_contiguous()) == ((3, 1000, 7), torch.bfloat16, True)
    assert t.data_ptr() % HUGE_PAGE == 0
    t.fill_(2.5)
    assert t.float().sum().item() == 2.5 * 21000
    if huge_pages_supported():  # MADV_HUGEPAGE shows as "hg" on the mapping
        assert "hg" in _vm_flags(t.data_ptr())


def test_negative_dimension_is_refused():
    with pytest.raises(ValueError, match=r"shape \(2, -1, 4\) has a negative dimension"):
        huge_page_empty((2, -1, 4), torch.float32)


def test_copies_share_one_mapping_at_page_boundaries_with_exact_values():
    g = torch.Generator().manual_seed(0)
    originals = [torch.randn(300, 17, generator=g), torch.randint(0, 255, (5000,), dtype=torch.uint8, generator=g),
                 torch.randn(64, 33, generator=g).to(torch.bfloat16), torch.arange(12, dtype=torch.int64).view(3, 4),
                 torch.randn(40, 40, generator=g).t()]  # a transposed view: copied contiguous
    copies = huge_page_copies(originals)
    base = copies[0].data_ptr()
    assert base % HUGE_PAGE == 0
    for orig, copy in zip(originals, copies):
        assert copy.dtype == orig.dtype and copy.shape == orig.shape and copy.is_contiguous()
        assert torch.equal(copy, orig)
        assert (copy.data_ptr() - base) % 4096 == 0
        assert copy.untyped_storage().data_ptr() == copies[0].untyped_storage().data_ptr()
    ends = sorted((c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()) for c in copies)
    assert all(prev_end <= start for (_, prev_end), (start, _) in zip(ends, ends[1:]))  # no overlap


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(512, 64)  # 128 KiB
        self.proj = torch.nn.Linear(64, 64)  # 16 KiB: below the threshold
        self.head = torch.nn.Linear(64, 512, bias=False)
        self.head.weight = self.embed.weight  # tied, as tie_word_embeddings
        self.register_buffer("table", torch.randn(256, 128))  # 128 KiB


def test_module_moves_large_tensors_once_and_keeps_ties():
    torch.manual_seed(0)
    m = _Tied()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    x = torch.randint(0, 512, (5,))
    ref = m.head(m.proj(m.embed(x)))
    param, small_ptr = m.embed.weight, m.proj.weight.data_ptr()
    moved = module_to_huge_pages(m)
    assert moved == 512 * 64 * 4 + 256 * 128 * 4  # the tied weight counted once
    assert m.embed.weight is param and m.head.weight is param  # same Parameter objects, still tied
    assert isinstance(m.embed.weight, torch.nn.Parameter)
    assert m.embed.weight.untyped_storage().data_ptr() == m.table.untyped_storage().data_ptr()  # one mapping
    assert m.proj.weight.data_ptr() == small_ptr  # under min_bytes: left alone
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(m.head(m.proj(m.embed(x))), ref)


def test_engine_places_weights_and_kv_in_huge_pages_and_generates_the_same(llama_dir, monkeypatch):
    from pagedllm import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]}, {"prompt_token_ids": [40, 3, 99]}]
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", flag)
        llm = LLM(llama_dir, device="cpu", block_size=8, max_model_len=64, kv_cache_memory=2**20)
        runner = llm.llm_engine.executor.runner
        aligned = runner.cache.kv.data_ptr() % HUGE_PAGE == 0
        embed = runner.model.model.embed_tokens.weight
        # the panel GEMM's copies (an AVX-512 build; whole panels): decode streams them
        panels = [m.packed_weight.panels for m in runner.model.modules()
                  if isinstance(getattr(m, "packed_weight", None), cpu_ops.PanelWeight)]
        runs[flag] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if flag == "1" and huge_pages_supported():
            assert aligned and "hg" in _vm_flags(runner.cache.kv.data_ptr())
            assert "hg" in _vm_flags(embed.data_ptr())  # the tiny model's embedding table is 64+ KiB
            assert panels or not cpu_ops.panels_apply(runner.model.lm_head.weight)  # the head's 512 rows: whole panels
            assert all("hg" in _vm_flags(p.data_ptr()) for p in panels)
        if flag == "0":
            assert "hg" not in _vm_flags(runner.cache.kv.data_ptr())
            assert not any("hg" in _vm_flags(p.data_ptr()) for p in panels)
    assert runs["1"] == runs["0"]


def test_switch_reads_the_environment(monkeypatch):
    from pagedllm import envs
    monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", "0")
    assert envs.PAGEDLLM_HUGE_PAGES is False
    monkeypatch.delenv("PAGEDLLM_HUGE_PAGES")
    assert envs.PAGEDLLM_HUGE_PAGES is True


PEAK_SCRIPT = """
import resource, torch
from pagedllm.platform import module_to_huge_pages
m = torch.nn.Sequential(*[torch.nn.Linear(2048, 1280, bias=False) for _ in range(10)])  # 10 x 10 MiB
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
moved = module_to_huge_pages(m)
print(moved, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_moving_a_module_peaks_at_one_tensor_not_a_second_model():
    """A model that fits in RAM once must load: the originals are let go one by one."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, check=True).stdout
    moved, growth = (int(x) for x in out.split())
    assert moved == 10 * 2048 * 1280 * 4
    assert growth < moved / 4, f"peak RSS grew {growth / 2**20:.0f} MiB moving {moved / 2**20:.0f} MiB"


def test_without_huge_pages_the_engine_says_so_and_keeps_4k_pages(llama_dir, monkeypatch, caplog):
    import logging

    from pagedllm import LLM
    monkeypatch.setattr("pagedllm.platform.huge_pages_supported", lambda: False)
    with caplog.at_level(logging.INFO, logger="pagedllm.worker.model_runner"):
        llm = LLM(llama_dir, device="cpu", block_size=8, max_model_len=64, kv_cache_memory=2**20)
    assert "weights stay in 4 KiB pages" in caplog.text
    runner = llm.llm_engine.executor.runner
    assert "hg" not in _vm_flags(runner.model.model.embed_tokens.weight.data_ptr())
    assert "hg" not in _vm_flags(runner.cache.kv.data_ptr())


def _resident_fraction(t: torch.Tensor) -> float:
    """Share of the 4 KiB pages under ``t``'s storage that are in memory (mincore(2))."""
    import ctypes
    import mmap
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    vec = (ctypes.c_ubyte * (-(-length // page)))()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / len(vec)


@pytest.mark.parametrize("flag", ["1", "0"])
def test_the_cpu_kv_pool_is_resident_before_the_first_request(llama_dir, monkeypatch, flag):
    """A pool within ``PREFAULT_SYNC_BYTES``: every page is in memory when the engine is built
    (nothing faults in while serving), and it reads zero."""
    from pagedllm import LLM
    monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", flag)
    llm = LLM(llama_dir, device="cpu", block_size=8, max_model_len=64, kv_cache_memory=8 * 2**20)
    kv = llm.llm_engine.executor.runner.cache.kv
    assert kv.numel() * kv.element_size() >= 4 * 2**20
    assert _resident_fraction(kv) == 1.0
    assert not kv.any()


needs_populate = pytest.mark.skipif(
    not huge_pages_supported() or not _kernel_populates(),
    reason="no transparent huge pages or no MADV_POPULATE_WRITE (Linux < 5.14)")


@needs_populate
def test_a_large_pool_is_populated_first_blocks_first_then_in_the_background(monkeypatch):
    """Past ``PREFAULT_SYNC_BYTES`` the first blocks (in every layer) are resident at once, the
    rest after the background thread; the values are never touched (the engine may already be
    writing its first blocks: they keep what it wrote)."""
    from pagedllm.kv_cache.spec import KVCacheSpec
    from pagedllm.worker import cache_engine
    monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", "1")
    monkeypatch.setattr(cache_engine, "PREFAULT_SYNC_BYTES", 4 * 2**20)
    started = threading.Event()
    release = threading.Event()
    real_run = cache_engine.PoolPrefault._run

    def held_run(self, first):  # hold the thread until the first blocks are checked
        started.set()
        release.wait(30)
        real_run(self, first)
    monkeypatch.setattr(cache_engine.PoolPrefault, "_run", held_run)
    spec = KVCacheSpec.full(2, 64)
    # 4 layers x K/V x 512 blocks x 2 heads x 16 x 64 fp32 = 32 MiB; a block in every slab: 64 KiB
    engine = cache_engine.CacheEngine(spec, 4, 512, 16, torch.float32, torch.device("cpu"))
    assert started.wait(30)
    first = 4 * 2**20 // (8 * 2 * 16 * 64 * 4)  # 64 blocks populated before the constructor returned
    for slab in engine.kv.flatten(0, 1):
        assert _resident_fraction(slab[:first]) == 1.0
        assert _resident_fraction(slab[-64:]) == 0.0  # a slab is 4 MiB: its second 2 MiB page is not in yet
    engine.kv[0, 0, 0].fill_(7.0)  # the engine writes its first block while the rest populates
    release.set()
    assert engine.wait_prefaulted(60)
    assert _resident_fraction(engine.kv) == 1.0
    assert engine.kv[0, 0, 0].eq(7.0).all() and engine.kv.count_nonzero() == engine.kv[0, 0, 0].numel()
    engine.close()


@needs_populate
def test_startup_prefault_populates_the_whole_pool_before_returning(monkeypatch):
    """``PAGEDLLM_KV_PREFAULT=startup``: every page is resident when the constructor returns, no
    thread runs; an unknown mode is refused naming the variable and the modes."""
    from pagedllm.kv_cache.spec import KVCacheSpec
    from pagedllm.worker import cache_engine
    monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", "1")
    monkeypatch.setenv("PAGEDLLM_KV_PREFAULT", "startup")
    monkeypatch.setattr(cache_engine, "PREFAULT_SYNC_BYTES", 2**20)  # background mode would sync 1 MiB only
    threads = []
    monkeypatch.setattr(cache_engine.PoolPrefault, "_run", lambda self, first: threads.append(first))
    engine = cache_engine.CacheEngine(KVCacheSpec.full(2, 64), 4, 512, 16, torch.float32, torch.device("cpu"))
    assert engine.wait_prefaulted(0) and _resident_fraction(engine.kv) == 1.0 and threads == []
    assert engine.kv.count_nonzero() == 0
    engine.close()
    monkeypatch.setenv("PAGEDLLM_KV_PREFAULT", "eager")
    with pytest.raises(ValueError, match=r"PAGEDLLM_KV_PREFAULT='eager' must be one of background, startup"):
        cache_engine.CacheEngine(KVCacheSpec.full(2, 64), 4, 64, 16, torch.float32, torch.device("cpu"))


@needs_populate
def test_close_stops_the_background_prefault(monkeypatch):
    from pagedllm.kv_cache.spec import KVCacheSpec
    from pagedllm.worker import cache_engine
    monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", "1")
    monkeypatch.setattr(cache_engine, "PREFAULT_SYNC_BYTES", 2**20)
    chunks = []
    real_populate = cache_engine.PoolPrefault._populate

    def counted(self, lo, hi):
        chunks.append(lo)
        return real_populate(self, lo, hi)
    monkeypatch.setattr(cache_engine.PoolPrefault, "_populate", counted)
    engine = cache_engine.CacheEngine(KVCacheSpec.full(2, 64), 4, 4096, 16, torch.float32,
                                      torch.device("cpu"))
    engine.close()  # joins the thread
    assert engine.wait_prefaulted(0)
    assert len(chunks) < 4096 // 32  # stopped before its last chunk (32 blocks per chunk here)


@needs_populate
def test_exiting_while_the_pool_populates_is_clean():
    """The interpreter exits while the thread is mid-pool: the exit joins it (a thread left in
    torch's C++ at exit is ended by an unwind that aborts the process: 'terminate called without
    an active exception', exit status 134)."""
    import subprocess
    import sys
    code = """
import torch
from pagedllm.kv_cache.spec import KVCacheSpec
from pagedllm.worker import cache_engine
cache_engine.PREFAULT_SYNC_BYTES = 2**20
engine = cache_engine.CacheEngine(KVCacheSpec.full(4, 64), 8, 4096, 16, torch.float32, torch.device("cpu"))
print(len(cache_engine._RUNNING), engine.wait_prefaulted(0))
"""
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**__import__("os").environ, "PAGEDLLM_HUGE_PAGES": "1"})
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == ["1", "False"]  # it was still running when the script ended
