"""Tests for benchmarks/structured.py's helpers (the benchmark itself runs the 34M model: not in CI)."""
from __future__ import annotations

import jsonschema
import pytest
from conftest import load_benchmark

bench = load_benchmark("pagedllm_bench_structured", "structured.py")


def test_open_ended_schema_cannot_finish_before_max_tokens():
    schema = bench.open_ended(bench.SCHEMA, 8)
    jsonschema.validate({"id": 1, "tags": ["a"] * 8}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"id": 1, "tags": ["a"] * 7}, schema)  # 7 tags: fewer than max_tokens
    assert "minItems" not in bench.SCHEMA["properties"]["tags"]  # the base schema is left as it was


def test_params_constrain_only_the_schema_run():
    free, constrained = bench.params(2, 5, None), bench.params(2, 5, bench.SCHEMA)
    assert all(p.structured_outputs is None and p.ignore_eos for p in free)
    assert all(p.structured_outputs.kind == "json" and p.max_tokens == 5 for p in constrained)
    assert [p.seed for p in constrained] == [0, 1]


def test_quick_sets_only_the_sizes_left_unset():
    import argparse
    args = argparse.Namespace(quick=True, num_prompts=3, repeat=None)
    bench.fill_unset(args, quick=dict(num_prompts=16, repeat=1), full=dict(num_prompts=64, repeat=4))
    assert (args.num_prompts, args.repeat) == (3, 1)  # the explicit --num-prompts survives --quick
