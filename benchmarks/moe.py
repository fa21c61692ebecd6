"""Mixture-of-experts: the FusedMoE layer against per-expert Python loops, and a random
Mixtral-style model through pagedllm against transformers ``generate`` in the same run.

The model: 8 experts, top-2, sized so the parameters one token uses (attention, two experts,
embeddings, LM head) are ~30M, about the benchmark Llama of benchmarks/common.py. Example::

    python benchmarks/moe.py --quick     # tiny sizes, seconds
    python benchmarks/moe.py             # the sizes above (results/moe.json)

Layer timing (``--layer-tokens``, default 64 tokens, one MoE layer of the model's shape). Before
every timed call the caches are flushed by reading a buffer twice the size of the L3
(``--warm-cache`` skips this): in a model forward the other layers' weights evict this layer's,
and a variant with its own packed copy of the experts would otherwise be timed against
baselines that share the stacked tensors and keep them cached for each other:
  fused         FusedMoE as the engine runs it on the CPU: the C kernel over packed expert panels
                (layers/moe_cpu.py), packed by cpu_ops.pack_model as the model runner does
  fused-onednn  FusedMoE's torch path (sort tokens by expert, one GEMM pair per active expert)
                through oneDNN-packed expert weights: the fallback where the kernel does not apply
  fused-plain   the torch path on the stacked tensors (F.linear, no packed copies)
  loop-routed   per expert in a Python loop over all experts: find its tokens (torch.where), run
                them, scatter back (transformers' MixtralExperts loop)
  loop-dense    per expert over all experts: every token through every expert, routing weights
                zero outside its top-k (the loop without any routing)
End to end: output tok/s of both systems on ``--num-prompts`` prompts, greedy, EOS ignored, and
the share of pagedllm's generate time spent inside the MoE layers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py

import common  # noqa: E402  (puts this checkout's pagedllm first on sys.path)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from attention import filled, l3_bytes  # noqa: E402

from pagedllm.distributed.parallel_state import TensorParallelGroup  # noqa: E402
from pagedllm.entrypoints.plan import count_params, model_shape  # noqa: E402
from pagedllm.layers import cpu_ops  # noqa: E402
from pagedllm.layers.fused_moe import FusedMoE, route  # noqa: E402

FULL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=8,
            num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2)
QUICK = dict(FULL, hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=1024)
COMMON = dict(max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
              eos_token_id=2, pad_token_id=0, initializer_range=0.05, sliding_window=None)


def active_params(cfg: dict) -> int:
    """Parameters one token touches (attention, top-k experts, router, norms, embedding row, LM head):
    the KV planner's count (entrypoints/plan.py) for this Mixtral config."""
    return count_params(model_shape({**cfg, **COMMON, "model_type": "mixtral"}), active=True)


def build_model(cfg: dict, path: Path) -> Path:
    """Builds the random checkpoint once (seed 0) into ``path``; a finished one is reused."""
    if (path / "config.json").exists():
        return path
    import transformers as tf
    tmp = path.with_name(path.name + ".tmp")
    torch.manual_seed(0)
    tf.MixtralForCausalLM(tf.MixtralConfig(**cfg, **COMMON)).save_pretrained(tmp, safe_serialization=True)
    common.word_tokenizer(cfg["vocab_size"]).save_pretrained(tmp)
    os.replace(tmp, path)  # a run killed mid-save leaves no half checkpoint behind to be reused
    return path


# --------------------------------------------------------------------------- the layer alone


def loop_routed(moe: FusedMoE, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    weights, ids = route(logits, moe.top_k, moe.renormalize)
    y = torch.zeros_like(x)
    for e in range(moe.num_experts):
        token, slot = torch.where(ids == e)
        h = F.linear(moe.act_and_mul(F.linear(x[token], moe.w13[e])), moe.w2[e])
        y.index_add_(0, token, h * weights[token, slot, None])
    return y


def loop_dense(moe: FusedMoE, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    weights, ids = route(logits, moe.top_k, moe.renormalize)
    dense = torch.zeros(x.shape[0], moe.num_experts).scatter_(1, ids, weights)  # [tokens, experts]
    y = torch.zeros_like(x)
    for e in range(moe.num_experts):
        y += F.linear(moe.act_and_mul(F.linear(x, moe.w13[e])), moe.w2[e]) * dense[:, e:e + 1]
    return y


def time_layer(cfg: dict, tokens: int, repeats: int, flush: torch.Tensor | None = None) -> dict:
    torch.manual_seed(0)
    h, inter, experts = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    moe = FusedMoE(experts, cfg["num_experts_per_tok"], h, inter, renormalize=True, tp=TensorParallelGroup())
    moe.w13.normal_(std=0.05), moe.w2.normal_(std=0.05)
    onednn, plain = (FusedMoE(experts, cfg["num_experts_per_tok"], h, inter, renormalize=True,
                              tp=TensorParallelGroup()) for _ in range(2))
    onednn.w13, onednn.w2 = plain.w13, plain.w2 = moe.w13, moe.w2  # shared: only the packed copies add bytes
    cpu_ops.pack_model(moe)  # what the model runner does once a CPU model is loaded
    if moe.kernel_weights is None or onednn.pack_weights(kernel=False) == 0:
        # otherwise "fused" / "fused-onednn" would time another path under their names
        raise RuntimeError("moe.py: the C expert kernel (moe_cpu.can_pack) or oneDNN packing "
                           "(cpu_ops.pack_weight) does not apply in this configuration")
    x, logits = torch.randn(tokens, h), torch.randn(tokens, experts)
    fns = {"fused": moe, "fused-onednn": onednn, "fused-plain": plain,
           "loop-routed": lambda a, b: loop_routed(moe, a, b), "loop-dense": lambda a, b: loop_dense(moe, a, b)}
    with torch.inference_mode():
        ref = moe(x, logits)
        for name, fn in fns.items():
            assert torch.allclose(fn(x, logits), ref, atol=1e-4, rtol=1e-4), name
        return _best_ms_interleaved({name: lambda fn=fn: fn(x, logits) for name, fn in fns.items()}, repeats, flush)


def _best_ms_interleaved(fns: dict, repeats: int, flush: torch.Tensor | None) -> dict[str, float]:
    """Best-of-``repeats`` wall time of each function, run in turn so load on a shared machine
    hits them all alike; ``flush`` (if given) is read before each call, outside the timing."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            if flush is not None:
                flush.sum()
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: t * 1e3 for name, t in best.items()}


# --------------------------------------------------------------------------- end to end


class MoeTimer:
    """Wall time spent inside every FusedMoE forward of a model (forward hooks)."""

    def __init__(self, model: torch.nn.Module):
        self.total, self._start = 0.0, 0.0
        for m in model.modules():
            if isinstance(m, FusedMoE):
                m.register_forward_pre_hook(self._pre)
                m.register_forward_hook(self._post)

    def _pre(self, *_):
        self._start = time.perf_counter()

    def _post(self, *_):
        self.total += time.perf_counter() - self._start


def run_end_to_end(path: Path, args) -> dict:
    from pagedllm import LLM, SamplingParams
    prompts = common.make_prompts([args.prompt_len] * args.num_prompts, args.vocab_size, seed=0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", seed=0, kv_cache_memory="512MiB", num_threads=args.num_threads)
    timer = MoeTimer(llm.llm_engine.executor.runner.model)  # single process: the model is in this one
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    paged_s = time.perf_counter() - t0
    hf = common.load_hf(path, "cpu")
    t0 = time.perf_counter()
    ids = torch.tensor(prompts)  # equal lengths: one static batch, no padding
    with torch.inference_mode():
        hf_out = hf.generate(input_ids=ids, do_sample=False, max_new_tokens=args.output_len, pad_token_id=0)
    hf_s = time.perf_counter() - t0
    paged_ids = [o.outputs[0].token_ids for o in outs]
    hf_ids = hf_out[:, ids.shape[1]:].tolist()
    lens = [args.output_len] * len(prompts)
    n = args.num_prompts * args.output_len
    return dict(pagedllm_tok_s=n / paged_s, transformers_tok_s=n / hf_s, ratio=hf_s / paged_s,
                moe_share=timer.total / paged_s, greedy_agreement=common.prefix_agreement(paged_ids, hf_ids, lens))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model and workload")
    ap.add_argument("--layer-tokens", type=int, default=64)
    ap.add_argument("--warm-cache", action="store_true", help="layer timing: do not flush the caches before each "
                    "call (always so with --quick)")
    ap.add_argument("--num-prompts", type=int, default=None, help="default 32 (4 with --quick)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128 (16 with --quick)")
    ap.add_argument("--output-len", type=int, default=None, help="default 64 (8 with --quick)")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--model-dir", type=Path, default=None, help="where the random checkpoint is built "
                    "(default: benchmarks/.cache/<name>-<config crc>); reused when it exists")
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "moe.json")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    common.fill_unset(args, quick=dict(num_prompts=4, prompt_len=16, output_len=8),
                      full=dict(num_prompts=32, prompt_len=128, output_len=64))
    args.vocab_size = cfg["vocab_size"]
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    flush = None if args.quick or args.warm_cache else filled(2 * l3_bytes() // 4)
    layer = time_layer(cfg, args.layer_tokens, repeats=5 if args.quick else 30, flush=flush)
    del flush
    name = "mixtral-quick" if args.quick else "mixtral-30m-active"
    key = zlib.crc32(json.dumps({**cfg, **COMMON}, sort_keys=True).encode())  # a changed config builds anew
    path = build_model(cfg, args.model_dir or common.CACHE_DIR / f"{name}-{key:08x}")
    e2e = run_end_to_end(path, args)
    print(f"{name}: {active_params(cfg) / 1e6:.1f}M active parameters per token")
    rows = [[k, f"{v:.3f}", f"x{v / layer['fused']:.2f}"] for k, v in layer.items()]
    print(common.format_table([f"MoE layer, {args.layer_tokens} tokens", "ms", "vs fused"], rows))
    print(common.format_table(["end to end", "value"], [[k, f"{v:.3f}"] for k, v in e2e.items()]))
    results = dict(model=name, config=cfg, active_params=active_params(cfg), layer_ms=layer,
                   layer_tokens=args.layer_tokens, end_to_end=e2e, commit=common.git_commit())
    common.save_json(results, args.out)
    return results


if __name__ == "__main__":
    main()
