"""Where a vision-language request's CPU time goes, pagedllm against transformers, on multimodal.py's
tiny Qwen2-VL-shaped model (one thread; CPU time of the process, which a loaded machine skews far
less than wall time). For a batch (``--batch``, image + 64-word question, ``--output-len`` tokens),
per phase for both systems: the HF processor, the vision tower's blocks, the patch merger (the
projector), the language model's prefill and decode, and pagedllm's rest of the steps (scheduler,
sampler, outputs, logits); with each compute phase's GFLOP (counted from the configs) and the rate it
ran at, beside torch's best float32 GEMM rate at a tower shape on this core (oneDNN on a prepacked
weight): the floor the FLOPs put under any fp32 system. Then one request at a time: a miss, an
encoder-cache hit (question first), an image-first follow-up and an exact repeat::

    python benchmarks/probes/multimodal_breakdown.py [--batch 16] [--output-len 64]
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import multimodal as mm  # noqa: E402  (benchmarks/multimodal.py: the model and the prompts)
import torch  # noqa: E402

PHASES = ("processor", "tower blocks", "merger", "prefill", "decode", "other step work")


def timed(table: dict, key: str, fn):
    def wrapper(*args, **kwargs):
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            table[key] += time.process_time() - start
    return wrapper


def instrument(llm) -> dict:
    """CPU seconds per part, filled while the engine runs (instance attributes wrap the methods)."""
    table = collections.defaultdict(float)
    engine, runner = llm.llm_engine, llm.llm_engine.executor.runner
    engine.add_request = timed(table, "processor", engine.add_request)
    engine.step = timed(table, "steps", engine.step)
    runner.model.encode_image = timed(table, "tower", runner.model.encode_image)
    try:
        from pagedllm.models import qwen2_vl_tower
        qwen2_vl_tower.merge = timed(table, "merger", qwen2_vl_tower.merge)
    except ImportError:  # a checkout from before our tower forward (an A/B baseline): transformers' merger module
        merger = runner.model.visual.merger
        merger.forward = timed(table, "merger", merger.forward)
    fused = runner.model.model.fused_decoder
    if fused is not None:  # decode steps on the one-call C decoder
        fused.forward_host = timed(table, "decode", fused.forward_host)
    forward = runner.model.forward

    def model_forward(input_ids, *args, **kwargs):
        decode = kwargs.get("inputs_embeds") is None and input_ids.shape[0] <= 64
        return timed(table, "decode" if decode else "prefill", forward)(input_ids, *args, **kwargs)
    runner.model.forward = model_forward
    return table


def run_ours(llm, table: dict, prompts: list, output_len: int) -> dict:
    from pagedllm import SamplingParams
    table.clear()
    start = time.process_time()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True),
                        use_tqdm=False)
    parts = collections.defaultdict(float, table)
    parts["tower blocks"] = parts.pop("tower", 0.0) - parts["merger"]
    parts["other step work"] = parts.pop("steps", 0.0) - sum(parts[k] for k in ("tower blocks", "merger", "prefill",
                                                                           "decode"))
    parts["total"] = time.process_time() - start
    parts["prompt_len"] = len(outs[0].prompt_token_ids)
    return parts


def run_hf(model, processor, texts: list, imgs: list, output_len: int) -> dict:
    table = collections.defaultdict(float)
    merger = model.model.visual.merger
    handles = [merger.register_forward_pre_hook(lambda *_: table.__setitem__("m0", time.process_time())),
               merger.register_forward_hook(lambda *_: table.__setitem__(
                   "merger", table["merger"] + time.process_time() - table["m0"]))]
    start = time.process_time()
    inputs = processor(text=texts, images=imgs, return_tensors="pt", padding=True)
    table["processor"] = time.process_time() - start
    with torch.no_grad():
        start = time.process_time()
        model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
        tower = time.process_time() - start
        start = time.process_time()
        model.generate(**inputs, max_new_tokens=1, do_sample=False)
        first = time.process_time() - start
        start = time.process_time()
        model.generate(**inputs, max_new_tokens=output_len, do_sample=False)
        total = time.process_time() - start
    for h in handles:
        h.remove()
    merger_once = table["merger"] / 3  # the tower ran three times: alone and in each generate
    return {"processor": table["processor"], "tower blocks": tower - merger_once, "merger": merger_once,
            "prefill": first - tower, "decode": total - first, "total": total + table["processor"]}


def flops(cfg, grid: tuple[int, int, int], prompt_len: int, batch: int, output_len: int) -> dict:
    """GFLOP of each compute phase for the batch (multiply-adds x 2), from the configs."""
    vc, tc = cfg.vision_config, cfg.text_config
    t, h, w = grid
    n, e, merge = t * h * w, vc.embed_dim, vc.spatial_merge_size
    m = int(e * vc.mlp_ratio)
    patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    block = 2 * n * e * 3 * e + 2 * n * e * e + 2 * 2 * n * e * m + 4 * n * (h * w) * e  # qkv, proj, mlp, attention
    tower = 2 * n * patch_dim * e + vc.depth * block
    rows, wide = n // merge ** 2, e * merge ** 2
    merger = 2 * rows * wide * wide + 2 * rows * wide * vc.hidden_size
    d, hd = tc.hidden_size, tc.hidden_size // tc.num_attention_heads
    qkv = 2 * d * (tc.num_attention_heads + 2 * tc.num_key_value_heads) * hd
    linears = qkv + 2 * d * d + 6 * d * tc.intermediate_size  # qkv, o, gate_up + down

    def tokens(count: int, context: float) -> float:  # ``count`` tokens attending to ``context`` keys on average
        return count * tc.num_hidden_layers * (linears + 4 * context * tc.num_attention_heads * hd)
    logits = 2 * d * tc.vocab_size
    prefill = tokens(prompt_len, (prompt_len + 1) / 2) + logits
    decode = sum(tokens(1, prompt_len + i) + logits for i in range(1, output_len))
    return {k: v * batch / 1e9 for k, v in
            {"tower blocks": tower, "merger": merger, "prefill": prefill, "decode": decode}.items()}


def gemm_rate(rows: int, inner: int, out: int) -> float:
    """GFLOP/s of oneDNN's float32 GEMM on a prepacked weight (the best of torch's here), one thread."""
    x, w = torch.randn(rows, inner), torch.randn(out, inner)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
    best = float("inf")
    for _ in range(20):
        start = time.process_time()
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        best = min(best, time.process_time() - start)
    return 2 * rows * inner * out / best / 1e9


def rate(gflop: float | None, seconds: float) -> str:
    return f"{gflop / seconds:7.0f}" if gflop and seconds else " " * 7


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import transformers as tf

    from pagedllm import LLM
    from pagedllm.multimodal.processor import load_hf_processor
    torch.set_num_threads(1)
    path = str(mm.ensure_tiny_qwen2_vl(mm.tiny_qwen2_vl_dir()))
    llm = LLM(model=path, max_model_len=2048, kv_cache_memory="1GiB", dtype="float32", max_num_seqs=args.batch,
              num_threads=1)
    table = instrument(llm)
    processor = load_hf_processor(path)
    processor.tokenizer.padding_side = "left"
    model = tf.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ph = llm.llm_engine.multimodal.placeholder
    texts = [f"{ph} {mm.question(64, seed)}" for seed in range(args.batch)]
    runs = collections.defaultdict(list)
    for rep in range(args.repeats):
        imgs = mm.images(args.batch, 336, seed=100 + rep)
        runs["pagedllm"].append(run_ours(llm, table, [{"prompt": t, "multi_modal_data": {"image": i}}
                                                      for t, i in zip(texts, imgs)], args.output_len))
        runs["transformers"].append(run_hf(model, processor, texts, imgs, args.output_len))
    grid = tuple(processor.image_processor(images=imgs[:1], return_tensors="pt")["image_grid_thw"][0].tolist())
    gflop = flops(model.config, grid, runs["pagedllm"][0]["prompt_len"], args.batch, args.output_len)
    med = {name: {k: statistics.median(r.get(k, 0.0) for r in rs) for k in (*PHASES, "total")}
           for name, rs in runs.items()}
    peak = gemm_rate(576, 192, 768)
    print(f"batch {args.batch}, {args.output_len} output tokens, CPU seconds (median of {args.repeats}); "
          f"oneDNN fp32 GEMM at 576x192x768: {peak:.0f} GFLOP/s")
    print(f"{'phase':<16} {'GFLOP':>6} {'pagedllm s':>10} {'GFLOP/s':>7} {'transformers s':>14} {'GFLOP/s':>7}")
    for phase in (*PHASES, "total"):
        ours, theirs, g = med["pagedllm"][phase], med["transformers"][phase], gflop.get(phase)
        print(f"{phase:<16} {g or 0:6.1f} {ours:10.3f} {rate(g, ours)} {theirs:14.3f} {rate(g, theirs)}")
    floor = (gflop["tower blocks"] + gflop["merger"] + gflop["prefill"]) / peak
    print(f"ratio {med['transformers']['total'] / med['pagedllm']['total']:.2f}x; the tower + merger + prefill "
          f"at {peak:.0f} GFLOP/s alone: {floor:.3f} s, a ceiling of {med['transformers']['total'] / floor:.2f}x "
          "with everything else free")
    singles = collections.defaultdict(list)
    for k, image in enumerate(mm.images(args.repeats, 336, seed=1000)):
        for i, (name, layout) in enumerate((("miss", "{q} {p}"), ("hit", "{q} {p}"), ("first turn", "{p} {q}"),
                                            ("image-first hit", "{p} {q}"), ("repeat", "{p} {q}"))):
            text = layout.format(q=mm.question(64, 5 * k + min(i, 3)), p=ph)
            singles[name].append(run_ours(llm, table, [{"prompt": text, "multi_modal_data": {"image": image}}], 1))
    miss = statistics.median(r["total"] for r in singles["miss"])
    for name, rs in singles.items():
        parts = {key: round(statistics.median(r.get(key, 0.0) for r in rs) * 1e3, 1) for key in (*PHASES, "total")}
        print(f"one request, {name}: ms", parts, f"{parts['total'] / 1e3 / miss:.0%} of a miss")
    llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
