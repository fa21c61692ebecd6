"""Where a vision-language request's CPU time goes, pagedllm against transformers, on multimodal.py's
tiny Qwen2-VL-shaped model (one thread; CPU time of the process, which a loaded machine skews far
less than wall time). Prints, for a batch of 16 (image + 64-word question, 64 output tokens):
pagedllm's request processing (the HF processor, hashing), vision tower, language-model prefill and
decode steps, the rest of the steps (scheduler, sampler, outputs); transformers' tower (its own
call over all images), its one-token generate (tower + prefill) and the decode after it. Then one
request at a time: a miss, an encoder-cache hit (question first), an image-first follow-up and an
exact repeat, split the same way::

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
    engine.add_request = timed(table, "requests (processor)", engine.add_request)
    engine.step = timed(table, "steps", engine.step)
    runner.model.encode_image = timed(table, "tower", runner.model.encode_image)
    forward = runner.model.forward

    def model_forward(input_ids, *args, **kwargs):
        decode = kwargs.get("inputs_embeds") is None and input_ids.shape[0] <= 64
        key = "decode forward" if decode else "prefill forward"
        return timed(table, key, forward)(input_ids, *args, **kwargs)
    runner.model.forward = model_forward
    return table


def run_ours(llm, table: dict, prompts: list, output_len: int) -> dict:
    from pagedllm import SamplingParams
    table.clear()
    start = time.process_time()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True), use_tqdm=False)
    parts = dict(table)
    parts["other step work"] = parts.pop("steps") - sum(v for k, v in parts.items() if k.endswith(("forward", "tower")))
    parts["total"] = time.process_time() - start
    return parts


def run_hf(model, processor, texts: list, imgs: list, output_len: int) -> dict:
    inputs = processor(text=texts, images=imgs, return_tensors="pt", padding=True)
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
    return {"tower": tower, "prefill (one-token generate - tower)": first - tower, "decode": total - first,
            "total": total}


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
    for rep in range(args.repeats):
        imgs = mm.images(args.batch, 336, seed=100 + rep)
        ours = run_ours(llm, table, [{"prompt": t, "multi_modal_data": {"image": i}} for t, i in zip(texts, imgs)],
                        args.output_len)
        theirs = run_hf(model, processor, texts, imgs, args.output_len)
        print(f"batch {args.batch}: pagedllm", {k: round(v, 3) for k, v in ours.items()})
        print(f"batch {args.batch}: transformers", {k: round(v, 3) for k, v in theirs.items()},
              f"ratio {theirs['total'] / ours['total']:.2f}x")
    singles = collections.defaultdict(list)
    for k, image in enumerate(mm.images(args.repeats, 336, seed=1000)):
        for i, (name, layout) in enumerate((("miss", "{q} {p}"), ("hit", "{q} {p}"), ("first turn", "{p} {q}"),
                                            ("image-first hit", "{p} {q}"), ("repeat", "{p} {q}"))):
            text = layout.format(q=mm.question(64, 5 * k + min(i, 3)), p=ph)
            singles[name].append(run_ours(llm, table, [{"prompt": text, "multi_modal_data": {"image": image}}], 1))
    miss = statistics.median(r["total"] for r in singles["miss"])
    for name, runs in singles.items():
        parts = {key: round(statistics.median(r.get(key, 0.0) for r in runs) * 1e3, 1) for key in runs[0]}
        print(f"one request, {name}: ms", parts, f"{parts['total'] / 1e3 / miss:.0%} of a miss")
    llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
