"""Vision-language serving on a LLaVA or Qwen2-VL checkpoint: TTFT and throughput for one image +
a question at several batch sizes, pagedllm against transformers' ``generate`` in the same run
(same weights, threads, images), and the encoder cache's effect on a repeated image. Examples::

    python benchmarks/multimodal.py --model llava-hf/llava-1.5-7b-hf --batch 1 16 --json results/mm.json
    python benchmarks/multimodal.py --tiny-qwen2-vl --batch 1 16   # a random Qwen2-VL-shaped model, built once

Each prompt is ``<image>`` followed by a ``--question-len``-word question; greedy, EOS ignored,
``--output-len`` tokens. ``ttft`` (pagedllm): first token time - arrival, mean over the batch;
transformers': the time of a one-token ``generate`` of the whole batch (neither counts the HF
processor). ``tok/s``: output tokens of the batch / its wall time, the HF processor's included on
both sides (pagedllm runs it inside ``llm.generate``; transformers' timer covers its processor call
and ``generate``, in its default SDPA attention); ``cpu speedup``: the same ratio over the process's
CPU time instead (with ``--threads 1`` the work each system did, which a machine shared with other
jobs does not skew the way it skews wall time); ``tower``: the share of pagedllm's wall time its
vision tower took (Qwen2-VL's: our forward on transformers' module, models/qwen2_vl_tower.py;
per-phase CPU time: benchmarks/probes/multimodal_breakdown.py). Encoder cache: one request with a
new image (``miss``: the tower runs) and then the same image behind another question (``hit``: the
question comes first, so no prefix-cache block covers the image and only the encoder cache can serve
it); TTFT of each, the median over ``--repeats`` images; ``hit (image first)``: the same image at
the start of a new question after another question on it, as in a follow-up turn, where the prefix
cache also holds the image's full blocks; ``repeat``: that last prompt again (the same image and
question), where the prefix cache holds every full block and only the last partial one is computed.
The same ratios are also given over the process's CPU time of each one-token request.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
import zlib
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


# a Qwen2-VL-shaped model at a benchmark's scale: the released layout (14-pixel patches of two
# frames, 2x2 merge, M-RoPE sections [16, 24, 24] over head_dim 128) at 1/6 of Qwen2-VL-2B's widths
TINY_QWEN2_VL = dict(
    text=dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
              bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.05),
    vision=dict(depth=4, embed_dim=192, hidden_size=256, num_heads=4, mlp_ratio=4, patch_size=14, spatial_merge_size=2,
                temporal_patch_size=2, in_channels=3, initializer_range=0.05),
    pixels=dict(min_pixels=56 * 56, max_pixels=448 * 448))
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def tiny_qwen2_vl_dir() -> Path:
    key = zlib.crc32(json.dumps(TINY_QWEN2_VL, sort_keys=True).encode())
    return common.CACHE_DIR / f"qwen2-vl-tiny-random-{key:08x}"


def ensure_tiny_qwen2_vl(path: Path) -> Path:
    """Builds the random Qwen2-VL-shaped checkpoint once (seed 0): a word tokenizer over ``WORDS``
    with the vision tokens, the model, and its Qwen2-VL image processor."""
    if (path / "config.json").exists():
        return path
    import transformers as tf

    from pagedllm.multimodal.processor import image_only_processor
    tok = common.word_tokenizer(512)
    tok.add_tokens(sorted(set(WORDS)))
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in zip(
        ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), VISION_TOKENS)}
    cfg = tf.Qwen2VLConfig(text_config=dict(TINY_QWEN2_VL["text"], vocab_size=len(tok)),
                           vision_config=TINY_QWEN2_VL["vision"], **ids)
    tmp = path.with_name(path.name + ".tmp")
    torch.manual_seed(0)
    tf.Qwen2VLForConditionalGeneration(cfg).save_pretrained(tmp)
    image_processor = tf.Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2,
                                                  **TINY_QWEN2_VL["pixels"])
    image_only_processor(tf.Qwen2VLProcessor)(image_processor=image_processor, tokenizer=tok).save_pretrained(tmp)
    os.replace(tmp, path)
    return path


def run_pagedllm(llm, texts: list[str], imgs: list, output_len: int) -> dict:
    from pagedllm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    stats = llm.llm_engine.scheduler.encoder.stats
    tower = stats.encoder_seconds
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": i}} for t, i in zip(texts, imgs)], params,
                        use_tqdm=False)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    ttft = statistics.mean(o.metrics.first_token_time - o.metrics.arrival_time for o in outs)
    return dict(ttft=ttft, tok_s=len(outs) * output_len / wall, tokens=[list(o.outputs[0].token_ids) for o in outs],
                wall=wall, cpu=cpu, tower=stats.encoder_seconds - tower)


def run_transformers(model, processor, texts: list[str], imgs: list, output_len: int) -> dict:
    """TTFT: a one-token ``generate`` on the processed batch (pagedllm's TTFT starts after its
    processor too); throughput and CPU time: the processor and ``generate``, as pagedllm's
    ``llm.generate`` runs its processor inside the timed call."""
    processor.tokenizer.padding_side = "left"
    inputs = processor(text=texts, images=imgs, return_tensors="pt", padding=True)
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(**inputs, max_new_tokens=1, do_sample=False)
        ttft = time.perf_counter() - start
        start, cpu = time.perf_counter(), time.process_time()
        inputs = processor(text=texts, images=imgs, return_tensors="pt", padding=True)
        out = model.generate(**inputs, max_new_tokens=output_len, do_sample=False)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    new = out[:, inputs["input_ids"].shape[1]:].tolist()
    return dict(ttft=ttft, tok_s=len(texts) * output_len / wall, cpu=cpu, tokens=new)


def encoder_cache_effect(llm, placeholder: str, args) -> dict:
    from pagedllm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=1)
    miss, hit, first_turn, hit_first, repeat = [], [], [], [], []
    repeat_cached = []  # the repeat's prompt tokens served by the prefix cache, of its prompt's
    stats = llm.llm_engine.scheduler.encoder.stats
    hits_before = stats.cache_hits
    for k, image in enumerate(images(args.repeats, args.image_size, seed=1000)):
        # the question first: no prefix hit on the image; then two turns with the image first
        runs = ((miss, "{q} {p}"), (hit, "{q} {p}"), (first_turn, "{p} {q}"), (hit_first, "{p} {q}"),
                (repeat, "{p} {q}"))
        for i, (times, layout) in enumerate(runs):
            seed = len(runs) * k + min(i, 3)  # the repeat asks hit_first's question again
            text = layout.format(q=question(args.question_len, seed), p=placeholder)
            cpu, wall = time.process_time(), time.perf_counter()
            out = llm.generate([{"prompt": text, "multi_modal_data": {"image": image}}], params, use_tqdm=False)[0]
            # (TTFT, the process's CPU time for the one-token request: its work, which other jobs do not skew,
            # and its wall time: TTFT starts when the engine takes the request, after the HF processor ran)
            times.append((out.metrics.first_token_time - out.metrics.arrival_time, time.process_time() - cpu,
                          time.perf_counter() - wall))
            if times is repeat:
                repeat_cached.append(out.num_cached_tokens / len(out.prompt_token_ids))
    named = (("miss", miss), ("hit", hit), ("hit_first", hit_first), ("repeat", repeat))
    ttft, cpu, wall = ({name: statistics.median(t[i] for t in runs) for name, runs in named} for i in range(3))
    return dict(ttft_miss=ttft["miss"], ttft_hit=ttft["hit"], hit_over_miss=ttft["hit"] / ttft["miss"],
                ttft_hit_image_first=ttft["hit_first"], hit_image_first_over_miss=ttft["hit_first"] / ttft["miss"],
                ttft_repeat=ttft["repeat"], repeat_over_miss=ttft["repeat"] / ttft["miss"],
                cpu_miss=cpu["miss"], cpu_hit_over_miss=cpu["hit"] / cpu["miss"],
                cpu_hit_image_first_over_miss=cpu["hit_first"] / cpu["miss"],
                cpu_repeat_over_miss=cpu["repeat"] / cpu["miss"],
                request_wall_s={name: wall[name] for name, _ in named},
                repeat_cached_share=min(repeat_cached), encoder_cache_hits=stats.cache_hits - hits_before)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="a LLaVA or Qwen2-VL checkpoint (local directory or Hub id)")
    which.add_argument("--tiny-qwen2-vl", action="store_true",
                       help="a random Qwen2-VL-shaped model (TINY_QWEN2_VL), built once under benchmarks/.cache")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--question-len", type=int, default=64, help="words in each question")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--image-size", type=int, default=336, help="pixels of each (square, random) image")
    ap.add_argument("--repeats", type=int, default=3, help="images in the encoder-cache measurement")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for both systems (default: torch's; 1 gives steadier numbers on a busy machine)")
    ap.add_argument("--mm-processor-cache-gb", type=float, default=4.0,
                    help="the processor-output cache (0: every image runs the HF processor, as before issue 34)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    import transformers as tf

    from pagedllm import LLM
    from pagedllm.multimodal.processor import load_hf_processor
    if args.tiny_qwen2_vl:
        args.model = str(ensure_tiny_qwen2_vl(tiny_qwen2_vl_dir()))
    threads = {}
    if args.threads is not None:
        torch.set_num_threads(args.threads)
        threads = dict(num_threads=args.threads)
    llm = LLM(model=args.model, max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
              dtype="float32", max_num_seqs=max(args.batch), mm_processor_cache_gb=args.mm_processor_cache_gb,
              **threads)
    processor = load_hf_processor(args.model)
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
                         speedup=ours["tok_s"] / theirs["tok_s"], cpu_speedup=theirs["cpu"] / ours["cpu"],
                         pagedllm_cpu_s=ours["cpu"], transformers_cpu_s=theirs["cpu"],
                         same=ours["tokens"] == theirs["tokens"],
                         tower_share=ours["tower"] / ours["wall"]))
    result = dict(model=args.model, batches=rows, encoder_cache=encoder_cache_effect(llm, placeholder, args),
                  transformers_attention=model.config._attn_implementation, threads=torch.get_num_threads(),
                  commit=common.git_commit())
    table = [[str(r["batch"]), f"{r['pagedllm_ttft'] * 1e3:.1f}", f"{r['transformers_ttft'] * 1e3:.1f}",
              f"{r['pagedllm_tok_s']:.1f}", f"{r['transformers_tok_s']:.1f}", f"{r['speedup']:.2f}x",
              f"{r['cpu_speedup']:.2f}x", f"{r['tower_share']:.0%}", str(r["same"])] for r in rows]
    print(common.format_table(["batch", "ttft ms", "hf ttft ms", "tok/s", "hf tok/s", "speedup", "cpu speedup", "tower",
                               "same"], table))
    enc = result["encoder_cache"]
    print(f"encoder cache: ttft miss {enc['ttft_miss'] * 1e3:.1f} ms, hit {enc['ttft_hit'] * 1e3:.1f} ms "
          f"({enc['hit_over_miss']:.0%} of a miss), hit with the image first {enc['ttft_hit_image_first'] * 1e3:.1f} "
          f"ms ({enc['hit_image_first_over_miss']:.0%}), the same image and question again "
          f"{enc['ttft_repeat'] * 1e3:.1f} ms ({enc['repeat_over_miss']:.0%}; {enc['repeat_cached_share']:.0%} of its "
          "prompt from the prefix cache)")
    print(f"  in CPU time: miss {enc['cpu_miss'] * 1e3:.1f} ms, hit {enc['cpu_hit_over_miss']:.0%} of it, image first "
          f"{enc['cpu_hit_image_first_over_miss']:.0%}, repeat {enc['cpu_repeat_over_miss']:.0%}")
    print("  one-token request wall time (processor + TTFT): " +
          ", ".join(f"{name} {s * 1e3:.1f} ms" for name, s in enc["request_wall_s"].items()))
    if args.json is not None:
        common.save_json(result, args.json)
    llm.llm_engine.shutdown()
    return result


if __name__ == "__main__":
    main()
