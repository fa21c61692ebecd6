#!/usr/bin/env python
"""Train the small demo Llama model bundled in ``pagedllm/models/demo``.

The demo model exists so that pagedllm's tests, examples and benchmarks have a
real (tiny) Hugging Face checkpoint to load without any network access.  It is
trained from scratch by this script, on CPU, in roughly half an hour.

Corpus
------
The King James Version of the Bible (1611; public domain) as packaged by
Debian in ``bible-kjv-text``.  Debian stores it in a compressed binary format
(``/usr/lib/bible.data``) that is read with the ``bible`` program from the
``bible-kjv`` package, so get it with::

    apt-get update && apt-get install bible-kjv        # pulls in bible-kjv-text

``--corpus`` accepts any of:

* nothing: the script runs ``bible -l100000 Gen1:1-Rev22:21`` itself;
* the binary data file (``/usr/lib/bible.data``): read with ``bible -p DIR -d NAME``;
* a plain-text dump in the format printed by ``bible`` (chapter headings such as
  ``Genesis 1`` followed by numbered verses ``  1 In the beginning ...``), e.g.
  made with ``bible -l100000 Gen1:1-Rev22:21 > kjv.txt``.

Chapter headings and verse numbers are stripped; the verses of a chapter are
joined into one paragraph of prose, and every chapter is one document.
Documents are separated by ``<|endoftext|>`` (which is also the bos/eos token).
Every 20th chapter is held out as the validation split.

Usage
-----
::

    python scripts/train_demo_model.py --corpus /usr/lib/bible.data \\
        --out pagedllm/models/demo --minutes 30 --seed 0

``--minutes`` bounds the optimisation loop; the learning-rate schedule
(linear warm-up, cosine decay) follows the fraction of that time budget that
has elapsed, so the run always finishes with a fully decayed learning rate
however fast the machine is.  For an exactly repeatable run pass ``--steps N``
instead: the schedule then follows the step count (and the run is bit-for-bit
deterministic for a given seed, thread count and torch build).

Everything runs on one CPU thread by default (``--threads``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

BOS_EOS = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [BOS_EOS, PAD]

HEADING_RE = re.compile(r"^(?:[1-3] )?[A-Z][A-Za-z ]+ \d+$")
VERSE_RE = re.compile(r"^\s*(\d+) (.*)$")


# --------------------------------------------------------------------------- corpus
def _run_bible(data_file: str | None) -> str:
    exe = shutil.which("bible")
    if exe is None:
        sys.exit(
            "error: the `bible` program was not found; install the corpus with\n"
            "    apt-get update && apt-get install bible-kjv\n"
            "or pass --corpus with a plain-text dump of the KJV."
        )
    cmd = [exe, "-l100000"]
    if data_file is not None:
        p = Path(data_file).resolve()
        # `bible -d` only accepts a bare file name, resolved against -p.
        cmd += ["-p", str(p.parent), "-d", p.name]
    cmd.append("Gen1:1-Rev22:21")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out.stdout


def load_corpus_text(path: str | None) -> str:
    if path is None:
        return _run_bible(None)
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
        if "\x00" in text:
            raise UnicodeDecodeError("utf-8", raw, 0, 1, "binary")
        return text
    except UnicodeDecodeError:
        return _run_bible(path)  # Debian's compressed bible.data


def parse_chapters(text: str) -> list[tuple[str, str]]:
    """Return [(heading, prose)] with verse numbers and line wrapping removed."""
    chapters: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if HEADING_RE.match(line):
            chapters.append((line.strip(), []))
            continue
        m = VERSE_RE.match(line)
        if m and chapters:
            chapters[-1][1].append(m.group(2).strip())
        elif chapters and chapters[-1][1]:
            # continuation of a wrapped verse (output made without -l)
            chapters[-1][1][-1] += " " + line.strip()
        elif not chapters:
            # not in `bible` format: treat blank-line separated blocks as documents
            return [(f"doc{i}", " ".join(b.split()))
                    for i, b in enumerate(re.split(r"\n\s*\n", text)) if b.strip()]
    out = []
    for heading, verses in chapters:
        prose = " ".join(" ".join(v.split()) for v in verses)
        if prose:
            out.append((heading, prose))
    return out


# --------------------------------------------------------------------------- tokenizer
def train_tokenizer(docs: list[str], vocab_size: int, out_dir: Path, max_len: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    bos_id = tok.token_to_id(BOS_EOS)
    # Like Llama: the tokenizer prepends bos to every sequence, so a prompt is
    # seen as "start of a chapter", exactly as in training.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_EOS} $A",
        pair=f"{BOS_EOS} $A {BOS_EOS} $B",
        special_tokens=[(BOS_EOS, bos_id)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_EOS,
        eos_token=BOS_EOS,
        unk_token=None,
        pad_token=PAD,
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )
    fast.save_pretrained(str(out_dir))
    return fast


# --------------------------------------------------------------------------- model
def build_model(args, vocab_size: int, bos_id: int, pad_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        hidden_act="silu",
        max_position_embeddings=args.max_pos,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=bos_id,
        eos_token_id=bos_id,
        pad_token_id=pad_id,
        initializer_range=0.02,
    )
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config)
    return model


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


def batch_from(stream: torch.Tensor, starts: torch.Tensor, seq_len: int):
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    chunk = stream[idx]
    return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, seq_len: int, batch: int, max_windows: int) -> float:
    model.eval()
    n = min(max_windows, (len(stream) - 1) // seq_len)
    starts = torch.arange(n) * seq_len  # fixed, non-overlapping windows
    tot, cnt = 0.0, 0
    for i in range(0, n, batch):
        x, y = batch_from(stream, starts[i:i + batch], seq_len)
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum")
        tot += loss.item()
        cnt += y.numel()
    model.train()
    return tot / cnt


def lr_at(progress: float, args) -> float:
    if progress < args.warmup:
        return args.lr * progress / args.warmup
    p = min(1.0, (progress - args.warmup) / (1 - args.warmup))
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * p))


def make_portable(out_dir: Path, save_dtype: str):
    """Make the saved files readable by transformers 4.x and by plain Llama loaders.

    transformers 5 writes ``rope_parameters``/``dtype`` and tokenizer class
    ``TokenizersBackend``; older readers look for ``rope_theta``/``torch_dtype`` and
    ``PreTrainedTokenizerFast``.  Both spellings are kept (transformers 5 reads either).
    """
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rope = cfg.get("rope_parameters") or {}
    cfg["rope_theta"] = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    cfg["torch_dtype"] = save_dtype
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tc_path = out_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc["add_bos_token"] = True
    tc["add_eos_token"] = False
    tc["model_input_names"] = ["input_ids", "attention_mask"]  # no token_type_ids
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- samples
SAMPLE_PROMPTS = ["In the beginning", "And God said", "The LORD is my shepherd"]


def generate_samples(model_dir: Path, seed: int, max_new_tokens: int = 60):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    out = []
    for prompt in SAMPLE_PROMPTS:
        enc = tok(prompt, return_tensors="pt")
        g = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                           pad_token_id=tok.pad_token_id)
        greedy = tok.decode(g[0], skip_special_tokens=True)
        torch.manual_seed(seed)
        s = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True,
                           temperature=0.8, top_p=0.95, pad_token_id=tok.pad_token_id)
        sampled = tok.decode(s[0], skip_special_tokens=True)
        out.append({"prompt": prompt, "greedy": greedy, "sampled": sampled})
    return out


# --------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default=None,
                    help="bible.data, or a text dump from `bible`; default: run `bible`")
    ap.add_argument("--out", default="pagedllm/models/demo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--minutes", type=float, default=30.0,
                    help="time budget of the training loop (ignored if --steps is given)")
    ap.add_argument("--steps", type=int, default=None,
                    help="fixed number of optimiser steps (deterministic schedule)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=640)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--max-pos", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=float, default=0.03, help="fraction of the run")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--val-every", type=int, default=20, help="hold out every Nth chapter")
    ap.add_argument("--eval-interval-s", type=float, default=180.0)
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--log-interval", type=int, default=10)
    ap.add_argument("--save-dtype", choices=["float16", "float32"], default="float16")
    ap.add_argument("--no-samples", action="store_true")
    args = ap.parse_args(argv)

    t_start = time.time()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    # ---- corpus
    chapters = parse_chapters(load_corpus_text(args.corpus))
    train_docs = [c for i, c in enumerate(chapters) if i % args.val_every != args.val_every // 2]
    val_docs = [c for i, c in enumerate(chapters) if i % args.val_every == args.val_every // 2]
    n_chars = sum(len(t) for _, t in chapters)
    print(f"corpus: {len(chapters)} chapters, {n_chars:,} chars; "
          f"train {len(train_docs)} / val {len(val_docs)} chapters", flush=True)

    # ---- tokenizer
    t0 = time.time()
    tok = train_tokenizer([t for _, t in train_docs], args.vocab, out_dir, args.max_pos)
    bos = tok.bos_token_id

    def to_stream(docs):
        ids = [bos]
        encs = tok.backend_tokenizer.encode_batch([t for _, t in docs], add_special_tokens=False)
        for enc in encs:
            ids.extend(enc.ids)
            ids.append(bos)
        return torch.tensor(ids, dtype=torch.long)

    train_stream, val_stream = to_stream(train_docs), to_stream(val_docs)
    print(f"tokenizer: vocab {len(tok)}, trained in {time.time() - t0:.1f}s; "
          f"train {len(train_stream):,} tokens, val {len(val_stream):,} tokens "
          f"({n_chars / (len(train_stream) + len(val_stream)):.2f} chars/token)", flush=True)

    # ---- model
    model = build_model(args, len(tok), bos, tok.pad_token_id)
    n_params = count_params(model)
    n_embed = model.model.embed_tokens.weight.numel()
    print(f"model: {n_params:,} params ({n_params - n_embed:,} non-embedding)", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    gen = torch.Generator().manual_seed(args.seed)
    max_start = len(train_stream) - args.seq_len - 1
    budget_s = args.minutes * 60.0
    model.train()
    log = []
    step, tokens_seen = 0, 0
    t_train = time.time()
    last_eval = t_train
    ema = None
    while True:
        elapsed = time.time() - t_train
        progress = step / args.steps if args.steps else elapsed / budget_s
        if progress >= 1.0:
            break
        lr = lr_at(progress, args)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, max_start, (args.batch,), generator=gen)
        x, y = batch_from(train_stream, starts, args.seq_len)
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += x.numel()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % args.log_interval == 0:
            el = time.time() - t_train
            print(f"step {step:5d}  loss {loss.item():.3f} (ema {ema:.3f})  lr {lr:.2e}  "
                  f"{tokens_seen / el:,.0f} tok/s  {el / 60:.1f} min", flush=True)
        if time.time() - last_eval > args.eval_interval_s:
            vl = evaluate(model, val_stream, args.seq_len, args.batch, args.eval_windows)
            el = time.time() - t_train
            log.append({"step": step, "minutes": round(el / 60, 2),
                        "train_loss_ema": round(ema, 4), "val_loss": round(vl, 4)})
            print(f"== eval step {step}: train(ema) {ema:.3f}  val {vl:.3f}", flush=True)
            last_eval = time.time()
    train_s = time.time() - t_train

    # ---- final evaluation: the whole val split; the first 256 windows of train
    final_train = evaluate(model, train_stream, args.seq_len, args.batch, 256)
    final_val = evaluate(model, val_stream, args.seq_len, args.batch, 10**9)
    print(f"final: {step} steps, {tokens_seen:,} tokens, {train_s / 60:.1f} min; "
          f"train loss {final_train:.4f}, val loss {final_val:.4f} "
          f"(ppl {math.exp(final_val):.1f})", flush=True)

    # ---- save
    from transformers import GenerationConfig

    save_dtype = getattr(torch, args.save_dtype)
    model.to(save_dtype)
    model.config.dtype = args.save_dtype
    model.save_pretrained(str(out_dir), safe_serialization=True)
    GenerationConfig(
        bos_token_id=bos, eos_token_id=bos, pad_token_id=tok.pad_token_id,
        do_sample=True, temperature=0.8, top_p=0.95, max_new_tokens=128,
    ).save_pretrained(str(out_dir))
    make_portable(out_dir, args.save_dtype)
    # check the saved (possibly fp16) weights against the fp32 ones
    from transformers import AutoModelForCausalLM
    reloaded = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    saved_val = evaluate(reloaded, val_stream, args.seq_len, args.batch, 10**9)
    print(f"val loss of saved {args.save_dtype} weights: {saved_val:.4f}", flush=True)

    samples = [] if args.no_samples else generate_samples(out_dir, args.seed)
    for s in samples:
        print(f"--- {s['prompt']!r}\n greedy:  {s['greedy']}\n sampled: {s['sampled']}")

    total_s = time.time() - t_start
    stats = {
        "params": n_params, "non_embedding_params": n_params - n_embed,
        "steps": step, "tokens_seen": tokens_seen, "train_minutes": round(train_s / 60, 1),
        "total_minutes": round(total_s / 60, 1),
        "final_train_loss": round(final_train, 4), "final_val_loss": round(final_val, 4),
        "saved_val_loss": round(saved_val, 4),
        "train_tokens": len(train_stream), "val_tokens": len(val_stream),
        "n_train_chapters": len(train_docs), "n_val_chapters": len(val_docs),
        "weights_bytes": (out_dir / "model.safetensors").stat().st_size,
    }
    write_model_card(out_dir, args, argv if argv is not None else sys.argv[1:], stats, log, samples)
    print(json.dumps(stats, indent=1))


def write_model_card(out_dir: Path, args, argv, stats, log, samples):
    cmd = "python scripts/train_demo_model.py " + " ".join(argv)
    hw = f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s)"
    try:
        import transformers
        hw += f", transformers {transformers.__version__}"
    except Exception:
        pass
    lines = [
        "# pagedllm demo model (tiny Llama trained on the King James Bible)",
        "",
        "A deliberately tiny `LlamaForCausalLM` bundled with pagedllm so that tests, examples and",
        "benchmarks have a real Hugging Face checkpoint that loads offline in well under a second.  It writes",
        "KJV-flavoured English; it knows nothing else and is not useful for any real task.",
        "",
        "## Architecture",
        "",
        "| | |",
        "|---|---|",
        "| architecture | `LlamaForCausalLM` (RMSNorm, SwiGLU/`silu` MLP, RoPE θ=10000) |",
        f"| parameters | {stats['params']:,} ({stats['non_embedding_params']:,} non-embedding; embeddings tied) |",
        f"| layers / hidden / intermediate | {args.layers} / {args.hidden} / {args.ffn} |",
        f"| attention heads / KV heads / head_dim | {args.heads} / {args.kv_heads} (GQA) / "
        f"{args.hidden // args.heads} |",
        f"| vocabulary | {args.vocab} (byte-level BPE, `tokenizers`) |",
        f"| max_position_embeddings | {args.max_pos} (trained on {args.seq_len}-token windows) |",
        f"| weights | `model.safetensors`, {args.save_dtype}, {stats['weights_bytes'] / 1e6:.2f} MB |",
        "",
        "Special tokens: `<|endoftext|>` (id 0) is bos, eos and the document separator; `<|pad|>` (id 1)",
        "is padding only (never trained).  The tokenizer prepends `<|endoftext|>` to every input, like",
        "Llama's tokenizer prepends `<s>`.",
        "",
        "## Training data and licence",
        "",
        "The King James Version of the Bible (1611) from Debian's `bible-kjv-text` package (read with",
        "the `bible` program of `bible-kjv`).  Debian's copyright file states: *\"The copyright for the",
        "King James Version text of the Bible is expired since the translation was done in 1611 under",
        "King James the first of Great Britain.\"*  The data file's own notice (Chip Chapin, 1989) reads",
        "*\"provided for unrestricted use ... Users may copy, modify or distribute this file at will.\"*",
        "The KJV text is in the public domain (in the United Kingdom alone the Crown claims perpetual",
        "rights in it by letters patent).  The GPL-2+ in the same copyright file covers Debian's `bible`",
        "program, not the text.  The weights and tokenizer here are derived from the text only.",
        "",
        "Pre-processing: chapter headings and verse numbers removed; the verses of each chapter joined",
        "into one paragraph; each chapter is a document, documents separated by `<|endoftext|>`.",
        f"Every {args.val_every}th chapter is held out for validation ({stats['n_val_chapters']} chapters, "
        f"{stats['val_tokens']:,} tokens); the remaining {stats['n_train_chapters']} chapters "
        f"({stats['train_tokens']:,} tokens) are the training set (the tokenizer is trained on them too).",
        "",
        "## Training",
        "",
        "```",
        "apt-get update && apt-get install bible-kjv",
        cmd,
        "```",
        "",
        f"AdamW (β=(0.9, 0.95), weight decay {args.weight_decay}), peak LR {args.lr}, linear warm-up over",
        f"{args.warmup:.0%} of the run then cosine decay to {args.min_lr}, batch {args.batch} × {args.seq_len} tokens,",
        f"gradient clipping 1.0, fp32 on CPU ({hw}), seed {args.seed}.",
        f"{stats['steps']:,} steps, {stats['tokens_seen']:,} tokens seen "
        f"(≈{stats['tokens_seen'] / stats['train_tokens']:.1f} epochs).",
        f"Wall time: {stats['train_minutes']} min training loop, {stats['total_minutes']} min for the whole script",
        "(corpus, tokenizer, training, evaluation, saving, samples) on a CPU shared with other jobs.",
        "",
        f"Final loss (mean token cross-entropy, nats): **train {stats['final_train_loss']:.3f}, "
        f"val {stats['final_val_loss']:.3f}** (val perplexity {math.exp(stats['final_val_loss']):.1f}).",
        f"Val is the whole held-out split; train is the first {256 * args.seq_len:,} tokens of the",
        "training stream (Genesis onwards, non-overlapping windows).  The saved "
        f"{args.save_dtype} weights give val {stats['saved_val_loss']:.3f}.",
        "",
        f"Progress (val here is the first {args.eval_windows * args.seq_len:,} tokens of the val split only,",
        "hence lower than the full-split figure above; train is an EMA of the batch loss):",
        "",
        "| step | minutes | train loss (EMA) | val loss (subset) |",
        "|---:|---:|---:|---:|",
    ]
    lines += [f"| {r['step']} | {r['minutes']} | {r['train_loss_ema']:.3f} | {r['val_loss']:.3f} |" for r in log]
    if samples:
        lines += ["", "## Sample generations", "",
                  "60 new tokens each, prompt included, from `transformers` `generate()`.",
                  "Greedy decoding, then sampling with temperature 0.8, top-p 0.95, "
                  f"`torch.manual_seed({args.seed})`.  Greedy decoding falls into loops, as",
                  "expected of a model this small; sampled text is the better showcase.", ""]
        for s in samples:
            lines += [f"**{s['prompt']}**", "",
                      f"- greedy: {s['greedy']}",
                      f"- sampled: {s['sampled']}", ""]
    lines += ["", "## Usage", "", "```python",
              "from transformers import AutoModelForCausalLM, AutoTokenizer",
              "tok = AutoTokenizer.from_pretrained(\"pagedllm/models/demo\")",
              "model = AutoModelForCausalLM.from_pretrained(\"pagedllm/models/demo\")",
              "ids = tok(\"And God said\", return_tensors=\"pt\")",
              "print(tok.decode(model.generate(**ids, max_new_tokens=40)[0], skip_special_tokens=True))",
              "```", ""]
    (out_dir / "README.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
