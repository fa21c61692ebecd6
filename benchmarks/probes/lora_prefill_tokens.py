"""How many prompt tokens each timed run of ``lora.py`` computes, by row: whether a row's prefill was
served from the prefix cache.

Runs ``benchmarks/lora.py`` (same arguments) with its ``run_paged`` wrapped: every step's scheduled
tokens of chunks longer than one token (prefill chunks) are summed per run, and printed by row after
lora.py's table. A row that computes far fewer tokens than another found its prompts cached, and its
throughput then measures decode alone. Issue 33 (the 200M model at 0.44x): before ``run_paged`` emptied
the prefix cache, the base engine computed 1024 of 8192 prompt tokens from its second repeat on (its
last run left them cached), while the adapter rows, sharing one engine's 1024-block KV pool, evicted
each other's and computed 6400-7968; on the 34M model the pool holds every row's blocks, so all rows hit.

    python benchmarks/probes/lora_prefill_tokens.py --size 200m --output-len 4 --repeats 2
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: lora, common

import lora  # noqa: E402


def count_prefill(counts: dict[str, list[int]]):
    """lora.run_paged, recording the prefill tokens each run computed under its row's name."""
    run_paged = lora.run_paged

    def counted(llm, prompts, params, loras):
        executor = llm.llm_engine.executor
        execute, total = executor.execute, [0]

        def execute_counting(out):
            total[0] += sum(len(c.token_ids) for c in out.chunks if len(c.token_ids) > 1)
            return execute(out)
        executor.execute = execute_counting
        try:
            return run_paged(llm, prompts, params, loras)
        finally:
            executor.execute = execute
            row = f"{len({r.lora_int_id for r in loras})} adapters" if loras else "base"
            counts.setdefault(row, []).append(total[0])
    return counted


def main() -> None:
    counts: dict[str, list[int]] = {}
    lora.run_paged = count_prefill(counts)
    lora.main(sys.argv[1:])
    print("prompt tokens computed per timed run:")
    for row, runs in counts.items():
        print(f"  {row:12s} {' / '.join(map(str, runs))}")


if __name__ == "__main__":
    main()
