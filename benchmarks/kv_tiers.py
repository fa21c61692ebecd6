"""KV tiers: time to first token when a long shared document's prefix comes from each tier.

A document of ``--doc-len`` tokens (default 4096) followed by a short question, on the random
34M Llama (benchmarks/common.py), with a device pool that holds one such request and little
more: a filler request of the same length evicts the document. For each case, one request
(document + a new question, ``--max-tokens`` greedy tokens) is timed from ``generate`` to its
first token, and the prompt tokens the engine computed for it are counted::

    cold          nothing cached (after reset_prefix_cache(reset_disk=True))
    device        the document's blocks still in the device pool
    cpu           evicted to the CPU tier (--kv-offload-cpu-gb large enough for it)
    disk          evicted through a CPU tier of 8 blocks to the disk tier
    disk-restart  a new engine on the same --kv-offload-dir (persisted entries only)

Each case runs ``--repeats`` times (median reported); every case's greedy tokens must equal
the cold run's. Targets (issue 17): CPU-tier TTFT <= 15% of cold, disk <= 30% of cold.

Multi-turn chat: ``--chats`` conversations take turns (round robin), each turn appending the
previous answer and a new user message; the device pool cannot hold every conversation, so
device-only prefix caching loses them between turns while the CPU tier keeps them. Reported:
prefix-cache hit rate, prompt tokens computed and mean TTFT, device-only vs with the CPU tier,
at the same device budget.

    python benchmarks/kv_tiers.py --quick   # doc 512 tokens, 1 repeat (~1 min on 2 cores)
    python benchmarks/kv_tiers.py           # doc 4096 tokens, 3 repeats

Start-up cost of the disk tier's fingerprint (every weights file hashed whole, on a thread beside
the weight loading, then cached by file identity in the tier directory): ``--startup-gb N``
writes a random bfloat16 Llama of about N GB to a temporary directory (or measures ``--model``)
and times engine start-up without a disk tier, with one on a fresh directory (hashed), and with
one whose digests are cached, ``--repeats`` rounds in rotating order, reporting medians and the median
per-round ratio to no tier (target: <= 1.10 when hashing), plus the hash alone (its throughput, to
estimate larger checkpoints, and what hashing before loading would cost)::

    python benchmarks/kv_tiers.py --startup-gb 1 --repeats 5

Writes ``--out``.json and, when matplotlib imports, ``--out``.png (TTFT by tier).

``--remote``: the remote tier across two replicas behind the router, and prefill/decode
disaggregation against colocated serving (``kv_remote.py``: its own flags, see its --help)::

    python benchmarks/kv_tiers.py --remote --quick
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))  # benchmarks/common.py
# the 34M model's positions stop at 2048; the document is longer (rope extends, weights are random)
os.environ.setdefault("PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")

import common  # noqa: E402  (puts this checkout's pagedllm first on sys.path)

from pagedllm import LLM, SamplingParams  # noqa: E402

CASES = ("cold", "device", "cpu", "disk", "disk-restart")
SMALL_CPU_TIER_BLOCKS = 8  # the disk cases' CPU tier: most of the document goes on to disk


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the random 34M Llama)")
    p.add_argument("--quick", action="store_true", help="doc 512 tokens, 1 repeat, 2 short chats")
    p.add_argument("--doc-len", type=int, default=None, help="document tokens (default 4096; quick 512)")
    p.add_argument("--question-len", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--repeats", type=int, default=None, help="runs per case (default 3; quick 1)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--chats", type=int, default=None, help="conversations in the chat benchmark (6; quick 3)")
    p.add_argument("--turns", type=int, default=None, help="turns per conversation (4; quick 3)")
    p.add_argument("--chat-system-len", type=int, default=None, help="first message tokens (1024; quick 128)")
    p.add_argument("--disk-dir", type=Path, default=None, help="disk tier directory (default: a temporary one)")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR / "kv_tiers", help="results path, no suffix")
    p.add_argument("--startup-gb", type=float, default=None,
                   help="only measure the disk tier's start-up cost, on a random checkpoint of this many GB")
    args = p.parse_args(argv)
    common.fill_unset(args, dict(doc_len=512, repeats=1, chats=3, turns=3, chat_system_len=128),
                      dict(doc_len=4096, repeats=3, chats=6, turns=4, chat_system_len=1024))
    return args


# --------------------------------------------------------------------------- engines


class Setup:
    """Prompts, lengths and engine sizes of one run."""

    def __init__(self, args, vocab: int):
        self.args, self.vocab = args, vocab
        bs = args.block_size
        docs = common.make_prompts([args.doc_len] * 2, vocab, seed=1)
        self.doc, self.filler = docs
        self.questions = common.make_prompts([args.question_len] * (4 * args.repeats + 4), vocab, seed=2)
        self.max_len = args.doc_len + args.question_len + args.max_tokens + bs
        self.device_blocks = -(-self.max_len // bs) + 4  # one request and a few blocks more
        self.params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    def engine(self, model: str, cpu_blocks: int = 0, disk: Path | None = None, blocks: int | None = None,
               max_len: int | None = None) -> LLM:
        kw = dict(block_size=self.args.block_size, max_model_len=max_len or self.max_len,
                  num_gpu_blocks_override=blocks or self.device_blocks, seed=0, num_threads=self.args.num_threads,
                  max_num_batched_tokens=max(2048, max_len or self.max_len))
        llm = LLM(model, **kw)
        bb = llm.llm_engine.executor.block_bytes()
        llm.llm_engine.shutdown()
        tiers = {}
        if cpu_blocks:
            tiers["kv_offload_cpu_gb"] = (cpu_blocks + 0.5) * bb / 2**30
        if disk is not None:
            tiers.update(kv_offload_dir=str(disk), kv_offload_disk_gb=4 * self.device_blocks * bb / 2**30 + 0.01)
        return LLM(model, **kw, **tiers)


def timed(llm: LLM, prompt: list[int], params: SamplingParams) -> dict:
    """TTFT (one request alone: the first token ends its first step that samples), prompt tokens
    computed, and the greedy tokens."""
    engine = llm.llm_engine
    before = engine.counters.prompt_tokens_computed
    t0 = time.perf_counter()
    engine.add_request("q", {"prompt_token_ids": prompt}, params)
    ttft, tokens = None, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if ttft is None and out.outputs[0].token_ids:
                ttft = time.perf_counter() - t0
            tokens = out.outputs[0].token_ids
    return dict(ttft_s=ttft, prompt_tokens_computed=engine.counters.prompt_tokens_computed - before,
                tokens=list(tokens))


def evict(llm: LLM, s: Setup) -> None:
    llm.generate([{"prompt_token_ids": s.filler}], SamplingParams(max_tokens=1), use_tqdm=False)


def tier_hits(llm: LLM) -> dict:
    return {t: int(v["hits"]) for t, v in llm.get_kv_cache_stats().offload.items()}


# --------------------------------------------------------------------------- TTFT by tier


def run_cases(model: str, s: Setup, disk_root: Path) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {c: [] for c in CASES}
    q = iter(s.questions)
    cpu_engine = s.engine(model, cpu_blocks=3 * s.device_blocks)
    for _ in range(s.args.repeats):
        cpu_engine.reset_prefix_cache()
        runs["cold"].append(_case(cpu_engine, s, next(q)))
        runs["device"].append(_case(cpu_engine, s, next(q)))
        evict(cpu_engine, s)
        runs["cpu"].append(_case(cpu_engine, s, next(q)))
    cpu_engine.llm_engine.shutdown()
    for i in range(s.args.repeats):
        runs["disk"].append(_disk_case(model, s, disk_root / f"r{i}", next(q)))
        runs["disk-restart"].append(_restart_case(model, s, disk_root / f"r{i}", next(q)))
    return runs


def _case(llm: LLM, s: Setup, question: list[int]) -> dict:
    before = tier_hits(llm)
    r = timed(llm, s.doc + question, s.params)
    r["tier_hits"] = {t: n - before.get(t, 0) for t, n in tier_hits(llm).items()}
    return r


def _disk_case(model: str, s: Setup, disk: Path, question: list[int]) -> dict:
    llm = s.engine(model, cpu_blocks=SMALL_CPU_TIER_BLOCKS, disk=disk)
    llm.generate([{"prompt_token_ids": s.doc + question[:1]}], SamplingParams(max_tokens=1), use_tqdm=False)
    evict(llm, s)
    llm.llm_engine.flush_kv_tiers()  # its queued disk writes land before the timing
    r = _case(llm, s, question)
    llm.llm_engine.shutdown()
    return r


def _restart_case(model: str, s: Setup, disk: Path, question: list[int]) -> dict:
    llm = s.engine(model, cpu_blocks=SMALL_CPU_TIER_BLOCKS, disk=disk)
    r = _case(llm, s, question)
    llm.llm_engine.shutdown()
    return r


def check_outputs(model: str, s: Setup, runs: dict[str, list[dict]]) -> bool:
    """Every case's greedy tokens equal a from-scratch run of the same prompt (no prefix cache)."""
    ref = LLM(model, block_size=s.args.block_size, max_model_len=s.max_len, num_gpu_blocks_override=s.device_blocks,
              enable_prefix_caching=False, num_threads=s.args.num_threads, max_num_batched_tokens=max(2048, s.max_len))
    q = iter(s.questions)
    ok = True
    order = [(c, i) for i in range(s.args.repeats) for c in ("cold", "device", "cpu")]
    order += [(c, i) for i in range(s.args.repeats) for c in ("disk", "disk-restart")]
    for case, i in order:
        prompt = s.doc + next(q)
        expected = ref.generate([{"prompt_token_ids": prompt}], s.params, use_tqdm=False)[0].outputs[0].token_ids
        runs[case][i]["matches_recompute"] = list(expected) == runs[case][i]["tokens"]
        ok &= runs[case][i]["matches_recompute"]
    ref.llm_engine.shutdown()
    return ok


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    cold = statistics.median(r["ttft_s"] for r in runs["cold"])
    out = {}
    for case, rs in runs.items():
        ttft = statistics.median(r["ttft_s"] for r in rs)
        out[case] = dict(ttft_ms=1e3 * ttft, pct_of_cold=100 * ttft / cold,
                         prompt_tokens_computed=statistics.median(r["prompt_tokens_computed"] for r in rs),
                         tier_hits=rs[-1]["tier_hits"], matches_recompute=all(r.get("matches_recompute") for r in rs))
    return out


# --------------------------------------------------------------------------- multi-turn chat


def run_chat(model: str, s: Setup, with_cpu_tier: bool) -> dict:
    """Round-robin turns of ``--chats`` conversations on a pool that holds about two of them; the
    CPU tier, when there is one, holds them all."""
    a = s.args
    lens = [a.chat_system_len] + [a.question_len] * a.turns
    prompts = common.make_prompts(lens * a.chats, s.vocab, seed=3)
    max_len = a.chat_system_len + a.turns * (a.question_len + a.max_tokens) + a.block_size
    blocks = 2 * (-(-max_len // a.block_size)) + 4
    cpu_blocks = a.chats * (-(-max_len // a.block_size)) + 4 if with_cpu_tier else 0
    llm = s.engine(model, cpu_blocks=cpu_blocks, blocks=blocks, max_len=max_len)
    history = [prompts[i * len(lens)] for i in range(a.chats)]
    ttfts = []
    for turn in range(a.turns):
        for c in range(a.chats):
            history[c] = history[c] + prompts[c * len(lens) + 1 + turn]
            r = timed(llm, history[c], s.params)
            ttfts.append(r["ttft_s"])
            history[c] = history[c] + r["tokens"]
    stats = llm.get_kv_cache_stats()
    computed = llm.llm_engine.counters.prompt_tokens_computed
    llm.llm_engine.shutdown()
    return dict(device_blocks=blocks, cpu_tier_blocks=cpu_blocks, prefix_hit_rate=stats.prefix_cache_hit_rate,
                prompt_tokens_computed=computed, mean_ttft_ms=1e3 * statistics.mean(ttfts))


# --------------------------------------------------------------------------- report


def plot(summary: dict[str, dict], path: Path, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no chart {path}")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    ms = [summary[c]["ttft_ms"] for c in CASES]
    bars = ax.bar(CASES, ms, color=["C3", "C0", "C2", "C1", "C4"])
    for bar, c in zip(bars, CASES):
        ax.annotate(f"{summary[c]['ttft_ms']:.0f} ms\n{summary[c]['pct_of_cold']:.0f}%", (bar.get_x() + 0.4,
                    bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("time to first token (ms)")
    ax.set_ylim(0, max(ms) * 1.25)
    ax.set_title(title, fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(summary: dict[str, dict], chat: dict[str, dict]) -> None:
    rows = [[c, f"{v['ttft_ms']:.1f}", f"{v['pct_of_cold']:.1f}%", f"{v['prompt_tokens_computed']:.0f}",
             " ".join(f"{t}={n}" for t, n in v["tier_hits"].items()), str(v["matches_recompute"])]
            for c, v in summary.items()]
    print(common.format_table(["case", "TTFT ms", "of cold", "computed", "tier hits (blocks)", "= recompute"], rows))
    rows = [[k, f"{v['prefix_hit_rate']:.3f}", str(v["prompt_tokens_computed"]), f"{v['mean_ttft_ms']:.1f}"]
            for k, v in chat.items()]
    print()
    print(common.format_table(["chat", "prefix hit rate", "prompt tokens computed", "mean TTFT ms"], rows))


# --------------------------------------------------------------------------- start-up cost of the fingerprint


def write_random_llama(path: Path, gb: float) -> Path:
    """A random-weight bfloat16 Llama of about ``gb`` GB: hidden 2048, as many layers as fit."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig
    hidden, inter, vocab, kv = 2048, 5632, 8192, 1024
    layer = {"self_attn.q_proj.weight": (hidden, hidden), "self_attn.k_proj.weight": (kv, hidden),
             "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, hidden),
             "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
             "mlp.down_proj.weight": (hidden, inter), "input_layernorm.weight": (hidden,),
             "post_attention_layernorm.weight": (hidden,)}
    layer_bytes = 2 * sum(torch.Size(s).numel() for s in layer.values())
    layers = max(1, round((gb * 1e9 - 4 * vocab * hidden) / layer_bytes))
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    shapes.update({f"model.layers.{i}.{k}": v for i in range(layers) for k, v in layer.items()})
    g = torch.Generator().manual_seed(0)
    tensors = {k: (torch.randn(v, generator=g) * 0.02).to(torch.bfloat16) for k, v in shapes.items()}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=False, bos_token_id=1,
                eos_token_id=2, pad_token_id=0, torch_dtype="bfloat16",
                architectures=["LlamaForCausalLM"]).save_pretrained(path)
    common.word_tokenizer(vocab).save_pretrained(path)
    return path


_STARTUP = """
import json, sys, time
from pagedllm import LLM
model, disk, threads = sys.argv[1], sys.argv[2] or None, int(sys.argv[3]) or None
tiers = dict(kv_offload_dir=disk, kv_offload_disk_gb=1) if disk else {}
t0, c0 = time.perf_counter(), time.process_time()
llm = LLM(model, max_model_len=256, num_gpu_blocks_override=64, num_threads=threads, **tiers)
print(json.dumps([time.perf_counter() - t0, time.process_time() - c0]))
"""


def startup_seconds(model: str, disk: Path | None, num_threads: int | None) -> tuple[float, float]:
    """Wall-clock and CPU seconds (every thread) of one engine start-up (``LLM(...)``), in a fresh
    process each time (as a server starts; in one process the starts' memory piled up): on a busy
    machine the CPU seconds are the steadier measure of the work hashing adds."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(common.ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _STARTUP, model, str(disk or ""), str(num_threads or 0)],
                         capture_output=True, text=True, env=env, check=True).stdout
    seconds, cpu = json.loads(out.strip().splitlines()[-1])
    return seconds, cpu


STARTUP_CASES = ("no_tier", "tier_hashing", "tier_cached")


def measure_startup(args) -> dict:
    """Engine start-up without a disk tier, with one on a fresh directory (every weights file hashed,
    on a thread beside the weight loading) and with one whose digest cache is warm; ``--repeats``
    rounds, the order of the three rotating each round (so none always runs first after the others
    warmed the machine); medians, and the median of each round's ratio to no_tier. The hash alone,
    and what a serial hash (hash, then load) would cost: no_tier + hash alone."""
    from pagedllm.kv_cache.offload.fingerprint import content_digest
    with tempfile.TemporaryDirectory(prefix="pagedllm-startup-") as tmp:
        model = Path(args.model) if args.model else write_random_llama(Path(tmp) / "model", args.startup_gb)
        files = sorted(model.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        startup_seconds(str(model), None, args.num_threads)  # warms the page cache and the imports
        warm = Path(tmp) / "tier-warm"
        startup_seconds(str(model), warm, args.num_threads)  # fills warm's digest cache
        runs, cpu_runs = [], []
        for i in range(args.repeats):
            dirs = {"no_tier": None, "tier_hashing": Path(tmp) / f"tier{i}", "tier_cached": warm}
            order = STARTUP_CASES[i % 3:] + STARTUP_CASES[:i % 3]
            timed = {case: startup_seconds(str(model), dirs[case], args.num_threads) for case in order}
            runs.append({case: timed[case][0] for case in STARTUP_CASES})
            cpu_runs.append({case: timed[case][1] for case in STARTUP_CASES})
        t0, c0 = time.perf_counter(), time.process_time()
        for f in files:
            content_digest(f)
        hash_s, hash_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    return startup_summary(size, runs, cpu_runs, hash_s, hash_cpu_s)


def startup_summary(size: int, runs: list[dict], cpu_runs: list[dict], hash_s: float, hash_cpu_s: float) -> dict:
    med = {k: statistics.median(r[k] for r in runs) for k in STARTUP_CASES}
    med_cpu = {k: statistics.median(r[k] for r in cpu_runs) for k in STARTUP_CASES}
    ratio = {k: statistics.median(r[f"tier_{k}"] / r["no_tier"] for r in runs) for k in ("hashing", "cached")}
    out = dict(checkpoint_gb=size / 1e9, repeats=len(runs), median_startup_s=med, median_startup_cpu_s=med_cpu,
               median_ratio_to_no_tier=ratio, added_pct={k: 100 * (v - 1) for k, v in ratio.items()},
               serial_hash_estimate_s=med["no_tier"] + hash_s, runs=runs, cpu_runs=cpu_runs,
               hash_alone_s=hash_s, hash_alone_cpu_s=hash_cpu_s, hash_gb_per_s=size / 1e9 / hash_s,
               estimate_15gb_hash_alone_s=15 / (size / 1e9 / hash_s), commit=common.git_commit())
    print(json.dumps({k: v for k, v in out.items() if k not in ("runs", "cpu_runs")}, indent=1))
    return out


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if "--remote" in argv:  # the remote tier across replicas: its own flags and processes
        import kv_remote
        return kv_remote.main(argv)
    args = parse_args(argv)
    if args.num_threads:
        import torch
        torch.set_num_threads(args.num_threads)
    if args.startup_gb is not None:  # (with --model: that checkpoint, whatever the size given)
        results = measure_startup(args)
        common.save_json(results, args.out.with_name(args.out.name + "_startup").with_suffix(".json"))
        return results
    model = args.model or str(common.ensure_model(common.default_model_dir()))
    from transformers import AutoConfig
    s = Setup(args, AutoConfig.from_pretrained(model).vocab_size)
    with tempfile.TemporaryDirectory(prefix="pagedllm-kv-tiers-") as tmp:
        runs = run_cases(model, s, args.disk_dir or Path(tmp))
    outputs_ok = check_outputs(model, s, runs)
    summary = summarize(runs)
    chat = {"device only": run_chat(model, s, False), "with CPU tier": run_chat(model, s, True)}
    report(summary, chat)
    results = dict(doc_len=args.doc_len, question_len=args.question_len, block_size=args.block_size,
                   device_blocks=s.device_blocks, repeats=args.repeats, outputs_match=outputs_ok,
                   ttft=summary, chat=chat, runs={c: [{k: v for k, v in r.items() if k != "tokens"} for r in rs]
                                                   for c, rs in runs.items()},
                   commit=common.git_commit())
    common.save_json(results, args.out.with_suffix(".json"))
    plot(summary, args.out.with_suffix(".png"), f"TTFT by KV tier: {args.doc_len}-token document + "
         f"{args.question_len}-token question, block size {args.block_size}")
    return results


if __name__ == "__main__":
    main()
