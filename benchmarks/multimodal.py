"""Vision-language serving on a LLaVA checkpoint: TTFT and throughput for one image + a question
at several batch sizes, pagedllm against transformers' ``generate`` in the same run (same weights,
threads, images), and the encoder cache's effect on a repeated image. Example::

    python benchmarks/multimodal.py --model llava-hf/llava-1.5-7b-hf --batch 1 16 --json results/mm.json

Each prompt is ``<image>`` followed by a ``--question-len``-word question; greedy, EOS ignored,
``--output-len`` tokens. ``ttft`` (pagedllm): first token time - arrival, mean over the batch;
transformers': the time of a one-token ``generate`` of the whole batch. ``tok/s``: output tokens
of the batch / its wall time. Encoder cache: one request with a new image (``miss``: the tower
runs) and then the same image behind another question (``hit``: the question comes first, so no
prefix-cache block covers the image and only the encoder cache can serve it); TTFT of each, the
median over ``--repeats`` images.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import common  # noqa: F401 - puts this checkout's pagedllm first on sys.path, the Hub offline
import numpy as np
import torch
from PIL import Image

WORDS = "the quick brown fox jumps over a lazy dog while paged attention keeps every block in its table".split()


def images(n: int, size: int, seed: int) -> list[Image.Image]:
    rng = np.random.RandomState(seed)
    return [Image.fromarray(rng.randint(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def question(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def run_pagedllm(llm, texts: list[str], imgs: list, output_len: int) -> dict:
    from pagedllm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": i}} for t, i in zip(texts, imgs)], params,
                        use_tqdm=False)
    wall = time.perf_counter() - start
    ttft = statistics.mean(o.metrics.first_token_time - o.metrics.arrival_time for o in outs)
    return dict(ttft=ttft, tok_s=len(outs) * output_len / wall, tokens=[list(o.outputs[0].token_ids) for o in outs])


def run_transformers(model, processor, texts: list[str], imgs: list, output_len: int) -> dict:
    processor.tokenizer.padding_side = "left"
    inputs = processor(text=texts, images=imgs, return_tensors="pt", padding=True)
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(**inputs, max_new_tokens=1, do_sample=False)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=output_len, do_sample=False)
        wall = time.perf_counter() - start
    new = out[:, inputs["input_ids"].shape[1]:].tolist()
    return dict(ttft=ttft, tok_s=len(texts) * output_len / wall, tokens=new)


def encoder_cache_effect(llm, placeholder: str, args) -> dict:
    from pagedllm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=1)
    miss, hit = [], []
    stats = llm.llm_engine.scheduler.encoder.stats
    hits_before = stats.cache_hits
    for k, image in enumerate(images(args.repeats, args.image_size, seed=1000)):
        for times, seed in ((miss, 2 * k), (hit, 2 * k + 1)):
            text = f"{question(args.question_len, seed)} {placeholder}"  # the question first: no prefix hit
            out = llm.generate([{"prompt": text, "multi_modal_data": {"image": image}}], params, use_tqdm=False)[0]
            times.append(out.metrics.first_token_time - out.metrics.arrival_time)
    return dict(ttft_miss=statistics.median(miss), ttft_hit=statistics.median(hit),
                hit_over_miss=statistics.median(hit) / statistics.median(miss),
                encoder_cache_hits=stats.cache_hits - hits_before)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a LLaVA checkpoint (local directory or Hub id)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--question-len", type=int, default=64, help="words in each question")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--image-size", type=int, default=336, help="pixels of each (square, random) image")
    ap.add_argument("--repeats", type=int, default=3, help="images in the encoder-cache measurement")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    import transformers as tf

    from pagedllm import LLM
    llm = LLM(model=args.model, max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
              dtype="float32", max_num_seqs=max(args.batch))
    processor = tf.AutoProcessor.from_pretrained(args.model)
    model = tf.AutoModelForImageTextToText.from_pretrained(args.model, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore_eos, as pagedllm runs it
    placeholder = llm.llm_engine.multimodal.placeholder
    rows = []
    for batch in args.batch:
        texts = [f"{placeholder} {question(args.question_len, seed)}" for seed in range(batch)]
        imgs = images(batch, args.image_size, seed=batch)
        ours = run_pagedllm(llm, texts, imgs, args.output_len)
        theirs = run_transformers(model, processor, texts, imgs, args.output_len)
        rows.append(dict(batch=batch, pagedllm_ttft=ours["ttft"], transformers_ttft=theirs["ttft"],
                         pagedllm_tok_s=ours["tok_s"], transformers_tok_s=theirs["tok_s"],
                         speedup=ours["tok_s"] / theirs["tok_s"], same=ours["tokens"] == theirs["tokens"]))
    result = dict(model=args.model, batches=rows, encoder_cache=encoder_cache_effect(llm, placeholder, args),
                  commit=common.git_commit())
    table = [[str(r["batch"]), f"{r['pagedllm_ttft'] * 1e3:.1f}", f"{r['transformers_ttft'] * 1e3:.1f}",
              f"{r['pagedllm_tok_s']:.1f}", f"{r['transformers_tok_s']:.1f}", f"{r['speedup']:.2f}x", str(r["same"])]
             for r in rows]
    print(common.format_table(["batch", "ttft ms", "hf ttft ms", "tok/s", "hf tok/s", "speedup", "same"], table))
    enc = result["encoder_cache"]
    print(f"encoder cache: ttft miss {enc['ttft_miss'] * 1e3:.1f} ms, hit {enc['ttft_hit'] * 1e3:.1f} ms "
          f"({enc['hit_over_miss']:.0%} of a miss)")
    if args.json is not None:
        common.save_json(result, args.json)
    llm.llm_engine.shutdown()
    return result


if __name__ == "__main__":
    main()
