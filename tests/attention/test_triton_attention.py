"""TritonAttentionBackend against the torch reference and dense float64 attention.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), at ~0.1-1 s per launch, so shapes are tiny and each parametrized axis
covers every value without taking the cartesian product. With a GPU the same tests run the
compiled kernels on it, and the ``gpu`` tests add what the interpreter cannot check.
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest
import torch
from concurrent_runs import run_side_by_side

from pagedllm.attention.testing import PagedBatch, dense_attention_f64, gather_context, make_paged_batch
from pagedllm.attention.torch_ref import TorchReferenceBackend

triton_backend = pytest.importorskip("pagedllm.attention.triton.backend")
from pagedllm.attention import triton as triton_pkg  # noqa: E402 - after the importorskip
from pagedllm.attention.triton import plan  # noqa: E402
from pagedllm.attention.triton.backend import TritonAttentionBackend  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_torch_thread")
DEVICE = "cpu" if triton_pkg.interpreting() else "cuda"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# (num_cached, q_len): decodes, fresh and mid-context prefill chunks, partial blocks, a request
# with no new tokens this step
MIXED = [(0, 1), (37, 1), (5, 20), (40, 9), (0, 17), (20, 0), (16, 16)]
ATOL = RTOL = 1e-5


def run(backend, batch: PagedBatch, query=None, **kwargs):
    """Runs ``backend`` on fresh copies of the pool; returns (out, key cache, value cache) on the CPU."""
    batch = batch.to(DEVICE) if isinstance(backend, TritonAttentionBackend) else batch
    kc, vc = batch.fresh_caches()
    q = batch.query if query is None else query.to(batch.query.device)
    out = backend.forward(q, batch.key, batch.value, kc, vc, batch.meta, batch.scale, **kwargs)
    return out.cpu(), kc.cpu(), vc.cpu()


def check(batch: PagedBatch, backend=None, atol=ATOL, **kwargs) -> torch.Tensor:
    """The Triton output equals the torch reference and float64 attention; the pool equals the
    reference's pool after the write (new slots written, nothing else touched)."""
    out, kc, vc = run(backend or TritonAttentionBackend(num_kv_splits=1), batch, **kwargs)
    ref, kc_ref, vc_ref = run(TorchReferenceBackend(), batch, **kwargs)
    torch.testing.assert_close(out, ref, atol=atol, rtol=RTOL)
    dense = dense_attention_f64(batch, kwargs.get("sliding_window"), kwargs.get("logits_soft_cap"))
    torch.testing.assert_close(out.double(), dense, atol=atol, rtol=RTOL)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    return out


# every block size, GQA ratio (query heads per KV head) and head dim, each at least once
@pytest.mark.parametrize("block_size, group, head_dim", [
    (8, 1, 64), (16, 4, 80), (32, 8, 96), (64, 1, 128), (128, 4, 256), (16, 8, 64)])
def test_mixed_batch_matches_reference_and_dense(block_size, group, head_dim):
    batch = make_paged_batch(MIXED, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                             block_size=block_size, seed=block_size + group)  # fmt: skip
    check(batch)


def test_group_larger_than_one_program():
    """20 query heads per KV head: two programs per KV head (16 + 4 heads)."""
    check(make_paged_batch([(9, 1), (3, 5)], num_heads=20, num_kv_heads=1, head_dim=64, block_size=8))


@pytest.mark.parametrize("window", [1, 5, 37])
def test_sliding_window(window):
    batch = make_paged_batch(MIXED + [(60, 12)], num_heads=4, num_kv_heads=1, head_dim=64, block_size=16,
                             seed=window)  # fmt: skip
    out = check(batch, sliding_window=window)
    assert not torch.allclose(out.double(), dense_attention_f64(batch), atol=1e-3)  # the window mattered


@pytest.mark.parametrize("window", [None, 7])
def test_logits_soft_cap(window):
    batch = make_paged_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, seed=3)
    batch = replace(batch, scale=1.0)  # scores ~ N(0, 8): the cap at 2 changes them a lot
    out = check(batch, sliding_window=window, logits_soft_cap=2.0)
    assert not torch.allclose(out.double(), dense_attention_f64(batch, window), atol=1e-2)


def test_torch_backends_soft_cap_and_cpu_refuses_it():
    from pagedllm.attention.sdpa import SdpaBackend
    batch = make_paged_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    dense = dense_attention_f64(batch, 5, 1.5)
    for backend in (TorchReferenceBackend(), SdpaBackend()):
        out, _, _ = run(backend, batch, sliding_window=5, logits_soft_cap=1.5)
        torch.testing.assert_close(out.double(), dense, atol=ATOL, rtol=RTOL)
    from pagedllm.attention.cpu import CpuAttentionBackend
    if CpuAttentionBackend.is_available():
        with pytest.raises(ValueError, match="logits_soft_cap=1.5 is not supported by attention_backend='cpu'"):
            run(CpuAttentionBackend(), batch, logits_soft_cap=1.5)


@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_split_kv_equals_unsplit(num_splits):
    """Long decodes plus a short prefill chunk and a window: splits that see no key at all
    (more splits than key tiles, or tiles outside the window) must merge away."""
    batch = make_paged_batch([(200, 1), (3, 1), (90, 2), (20, 0)], num_heads=8, num_kv_heads=2, head_dim=64,
                             block_size=16, seed=num_splits)  # fmt: skip
    unsplit = check(batch)
    split = check(batch, TritonAttentionBackend(num_kv_splits=num_splits))
    torch.testing.assert_close(split, unsplit, atol=1e-6, rtol=1e-6)
    check(batch, TritonAttentionBackend(num_kv_splits=num_splits), sliding_window=40)


def test_heuristic_splits_only_small_long_decode_steps():
    assert plan.choose_num_kv_splits(num_programs=8, max_query_len=1, max_seq_len=8192, num_sms=132) == 32
    assert plan.choose_num_kv_splits(num_programs=64, max_query_len=1, max_seq_len=8192, num_sms=132) == 5
    assert plan.choose_num_kv_splits(num_programs=8, max_query_len=1, max_seq_len=700, num_sms=132) == 2
    assert plan.choose_num_kv_splits(num_programs=8, max_query_len=1, max_seq_len=300, num_sms=132) == 1
    assert plan.choose_num_kv_splits(num_programs=8, max_query_len=512, max_seq_len=8192, num_sms=132) == 1
    assert plan.choose_num_kv_splits(num_programs=400, max_query_len=1, max_seq_len=8192, num_sms=132) == 1


def test_float16():
    batch = make_paged_batch(MIXED, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                             cache_dtype=torch.float16)  # fmt: skip
    batch = replace(batch, query=batch.query.half(), key=batch.key.half(), value=batch.value.half())
    out, kc, _ = run(TritonAttentionBackend(), batch)
    assert out.dtype == torch.float16 and kc.dtype == torch.float16
    # the probabilities go through float16 for the P @ V product, as in FlashAttention
    ref = dense_attention_f64(replace(batch, query=batch.query.float()))
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)
    for r in range(batch.meta.num_reqs):
        assert torch.equal(gather_context(kc, batch, r).float(), batch.ctx_k[r])


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_float32_model_over_half_cache(cache_dtype):
    """K/V are rounded to the cache dtype on write and computed in float32 on read (bfloat16
    conversions only: the interpreter's bfloat16 arithmetic is wrong, triton#11584); fp8 caches
    the same way (the reference attends over the fp8-rounded K/V)."""
    batch = make_paged_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=8,
                             cache_dtype=cache_dtype)  # fmt: skip
    out = check(batch)
    assert out.dtype == torch.float32


@pytest.mark.parametrize("cache_dtype, num_splits", [(torch.float8_e4m3fn, 1), (torch.float8_e5m2, 2)])
def test_float16_model_over_fp8_cache(cache_dtype, num_splits):
    """The tensor-core path of an fp8 cache: q stays float16 and K/V are widened to float16 in
    registers (exact for e4m3 and e5m2), P goes through float16 for P @ V as with a float16
    cache; equals the torch reference (which widens to float32) within float16's rounding, and
    the pool holds the same fp8 bytes. (bfloat16 models take the same code path; the
    interpreter's bfloat16 arithmetic is wrong, triton#11584, so they are checked on a GPU.)"""
    batch = make_paged_batch([(0, 1), (37, 1), (5, 20), (20, 0)], num_heads=4, num_kv_heads=2, head_dim=64,
                             block_size=8, cache_dtype=cache_dtype)  # fmt: skip
    batch = replace(batch, query=batch.query.half(), key=batch.key.half(), value=batch.value.half())
    out, kc, vc = run(TritonAttentionBackend(num_kv_splits=num_splits), batch)
    ref, kc_ref, vc_ref = run(TorchReferenceBackend(), batch)
    assert out.dtype == torch.float16 and kc.dtype == cache_dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=2e-3)
    assert torch.equal(kc.view(torch.uint8), kc_ref.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vc_ref.view(torch.uint8))


def test_launch_plans_are_built_once_per_call_signature(monkeypatch):
    """The validation and the launch arguments are worked out on a signature's first call; later
    calls of the same shapes only bind their tensors (and compute the same), other shapes get a
    plan of their own, and a cached plan lets no invalid option through."""
    validated = []
    real = triton_backend.check_call
    monkeypatch.setattr(triton_backend, "check_call", lambda *args: validated.append(1) or real(*args))
    backend = TritonAttentionBackend(num_kv_splits=1)
    batch = make_paged_batch([(5, 1), (20, 1)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8)
    first, second = run(backend, batch)[0], run(backend, batch)[0]
    assert len(validated) == 1 and torch.equal(first, second)
    torch.testing.assert_close(first, run(TorchReferenceBackend(), batch)[0], atol=ATOL, rtol=RTOL)
    (plan,) = backend._plans.values()
    templates = [plan.write, plan.attention[1][0]]
    assert not any(isinstance(v, torch.Tensor) for t in templates for v in t.args.values())  # keeps nothing alive
    run(backend, make_paged_batch([(5, 3), (20, 1)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8))
    assert len(validated) == 2 and len(backend._plans) == 2
    run(backend, batch, sliding_window=5)
    with pytest.raises(ValueError, match="sliding_window=5.0"):
        run(backend, batch, sliding_window=5.0)


def test_bfloat16_write_is_exact():
    batch = make_paged_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=8,
                             cache_dtype=torch.bfloat16)  # fmt: skip
    key, value = batch.key.bfloat16(), batch.value.bfloat16()
    kc, vc = batch.to(DEVICE).fresh_caches()
    kernels = triton_pkg.load_kernels()
    from pagedllm.attention.triton.launch import write_kv_launch
    write_kv_launch(key.to(DEVICE), value.to(DEVICE), kc, vc, batch.meta.slot_mapping.to(DEVICE)).run(kernels)
    for r in range(batch.meta.num_reqs):
        assert torch.equal(gather_context(kc.cpu(), batch, r).float(), batch.ctx_k[r])
        assert torch.equal(gather_context(vc.cpu(), batch, r).float(), batch.ctx_v[r])


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_write_rounds_and_saturates_like_torch(cache_dtype):
    """K/V that fp8 cannot represent (and some past its range) are stored as torch rounds them,
    to nearest even and saturating: rounded in torch before the copy kernel (the interpreter's
    own float -> fp8 cast drops the carry into the exponent)."""
    batch = make_paged_batch([(0, 5), (3, 2)], num_heads=2, num_kv_heads=2, head_dim=64, block_size=8)
    key = batch.key * 3.7
    key[0, 0, :2] = torch.tensor([1e6, -1e6])
    out, kc, vc = run(TritonAttentionBackend(num_kv_splits=1),
                      replace(batch, key=key, key_cache=batch.key_cache.to(cache_dtype),
                              value_cache=batch.value_cache.to(cache_dtype)))
    limit = torch.finfo(cache_dtype).max
    slots = batch.meta.slot_mapping.long()
    stored = kc[slots // 8, :, slots % 8]  # [num_tokens, kv_heads, head_dim]
    assert torch.equal(stored.float(), key.clamp(-limit, limit).to(cache_dtype).float())
    assert not out.isnan().any()


def test_strided_views_of_fused_qkv_and_padding_slots():
    batch = make_paged_batch([(3, 4), (0, 2)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8)
    qkv = torch.cat([batch.query, batch.key, batch.value], dim=1)  # [T, 4 + 2 + 2, D]
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    slots = batch.meta.slot_mapping.clone()
    slots[-1] = -1  # a padding token: not written
    meta = replace(batch.meta, slot_mapping=slots)
    kc, vc = batch.to(DEVICE).fresh_caches()
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    meta_dev = replace(batch.to(DEVICE).meta, slot_mapping=dev(slots))
    out = TritonAttentionBackend().forward(dev(q), dev(k), dev(v), kc, vc, meta_dev, batch.scale).cpu()
    kc, vc = kc.cpu(), vc.cpu()
    kc_ref, vc_ref = batch.fresh_caches()
    TorchReferenceBackend().forward(q[:-1], k[:-1], v[:-1], kc_ref, vc_ref,
                                    replace(meta, slot_mapping=slots[:-1]), batch.scale)  # fmt: skip
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    torch.testing.assert_close(out[:-1].double(), dense_attention_f64(batch)[:-1], atol=ATOL, rtol=RTOL)


def test_empty_batch():
    batch = make_paged_batch([], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8)
    out, _, _ = run(TritonAttentionBackend(), batch)
    assert out.shape == (0, 4, 64)


# --- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(head_dim=72), r"head_dim=72 is not supported by attention_backend='triton'; allowed: \(64, 80"),
    (dict(block_size=4), r"block_size=4 is not supported by attention_backend='triton'; allowed: \(8, 16"),
    (dict(cache_dtype=torch.float16, query_dtype=torch.bfloat16), r"\(query dtype, kv cache dtype\)"),
    (dict(logits_soft_cap=0.0), r"logits_soft_cap=0.0 must be None or > 0"),
    (dict(sliding_window=-1), r"sliding_window=-1 must be None or an int >= 0"),
])
def test_refuses_unsupported_configurations(kwargs, match):
    shape = dict(head_dim=kwargs.pop("head_dim", 64), block_size=kwargs.pop("block_size", 8))
    query_dtype = kwargs.pop("query_dtype", torch.float32)
    cache_dtype = kwargs.pop("cache_dtype", torch.float32)
    batch = make_paged_batch([(3, 2)], num_heads=2, num_kv_heads=1, cache_dtype=cache_dtype, **shape)
    batch = batch.to(DEVICE)
    kc, vc = batch.fresh_caches()
    q, k, v = (t.to(query_dtype) for t in (batch.query, batch.key, batch.value))
    with pytest.raises(ValueError, match=match):
        TritonAttentionBackend().forward(q, k, v, kc, vc, batch.meta, batch.scale, **kwargs)
    with pytest.raises(ValueError, match="num_kv_splits=0"):
        TritonAttentionBackend(num_kv_splits=0)


def test_fallback_runs_what_the_kernels_do_not_cover(caplog):
    """attention_backend="auto" on CUDA: head_dim 16 goes to the fallback, with one warning."""
    batch = make_paged_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    backend = TritonAttentionBackend(fallback=TorchReferenceBackend())
    with caplog.at_level("WARNING"):
        out, _, _ = run(backend, batch)
        run(backend, batch)
    torch.testing.assert_close(out.double(), dense_attention_f64(batch), atol=ATOL, rtol=RTOL)
    warnings = [r.getMessage() for r in caplog.records if "head_dim=16 is not supported" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].endswith("using the torch attention backend instead")


def test_selector(monkeypatch):
    from pagedllm.attention import selector
    from pagedllm.attention.sdpa import SdpaBackend
    assert "triton" in selector.BACKENDS
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    named = selector.get_attention_backend("triton", torch.device(DEVICE))
    assert isinstance(named, TritonAttentionBackend) and named.fallback is None  # refuses, never falls back
    auto = selector.get_attention_backend("auto", cuda)
    assert isinstance(auto, TritonAttentionBackend) and isinstance(auto.fallback, SdpaBackend)
    monkeypatch.setattr(triton_pkg, "import_error", lambda: "No module named 'triton'")
    with pytest.raises(ValueError, match="attention_backend='triton' needs triton and numpy: No module named"):
        selector.get_attention_backend("triton", cpu)
    assert isinstance(selector.get_attention_backend("auto", cuda), SdpaBackend)  # with a warning


def test_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(triton_backend, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="attention_backend='triton' on cpu runs in Triton's interpreter: set "
                                         "TRITON_INTERPRET=1"):  # fmt: skip
        TritonAttentionBackend.check_device(torch.device("cpu"))
    TritonAttentionBackend.check_device(torch.device("cuda"))  # compiled kernels: fine


# --- compiled for real GPUs -------------------------------------------------------------------


def test_every_shipped_kernel_compiles_for_sm80_and_sm90(tmp_path):
    """Every (kernel, dtypes, constexprs) the backend launches, compiled to cubin with the
    wheel's ptxas. Subprocesses, one per arch side by side: this process's triton is in
    interpreter mode; fresh cache directories: nothing is reused from an earlier run."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    archs = ("80", "90")
    envs = [dict(env, TRITON_CACHE_DIR=str(tmp_path / arch), PYTHONWARNINGS="ignore") for arch in archs]
    done = run_side_by_side([[sys.executable, "-m", "pagedllm.attention.triton.aot", "--arch", arch]
                             for arch in archs], envs, timeout=2400)
    assert not done.failures, done.failures
    lines = done.stdout.splitlines()
    from pagedllm.attention.triton.aot import shipped_launches
    # 11 (query, cache) dtype pairs x 4 attention launches, 7 K/V writes (fp8 caches take fp8 K/V:
    # one write each), 3 merges; the e4m3-cache kernels (3 x 4 + 1) on sm_90 only, and so the
    # e5m2 ones with a triton before 3.7
    e5m2_sm90_only = plan.device_lacks_dtype(torch.float8_e5m2, (8, 0))
    sm90_only = 13 * (1 + e5m2_sm90_only)
    assert len(lines) == 2 * len(list(shipped_launches())) - sm90_only == 2 * 54 - sm90_only
    assert {line.split()[0] for line in lines} == {"sm_80", "sm_90"}
    e4m3 = [line for line in lines if "key_cache=fp8e4nv" in line]
    assert len(e4m3) == 13 and {line.split()[0] for line in e4m3} == {"sm_90"}
    e5m2_archs = {line.split()[0] for line in lines if "key_cache=fp8e5" in line}
    assert e5m2_archs == ({"sm_90"} if e5m2_sm90_only else {"sm_80", "sm_90"})
    check_fp8_dots_match_the_same_dtype_cache(lines)


def check_fp8_dots_match_the_same_dtype_cache(lines: list[str]) -> None:
    """An fp8 cache under a half-precision model runs the tensor-core instructions a cache of the
    model's own dtype runs (K/V widened in registers), and a float32 model full-precision FMA."""
    import re
    dots = {}  # (arch, query, cache, constexprs and options) -> the attention kernel's dot= field
    for line in lines:
        m = re.match(r"(sm_\d+) shared=\d+ paged_attention_kernel out=\w+ acc=\w+ query=(\w+) key_cache=(\w+) "
                     r"(.*) dot=(\S+)$", line)
        if m:
            arch, query, cache, rest, dot = m.groups()
            dots[arch, query, cache, rest] = dot
    fp8 = [(key, dot) for key, dot in dots.items() if key[2].startswith("fp8") and key[1] != "fp32"]
    assert len(fp8) >= 16  # fp16 and bf16 models x 2 fp8 formats x 4 launches, on sm_90 at least
    for (arch, query, _cache, rest), dot in fp8:
        ptx_type = {"fp16": ".f16.", "bf16": ".bf16."}[query]  # the PTX name of the operands' type
        assert dot == dots[arch, query, query, rest] and dot.startswith("mma.sync.aligned.") and ptx_type in dot
    assert {dot for (_, query, _, _), dot in dots.items() if query == "fp32"} == {"fma"}


@pytest.mark.parametrize("cache_dtype, capability, triton_version, lacks", [
    (torch.float8_e4m3fn, (8, 0), (3, 9), True), (torch.float8_e4m3fn, (8, 9), (3, 6), False),
    (torch.float8_e5m2, (8, 0), (3, 6), True),  # 3.6 converts e5m2 with sm_89's cvt.e5m2x2
    (torch.float8_e5m2, (8, 0), (3, 7), False), (torch.float8_e5m2, (9, 0), (3, 6), False),
    (torch.bfloat16, (8, 0), (3, 6), False), (torch.float16, (7, 5), (3, 6), False),
])  # fmt: skip
def test_which_cache_dtypes_a_gpu_lacks_by_triton_version(cache_dtype, capability, triton_version, lacks):
    assert plan.device_lacks_dtype(cache_dtype, capability, triton_version) is lacks


# --- on a real GPU -----------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("head_dim", [128, 96])
def test_gpu_half_precision_math(dtype, num_splits, head_dim):
    reqs = [(0, 1), (300, 1), (5, 70), (1000, 1), (64, 64), (130, 3)]
    batch = make_paged_batch(reqs, num_heads=16, num_kv_heads=2, head_dim=head_dim, block_size=16,
                             cache_dtype=dtype)  # fmt: skip
    batch = replace(batch, query=batch.query.to(dtype), key=batch.key.to(dtype), value=batch.value.to(dtype))
    out, _, _ = run(TritonAttentionBackend(num_kv_splits=num_splits), batch, sliding_window=200, logits_soft_cap=30.0)
    ref = dense_attention_f64(replace(batch, query=batch.query.float()), 200, 30.0)
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_gpu_half_precision_model_over_fp8_cache(dtype, cache_dtype, num_splits):
    """The tensor-core fp8 path on the device (K/V widened to the model's dtype in registers)
    against float64 attention over the fp8-rounded context."""
    reqs = [(0, 1), (300, 1), (5, 70), (1000, 1), (130, 3)]
    batch = make_paged_batch(reqs, num_heads=16, num_kv_heads=2, head_dim=128, block_size=16,
                             cache_dtype=cache_dtype)  # fmt: skip
    batch = replace(batch, query=batch.query.to(dtype), key=batch.key.to(dtype), value=batch.value.to(dtype))
    out, _, _ = run(TritonAttentionBackend(num_kv_splits=num_splits), batch)
    ref = dense_attention_f64(replace(batch, query=batch.query.float()))
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3  # as test_gpu_half_precision_math: fp8 values are exact there
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.gpu
@needs_cuda
def test_gpu_block_offsets_past_int32():
    """A pool of more than 2**31 elements: block id x block stride must be computed in int64."""
    num_kv_heads, block_size, head_dim = 2, 16, 128
    num_blocks = 2**31 // (num_kv_heads * block_size * head_dim) + 8  # 4 GiB per fp16 cache
    kc = torch.zeros(num_blocks, num_kv_heads, block_size, head_dim, dtype=torch.float16, device="cuda")
    vc = torch.zeros_like(kc)
    small = make_paged_batch([(20, 1), (5, 3)], num_heads=4, num_kv_heads=num_kv_heads, head_dim=head_dim,
                             block_size=block_size, cache_dtype=torch.float16)  # fmt: skip
    top = num_blocks - small.key_cache.shape[0]  # the batch's blocks moved to the top of the pool
    kc[top:], vc[top:] = small.key_cache.cuda(), small.value_cache.cuda()
    tables = torch.where(small.meta.block_tables >= 0, small.meta.block_tables + top, -1)
    meta = replace(small.meta, block_tables=tables, slot_mapping=small.meta.slot_mapping + top * block_size)
    batch = replace(small, meta=meta).to("cuda")
    q = batch.query.half()
    out = TritonAttentionBackend().forward(q, batch.key.half(), batch.value.half(), kc, vc, batch.meta, batch.scale)
    torch.testing.assert_close(out.double().cpu(), dense_attention_f64(small), atol=3e-3, rtol=3e-3)
