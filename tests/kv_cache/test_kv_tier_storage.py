"""The KV tiers' storage pieces on their own: the disk tier's file format, checksum, budget and
sharing between processes; the CPU tier's LRU index; the fingerprint."""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from weights_rewrite import rewrite_in_place_keeping_size_mtime_and_ends

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.kv_cache.offload.cpu_tier import CpuTierIndex
from pagedllm.kv_cache.offload.disk_tier import DiskTier
from pagedllm.kv_cache.offload.fingerprint import kv_fingerprint

SHAPE = (2, 2, 2, 8, 16)  # [num_layers, K/V, kv heads, block_size, head_dim]
FP = "ab" * 32


def _block(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def _hash(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8  # 32 bytes, like a SHA-256 block hash


def _file_bytes(tier: DiskTier) -> int:
    return len(tier.encode(_hash(0), _block(0)))


def test_round_trip_is_bit_exact_for_every_dtype(tmp_path):
    tier = DiskTier(tmp_path, FP, 1 << 20)
    for i, dtype in enumerate((torch.float32, torch.float16, torch.bfloat16)):
        block = _block(i).to(dtype)
        tier.write_many([(_hash(i), block)])
        assert torch.equal(tier.read(_hash(i), SHAPE, dtype), block)
    assert tier.read(_hash(99), SHAPE, torch.float32) is None  # absent: a plain miss


def test_entry_written_with_another_fingerprint_or_shape_is_never_read(tmp_path, caplog):
    DiskTier(tmp_path, FP, 1 << 20).write_many([(_hash(1), _block(1))])
    other = DiskTier(tmp_path, "cd" * 32, 1 << 20)
    assert not other.contains(_hash(1))
    # the same file under the other fingerprint's name: its header still names the first one
    os.link(tmp_path / FP / (_hash(1).hex() + ".kv"), other.path(_hash(1)))
    with caplog.at_level(logging.WARNING):
        assert other.read(_hash(1), SHAPE, torch.float32) is None
    assert "fingerprint" in caplog.text and not other.path(_hash(1)).exists()
    assert DiskTier(tmp_path, FP, 1 << 20).read(_hash(1), SHAPE[:-1] + (8,), torch.float32) is None


@pytest.mark.parametrize("damage", ["truncate", "bitflip_payload", "bitflip_header", "empty"])
def test_damaged_file_is_a_miss_logged_once_and_deleted(tmp_path, caplog, damage):
    tier = DiskTier(tmp_path, FP, 1 << 20)
    tier.write_many([(_hash(1), _block(1))])
    path = tier.path(_hash(1))
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:-7]
    elif damage == "empty":
        data = bytearray()
    else:
        data[-5 if damage == "bitflip_payload" else 20] ^= 0x10
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert tier.read(_hash(1), SHAPE, torch.float32) is None
        path.write_bytes(bytes(data))  # the same bad file again: still a miss, not logged twice
        assert tier.read(_hash(1), SHAPE, torch.float32) is None
    assert caplog.text.count("treated as a miss") == 1
    assert not path.exists()


def test_budget_evicts_least_recently_used_files(tmp_path):
    size = _file_bytes(DiskTier(tmp_path, FP, 1))
    tier = DiskTier(tmp_path, FP, 3 * size)
    tier.write_many([(_hash(i), _block(i)) for i in range(3)])
    os.utime(tier.path(_hash(0)), (1e9, 1e9))  # 0 is old, then 1, 2; reading 1 makes it newest
    os.utime(tier.path(_hash(1)), (1e9 + 1, 1e9 + 1))
    os.utime(tier.path(_hash(2)), (1e9 + 2, 1e9 + 2))
    assert tier.read(_hash(1), SHAPE, torch.float32) is not None
    tier.write_many([(_hash(3), _block(3)), (_hash(4), _block(4))])
    assert [tier.contains(_hash(i)) for i in range(5)] == [False, True, False, True, True]
    assert tier.usage_bytes() <= 3 * size
    small = DiskTier(tmp_path / "small", FP, size - 1)  # a block larger than the budget is skipped
    assert small.write_many([(_hash(0), _block(0))]) == 0 and not small.contains(_hash(0))


def test_clear_removes_only_this_fingerprint(tmp_path):
    a, b = DiskTier(tmp_path, FP, 1 << 20), DiskTier(tmp_path, "cd" * 32, 1 << 20)
    a.write_many([(_hash(1), _block(1))])
    b.write_many([(_hash(1), _block(1))])
    a.clear()
    assert not a.contains(_hash(1)) and b.contains(_hash(1))


def _writer(root: str, budget: int, start: int, count: int) -> None:
    tier = DiskTier(root, FP, budget)
    for i in range(start, start + count, 4):
        tier.write_many([(_hash(j), _block(j)) for j in range(i, min(i + 4, start + count))])
        tier.read(_hash(i), SHAPE, torch.float32)


def test_two_processes_sharing_a_directory_stay_consistent_and_within_budget(tmp_path):
    size = _file_bytes(DiskTier(tmp_path, FP, 1 << 20))
    budget = 25 * size + size // 2
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), budget, k * 1000, 60)) for k in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    tier = DiskTier(tmp_path, FP, budget)
    files = sorted(Path(tmp_path, FP).iterdir())
    assert 0 < len(files) <= 25 and tier.usage_bytes() <= budget
    assert all(f.suffix == ".kv" for f in files)  # no temporary file left behind
    for f in files:  # every entry left is whole and holds the block its name says
        i = int.from_bytes(bytes.fromhex(f.stem)[:4], "little")
        assert torch.equal(tier.read(_hash(i), SHAPE, torch.float32), _block(i))


def test_cpu_tier_lru_with_pins():
    cpu = CpuTierIndex(2)
    assert cpu.insert(b"a") == (0, None) and cpu.insert(b"b") == (1, None)
    cpu.touch(b"a")  # b is now least recently used
    assert cpu.insert(b"c") == (1, (b"b", 1))
    cpu.pin(0)  # a is being loaded from: c goes instead
    cpu.pin(1)
    assert cpu.insert(b"d") is None  # every slot pinned: nothing evicted
    cpu.unpin(1)
    assert cpu.insert(b"d") == (1, (b"c", 1))
    with pytest.raises(AssertionError, match="pinned"):  # between steps no load holds a slot
        cpu.check_integrity()
    cpu.unpin(0)
    cpu.check_integrity()
    cpu.clear()
    assert len(cpu) == 0 and cpu.insert(b"x") == (0, None)


@pytest.fixture(scope="module")
def base_config(llama_dir):
    return EngineArgs(model=llama_dir, block_size=8).create_engine_config()


def test_fingerprint_changes_with_everything_that_changes_kv(base_config, tmp_path):
    from conftest import make_model_dir
    fp = kv_fingerprint(base_config, 0)
    assert kv_fingerprint(base_config, 0) == fp  # stable: a restart finds its entries
    cache, model = base_config.cache, base_config.model
    changed = [
        kv_fingerprint(base_config, 1),
        kv_fingerprint(replace(base_config, cache=replace(cache, block_size=16)), 0),
        kv_fingerprint(replace(base_config, cache=replace(cache, cache_dtype=torch.bfloat16)), 0),
        kv_fingerprint(replace(base_config, model=replace(model, dtype=torch.bfloat16)), 0),
        kv_fingerprint(replace(base_config, parallel=replace(base_config.parallel, tensor_parallel_size=2)), 0),
        kv_fingerprint(replace(base_config, model=replace(model, model=make_model_dir(tmp_path, seed=1))), 0),
    ]
    assert len({fp, *changed}) == len(changed) + 1


def test_eviction_while_every_cpu_slot_is_pinned_still_reaches_disk(tmp_path):
    from pagedllm.contracts.tier_ops import CPU_TO_DISK, DEVICE_TO_CPU, DEVICE_TO_DISK
    from pagedllm.kv_cache.offload.manager import OffloadManager
    mgr = OffloadManager(1, [DiskTier(tmp_path, FP, 1 << 20)], block_bytes=10)
    mgr.on_evict(3, _hash(1))
    assert mgr.take_ops().moves == [(DEVICE_TO_CPU, 3, 0), (DEVICE_TO_DISK, 3, _hash(1))]  # write-through
    mgr.pin(0)  # a load reads slot 0 this step
    mgr.on_evict(4, _hash(2))
    assert mgr.take_ops().moves == [(DEVICE_TO_DISK, 4, _hash(2))]
    mgr.cpu.unpin(0)
    mgr.on_evict(5, _hash(3))  # slot 0's entry leaves the CPU tier: its disk write never landed, so it spills
    assert mgr.take_ops().moves == [(CPU_TO_DISK, 0, _hash(1)), (DEVICE_TO_CPU, 5, 0), (DEVICE_TO_DISK, 5, _hash(3))]
    assert mgr.stats["cpu"].stored_blocks == 2 and mgr.stats["disk"].bytes_stored == 40


def test_a_block_written_through_and_evicted_from_the_cpu_tier_in_one_step_is_queued_for_disk_once(tmp_path):
    from pagedllm.contracts.tier_ops import CPU_TO_DISK, DEVICE_TO_CPU, DEVICE_TO_DISK
    from pagedllm.kv_cache.offload.manager import OffloadManager
    mgr = OffloadManager(1, [DiskTier(tmp_path, FP, 1 << 20)], block_bytes=10)
    for block, i in [(3, 1), (4, 2), (5, 3)]:  # one step's run of evictions through a 1-slot CPU tier
        mgr.on_evict(block, _hash(i))
    moves = mgr.take_ops().moves
    disk_writes = [h for kind, _, h in moves if kind in (CPU_TO_DISK, DEVICE_TO_DISK)]
    assert disk_writes == [_hash(1), _hash(2), _hash(3)]  # each write-through once, no CPU spill of it
    assert [m for m in moves if m[0] == DEVICE_TO_CPU] == [(DEVICE_TO_CPU, 3, 0), (DEVICE_TO_CPU, 4, 0),
                                                           (DEVICE_TO_CPU, 5, 0)]
    assert mgr.stats["disk"].stored_blocks == 3


def test_an_engine_reads_the_weights_for_its_fingerprints_once(llama_dir, tmp_path, monkeypatch):
    """The executor computes every rank's disk-tier fingerprint once and hands them to the ranks
    and the scheduler (which used to recompute them: one read of the weights each)."""
    from pagedllm import LLM
    from pagedllm.kv_cache.offload import fingerprint
    reads, real = [], fingerprint.weights_identity
    monkeypatch.setattr(fingerprint, "weights_identity", lambda d, cache: reads.append(d) or real(d, cache))
    llm = LLM(llama_dir, block_size=8, max_model_len=64, num_gpu_blocks_override=16, kv_offload_dir=str(tmp_path))
    assert reads == [llm.llm_engine.config.model.model]
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [fingerprint.kv_fingerprint(llm.llm_engine.config, 0)]
    llm.llm_engine.shutdown()


def _store(num_slots: int = 8, device: str = "cpu"):
    from pagedllm.distributed.parallel_state import TensorParallelGroup
    from pagedllm.kv_cache.offload.worker_store import TierStore
    kv = torch.randn(2, 2, 16, 2, 8, 16, device=device)  # [layers, K/V, blocks, kv heads, block_size, head_dim]
    return TierStore(kv, num_slots, None, TensorParallelGroup())


def _largest_allocation(fn) -> int:
    """Bytes of the largest CPU allocation any op made while ``fn`` ran (torch's profiler)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


def test_cpu_tier_round_trip_copies_without_temporaries():
    """Blocks evicted to CPU slots (runs and gaps) come back bit-exact into other device blocks;
    on a CPU pool both directions copy block to slot directly: no gathered temporary (the old
    path allocated one for every batch of evictions)."""
    from pagedllm.contracts.tier_ops import DEVICE_TO_CPU, TIER_CPU, LoadItem, LoadJob, TierOps
    store = _store()
    pairs = [(7, 3), (2, 4), (5, 5), (1, 0)]  # (device block, CPU slot): a run of three, then slot 0
    expected = {slot: store.kv[:, :, block].clone() for block, slot in pairs}
    evict = TierOps(moves=[(DEVICE_TO_CPU, b, s) for b, s in pairs])
    assert _largest_allocation(lambda: store.apply(evict)) < store.kv[:, :, 0].nbytes
    load = TierOps(loads=[LoadJob("r", tuple(LoadItem(b, TIER_CPU, b"h", s) for b, s in
                                            [(12, 3), (13, 4), (14, 5), (15, 0)]))])
    assert _largest_allocation(lambda: store.apply(load)) < store.kv[:, :, 0].nbytes
    assert store.collect().num_ok == {"r": 4}
    for block, slot in [(12, 3), (13, 4), (14, 5), (15, 0)]:
        assert torch.equal(store.kv[:, :, block], expected[slot])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_tier_round_trip_from_a_cuda_pool():
    """The CUDA branch (one gather on the device, one pinned copy per run of consecutive slots,
    and back): evicted blocks return bit-exact into other device blocks."""
    from pagedllm.contracts.tier_ops import DEVICE_TO_CPU, TIER_CPU, LoadItem, LoadJob, TierOps
    store = _store(device="cuda")
    pairs = [(7, 3), (2, 4), (5, 5), (1, 0)]  # a run of three slots, then slot 0
    expected = {slot: store.kv[:, :, block].cpu() for block, slot in pairs}
    store.apply(TierOps(moves=[(DEVICE_TO_CPU, b, s) for b, s in pairs]))
    targets = [(12, 3), (13, 4), (14, 5), (15, 0)]
    store.apply(TierOps(loads=[LoadJob("r", tuple(LoadItem(b, TIER_CPU, b"h", s) for b, s in targets))]))
    assert store.collect().num_ok == {"r": 4}
    for block, slot in targets:
        assert torch.equal(store.kv[:, :, block].cpu(), expected[slot])


def test_consecutive_runs():
    from pagedllm.kv_cache.offload.worker_store import consecutive_runs
    assert consecutive_runs([3, 4, 5, 0, 1, 7]) == [(0, 3, 3), (3, 0, 2), (5, 7, 1)]
    assert consecutive_runs([]) == []


@pytest.fixture(scope="module")
def big_llama_dirs(tmp_path_factory):
    """Two tiny Llamas with the same layout and weights files past 2 MiB (seeds 0 and 1)."""
    from conftest import make_model_dir
    return [make_model_dir(tmp_path_factory.mktemp(f"big{seed}"), seed=seed, intermediate_size=1536)
            for seed in (0, 1)]


def test_weights_identity_sees_an_in_place_rewrite_and_hashes_once_per_file_identity(big_llama_dirs, tmp_path,
                                                                                      monkeypatch):
    import shutil

    from pagedllm.kv_cache.offload import fingerprint
    model = Path(shutil.copytree(big_llama_dirs[0], tmp_path / "model"))
    weights = model / "model.safetensors"
    hashed = []
    real = fingerprint.content_digest
    monkeypatch.setattr(fingerprint, "content_digest", lambda p: hashed.append(p) or real(p))
    cache_dir = tmp_path / "tier"
    before = fingerprint.weights_identity(model, cache_dir)
    assert hashed == [weights] and (cache_dir / fingerprint.DIGEST_CACHE).exists()
    assert fingerprint.weights_identity(model, cache_dir) == before and len(hashed) == 1  # cached
    head, tail = weights.read_bytes()[:1 << 20], weights.read_bytes()[-(1 << 20):]
    rewrite_in_place_keeping_size_mtime_and_ends(weights, Path(big_llama_dirs[1]) / "model.safetensors")
    assert (weights.read_bytes()[:1 << 20], weights.read_bytes()[-(1 << 20):]) == (head, tail)
    after = fingerprint.weights_identity(model, cache_dir)
    assert after != before and len(hashed) == 2  # the ctime moved: the cached digest was not used
    assert fingerprint.weights_identity(model, None) == after  # the cache only saves work


def test_digest_cache_that_cannot_be_read_or_written_only_costs_a_rehash(big_llama_dirs, tmp_path):
    from pagedllm.kv_cache.offload import fingerprint
    expected = fingerprint.weights_identity(big_llama_dirs[0], None)
    (tmp_path / fingerprint.DIGEST_CACHE).write_text("{not json")
    assert fingerprint.weights_identity(big_llama_dirs[0], tmp_path) == expected
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert fingerprint.weights_identity(big_llama_dirs[0], blocked / "sub") == expected  # ENOTDIR on save
