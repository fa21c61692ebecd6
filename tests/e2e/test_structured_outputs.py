"""Structured outputs on a random tiny model at temperature 1.0: a random model never writes valid
JSON or a regex match by chance, so every check here fails without the grammar's bitmask."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from conftest import random_prompts

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.contracts.grammar import lengths_as_patterns

# maxLength has its own test below (xgrammar 0.2.9's rule for it admits raw control characters,
# so grammar.lengths_as_patterns rewrites it as a pattern)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                                           "size": {"enum": ["s", "m", "l"]}, "ok": {"type": "boolean"}},
          "required": ["name", "size", "ok"]}
REGEX = "[a-c]{3}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe so"]
GRAMMAR = 'root ::= "(" item ("," item)? ")"\nitem ::= [xyz] [0-9]'
PROMPTS = [{"prompt_token_ids": p} for p in random_prompts(12, seed=7, lo=3, hi=30)]


def constrained(seed: int, **kind) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=60,
                          structured_outputs=StructuredOutputsParams(disable_any_whitespace=True, **kind))


def check(kind: str, text: str) -> None:
    """Fails unless ``text`` satisfies the constraint of ``kind``."""
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    elif kind == "grammar":
        assert re.fullmatch(r"\([xyz][0-9](,[xyz][0-9])?\)", text), text
    else:
        assert isinstance(json.loads(text), dict), text


KINDS = {"json": dict(json=SCHEMA), "regex": dict(regex=REGEX), "choice": dict(choice=CHOICES),
         "grammar": dict(grammar=GRAMMAR), "json_object": dict(json_object=True)}


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, block_size=8, num_gpu_blocks_override=200, max_model_len=256)


def closing_bias(llm) -> dict[int, float]:
    """Makes '"' and '}' likely, so a free-form JSON object closes within max_tokens (without the
    grammar the output would then start with '}' and fail even sooner)."""
    tok = llm.get_tokenizer()
    return {tok.convert_tokens_to_ids(t): 4.0 for t in ('"', "}")}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_output_satisfies_its_constraint(llm, kind):
    params = [constrained(i, **KINDS[kind]) for i in range(len(PROMPTS))]
    if kind == "json_object":
        for p in params:
            p.logit_bias = closing_bias(llm)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.text, c.finish_reason)
        check(kind, c.text)
    llm.llm_engine.scheduler.kv.check_integrity()


def test_length_bounded_strings_hold_no_raw_control_characters(llm):
    """xgrammar's own rule for minLength / maxLength admits U+0000-U+001F unescaped (invalid JSON);
    a bias that makes the model want byte 0x02 shows it: the output must still be JSON."""
    tok = llm.get_tokenizer()
    control = tok.encode("\x02", add_special_tokens=False)
    assert len(control) == 1
    schema = {"type": "object", "properties": {"b": {"type": "string", "minLength": 2, "maxLength": 5}},
              "required": ["b"], "additionalProperties": False}
    params = [SamplingParams(temperature=t, seed=1, max_tokens=40, logit_bias={control[0]: 20.0},
                             structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
              for t in (0.0, 1.0)]
    for out in llm.generate(PROMPTS[:2], params, use_tqdm=False):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)


def test_only_string_length_keywords_become_patterns():
    schema = {"type": "object", "default": {"maxLength": 3},
              "properties": {"maxLength": {"type": "string", "maxLength": 4},  # a property named like the keyword
                             "a": {"type": "string", "minLength": 1},
                             "p": {"type": "string", "pattern": "^x+$", "maxLength": 2}}}
    out = json.loads(lengths_as_patterns(json.dumps(schema)))
    assert out["default"] == {"maxLength": 3} and out["properties"]["p"] == schema["properties"]["p"]
    assert out["properties"]["maxLength"] == {"type": "string", "pattern": "^.{0,4}$"}
    assert out["properties"]["a"] == {"type": "string", "pattern": "^.{1,}$"}


def test_mixed_batch_of_constrained_and_free_requests(llm):
    kinds = ["json", "regex", "choice", "grammar", None, None, None]
    params = [constrained(i, **KINDS[k]) if k else SamplingParams(temperature=1.0, seed=i, max_tokens=12,
                                                                   ignore_eos=True)
              for i, k in enumerate(kinds)]
    outs = llm.generate(PROMPTS[:len(kinds)], params, use_tqdm=False)
    for kind, out in zip(kinds, outs):
        if kind:
            check(kind, out.outputs[0].text)
        else:  # free rows are not masked: the random model runs to max_tokens
            assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].finish_reason == "length"


def test_free_requests_match_a_run_without_constrained_neighbours(llm):
    free = SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True, logprobs=2)
    alone = llm.generate(PROMPTS[:2], free, use_tqdm=False)
    mixed = llm.generate(PROMPTS[:2] + PROMPTS[2:5], [free, free] + [constrained(i, regex=REGEX) for i in range(3)],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]


def test_n3_with_a_schema_each_sequence_valid(llm):
    params = SamplingParams(n=3, best_of=4, temperature=1.0, seed=5, max_tokens=60, logprobs=1,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    out = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    for o in out:
        assert len(o.outputs) == 3
        for c in o.outputs:
            check("json", c.text)
            assert len(c.logprobs) == len(c.token_ids)  # raw logprobs reported for each token


def test_stop_string_and_chunked_prefill(llama_dir):
    """A stop string cuts a constrained output; a prompt computed in chunks is constrained only on
    its sampled row."""
    llm = LLM(llama_dir, block_size=8, num_gpu_blocks_override=200, max_model_len=256, max_num_batched_tokens=16)
    long_prompts = [{"prompt_token_ids": p} for p in random_prompts(4, seed=9, lo=40, hi=60)]
    outs = llm.generate(long_prompts, [constrained(i, regex=REGEX) for i in range(4)], use_tqdm=False)
    for o in outs:
        check("regex", o.outputs[0].text)
    stopped = llm.generate(long_prompts[:1], SamplingParams(
        temperature=0, max_tokens=20, stop=["-"], structured_outputs=StructuredOutputsParams(regex=REGEX)),
        use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[a-c]{3}", stopped.text) and stopped.stop_reason == "-"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_constrained_requests_survive_preemption(llama_dir, mode):
    tight = LLM(llama_dir, block_size=8, num_gpu_blocks_override=16, max_model_len=128, preemption_mode=mode,
                watermark=0.0, swap_space=0.01, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(8, seed=3, lo=20, hi=30)]
    params = [constrained(i, json=SCHEMA) for i in range(8)]
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.get_kv_cache_stats().preemptions_by_mode[mode] > 0
    roomy = LLM(llama_dir, block_size=8, num_gpu_blocks_override=200, max_model_len=128)
    expected = roomy.generate(prompts, params, use_tqdm=False)
    for o, e in zip(outs, expected):
        check("json", o.outputs[0].text)
        assert o.outputs[0].token_ids == e.outputs[0].token_ids  # resumed exactly where it was


def test_invalid_constraints_are_refused_before_queueing(llm):
    for kwargs, name in [(dict(json={"type": "strin"}), "json"), (dict(regex="[a-"), "regex"),
                         (dict(choice=[]), "choice"), (dict(grammar="root ::= "), "grammar"),
                         (dict(json="{not json"), "json"), (dict(regex="a", choice=["a"]), "structured_outputs"),
                         (dict(whitespace_pattern=r"\s*", json_object=True), "whitespace_pattern")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs))
    with pytest.raises(TypeError):
        StructuredOutputsParams(jsonn={})
    assert not llm.llm_engine.has_unfinished_requests()


def test_grammars_are_cached_by_key(llm):
    manager = llm.llm_engine.structured_output
    llm.generate(PROMPTS[:3], constrained(0, json={"type": "object", "properties": {"q": {"const": 1}}}),
                 use_tqdm=False)
    compiled = manager.stats.num_compiled
    same = '{"type": "object", "properties": {"q": {"const": 1}}}'  # the same schema as JSON text
    llm.generate(PROMPTS[:3], constrained(1, json=same), use_tqdm=False)
    assert manager.stats.num_compiled == compiled


def hold_compiles(monkeypatch):
    """Makes every grammar compile wait for the returned event (set it to let them finish)."""
    import threading

    from pagedllm.structured_output.manager import StructuredOutputManager
    release = threading.Event()
    compile_grammar = StructuredOutputManager._compile

    def slow_compile(self, params):
        release.wait(30)
        return compile_grammar(self, params)

    monkeypatch.setattr(StructuredOutputManager, "_compile", slow_compile)
    return release


def test_a_compiling_grammar_does_not_stall_other_requests(llama_dir, monkeypatch):
    """The constrained request waits in the scheduler while its grammar compiles; a free request
    queued after it runs meanwhile."""
    release = hold_compiles(monkeypatch)
    engine = LLM(llama_dir, block_size=8, num_gpu_blocks_override=64, max_model_len=128).llm_engine
    engine.add_request("constrained", PROMPTS[0], constrained(0, regex=REGEX))
    engine.add_request("free", PROMPTS[1], SamplingParams(max_tokens=4, ignore_eos=True))
    finished = {}
    while "free" not in finished:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert "constrained" not in finished and engine.scheduler.make_stats().num_waiting == 1
    release.set()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    check("regex", finished["constrained"].outputs[0].text)


def test_a_grammar_that_fails_to_compile_ends_its_request(llama_dir, monkeypatch):
    """Construction-time checks make this rare; if compilation still fails, the request ends
    (finish_reason "abort") instead of waiting forever, and the others complete."""
    from pagedllm.structured_output.manager import StructuredOutputManager

    def failing_compile(self, params):
        raise RuntimeError("compiler exploded")

    monkeypatch.setattr(StructuredOutputManager, "_compile", failing_compile)
    llm = LLM(llama_dir, block_size=8, num_gpu_blocks_override=64, max_model_len=128)
    params = [SamplingParams(n=2, structured_outputs=StructuredOutputsParams(regex=REGEX)),
              SamplingParams(max_tokens=3, ignore_eos=True)]
    failed, free = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [c.finish_reason for c in failed.outputs] == ["abort"] and failed.finished
    assert len(free.outputs[0].token_ids) == 3
    assert llm.get_kv_cache_stats().num_used_blocks == 0


def count_longest_whitespace_run(text: str) -> int:
    return max((len(run) for run in re.findall(r"[ \t\r\n]+", text)), default=0)


@pytest.mark.parametrize("model", ["random", "demo"])
def test_json_at_temperature_1_with_free_whitespace_ends_in_a_valid_document(llama_dir, model):
    """Whitespace is free (no disable_any_whitespace) but bounded per gap: sampled at temperature 1,
    every one of 16 samples is a document that validates, ended by the grammar, not by max_tokens
    (unbounded, a random model wrote "{" and whitespace until max_tokens)."""
    from pagedllm.contracts.grammar import JSON_MAX_WHITESPACE
    engine = LLM(llama_dir if model == "random" else "pagedllm-demo", block_size=8, num_gpu_blocks_override=400,
                 max_model_len=512)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=400, structured_outputs=StructuredOutputsParams(
        json=SCHEMA)) for i in range(16)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
    for out in engine.generate(prompts, params, use_tqdm=False):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.text, c.finish_reason)
        check("json", c.text)
        assert count_longest_whitespace_run(c.text) <= JSON_MAX_WHITESPACE
    objects = engine.generate(prompts[:4], [SamplingParams(
        temperature=1.0, seed=i, max_tokens=60, logit_bias=closing_bias(engine),
        structured_outputs=StructuredOutputsParams(json_object=True)) for i in range(4)], use_tqdm=False)
    for out in objects:
        assert count_longest_whitespace_run(out.outputs[0].text) <= JSON_MAX_WHITESPACE
    engine.llm_engine.scheduler.kv.check_integrity()


def test_a_spec_over_the_size_limit_is_refused_naming_the_limit(llama_dir):
    engine = LLM(llama_dir, block_size=8, num_gpu_blocks_override=64, max_model_len=128,
                 max_structured_output_bytes=1000)
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(60)}}
    with pytest.raises(ValueError, match="max_structured_output_bytes=1000"):
        engine.generate(PROMPTS[:2], constrained(0, json=big), use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs.choice is 1100 bytes"):
        engine.generate(PROMPTS[:1], constrained(0, choice=["x" * 100] * 11), use_tqdm=False)
    assert not engine.llm_engine.has_unfinished_requests()
    assert check("regex", engine.generate(PROMPTS[:1], constrained(0, regex=REGEX), use_tqdm=False)[0]
                 .outputs[0].text) is None


def test_a_request_whose_grammar_is_not_ready_in_time_fails_and_others_run(llama_dir, monkeypatch):
    release = hold_compiles(monkeypatch)
    llm = LLM(llama_dir, block_size=8, num_gpu_blocks_override=64, max_model_len=128,
              structured_output_compile_timeout=0.3)
    try:
        engine = llm.llm_engine
        engine.add_request("slow", PROMPTS[0], constrained(0, regex=REGEX))
        engine.add_request("free", PROMPTS[1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        finished = {}
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert finished["slow"].outputs[0].finish_reason == "abort"
        assert len(finished["free"].outputs[0].token_ids) == 4
        metrics = {m.name: m.value for m in llm.get_metrics()}
        assert metrics["pagedllm:structured_output_compile_timeouts"] == 1
        engine.scheduler.kv.check_integrity()
    finally:
        release.set()
