"""Times the C paged-attention kernel against the torch reference and a gather + SDPA baseline.

    python benchmarks/attention.py [--threads N] [--repeats R] [--block-size B]

Each timed call is a full backend step (write the new K/V, then attend), on a pool of shuffled
blocks. Cases: decode batch 1 and 64 (context 256) and one 512-token prefill; 8 query heads,
4 KV heads, head_dim 64. Reports the median over repeats, in milliseconds.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, not an installed copy

from pagedllm.attention.backend import write_kv  # noqa: E402
from pagedllm.attention.cpu import CpuAttentionBackend  # noqa: E402
from pagedllm.attention.testing import PagedBatch, make_paged_batch  # noqa: E402
from pagedllm.attention.torch_ref import TorchReferenceBackend  # noqa: E402

CASES = {  # name -> per request (num_cached, q_len)
    "decode bs=1 ctx=256": [(255, 1)],
    "decode bs=64 ctx=256": [(255, 1)] * 64,
    "prefill 512": [(0, 512)],
}


class GatherSdpaBackend:
    """Baseline: copy every request's context out of the pool into a padded dense batch, then
    one masked SDPA call (what you would write without a paged kernel)."""

    name = "gather+sdpa"

    def forward(self, query, key, value, key_cache, value_cache, meta, scale):
        write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        num_heads, block_size = query.shape[1], key_cache.shape[2]
        group = num_heads // key_cache.shape[1]
        q_lens, seq_lens = meta.query_lens.long(), meta.seq_lens.long()
        max_q, max_s = int(q_lens.max()), int(seq_lens.max())
        pos = torch.arange(max_s)
        blocks = meta.block_tables.long()[:, : (max_s + block_size - 1) // block_size]
        logical = (pos // block_size).clamp(max=blocks.shape[1] - 1).expand(len(seq_lens), -1)
        slot_blocks = blocks.gather(1, logical)  # [R, max_s] physical block of every position
        # [R, max_s, Hkv, D] -> [R, H, max_s, D]: the gather copy the paged kernel avoids
        k = key_cache[slot_blocks.clamp(min=0), :, pos % block_size].transpose(1, 2)
        v = value_cache[slot_blocks.clamp(min=0), :, pos % block_size].transpose(1, 2)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        q_idx = meta.query_start_loc[:-1].long()[:, None] + torch.arange(max_q)  # [R, max_q]
        q_valid = torch.arange(max_q)[None, :] < q_lens[:, None]
        q = query[q_idx.clamp(max=query.shape[0] - 1)].transpose(1, 2)  # [R, H, max_q, D]
        q_pos = seq_lens[:, None] - q_lens[:, None] + torch.arange(max_q)  # [R, max_q]
        key_pos = pos[None, None, :]
        mask = (key_pos <= q_pos[:, :, None]) & (key_pos < seq_lens[:, None, None])
        mask |= ~q_valid[:, :, None]  # padded query rows: any non-empty mask avoids NaNs
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale)
        return o.transpose(1, 2)[q_valid]  # [num_tokens, H, D]


def time_backend(backend, batch: PagedBatch, repeats: int, warmup: int = 2):
    """(median milliseconds, last output) of full forward steps on a private copy of the pool."""
    kc, vc = batch.fresh_caches()
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        out = backend.forward(batch.query, batch.key, batch.value, kc, vc, batch.meta, batch.scale)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    backends = [
        CpuAttentionBackend(num_threads=args.threads),
        TorchReferenceBackend(),
        GatherSdpaBackend(),
    ]

    print(f"threads={args.threads} block_size={args.block_size} heads=8 kv_heads=4 head_dim=64; "
          f"median ms over {args.repeats} repeats "
          f"({max(3, args.repeats // 4)} for torch ref and prefill)")  # fmt: skip
    header = (f"{'case':<22}{'cpu kernel':>12}{'torch ref':>12}{'gather+sdpa':>13}"
              f"{'ref/cpu':>9}{'sdpa/cpu':>10}{'max|diff|':>11}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for name, reqs in CASES.items():
        batch = make_paged_batch(reqs, 8, 4, 64, args.block_size, seed=0)
        # the torch reference is ~100x slower: fewer repeats keep the whole run short
        slow = lambda b: isinstance(b, TorchReferenceBackend) or "prefill" in name  # noqa: E731
        results = [time_backend(b, batch, max(3, args.repeats // 4) if slow(b) else args.repeats)
                   for b in backends]  # fmt: skip
        (t_cpu, o_cpu), (t_ref, o_ref), (t_sdpa, o_sdpa) = results
        diff = max((o_cpu - o_ref).abs().max().item(), (o_cpu - o_sdpa).abs().max().item())
        print(f"{name:<22}{t_cpu:>12.3f}{t_ref:>12.3f}{t_sdpa:>13.3f}"
              f"{t_ref / t_cpu:>8.1f}x{t_sdpa / t_cpu:>9.1f}x{diff:>11.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
