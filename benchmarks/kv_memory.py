"""KV-cache memory benchmark: the PagedAttention paper's memory claims, reproduced on this engine.

Three experiments on a tiny random Llama (built once into ``benchmarks/.cache/``), CPU-friendly:

1. **Utilization and concurrency.** A long-tailed workload (lognormal prompt and output
   lengths, fixed seed, greedy, ``ignore_eos``) runs under one fixed KV budget
   (``--budget-seqs`` x ``max_model_len`` tokens) with the contiguous reservations that systems
   before PagedAttention made (``preallocation="max_model_len"``: every request reserves the
   whole context, "Orca (Max)"; ``preallocation="request"``: prompt + max_tokens, "Orca
   (Oracle)") and with paged allocation at several block sizes. Every step samples
   ``utilization = tokens stored / (used blocks x block_size)``; reported are its average over
   steps that hold KV, the peak number of running requests, and throughput.
2. **Shared prefix.** Requests sharing a long system prompt, prefix caching off vs on: prompt
   tokens actually computed, prefix-cache hits, peak blocks, throughput.
3. **Sharing.** ``SamplingParams(n=W)`` and beam search of width W versus the same work as W
   independent requests per prompt (prefix caching off and on): blocks in use at peak and on
   average, and the saving.
4. **Latent KV (MLA).** A DeepSeek-V2-Lite-shaped model (27 layers, 16 heads, kv_lora_rank 512,
   qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128; hidden size, vocabulary and experts
   shrunk, which the KV does not depend on; dummy weights) versus the same attention stored as K/V
   per head (a Llama with 16 KV heads of head_dim 192, K's width, which V is padded to in a
   one-head_dim pool), in the model's dtype (bfloat16), plus the MLA model with an fp8 latent
   cache: the engine sizes its pool for ``--latent-kv-mib`` MiB and its own block accounting
   (blocks x block_size) gives tokens per GiB and ``max_model_len`` sequences that fit.

Run ``python benchmarks/kv_memory.py --quick`` (< 3 min on 2 cores) or without ``--quick`` for
the full run. Tables go to stdout, results to ``benchmarks/results/kv_memory.{json,png}``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's pagedllm, not whichever one is installed

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.sampling_params import BeamSearchParams  # noqa: E402

CACHE_DIR = ROOT / "benchmarks" / ".cache"
RESULTS_DIR = ROOT / "benchmarks" / "results"
MODEL_SHAPE = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
FIRST_TOKEN_ID = 3  # ids 0..2 are pad, bos, eos in the test tokenizer
EXPERIMENTS = ("memory", "prefix", "sharing", "latent")
# DeepSeek-V2-Lite's attention and layer count; everything the KV does not depend on made small
V2_LITE_ATTENTION = dict(num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
                         qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
V2_LITE_REST = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                    n_group=1, topk_group=1, max_position_embeddings=8192)


# --------------------------------------------------------------------------- model and workloads

def build_model(cache_dir: Path = CACHE_DIR) -> str:
    """The tiny random Llama checkpoint (and tokenizer), built once and reused."""
    path = cache_dir / "kvmem-llama-h128-l2-v1024"
    if (path / "config.json").exists():
        return str(path)
    return _conftest().make_model_dir(path, "llama", **MODEL_SHAPE)


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    def summary(self) -> dict:
        p = np.array([len(x) for x in self.prompts])
        o = np.array(self.output_lens)
        return {"num_requests": len(p), "prompt_len": _describe(p), "output_len": _describe(o)}


def _describe(x: np.ndarray) -> dict:
    return {"mean": round(float(x.mean()), 1), "median": round(float(np.median(x)), 1),
            "p90": round(float(np.percentile(x, 90)), 1), "min": int(x.min()), "max": int(x.max())}


def lognormal(rng: np.random.Generator, n: int, median: float, sigma: float, lo: int, hi) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), lo, hi).astype(int)


def random_ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(FIRST_TOKEN_ID, MODEL_SHAPE["vocab_size"], n).tolist()


def long_tailed(n: int, args, seed: int) -> Workload:
    """Lognormal prompt and output lengths, clipped so prompt + output <= max_model_len."""
    rng = np.random.default_rng(seed)
    prompt = lognormal(rng, n, args.prompt_median, args.sigma, 4, args.max_model_len // 2)
    output = lognormal(rng, n, args.output_median, args.sigma, 4, args.max_model_len - prompt)
    return Workload([random_ids(rng, int(p)) for p in prompt], output.tolist())


def shared_prefix(args) -> Workload:
    """One system prompt shared by every request, a short unique suffix, short outputs."""
    rng = np.random.default_rng(args.seed + 1)
    system = random_ids(rng, args.prefix_len)
    suffix = rng.integers(8, 33, args.prefix_requests)
    return Workload([system + random_ids(rng, int(s)) for s in suffix], [args.prefix_output_len] * len(suffix))


def _conftest():
    spec = importlib.util.spec_from_file_location("pagedllm_tests_conftest", ROOT / "tests" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    return conftest


def build_config_dir(path: Path, config) -> str:
    """A checkpoint directory without weights (the engine runs it with load_format="dummy")."""
    if not (path / "config.json").exists():
        config.save_pretrained(path)
        _conftest()._tokenizer().save_pretrained(path)
    return str(path)


def latent_models(cache_dir: Path, num_layers: int) -> dict[str, str]:
    """The V2-Lite-shaped MLA model and its per-head K/V twin (configs only)."""
    import transformers as tf
    mla = tf.DeepseekV2Config(num_hidden_layers=num_layers, architectures=["DeepseekV2ForCausalLM"],
                              **V2_LITE_ATTENTION, **V2_LITE_REST)
    heads, head_dim = V2_LITE_ATTENTION["num_attention_heads"], 128 + 64  # K = nope + rope wide
    per_head = tf.LlamaConfig(num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=heads,
                              head_dim=head_dim, vocab_size=1024, hidden_size=64, intermediate_size=128,
                              max_position_embeddings=8192, architectures=["LlamaForCausalLM"])
    return {"MLA latent (kv_lora_rank 512 + rope 64)": build_config_dir(cache_dir / f"kvmem-v2lite-mla-l{num_layers}",
                                                                         mla),
            "K/V per head (16 x 192)": build_config_dir(cache_dir / f"kvmem-v2lite-mha-l{num_layers}", per_head)}


def run_latent_config(label: str, model: str, args, **kwargs) -> dict:
    budget = args.latent_kv_mib * 2**20
    llm = LLM(model, load_format="dummy", kv_cache_memory=budget, max_model_len=args.latent_max_model_len,
              max_num_batched_tokens=256, max_num_seqs=1024, swap_space=0, num_threads=args.threads,
              block_size=16, enable_prefix_caching=False, dtype=args.latent_dtype, **kwargs)
    stats = llm.get_kv_cache_stats()
    block_bytes = llm.llm_engine.executor.block_bytes()
    tokens = stats.num_blocks * stats.block_size
    row = dict(config=label, kv_dtype=str(llm.llm_engine.executor.runner.cache.kv.dtype).removeprefix("torch."),
               block_bytes=block_bytes, bytes_per_token=block_bytes // stats.block_size,
               num_blocks=stats.num_blocks, tokens=tokens, tokens_per_gib=round(tokens * 2**30 / budget),
               max_len_seqs=stats.num_blocks // -(-args.latent_max_model_len // stats.block_size))
    llm.llm_engine.shutdown()
    _progress(row)
    return row


def experiment_latent(args) -> list[dict]:
    """The MLA model at the model dtype and with an fp8 latent, and its per-head twin; each row's
    tokens per GiB against the per-head one."""
    models = latent_models(args.cache_dir, args.latent_layers)
    (mla_label, mla_path), (per_head_label, per_head_path) = models.items()
    rows = [run_latent_config(mla_label, mla_path, args),
            run_latent_config(mla_label, mla_path, args, kv_cache_dtype="fp8"),
            run_latent_config(per_head_label, per_head_path, args)]
    for row in rows[:2]:
        row["vs_per_head"] = f"x{row['tokens_per_gib'] / rows[2]['tokens_per_gib']:.2f}"
    return rows


# --------------------------------------------------------------------------- engine driving

def make_llm(model: str, args, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", args.max_model_len)
    return LLM(model, max_num_seqs=256, swap_space=0, seed=args.seed, num_threads=args.threads, **kwargs)


@dataclass
class Trace:
    """Per-step samples of one run, taken after every engine step."""

    utilization: list[float] = field(default_factory=list)
    usage: list[float] = field(default_factory=list)
    used_blocks: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    engine_s: float = 0.0

    def sample(self, llm: LLM) -> None:
        s = llm.get_kv_cache_stats()
        if s.num_used_blocks:  # time-average over steps that hold KV only
            self.utilization.append(s.num_tokens_stored / (s.num_used_blocks * s.block_size))
            self.usage.append(s.usage)
            self.used_blocks.append(s.num_used_blocks)
        self.running.append(llm.llm_engine.scheduler.make_stats().num_running)


def add_requests(llm: LLM, wl: Workload, params_for) -> None:
    for i, (prompt, out_len) in enumerate(zip(wl.prompts, wl.output_lens)):
        llm.llm_engine.add_request(str(i), {"prompt_token_ids": prompt}, params_for(i, out_len))


def greedy(_: int, out_len: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True, detokenize=False)


def drive(llm: LLM) -> Trace:
    """Steps the engine until every request finished, sampling KV stats after each step."""
    engine, trace = llm.llm_engine, Trace()
    engine.counters.peak_used_blocks = 0
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        trace.engine_s += time.perf_counter() - t0  # the stats sampling below is not timed
        trace.sample(llm)
    return trace


def throughput(llm: LLM, trace: Trace, num_requests: int) -> dict:
    c = llm.llm_engine.counters
    return {"output_tokens": c.generation_tokens, "wall_s": round(trace.engine_s, 2),
            "output_tok_per_s": round(c.generation_tokens / trace.engine_s, 1),
            "req_per_s": round(num_requests / trace.engine_s, 2), "steps": c.num_steps}


# --------------------------------------------------------------------------- 1. utilization

def memory_configs(block_sizes: list[int]) -> list[tuple[str, str, int]]:
    """(label, preallocation, block_size) for every configuration of experiment 1."""
    return [("contiguous max_model_len", "max_model_len", 16), ("contiguous prompt+max_tokens", "request", 16)] + [
        (f"paged block_size={b}", "none", b) for b in block_sizes]


def run_memory_config(model: str, wl: Workload, label: str, mode: str, block_size: int, args) -> dict:
    num_blocks = args.budget_seqs * args.max_model_len // block_size
    # a contiguous reservation never grows, so it needs no admission watermark; paged keeps the default
    extra = {"watermark": 0.0} if mode != "none" else {}
    llm = make_llm(model, args, block_size=block_size, num_gpu_blocks_override=num_blocks,
                   enable_prefix_caching=False, preallocation=mode, **extra)
    add_requests(llm, wl, greedy)
    trace = drive(llm)
    return {"config": label, "preallocation": mode, "block_size": block_size, "num_blocks": num_blocks,
            "kv_utilization": round(float(np.mean(trace.utilization)), 4),
            "kv_usage": round(float(np.mean(trace.usage)), 4),
            "peak_running": max(trace.running), "mean_running": round(float(np.mean(trace.running)), 1),
            "preemptions": llm.get_kv_cache_stats().num_preemptions, **throughput(llm, trace, len(wl.prompts))}


def experiment_memory(model: str, args) -> list[dict]:
    wl = long_tailed(args.num_requests, args, args.seed)
    rows = []
    for label, mode, bs in memory_configs(args.block_sizes):
        rows.append(run_memory_config(model, wl, label, mode, bs, args))
        _progress(rows[-1])
    return rows


# --------------------------------------------------------------------------- 2. shared prefix

def run_prefix_config(model: str, wl: Workload, caching: bool, args) -> dict:
    max_len = args.prefix_len + 32 + args.prefix_output_len
    llm = make_llm(model, args, max_model_len=max_len, num_gpu_blocks_override=args.prefix_kv_tokens // 16,
                   enable_prefix_caching=caching)
    add_requests(llm, wl, greedy)
    trace = drive(llm)
    s, c = llm.get_kv_cache_stats(), llm.llm_engine.counters
    return {"prefix_caching": caching, "prompt_tokens_total": sum(map(len, wl.prompts)),
            "prompt_tokens_computed": c.prompt_tokens_computed, "prefix_cache_hits": s.prefix_cache_hits,
            "prefix_cache_queries": s.prefix_cache_queries, "peak_used_blocks": c.peak_used_blocks,
            "peak_running": max(trace.running), **throughput(llm, trace, len(wl.prompts))}


def experiment_prefix(model: str, args) -> list[dict]:
    wl = shared_prefix(args)
    rows = [run_prefix_config(model, wl, caching, args) for caching in (False, True)]
    for r in rows:
        _progress(r)
    return rows


# --------------------------------------------------------------------------- 3. sharing

def sampled(width: int, index: int, out_len: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, seed=1000 * index + width, max_tokens=out_len,
                          ignore_eos=True, detokenize=False)


def sharing_llm(model: str, args, caching: bool) -> LLM:
    # room for every sequence at full length: peaks reflect demand, never preemption
    num_blocks = args.sharing_prompts * args.width * args.max_model_len // 16
    return make_llm(model, args, num_gpu_blocks_override=num_blocks, enable_prefix_caching=caching)


def blocks_row(kind: str, llm: LLM, used_blocks: list[int]) -> dict:
    s = llm.get_kv_cache_stats()
    return {"run": kind, "peak_used_blocks": llm.llm_engine.counters.peak_used_blocks,
            "mean_used_blocks": round(float(np.mean(used_blocks)), 1), "preemptions": s.num_preemptions}


def run_parallel(model: str, wl: Workload, args) -> dict:
    llm = sharing_llm(model, args, caching=False)
    add_requests(llm, wl, lambda i, o: sampled(args.width, i, o, n=args.width))
    return blocks_row(f"n={args.width} (forks share blocks)", llm, drive(llm).used_blocks)


def run_independent(model: str, wl: Workload, args, caching: bool, out_len: int | None = None) -> dict:
    """Each prompt sent ``width`` times as separate requests (fresh seeds, so outputs differ)."""
    w = args.width
    llm = sharing_llm(model, args, caching)
    copies = Workload([p for p in wl.prompts for _ in range(w)],
                      [out_len or o for o in wl.output_lens for _ in range(w)])
    add_requests(llm, copies, lambda i, o: sampled(w, i, o))
    label = f"{w} independent requests, prefix caching {'on' if caching else 'off'}"
    return {**blocks_row(label, llm, drive(llm).used_blocks), "prefix_caching": caching}


def run_beam(model: str, wl: Workload, args) -> dict:
    """Beam searches run in the engine's ordinary steps, so ``drive`` traces them like requests."""
    llm = sharing_llm(model, args, caching=False)
    params = BeamSearchParams(args.width, args.beam_max_tokens, ignore_eos=True)
    for i, prompt in enumerate(wl.prompts):
        llm.llm_engine.add_beam_search(f"beam-{i}", {"prompt_token_ids": prompt}, params)
    return blocks_row(f"beam search width={args.width}", llm, drive(llm).used_blocks)


def savings(shared: dict, baseline: dict) -> dict:
    return {"vs": baseline["run"], "vs_prefix_caching": baseline["prefix_caching"],
            "peak_saved_pct": round(100 * (1 - shared["peak_used_blocks"] / baseline["peak_used_blocks"]), 1),
            "mean_saved_pct": round(100 * (1 - shared["mean_used_blocks"] / baseline["mean_used_blocks"]), 1)}


def experiment_sharing(model: str, args) -> list[dict]:
    wl = long_tailed(args.sharing_prompts, args, args.seed + 2)
    groups = [(run_parallel(model, wl, args), None), (run_beam(model, wl, args), args.beam_max_tokens)]
    out = []
    for shared, out_len in groups:
        baselines = [run_independent(model, wl, args, caching, out_len) for caching in (False, True)]
        shared["savings"] = [savings(shared, b) for b in baselines]
        out += [shared] + baselines
        for r in [shared] + baselines:
            _progress(r)
    return out


# --------------------------------------------------------------------------- output

def _progress(row: dict) -> None:
    print("  done:", ", ".join(f"{k}={v}" for k, v in row.items() if k != "savings"), file=sys.stderr, flush=True)


def print_table(title: str, rows: list[dict], cols: list[tuple[str, str]]) -> None:
    cells = [[_fmt(k, r.get(k)) for k, _ in cols] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h) in enumerate(cols)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for (_, h), w in zip(cols, widths)))
    print("  ".join("-" * w for w in widths))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths)))


PERCENT_KEYS = {"kv_utilization", "kv_usage"}


def _fmt(key: str, v) -> str:
    if key in PERCENT_KEYS:
        return f"{100 * v:.1f}%"
    return "" if v is None else str(v)


MEMORY_COLS = [("config", "configuration"), ("num_blocks", "blocks"), ("kv_utilization", "KV util (avg)"),
               ("kv_usage", "blocks in use (avg)"), ("peak_running", "peak running"),
               ("mean_running", "mean running"), ("preemptions", "preempt"), ("output_tok_per_s", "out tok/s"),
               ("req_per_s", "req/s"), ("wall_s", "wall s")]
PREFIX_COLS = [("prefix_caching", "prefix caching"), ("prompt_tokens_total", "prompt tokens"),
               ("prompt_tokens_computed", "computed"), ("prefix_cache_hits", "cache hits (tokens)"),
               ("peak_used_blocks", "peak blocks"), ("peak_running", "peak running"),
               ("output_tok_per_s", "out tok/s"), ("req_per_s", "req/s"), ("wall_s", "wall s")]
LATENT_COLS = [("config", "KV layout"), ("kv_dtype", "KV dtype"), ("bytes_per_token", "bytes / token"),
               ("block_bytes", "bytes / block"),
               ("num_blocks", "blocks"), ("tokens_per_gib", "tokens / GiB"), ("max_len_seqs", "max_model_len seqs"),
               ("vs_per_head", "vs K/V per head")]
SHARING_COLS = [("run", "run"), ("peak_used_blocks", "peak blocks"), ("mean_used_blocks", "mean blocks"),
                ("preemptions", "preempt"), ("saved", "saved by sharing (peak / mean)")]


def sharing_table_rows(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        saved = "; ".join(f"{s['peak_saved_pct']}% / {s['mean_saved_pct']}% vs caching "
                          f"{'on' if s['vs_prefix_caching'] else 'off'}" for s in r.get("savings", []))
        out.append({**r, "saved": saved or None})
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    mem = results["memory"]
    labels = [_short_memory_label(r) for r in mem]
    colors = ["tab:orange" if r["preallocation"] != "none" else "tab:blue" for r in mem]
    _bars(axes[0, 0], labels, [100 * r["kv_utilization"] for r in mem], colors, "KV utilization (%)",
          "tokens stored / reserved, time-averaged")
    _bars(axes[0, 1], labels, [r["peak_running"] for r in mem], colors, "requests",
          "peak concurrently running requests (same KV budget)")
    pre = results["prefix"]
    _bars(axes[1, 0], [f"prefix caching {'on' if r['prefix_caching'] else 'off'}" for r in pre],
          [r["prompt_tokens_computed"] for r in pre], ["tab:orange", "tab:blue"], "tokens",
          "prompt tokens computed (shared system prompt)")
    sh = results["sharing"]
    _bars(axes[1, 1], [_short_sharing_label(r) for r in sh], [r["peak_used_blocks"] for r in sh],
          ["tab:gray" if "prefix_caching" in r else "tab:blue" for r in sh], "blocks",
          "KV blocks in use at peak (blue: shared, gray: independent)")
    fig.suptitle("pagedllm KV-cache memory (tiny random Llama, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _short_memory_label(row: dict) -> str:
    if row["preallocation"] == "max_model_len":
        return "contiguous\nmax_model_len"
    if row["preallocation"] == "request":
        return "contiguous\nprompt+max_tok"
    return f"paged\nblock {row['block_size']}"


def _short_sharing_label(row: dict) -> str:
    if "prefix_caching" in row:
        return f"independent\ncache {'on' if row['prefix_caching'] else 'off'}"
    return row["run"].split(" (")[0].replace("beam search ", "beam\n")


def _bars(ax, labels: list[str], values: list[float], colors: list[str], ylabel: str, title: str) -> None:
    bars = ax.bar(range(len(values)), values, color=colors)
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(values)), labels, fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)


# --------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small run for development (< 3 min on 2 cores)")
    p.add_argument("--num-requests", type=int, help="experiment 1 requests (default 200, quick 48)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--prompt-median", type=float, default=100)
    p.add_argument("--output-median", type=float, default=120)
    p.add_argument("--sigma", type=float, default=0.8, help="lognormal sigma of both lengths")
    p.add_argument("--budget-seqs", type=int, default=8, help="KV budget in max_model_len sequences")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--prefix-requests", type=int, help="experiment 2 requests (default 256, quick 32)")
    p.add_argument("--prefix-len", type=int, default=1000, help="shared system prompt tokens")
    p.add_argument("--prefix-output-len", type=int, default=16)
    p.add_argument("--prefix-kv-tokens", type=int, default=32768, help="experiment 2 KV budget in tokens")
    p.add_argument("--sharing-prompts", type=int, help="experiment 3 prompts (default 16, quick 8)")
    p.add_argument("--width", type=int, default=4, help="n for parallel sampling, beam width")
    p.add_argument("--beam-max-tokens", type=int, help="beam search max_tokens (default 120, quick 48)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experiments", nargs="+", choices=EXPERIMENTS, default=list(EXPERIMENTS))
    p.add_argument("--latent-layers", type=int, default=27, help="experiment 4 layers (DeepSeek-V2-Lite: 27)")
    p.add_argument("--latent-kv-mib", type=int, default=512, help="experiment 4 KV budget in MiB")
    p.add_argument("--latent-max-model-len", type=int, default=512)
    p.add_argument("--latent-dtype", default="bfloat16", help="experiment 4 model dtype (V2-Lite ships bfloat16)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: the model is tiny, and one thread keeps timings "
                        "steady on a busy machine)")
    p.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help="where the tiny model is built")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "kv_memory", help="results path without suffix")
    args = p.parse_args(argv)
    _fill_defaults(args)
    return args


def _fill_defaults(args) -> None:
    full, quick = dict(num_requests=200, prefix_requests=256, sharing_prompts=16, beam_max_tokens=120), \
        dict(num_requests=48, prefix_requests=32, sharing_prompts=8, beam_max_tokens=48)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    model = build_model(args.cache_dir)
    results = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "model": MODEL_SHAPE,
               "workload": long_tailed(args.num_requests, args, args.seed).summary()}
    runs = {"memory": lambda: experiment_memory(model, args), "prefix": lambda: experiment_prefix(model, args),
            "sharing": lambda: experiment_sharing(model, args), "latent": lambda: experiment_latent(args)}
    for name in args.experiments:
        results[name] = runs[name]()
    results["total_s"] = round(time.perf_counter() - start, 1)
    report(results, args)
    return results


def report(results: dict, args) -> None:
    if "memory" in results:
        w = results["workload"]
        print(f"\n1. Long-tailed workload: {w['num_requests']} requests; prompt lengths {_lens(w['prompt_len'])}; "
              f"output lengths {_lens(w['output_len'])}; KV budget {args.budget_seqs} x {args.max_model_len} tokens")
        print_table("KV utilization and concurrency", results["memory"], MEMORY_COLS)
    if "prefix" in results:
        print(f"\n2. Shared prefix: {args.prefix_requests} requests, {args.prefix_len}-token system prompt + 8-32 "
              f"unique tokens, {args.prefix_output_len} output tokens, block_size 16")
        print_table("Prefix caching", results["prefix"], PREFIX_COLS)
    if "sharing" in results:
        print(f"\n3. Sharing: {args.sharing_prompts} long-tailed prompts, width {args.width}, block_size 16 "
              f"(n={args.width}: drawn output lengths; beam search and its baselines: {args.beam_max_tokens} tokens)")
        print_table("Blocks with and without sharing", sharing_table_rows(results["sharing"]), SHARING_COLS)
    if "latent" in results:
        print(f"\n4. Latent KV: DeepSeek-V2-Lite-shaped, {args.latent_layers} layers, {args.latent_dtype} model, "
              f"{args.latent_kv_mib} MiB budget, block_size 16, max_model_len {args.latent_max_model_len}")
        print_table("Tokens per GiB of KV (engine block accounting)", results["latent"], LATENT_COLS)
    write_results(results, args.out, with_plot=all(k in results for k in ("memory", "prefix", "sharing")))


def _lens(d: dict) -> str:
    return f"median {d['median']:g}, mean {d['mean']:g}, p90 {d['p90']:g}, max {d['max']}"


def write_results(results: dict, out: Path, with_plot: bool = True) -> None:
    """The JSON, and the figure of experiments 1-3 when they ran."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    if with_plot:
        plot(results, out.with_suffix(".png"))
    print(f"\nwrote {out.with_suffix('.json')}{' and ' + str(out.with_suffix('.png')) if with_plot else ''} "
          f"({results['total_s']} s)")


if __name__ == "__main__":
    main()
