"""KV tiers end to end: a prefix evicted from the device pool is found again in the CPU tier,
on disk, and on disk after a restart, and the outputs are the ones the engine computes without
any cache (greedy and seeded sampling; block sizes 8 and 16; a document ending mid-block)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_model_dir, random_prompts

from pagedllm import LLM, SamplingParams

MAX_LEN = 128
DOC = random_prompts(1, seed=40, lo=61, hi=62)[0]  # 61 tokens: the last block is partial for 8 and 16
QUESTIONS = random_prompts(6, seed=41, lo=3, hi=9)
FILLERS = random_prompts(2, seed=42, lo=100, hi=101)  # each takes most of the pool: evicts the document
PROMPTS = [DOC + q for q in QUESTIONS]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=8, ignore_eos=True)


def _block_bytes(block_size: int) -> int:
    return 2 * 2 * 2 * 16 * block_size * 4  # layers x K/V x kv heads x head_dim x tokens x float32


def _llm(model_dir: str, block_size: int, cpu_blocks: float = 0, disk: Path | None = None, disk_gb: float = 1e-3,
         **kw) -> LLM:
    tiers = {}
    if cpu_blocks:
        tiers["kv_offload_cpu_gb"] = (cpu_blocks + 0.5) * _block_bytes(block_size) / 2**30
    if disk is not None:
        tiers.update(kv_offload_dir=str(disk), kv_offload_disk_gb=disk_gb)
    return LLM(model_dir, block_size=block_size, max_model_len=MAX_LEN,
               num_gpu_blocks_override=MAX_LEN // block_size + 2, **tiers, **kw)


def _run(llm: LLM, i: int) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]}] * 2, [GREEDY, SEEDED], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _evict(llm: LLM) -> None:
    llm.generate([{"prompt_token_ids": f} for f in FILLERS[:1]], GREEDY, use_tqdm=False)
    llm.generate([{"prompt_token_ids": f} for f in FILLERS[1:]], GREEDY, use_tqdm=False)
    llm.llm_engine.flush_kv_tiers()  # disk writes run in the background: a lookup before they land misses


def _tier(llm: LLM, tier: str) -> dict:
    return llm.get_kv_cache_stats().offload[tier]


def _assert_all_blocks_free(llm: LLM) -> None:
    s = llm.get_kv_cache_stats()
    assert s.num_free_blocks == s.num_blocks
    llm.llm_engine.scheduler.kv.check_integrity()


@pytest.fixture(scope="module", params=[8, 16])
def block_size(request):
    return request.param


@pytest.fixture(scope="module")
def expected(llama_dir, block_size):
    """Every prompt computed from scratch (no prefix cache at all)."""
    llm = _llm(llama_dir, block_size, enable_prefix_caching=False)
    return [_run(llm, i) for i in range(len(PROMPTS))]


def test_cpu_tier_hit_matches_recompute(llama_dir, block_size, expected):
    llm = _llm(llama_dir, block_size, cpu_blocks=64)
    assert _run(llm, 0) == expected[0]  # cold
    assert _run(llm, 1) == expected[1]  # device hit
    assert _tier(llm, "cpu")["hits"] == 0
    _evict(llm)
    hits_before = llm.get_kv_cache_stats().prefix_cache_hits
    assert _run(llm, 2) == expected[2]
    cpu = _tier(llm, "cpu")
    assert cpu["hits"] >= len(DOC) // block_size  # the whole document came back from the CPU tier
    assert cpu["bytes_loaded"] == cpu["hits"] * _block_bytes(block_size)
    assert cpu["stored_blocks"] > 0 and cpu["load_seconds"] > 0
    assert llm.get_kv_cache_stats().prefix_cache_hits - hits_before >= 2 * (len(DOC) // block_size) * block_size
    metrics = {(m.name, tuple(sorted(m.labels.items()))): m.value for m in llm.get_metrics()}
    assert metrics[("pagedllm:kv_offload_hits", (("tier", "cpu"),))] == cpu["hits"]
    assert metrics[("pagedllm:kv_offload_bytes", (("direction", "load"), ("tier", "cpu")))] == cpu["bytes_loaded"]
    _assert_all_blocks_free(llm)


@pytest.mark.parametrize("cpu_blocks", [0, 2])  # straight from the device to disk / through a tiny CPU tier
def test_disk_tier_hit_and_restart_match_recompute(llama_dir, block_size, expected, tmp_path, cpu_blocks):
    llm = _llm(llama_dir, block_size, cpu_blocks=cpu_blocks, disk=tmp_path)
    assert _run(llm, 0) == expected[0]
    _evict(llm)
    assert _run(llm, 3) == expected[3]
    assert _tier(llm, "disk")["hits"] >= len(DOC) // block_size - cpu_blocks
    _assert_all_blocks_free(llm)
    llm.llm_engine.shutdown()  # waits for its queued writes
    restarted = _llm(llama_dir, block_size, cpu_blocks=cpu_blocks, disk=tmp_path)
    assert _run(restarted, 4) == expected[4]
    assert _tier(restarted, "disk")["hits"] == len(DOC) // block_size
    _assert_all_blocks_free(restarted)


def test_shutdown_writes_the_prefixes_still_cached_to_disk(llama_dir, block_size, expected, tmp_path):
    """Nothing was evicted: the document lives only in the device pool until shutdown writes it."""
    llm = _llm(llama_dir, block_size, cpu_blocks=2, disk=tmp_path)
    _run(llm, 0)
    assert not any(tmp_path.rglob("*.kv"))
    llm.llm_engine.shutdown()
    restarted = _llm(llama_dir, block_size, cpu_blocks=2, disk=tmp_path)
    assert _run(restarted, 1) == expected[1]
    assert _tier(restarted, "disk")["hits"] == len(DOC) // block_size
    _assert_all_blocks_free(restarted)


def test_changed_fingerprint_never_hits(llama_dir, tmp_path):
    llm = _llm(llama_dir, 8, disk=tmp_path)
    _run(llm, 0)
    _evict(llm)
    llm.llm_engine.shutdown()
    other = _llm(make_model_dir(tmp_path / "other", seed=1), 8, disk=tmp_path)  # other weights, same shapes
    _run(other, 1)
    assert _tier(other, "disk")["hits"] == 0
    half = _llm(llama_dir, 8, disk=tmp_path, kv_cache_dtype="bfloat16")
    _run(half, 1)
    assert _tier(half, "disk")["hits"] == 0


def test_corrupt_entries_are_recomputed_and_removed(llama_dir, block_size, expected, tmp_path):
    llm = _llm(llama_dir, block_size, disk=tmp_path)
    _run(llm, 0)
    _evict(llm)
    llm.llm_engine.shutdown()
    files = list(tmp_path.rglob("*.kv"))
    assert len(files) >= len(DOC) // block_size
    for i, f in enumerate(files):  # every other one truncated, the rest with one bit flipped
        data = bytearray(f.read_bytes())
        data[-3] ^= 0x01
        f.write_bytes(bytes(data[: len(data) // 2] if i % 2 else data))
    restarted = _llm(llama_dir, block_size, disk=tmp_path)
    assert _run(restarted, 5) == expected[5]
    disk = _tier(restarted, "disk")
    assert disk["hits"] == 0 and disk["misses"] >= 1
    assert len(list(tmp_path.rglob("*.kv"))) < len(files)  # the bad entries it met are gone
    _assert_all_blocks_free(restarted)


def test_reset_prefix_cache_clears_cpu_and_with_the_flag_disk(llama_dir, tmp_path):
    llm = _llm(llama_dir, 8, cpu_blocks=4, disk=tmp_path)
    _run(llm, 0)
    _evict(llm)
    assert _tier(llm, "cpu")["num_used_blocks"] > 0
    assert llm.reset_prefix_cache() is True
    assert _tier(llm, "cpu")["num_used_blocks"] == 0 and any(tmp_path.rglob("*.kv"))
    assert llm.reset_prefix_cache(reset_disk=True) is True
    assert not any(tmp_path.rglob("*.kv"))
    _run(llm, 1)
    assert _tier(llm, "cpu")["hits"] == _tier(llm, "disk")["hits"] == 0


def test_disk_budget_holds(llama_dir, tmp_path):
    budget_blocks = 5
    llm = LLM(llama_dir, block_size=8, max_model_len=MAX_LEN, num_gpu_blocks_override=MAX_LEN // 8 + 2,
              kv_offload_dir=str(tmp_path), kv_offload_disk_gb=(budget_blocks * 2200) / 2**30)
    _run(llm, 0)
    _evict(llm)
    llm.llm_engine.shutdown()
    files = list(tmp_path.rglob("*.kv"))
    assert 0 < len(files) <= budget_blocks
    assert sum(f.stat().st_size for f in files) <= budget_blocks * 2200


def test_tensor_parallel_ranks_keep_their_own_entries_and_agree_on_bad_ones(llama_dir, tmp_path):
    """Under TP each rank stores its own shard (its own fingerprint); an entry damaged on rank 1
    only is a miss for every rank, so no rank runs with K/V the others lack."""
    from pagedllm.kv_cache.offload.fingerprint import kv_fingerprint
    reference = _llm(llama_dir, 8, enable_prefix_caching=False)
    expected = [_run(reference, i) for i in (1, 2)]
    llm = _llm(llama_dir, 8, cpu_blocks=2, disk=tmp_path, tensor_parallel_size=2, num_threads=1)
    try:
        _run(llm, 0)
        _evict(llm)
        assert _run(llm, 1) == expected[0]
        assert _tier(llm, "disk")["hits"] > 0
        llm.reset_prefix_cache()  # forget the CPU tier and the device pool; waits for the writes
        rank1 = tmp_path / kv_fingerprint(llm.llm_engine.config, 1)
        assert len({p.parent for p in tmp_path.rglob("*.kv")}) == 2 and any(rank1.iterdir())
        for f in rank1.iterdir():
            data = bytearray(f.read_bytes())
            data[-1] ^= 0x80
            f.write_bytes(bytes(data))
        hits = _tier(llm, "disk")["hits"]
        assert _run(llm, 2) == expected[1]
        assert _tier(llm, "disk")["hits"] == hits
        _assert_all_blocks_free(llm)
    finally:
        llm.llm_engine.shutdown()


def test_two_engines_sharing_a_directory_concurrently(llama_dir, tmp_path):
    """Two engines (same model: same fingerprint) evict into one directory at the same time; every
    file left is whole, and a third engine finds both documents there."""
    import threading

    from pagedllm.kv_cache.offload.disk_tier import DiskTier
    from pagedllm.kv_cache.offload.fingerprint import DIGEST_CACHE, kv_fingerprint
    docs = random_prompts(2, seed=43, lo=64, hi=65)
    engines = [_llm(llama_dir, 8, cpu_blocks=1, disk=tmp_path) for _ in range(2)]

    def work(llm: LLM, doc: list[int]) -> None:
        for filler in FILLERS:
            llm.generate([{"prompt_token_ids": doc + [5]}, {"prompt_token_ids": filler}], GREEDY, use_tqdm=False)

    threads = [threading.Thread(target=work, args=(e, d)) for e, d in zip(engines, docs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in engines:
        e.llm_engine.shutdown()
    config = engines[0].llm_engine.config
    tier = DiskTier(tmp_path, kv_fingerprint(config, 0), 1 << 30)
    files = list(tmp_path.rglob("*"))
    # no temporary files: blocks, directories, the lock and the weights' digest cache only
    assert all(f.suffix == ".kv" or f.is_dir() or f.name in (".lock", DIGEST_CACHE) for f in files)
    shape = (2, 2, 2, 8, 16)  # [layers, K/V, kv heads, block_size, head_dim]
    assert all(tier.read(bytes.fromhex(f.stem), shape, torch.float32) is not None for f in files if f.suffix == ".kv")
    third = _llm(llama_dir, 8, disk=tmp_path)
    for doc in docs:
        third.generate([{"prompt_token_ids": doc + [6]}], GREEDY, use_tqdm=False)
    assert _tier(third, "disk")["hits"] == 2 * (64 // 8)


def test_tier_metrics_on_the_prometheus_endpoint(llama_dir):
    from pagedllm.metrics.prometheus import PrometheusMetrics
    llm = _llm(llama_dir, 8, cpu_blocks=64)
    _run(llm, 0)
    _evict(llm)
    _run(llm, 1)
    text = PrometheusMetrics("m").render(llm.get_metrics()).decode()
    hits = _tier(llm, "cpu")["hits"]
    assert hits > 0
    assert f'pagedllm:kv_offload_hits_total{{model_name="m",tier="cpu"}} {float(hits)}' in text
    assert 'pagedllm:kv_offload_bytes_total{direction="load",model_name="m",tier="cpu"}' in text


def test_weights_rewritten_in_place_never_hit_the_old_entries(tmp_path):
    """A fine-tune overwritten in place by its next epoch: same size, modification time put back,
    same first and last MiB. The old K/V on disk must not be served: no hit, and the outputs are
    those of the new weights computed from scratch."""
    import shutil

    from weights_rewrite import rewrite_in_place_keeping_size_mtime_and_ends
    model = make_model_dir(tmp_path / "model", intermediate_size=1536)  # weights past 2 MiB
    donor = make_model_dir(tmp_path / "donor", seed=1, intermediate_size=1536)
    llm = _llm(model, 8, disk=tmp_path / "tier")
    _run(llm, 0)
    _evict(llm)
    llm.llm_engine.shutdown()
    assert any((tmp_path / "tier").rglob("*.kv"))
    rewrite_in_place_keeping_size_mtime_and_ends(Path(model) / "model.safetensors",
                                                 Path(donor) / "model.safetensors")
    shutil.rmtree(Path(donor))
    reference = _llm(model, 8, enable_prefix_caching=False)
    expected = [_run(reference, i) for i in (1, 2)]
    restarted = _llm(model, 8, disk=tmp_path / "tier")
    assert [_run(restarted, i) for i in (1, 2)] == expected
    assert _tier(restarted, "disk")["hits"] == 0
    _assert_all_blocks_free(restarted)
