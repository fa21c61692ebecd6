"""Speculative decoding end to end: greedy output identical to plain decoding (n-gram, a draft
model, the target as its own draft) across block boundaries, chunked prefill, prefix caching and
preemption; stops and max_tokens inside an accepted run; logprobs; every KV block free at the
end; sampling matches the target's distribution (chi-squared); metrics."""
from __future__ import annotations

import pytest
import torch
from conftest import make_model_dir, random_prompts
from scipy.stats import chisquare

from pagedllm import LLM, SamplingParams
from pagedllm.metrics.prometheus import PrometheusMetrics

# copy-heavy prompts (the text twice: n-gram lookup finds matches) and random ones (it finds few)
PROMPTS = [p + p for p in random_prompts(4, seed=5, lo=10, hi=20)] + random_prompts(4, seed=6, lo=5, hi=30)
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def draft_dir(llama_dir, tmp_path_factory):
    """The target with noise on every weight: its drafts are accepted in part."""
    import transformers as tf
    path = tmp_path_factory.mktemp("draft")
    model = tf.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * param.std() * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def _configs(llama_dir, draft_dir):
    return {"ngram": NGRAM, "draft": {"model": draft_dir, "num_speculative_tokens": 3},
            "self-draft": {"model": llama_dir, "num_speculative_tokens": 5}}


def _generate(llm, params=GREEDY, prompts=PROMPTS):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _spec_metrics(llm) -> dict:
    return {m.name.removeprefix("pagedllm:spec_decode_") + "".join(m.labels.values()): m.value
            for m in llm.get_metrics() if "spec_decode" in m.name}


def _assert_all_blocks_free(llm):
    stats = llm.get_kv_cache_stats()
    assert stats.num_free_blocks == stats.num_blocks and stats.num_cpu_free_blocks == stats.num_cpu_blocks
    llm.llm_engine.scheduler.kv.check_integrity()


class _StepSpy:
    """Records every SchedulerOutput the executor runs (wraps the engine's executor.execute)."""

    def __init__(self, llm):
        self.outputs = []
        executor = llm.llm_engine.executor
        self.execute, executor.execute = executor.execute, self

    def __call__(self, out):
        self.outputs.append(out)
        return self.execute(out)

    def steps_with(self, pred) -> int:
        return sum(1 for out in self.outputs if pred(out))


def _count_tail_frees(llm) -> list[int]:
    """Counts rollbacks that freed blocks (a rejected run that had crossed into a new block)."""
    kv, freed = llm.llm_engine.scheduler.kv, [0]
    original = kv.rollback

    def counting(req):
        before = kv.num_free_blocks
        original(req)
        freed[0] += kv.num_free_blocks > before
    kv.rollback = counting
    return freed


@pytest.fixture(scope="module")
def reference(llama_dir):
    return _tokens(_generate(LLM(llama_dir, block_size=8, num_gpu_blocks_override=400)))


@pytest.mark.parametrize("name", ["ngram", "draft", "self-draft"])
def test_greedy_output_is_identical(llama_dir, draft_dir, reference, name):
    llm = LLM(llama_dir, block_size=8, num_gpu_blocks_override=400,
              speculative_config=_configs(llama_dir, draft_dir)[name])
    freed = _count_tail_frees(llm)
    spy = _StepSpy(llm)
    assert _tokens(_generate(llm)) == reference
    m = _spec_metrics(llm)
    assert m["num_drafts"] > 0 and 0 < m["num_accepted_tokens"] <= m["num_draft_tokens"]
    assert m["num_accepted_tokens"] == sum(v for k, v in m.items() if k.startswith("num_accepted_tokens_per_pos"))
    if name == "self-draft":  # the target agrees with itself
        assert m["num_accepted_tokens"] == m["num_draft_tokens"]
    else:  # rejected runs, some rolled back across a block boundary (block size 8)
        assert m["num_accepted_tokens"] < m["num_draft_tokens"] and freed[0] > 0
    # speculative and plain decode chunks in one step (the n-gram finds nothing for some prompts)
    assert spy.steps_with(lambda o: any(c.num_spec_tokens for c in o.chunks) and
                          any(c.num_samples and c.start >= 20 for c in o.chunks)) > 0 or name != "ngram"
    _assert_all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("name", ["ngram", "draft"])
def test_preemption_mid_speculation(llama_dir, draft_dir, reference, mode, name):
    llm = LLM(llama_dir, block_size=8, num_gpu_blocks_override=20, max_model_len=128, preemption_mode=mode,
              watermark=0.0, swap_space=0.01, speculative_config=_configs(llama_dir, draft_dir)[name])
    spy = _StepSpy(llm)
    assert _tokens(_generate(llm)) == reference
    assert llm.get_kv_cache_stats().preemptions_by_mode[mode] > 0
    assert spy.steps_with(lambda o: o.preempted_ids and any(c.num_spec_tokens for c in o.chunks)) > 0
    _assert_all_blocks_free(llm)


def test_chunked_prefill_and_prefix_caching(llama_dir, reference):
    """A small token budget chunks the prompts and cuts drafts short; the second pass is served
    by the prefix cache, which holds only accepted tokens."""
    llm = LLM(llama_dir, block_size=8, num_gpu_blocks_override=400, max_num_batched_tokens=16, max_num_seqs=4,
              speculative_config=NGRAM)
    spy = _StepSpy(llm)
    assert _tokens(_generate(llm)) == reference
    assert _tokens(_generate(llm)) == reference
    assert llm.get_kv_cache_stats().prefix_cache_hits > 0
    assert spy.steps_with(lambda o: any(c.num_spec_tokens for c in o.chunks) and
                          any(c.start + c.num_new_tokens < 20 and c.num_samples == 0 and not c.num_spec_tokens
                              for c in o.chunks)) > 0  # a prompt chunk beside a verified run
    _assert_all_blocks_free(llm)


def test_structured_outputs_and_forks_beside_speculation(llama_dir, reference):
    """A grammar-constrained request decodes plainly in the same steps; n=2 siblings speculate."""
    import re

    from pagedllm import StructuredOutputsParams
    llm = LLM(llama_dir, block_size=8, num_gpu_blocks_override=400, speculative_config=NGRAM)
    regex = SamplingParams(seed=3, max_tokens=20, structured_outputs=StructuredOutputsParams(regex="[a-c]{3}-[0-9]{2}"))
    twice = SamplingParams(n=2, temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outs = llm.generate(prompts[:1] + prompts, [regex] + [twice] * len(PROMPTS), use_tqdm=False)
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", outs[0].outputs[0].text)
    assert [[c.token_ids for c in o.outputs] for o in outs[1:]] == [r * 2 for r in reference]
    assert _spec_metrics(llm)["num_drafts"] > 0
    _assert_all_blocks_free(llm)


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
@pytest.mark.parametrize("name", ["ngram", "draft"])
def test_model_parallelism(llama_dir, draft_dir, reference, name, layout):
    """The target's verify forward runs on every rank (under PP its micro-batches' verify rows
    come back after their sampling rows); a draft model runs on rank 0 alone."""
    llm = LLM(llama_dir, block_size=8, num_gpu_blocks_override=400, num_threads=1, **layout,
              speculative_config=_configs(llama_dir, draft_dir)[name])
    try:
        assert _tokens(_generate(llm)) == reference
        assert _spec_metrics(llm)["num_accepted_tokens"] > 0
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def self_draft_llm(llama_dir):
    return LLM(llama_dir, block_size=8, num_gpu_blocks_override=400,
               speculative_config={"model": llama_dir, "num_speculative_tokens": 5})


@pytest.fixture(scope="module")
def plain_llm(llama_dir):
    return LLM(llama_dir, block_size=8, num_gpu_blocks_override=400)


def _completion(out):
    c = out.outputs[0]
    return c.token_ids, c.text, c.finish_reason, c.stop_reason


def test_stop_token_inside_an_accepted_run(self_draft_llm, plain_llm, reference):
    stop = reference[0][0][9]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop])
    spec, plain = _generate(self_draft_llm, params), _generate(plain_llm, params)
    assert [_completion(o) for o in spec] == [_completion(o) for o in plain]
    assert spec[0].outputs[0].token_ids[-1] == stop and len(spec[0].outputs[0].token_ids) <= 10


def test_stop_string_inside_an_accepted_run(self_draft_llm, plain_llm):
    text = _generate(plain_llm)[1].outputs[0].text
    stop = text[len(text) // 3:len(text) // 3 + 2]
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop],
                                include_stop_str_in_output=include)
        spec, plain = _generate(self_draft_llm, params), _generate(plain_llm, params)
        assert [_completion(o) for o in spec] == [_completion(o) for o in plain]
        assert spec[1].outputs[0].finish_reason == "stop"
    _assert_all_blocks_free(self_draft_llm)


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens_inside_an_accepted_run(self_draft_llm, reference, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    assert _tokens(_generate(self_draft_llm, params)) == [[t[0][:max_tokens]] for t in reference]


def test_logprobs_of_accepted_tokens(self_draft_llm, plain_llm):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
    spec, plain = _generate(self_draft_llm, params), _generate(plain_llm, params)
    for s, p in zip(spec, plain):
        s, p = s.outputs[0], p.outputs[0]
        assert s.token_ids == p.token_ids
        assert s.cumulative_logprob == pytest.approx(p.cumulative_logprob, abs=1e-3)
        for a, b in zip(s.logprobs, p.logprobs):
            assert a.keys() == b.keys()
            assert [a[t].logprob for t in a] == pytest.approx([b[t].logprob for t in a], abs=1e-4)
            assert [a[t].rank for t in a] == [b[t].rank for t in a]


def test_seeded_sampling_is_reproducible(self_draft_llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True,
                            repetition_penalty=1.2)
    first = _tokens(_generate(self_draft_llm, params))
    assert _tokens(_generate(self_draft_llm, params)) == first
    _assert_all_blocks_free(self_draft_llm)


def test_metrics_reach_prometheus(self_draft_llm):
    _generate(self_draft_llm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    text = PrometheusMetrics("m").render(self_draft_llm.get_metrics()).decode()
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert f"pagedllm:spec_decode_{name}_total{{model_name=\"m\"}}" in text
    assert 'pagedllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="4"}' in text


# ---------------------------------------------------------------------- sampling distribution
SMALL_VOCAB = 16
CONTEXT = [3, 7, 5, 9]


@pytest.fixture(scope="module")
def small_vocab_dirs(tmp_path_factory):
    target = make_model_dir(tmp_path_factory.mktemp("small_target"), std=0.5, vocab_size=SMALL_VOCAB)
    draft = make_model_dir(tmp_path_factory.mktemp("small_draft"), std=0.5, seed=3, vocab_size=SMALL_VOCAB,
                           num_hidden_layers=1)
    return target, draft


def _second_token_distribution(model_dir: str, temperature: float, top_k: int) -> torch.Tensor:
    """Exact marginal of the second sampled token: sum over t1 of p(t1 | ctx) p(t2 | ctx, t1)."""
    import transformers as tf
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def dist(ids):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1] / temperature
        kth = logits.topk(top_k).values[-1]
        return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1).double()
    first = dist(CONTEXT)
    return sum(first[t] * dist(CONTEXT + [t]) for t in range(SMALL_VOCAB))


def test_speculative_sampling_matches_the_targets_distribution(small_vocab_dirs):
    """1500 requests of 3 tokens: the second token always comes out of the rejection sampler
    (one draft from another model, accepted or replaced)."""
    target, draft = small_vocab_dirs
    llm = LLM(target, speculative_config={"model": draft, "num_speculative_tokens": 2}, max_num_seqs=256,
              num_gpu_blocks_override=600)
    params = SamplingParams(temperature=0.8, top_k=6, max_tokens=3, ignore_eos=True, detokenize=False)
    outs = _generate(llm, params, [CONTEXT] * 1500)
    counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[1] for o in outs]), minlength=SMALL_VOCAB)
    expected = _second_token_distribution(target, 0.8, 6) * len(outs)
    keep = expected >= 5  # pool the rare tokens into one bin
    observed = torch.cat([counts[keep], counts[~keep].sum()[None]]).double()
    expected = torch.cat([expected[keep], expected[~keep].sum()[None]])
    expected *= observed.sum() / expected.sum()  # exact to rounding: chisquare wants equal sums
    m = _spec_metrics(llm)
    assert m["num_draft_tokens"] >= len(outs) and 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3


def test_draft_model_kv_pool_is_counted_in_the_kv_budget(llama_dir, draft_dir):
    """The draft holds as many blocks as the target: with the same KV memory, a draft of the
    target's shape halves the target's blocks (both pools together fit the budget)."""
    plain = LLM(llama_dir, kv_cache_memory="1MiB", block_size=16, max_model_len=256)
    spec = LLM(llama_dir, kv_cache_memory="1MiB", block_size=16, max_model_len=256,
               speculative_config={"model": draft_dir, "num_speculative_tokens": 2})
    # tiny llama: 512 bytes/token (test_api.py); the draft has the same shape
    assert plain.get_kv_cache_stats().num_blocks == 1024 * 1024 // (512 * 16)
    assert spec.get_kv_cache_stats().num_blocks == 1024 * 1024 // (2 * 512 * 16)
    _generate(spec, prompts=PROMPTS[:2])
    _assert_all_blocks_free(spec)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_weights_are_counted_from_the_checkpoint(llama_dir, dtype):
    """draft_memory's weight bytes are the checkpoint's parameters in the draft's dtype."""
    import transformers as tf

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.worker.draft_memory import draft_memory
    config = EngineArgs(llama_dir, dtype=dtype, speculative_config={"model": llama_dir, "num_speculative_tokens": 2}
                        ).create_engine_config()
    hf = tf.AutoModelForCausalLM.from_pretrained(llama_dir)
    assert draft_memory(config).weight_bytes == hf.num_parameters() * dtype.itemsize


def test_fp8_weights_are_counted_at_one_byte(tmp_path):
    """FP8 weights stay one byte once loaded (raw_checkpoint_tensor); wider floats take the dtype."""
    from safetensors.torch import save_file

    from pagedllm.models.loader import checkpoint_bytes
    save_file({"w": torch.zeros(4, 8, dtype=torch.float8_e4m3fn), "s": torch.ones(4, dtype=torch.float32),
               "codes": torch.zeros(4, 2, dtype=torch.int32)}, str(tmp_path / "model.safetensors"))
    assert checkpoint_bytes(str(tmp_path), torch.bfloat16) == 32 * 1 + 4 * 2 + 8 * 4
