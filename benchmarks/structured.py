"""Structured outputs: 64 requests constrained by one JSON schema vs the same 64 unconstrained, in
one run, on the benchmark model (the random ~34M Llama of common.py). Example::

    python benchmarks/structured.py            # 64 requests, 64 -> 128 tokens
    python benchmarks/structured.py --quick    # 16 requests, 32 -> 32 tokens

The benchmark model's word-level tokenizer (``t3 t4 ...``) cannot spell JSON, so the same weights
are paired with a byte-level BPE tokenizer of the same vocabulary size, trained here on JSON text
(``<model>-bpe``, built once). The schema asks for an array of at least max_tokens short words, so
constrained requests, like the free ones, run to max_tokens: both runs generate the same number
of tokens at the same batch sizes and the ratio of output tokens/s isolates the constraint's cost.
Both run at temperature 1.0 with per-request seeds; the free requests ignore EOS. Runs go in ABBA
order (``--repeat`` of each, fastest kept).

Reported: output tok/s of each run and their ratio; grammar compile time per new schema (the
first compile also builds the tokenizer's xgrammar info, reported apart); time per step spent
filling and applying bitmasks (StructuredOutputManager's counters).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py

from common import (  # noqa: E402  (common also puts this checkout's pagedllm first on sys.path)
    MODEL_CONFIG,
    RESULTS_DIR,
    SPECIAL_TOKENS,
    add_engine_args,
    default_model_dir,
    engine_info,
    engine_kwargs,
    ensure_model,
    fill_unset,
    format_table,
    git_commit,
    make_prompts,
    save_json,
)

from pagedllm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from pagedllm.platform import physical_cores  # noqa: E402  (after common set up sys.path)

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"}}},
    "required": ["id", "tags"]}


def open_ended(schema: dict, output_len: int) -> dict:
    """``schema`` with at least ``output_len`` tags: each takes >= 2 tokens, so no request can
    finish before max_tokens and both runs generate the same number of tokens at the same batch size."""
    tags = {**schema["properties"]["tags"], "minItems": output_len}
    return {**schema, "properties": {**schema["properties"], "tags": tags}}


def json_corpus() -> list[str]:
    """JSON-ish text for the BPE tokenizer: objects, arrays, numbers, short words."""
    words = ["alpha", "beta", "gamma", "delta", "red", "green", "blue", "cat", "dog", "tree", "id", "tags",
             "name", "size", "true", "false", "null", "value", "items", "list"]
    lines = []
    for i in range(400):
        picked = [words[(i * 7 + k * 3) % len(words)] for k in range(1 + i % 5)]
        lines.append(json.dumps({"id": i, "tags": picked, "name": words[i % len(words)], "ok": i % 2 == 0}))
        lines.append(" ".join(picked) + f" {i} [{i}, {i + 1}] {{}}")
    return lines


def ensure_bpe_model(base: Path) -> Path:
    """``base``'s weights with a byte-level BPE tokenizer of the model's vocabulary size."""
    path = base.with_name(base.name + "-bpe")
    if (path / "tokenizer.json").exists():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=MODEL_CONFIG["vocab_size"], special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(json_corpus(), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(tmp)
    os.replace(tmp, path)
    return path


def params(n: int, output_len: int, schema: dict | None) -> list[SamplingParams]:
    so = None if schema is None else StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    return [SamplingParams(temperature=1.0, seed=i, max_tokens=output_len, ignore_eos=schema is None,
                           structured_outputs=so) for i in range(n)]


def timed_run(llm, prompts, sampling) -> dict:
    manager = llm.llm_engine.structured_output
    steps0, mask0 = manager.stats.num_bitmask_steps, manager.stats.bitmask_seconds
    engine_steps0 = llm.llm_engine.counters.num_steps
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    mask_steps = manager.stats.num_bitmask_steps - steps0
    return dict(time_s=elapsed, output_tokens=tokens, output_tok_s=tokens / elapsed,
                steps=llm.llm_engine.counters.num_steps - engine_steps0, bitmask_steps=mask_steps,
                bitmask_ms_per_step=1e3 * (manager.stats.bitmask_seconds - mask0) / mask_steps if mask_steps else 0.0,
                finish_reasons=sorted({c.finish_reason for o in outs for c in o.outputs}),
                ms_per_step=1e3 * elapsed / max(1, llm.llm_engine.counters.num_steps - engine_steps0),
                valid_json=sum(_is_json(c.text) for o in outs for c in o.outputs))


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def compile_times(llm, count: int) -> dict:
    """Seconds to compile ``count`` new schemas (each differs in one property name), one at a time."""
    manager = llm.llm_engine.structured_output
    times = []
    for i in range(count):
        schema = {**SCHEMA, "properties": {**SCHEMA["properties"], f"field{i}": {"type": "boolean"}}}
        n0, s0 = manager.stats.num_compiled, manager.stats.compile_seconds
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], params(1, 2, schema), use_tqdm=False)
        assert manager.stats.num_compiled == n0 + 1
        times.append(manager.stats.compile_seconds - s0)
    return dict(first_s=times[0], per_new_schema_s=sum(times[1:]) / max(1, len(times) - 1), all_s=times)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=None, help="default 64 (16 with --quick)")
    ap.add_argument("--input-len", type=int, default=None, help="default 64 (32 with --quick)")
    ap.add_argument("--output-len", type=int, default=None, help="default 128 (32 with --quick)")
    ap.add_argument("--num-schemas", type=int, default=6, help="new schemas compiled for the compile time")
    ap.add_argument("--repeat", type=int, default=None,
                    help="runs of each, in ABBA order; the fastest is reported (default 4, 1 with --quick)")
    ap.add_argument("--quick", action="store_true", help="16 requests, 32 -> 32, one run each (unless given)")
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--output", type=Path, default=RESULTS_DIR / "structured.json")
    add_engine_args(ap)
    args = ap.parse_args(argv)
    fill_unset(args, quick=dict(num_prompts=16, input_len=32, output_len=32, repeat=1),
               full=dict(num_prompts=64, input_len=64, output_len=128, repeat=4))
    model = ensure_bpe_model(ensure_model(args.model_dir or default_model_dir()))
    llm = LLM(str(model), **engine_kwargs(args))
    compile = compile_times(llm, args.num_schemas)
    prompts = make_prompts([args.input_len] * args.num_prompts, MODEL_CONFIG["vocab_size"], seed=0)
    schema = open_ended(SCHEMA, args.output_len)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params(4, 4, schema), use_tqdm=False)  # warm-up
    runs: dict[str, list[dict]] = {"free": [], "schema": []}
    sampling = {"free": params(args.num_prompts, args.output_len, None),
                "schema": params(args.num_prompts, args.output_len, schema)}
    for i in range(args.repeat):  # ABBA order, so a load trend on a shared machine hits both alike
        for name in ("free", "schema") if i % 2 == 0 else ("schema", "free"):
            runs[name].append(timed_run(llm, prompts, sampling[name]))
    free, constrained = (min(runs[k], key=lambda m: m["time_s"]) for k in ("free", "schema"))
    result = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), commit=git_commit(),
                  cores=physical_cores(), engine=engine_info(llm), num_prompts=args.num_prompts,
                  input_len=args.input_len, output_len=args.output_len, schema=schema, compile=compile,
                  unconstrained=free, constrained=constrained, all_runs=runs, repeat=args.repeat,
                  ratio=constrained["output_tok_s"] / free["output_tok_s"])
    print_report(result)
    save_json(result, args.output)
    return result


def print_report(r: dict) -> None:
    rows = [[name, f"{m['output_tokens']}", f"{m['time_s']:.2f}", f"{m['output_tok_s']:.1f}", f"{m['steps']}",
             f"{m['ms_per_step']:.1f}", f"{m['bitmask_ms_per_step']:.3f}"]
            for name, m in (("unconstrained", r["unconstrained"]), ("json schema", r["constrained"]))]
    print(format_table(["run", "out tokens", "time s", "out tok/s", "steps", "ms/step", "bitmask ms/step"], rows))
    c = r["compile"]
    print(f"constrained / unconstrained throughput: {r['ratio']:.3f}")
    print(f"grammar compile: first {1e3 * c['first_s']:.1f} ms (with the tokenizer info), "
          f"then {1e3 * c['per_new_schema_s']:.1f} ms per new schema")


if __name__ == "__main__":
    main()
