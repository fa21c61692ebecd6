"""LLaVA end to end, offline: greedy outputs equal transformers' on the same tiny random weights
and images, with chunked prefill splitting image runs, the encoder budget, prefix hits by image
content and limit_mm_per_prompt."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.multimodal.llava_fixtures import IMAGE_TOKENS, chunks_seen, hf_generate, llava_dir, llava_hf, make_image  # noqa: F401 - fixtures
from tests.multimodal.oracle_checks import assert_preemption_keeps_outputs_exact, vlm_engine

MAX_NEW = 8
BUDGET = 32  # max_num_batched_tokens: image runs (25 tokens) straddle chunk boundaries
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
LONG_TEXT = "the quick brown fox jumps over the lazy dog paged attention keeps"


@pytest.fixture(scope="module")
def llm(llava_dir):
    engine = vlm_engine(llava_dir, BUDGET, max_images=3)
    yield engine
    engine.llm_engine.shutdown()


def _generate(llm, prompt: str, images: list, **kwargs) -> list[int]:
    p = {"prompt": prompt, "multi_modal_data": {"image": images}, **kwargs} if images is not None else prompt
    return list(llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


CASES = [
    ("the quick <image> brown fox", [make_image(1)]),
    ("hello world, this is a tiny tokenizer", []),
    ("<image> paged attention <image> keeps a block", [make_image(2, (64, 30)), make_image(3, (30, 90))]),
    ("héllo wörld <image> the lazy dog", [make_image(4, (30, 30))]),
    ("<image><image><image> jumps over", [make_image(5), make_image(6, (50, 20)), make_image(7)]),
    ("paged attention keeps a block table", []),
]


def test_greedy_matches_transformers_mixed_batch(llm, llava_hf):
    """Image and text-only prompts in one batch (0, 1, 2 and 3 images of different sizes)."""
    prompts = [{"prompt": t, "multi_modal_data": {"image": imgs}} if imgs else t for t, imgs in CASES]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for (text, images), out in zip(CASES, outs):
        assert list(out.outputs[0].token_ids) == hf_generate(llava_hf, text, images, MAX_NEW), text


def test_images_change_the_output(llm):
    """The oracle comparison above means something: the image reaches the logits."""
    outs = {tuple(_generate(llm, "the quick <image> brown fox", [make_image(seed)])) for seed in (11, 12, 13)}
    assert len(outs) > 1


def test_chunk_boundary_inside_an_image_run(llm, llava_hf, monkeypatch):
    processor = llava_hf[1]
    prompt = f"{LONG_TEXT} <image> over"
    ids = processor(text=prompt, images=[make_image(8)])["input_ids"][0]
    offset = ids.index(processor.tokenizer.convert_tokens_to_ids("<image>"))
    assert offset < BUDGET < offset + IMAGE_TOKENS  # the first chunk ends inside the run
    seen = chunks_seen(llm, monkeypatch)
    assert _generate(llm, prompt, [make_image(8)]) == hf_generate(llava_hf, prompt, [make_image(8)], MAX_NEW)
    covering = [c for c in seen if c.mm_spans]
    assert len(covering) >= 2 and covering[0].seq_len < offset + IMAGE_TOKENS  # the run was split


def test_encoder_budget_defers_the_next_image(llm, llava_hf, monkeypatch):
    """Two new images (50 rows) never encode in one step of budget 32: the first chunk stops
    before the second image, and the output is still exact."""
    prompt, images = "<image> hello <image> world", [make_image(21), make_image(22)]
    seen = chunks_seen(llm, monkeypatch)
    stats = llm.llm_engine.scheduler.encoder.stats
    before = stats.images_encoded
    assert _generate(llm, prompt, images) == hf_generate(llava_hf, prompt, images, MAX_NEW)
    assert stats.images_encoded - before == 2
    metrics = {m.name: m.value for m in llm.llm_engine.get_metrics()}
    assert metrics["pagedllm:mm_images_encoded"] == stats.images_encoded
    assert 0 < metrics["pagedllm:mm_encoder_cache_usage_perc"] <= 1
    first = seen[0]
    assert len(first.mm_spans) == 1 and first.seq_len <= first.mm_spans[0][1] + IMAGE_TOKENS + 10


def test_prefix_cache_keys_on_image_content(llm, llava_hf):
    text = f"{LONG_TEXT} <image> the lazy dog jumps"
    first = llm.generate([{"prompt": text, "multi_modal_data": {"image": make_image(31)}}], GREEDY,
                         use_tqdm=False)[0]
    same = llm.generate([{"prompt": text, "multi_modal_data": {"image": make_image(31)}}], GREEDY,
                        use_tqdm=False)[0]
    other = llm.generate([{"prompt": text, "multi_modal_data": {"image": make_image(32)}}], GREEDY,
                         use_tqdm=False)[0]
    ids = first.prompt_token_ids
    offset = next(i for i, t in enumerate(ids) if ids.count(t) == IMAGE_TOKENS)  # the placeholder run
    assert same.num_cached_tokens > offset + IMAGE_TOKENS - 8  # hit through the image's blocks
    assert other.num_cached_tokens <= offset  # only the text blocks before the image are shared
    assert list(same.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    stats = llm.llm_engine.scheduler.encoder.stats
    encoded, hits = stats.images_encoded, stats.cache_hits
    _generate(llm, "hello <image> world", [make_image(32)])  # another text (no prefix hit), the cached image
    assert (stats.images_encoded, stats.cache_hits) == (encoded, hits + 1)
    assert list(other.outputs[0].token_ids) == hf_generate(llava_hf, text, [make_image(32)], MAX_NEW)


def test_image_inputs_vllm_shapes(llm, llava_hf):
    """numpy HWC arrays and CHW tensors give the same output as the PIL image."""
    image = make_image(41)
    array = np.array(image)
    tensor = torch.from_numpy(array).permute(2, 0, 1)
    expected = hf_generate(llava_hf, "the quick <image> brown fox", [image], MAX_NEW)
    for value in (image, array, tensor, [image]):
        assert _generate(llm, "the quick <image> brown fox", value) == expected


def test_mm_processor_kwargs_reach_the_processor(llm, llava_hf):
    """A request's mm_processor_kwargs change the HF processor's work (here: no normalization)."""
    prompt, image = "the quick <image> brown fox", make_image(51)
    ours = _generate(llm, prompt, [image], mm_processor_kwargs={"do_normalize": False})
    model, processor = llava_hf
    inputs = processor(text=prompt, images=[image], return_tensors="pt", do_normalize=False)
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    assert ours == ref.tolist()
    with pytest.raises(ValueError, match="mm_processor_kwargs has \\['no_such_option'\\]"):
        _generate(llm, prompt, [image], mm_processor_kwargs={"no_such_option": 1})


@pytest.mark.parametrize("prompt, mm, match", [
    ({"prompt": "<image>" * 4 + " x"}, {"image": [make_image(i) for i in range(4)]}, "limit_mm_per_prompt"),
    ({"prompt": "no placeholder"}, {"image": make_image(1)}, "0 <image> tokens and 1 images"),
    ({"prompt": "<image> x"}, {"video": make_image(1)}, "modalities"),
    ({"prompt": "<image> x"}, {"image": "not an image"}, "must be a PIL.Image"),
    ({"prompt_token_ids": [5, 6]}, {"image": make_image(1)}, "prompt_token_ids cannot carry images"),
    ({"prompt": "<image> x", "add_special_tokens": "yes"}, {"image": make_image(1)}, "add_special_tokens='yes'"),
])
def test_bad_multimodal_inputs_are_refused(llm, prompt, mm, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([{**prompt, "multi_modal_data": mm}], GREEDY, use_tqdm=False)


def test_text_only_model_refuses_images(llama_dir):
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine
    with pytest.raises(ValueError, match="limit_mm_per_prompt.*text-only"):
        LLMEngine.from_engine_args(EngineArgs(model=llama_dir, kv_cache_memory=2**20, limit_mm_per_prompt={"image": 1}))


def test_llm_chat_with_image_parts(llm, llava_hf):
    """LLM.chat: image_pil and data: image_url parts become placeholders in the template's text."""
    import base64
    import io
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    first, second = make_image(71), make_image(72)
    buf = io.BytesIO()
    second.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": first},
                                             {"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "what is this?"}]}]
    out = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=template)[0]
    text = "user: <image>\n<image>\nwhat is this?\nassistant:"
    assert list(out.outputs[0].token_ids) == hf_generate(llava_hf, text, [first, second], MAX_NEW)
    with pytest.raises(ValueError, match="not allowed"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.com/a"}}]}],
                 GREEDY, use_tqdm=False, chat_template=template)


def test_preemption_keeps_outputs_exact(llava_dir, llava_hf):
    """A KV cache too small for every image prompt at once: requests are preempted (recompute)
    and their images encoded again or hit in the encoder cache; outputs stay exact."""
    cases = [(f"{LONG_TEXT} <image> fox", [make_image(80 + i)]) for i in range(4)]
    assert_preemption_keeps_outputs_exact(llava_dir, llava_hf, cases, max_model_len=96, num_gpu_blocks_override=16,
                                          block_size=8, max_num_batched_tokens=64)


def test_language_model_only_loads_no_tower(llm, llava_dir, llava_hf):
    """vLLM's language_model_only: only the language model's parameters exist (the checkpoint's tower
    and projector tensors are skipped, the start-up profile runs no tower), text output equals the
    full model's and transformers', and an image is refused naming the option."""
    engine = LLM(model=llava_dir, max_model_len=256, kv_cache_memory=2**22, block_size=8, language_model_only=True)
    try:
        names = [n for n, _ in engine.llm_engine.executor.runner.model.named_parameters()]
        assert names and all(n.startswith("language_model.") for n in names)
        text = "hello world, this is a tiny tokenizer"
        expected = hf_generate(llava_hf, text, [], MAX_NEW)
        assert _generate(engine, text, None) == _generate(llm, text, None) == expected
        with pytest.raises(ValueError, match="language_model_only=True"):
            _generate(engine, "the quick <image> brown fox", [make_image(1)])
    finally:
        engine.llm_engine.shutdown()


@pytest.mark.parametrize("skip", [False, True])
def test_skip_mm_profiling_skips_the_tower_in_the_start_up_profile(llava_dir, monkeypatch, skip):
    """The memory profile (no kv_cache_memory: measured) runs the largest image through the tower
    unless skip_mm_profiling; images still work either way."""
    from pagedllm.models.llava import LlavaForConditionalGeneration
    calls, encode = [], LlavaForConditionalGeneration.encode_pixels
    monkeypatch.setattr(LlavaForConditionalGeneration, "encode_pixels", lambda self, data: calls.append(1) or
                        encode(self, data))
    engine = LLM(model=llava_dir, max_model_len=128, max_num_batched_tokens=BUDGET, block_size=8,
                 gpu_memory_utilization=0.05, skip_mm_profiling=skip)
    try:
        assert len(calls) == (0 if skip else 1)
        assert len(_generate(engine, "the quick <image> brown fox", [make_image(1)])) == MAX_NEW
        assert len(calls) == (1 if skip else 2)
    finally:
        engine.llm_engine.shutdown()


def test_processor_model_mismatch_is_refused(llava_dir):
    """A processor whose placeholder count differs from the model's embedding rows (a config
    mismatch) is refused instead of scattering the wrong rows."""
    from pagedllm.multimodal.processor import MultiModalLimits, MultiModalProcessor
    processor = MultiModalProcessor.from_pretrained(llava_dir, 368, MultiModalLimits(), lambda data: IMAGE_TOKENS + 1)
    with pytest.raises(ValueError, match="put 25 image placeholder tokens .* embeds as 26 rows"):
        processor.process("a <image> b", {"image": make_image(1)})
    exact = MultiModalProcessor.from_pretrained(llava_dir, 368, MultiModalLimits(), lambda data: IMAGE_TOKENS)
    ids, items = exact.process("a <image> b <image>", {"image": [make_image(1), make_image(1)]})
    assert [i.length for i in items] == [IMAGE_TOKENS] * 2 and items[0].hash == items[1].hash  # same content
    assert items[0].end < items[1].offset and ids.count(368) == 2 * IMAGE_TOKENS
    assert all(ids[i.offset:i.end] == [368] * IMAGE_TOKENS for i in items)


def test_add_special_tokens_reaches_the_processor(llava_dir):
    """A chat template's text is processed without another BOS (add_special_tokens=False)."""
    from tokenizers.processors import TemplateProcessing

    from pagedllm.multimodal.processor import MultiModalLimits, MultiModalProcessor
    processor = MultiModalProcessor.from_pretrained(llava_dir, 368, MultiModalLimits(), lambda data: IMAGE_TOKENS)
    bos = processor.hf.tokenizer.convert_tokens_to_ids("<s>")
    tokenizer = processor.hf.tokenizer._tokenizer
    tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    with_bos, _ = processor.process("a <image> b", {"image": make_image(1)})
    without, _ = processor.process("a <image> b", {"image": make_image(1)}, add_special_tokens=False)
    assert with_bos[0] == bos and with_bos[1:] == without and without[0] != bos


def test_beam_search_with_an_image(llm, llava_hf):
    """Every beam (forks included) keeps the image: the beams equal transformers' num_beams=2."""
    from pagedllm.sampling_params import BeamSearchParams
    prompt, image = "the quick <image> brown fox", make_image(91)
    out = llm.beam_search([{"prompt": prompt, "multi_modal_data": {"image": image}}],
                          BeamSearchParams(beam_width=2, max_tokens=MAX_NEW))[0]
    model, processor = llava_hf
    inputs = processor(text=prompt, images=[image], return_tensors="pt")
    with torch.no_grad():
        ref = model.generate(**inputs, num_beams=2, num_return_sequences=2, do_sample=False, max_new_tokens=MAX_NEW,
                             eos_token_id=2, pad_token_id=0)
    beams = [s[inputs["input_ids"].shape[1]:].tolist() for s in ref]
    beams = [b[: b.index(2) + 1] if 2 in b else b for b in beams]
    assert [s.output_token_ids for s in out.sequences] == beams


def test_tensor_parallel_two_ranks(llava_dir, llava_hf):
    """TP=2: the language model is sharded, each rank runs the (replicated) tower on the images the
    scheduler output carries; outputs equal transformers'."""
    engine = LLM(model=llava_dir, max_model_len=256, kv_cache_memory=2**22, max_num_batched_tokens=BUDGET,
                 block_size=8, tensor_parallel_size=2, num_threads=1)
    try:
        for text, images in (CASES[0], CASES[2]):
            assert _generate(engine, text, images) == hf_generate(llava_hf, text, images, MAX_NEW)
    finally:
        engine.llm_engine.shutdown()


def test_an_image_a_step_still_reads_is_not_evicted(llm, llava_hf):
    """The first prompt's image run ends in its second chunk while the second prompt's image, in
    the same step, needs the encoder cache's whole room: the first image stays until that step has
    run (releasing it at schedule time let the second evict it from under the forward)."""
    cases = [(f"{LONG_TEXT} <image> over", [make_image(101)]), ("<image> the quick brown fox", [make_image(102)])]
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": i}} for t, i in cases], GREEDY, use_tqdm=False)
    for (text, images), out in zip(cases, outs):
        assert list(out.outputs[0].token_ids) == hf_generate(llava_hf, text, images, MAX_NEW)
