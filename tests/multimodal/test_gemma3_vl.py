"""Gemma 3 with images, offline: greedy outputs equal transformers' on the same tiny random
weights and processor output, with the bidirectional attention among one image's tokens (also on
the sliding-window layers, whose window is shorter than an image run here), chunked prefill that
never splits an image run, and prefix hits by image content."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.multimodal.gemma3_vl_fixtures import IMAGE_TOKENS, gemma3_vl_dir, gemma3_vl_hf  # noqa: F401 - fixtures
from tests.multimodal.llava_fixtures import chunks_seen, make_image
from tests.multimodal.oracle_checks import assert_preemption_keeps_outputs_exact, vlm_engine

MAX_NEW = 6
BUDGET = 16  # max_num_batched_tokens: a plain chunk boundary would fall inside the image run below
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
IMG = "<start_of_image>"


@pytest.fixture(scope="module")
def llm(gemma3_vl_dir):
    engine = vlm_engine(gemma3_vl_dir, BUDGET, max_images=2)
    yield engine
    engine.llm_engine.shutdown()


def hf_generate(hf, prompt: str, images: list, bidirectional: bool = True, **processor_kwargs) -> list[int]:
    """transformers' greedy tokens; ``bidirectional=False`` drops token_type_ids (a causal-only mask)."""
    model, processor = hf
    inputs = processor(text=prompt, images=images or None, return_tensors="pt", **processor_kwargs)
    if not bidirectional:
        inputs.pop("token_type_ids")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _generate(llm, prompt: str, images: list, **kwargs) -> list[int]:
    p = {"prompt": prompt, "multi_modal_data": {"image": images}, **kwargs} if images else prompt
    return list(llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


CASES = [
    (f"the quick {IMG} brown fox", [make_image(1)]),
    ("hello world, this is a tiny tokenizer", []),
    (f"{IMG} paged attention {IMG} keeps a block", [make_image(2, (64, 30)), make_image(3, (30, 90))]),
]


def test_greedy_matches_transformers_mixed_batch(llm, gemma3_vl_hf):
    """0, 1 and 2 images of different sizes in one batch."""
    prompts = [{"prompt": t, "multi_modal_data": {"image": imgs}} if imgs else t for t, imgs in CASES]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for (text, images), out in zip(CASES, outs):
        assert list(out.outputs[0].token_ids) == hf_generate(gemma3_vl_hf, text, images), text


def _hf_logprobs(hf, prompt: str, images: list, bidirectional: bool) -> torch.Tensor:
    """transformers' next-token log-probabilities ``[vocab]`` after the prompt."""
    model, processor = hf
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    if not bidirectional:
        inputs.pop("token_type_ids")
    with torch.no_grad():
        return torch.log_softmax(model(**inputs).logits[0, -1].float(), -1)


def test_bidirectional_image_attention_changes_the_output(llm, gemma3_vl_hf):
    """The block mask matters on these weights (a causal-only mask moves the next-token
    log-probabilities well past the tolerance), and ours are the bidirectional ones."""
    prompt, images = f"the quick {IMG} brown", [make_image(20)]
    out = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": images}}],
                       SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)[0]
    ours = out.outputs[0].logprobs[0]
    both_ways = _hf_logprobs(gemma3_vl_hf, prompt, images, bidirectional=True)
    causal = _hf_logprobs(gemma3_vl_hf, prompt, images, bidirectional=False)
    tokens = list(ours)
    got = torch.tensor([ours[t].logprob for t in tokens])
    torch.testing.assert_close(got, both_ways[tokens], atol=2e-4, rtol=0)
    assert (got - causal[tokens]).abs().max() > 1e-2


def test_image_spans_stay_on_the_c_attention_kernel(llm, gemma3_vl_hf, monkeypatch):
    """A step with an image run runs on the engine's own backend (the C kernel on CPU, the
    bidirectional span passed to it), never on a fallback, and still equals transformers."""
    from pagedllm.attention.cpu import CpuAttentionBackend
    from pagedllm.attention.sdpa import SdpaBackend
    from pagedllm.attention.torch_ref import TorchReferenceBackend
    from pagedllm.native import bindings
    backend = llm.llm_engine.executor.runner.backend
    if not isinstance(backend, CpuAttentionBackend):
        pytest.skip(f"the engine runs {type(backend).__name__}, not the C kernel")
    spans, fallbacks = [], []
    attention = bindings.NativeLibrary.attention

    def spy(self, *args, attend_ends=None, **kwargs):
        spans.append(attend_ends)
        return attention(self, *args, attend_ends=attend_ends, **kwargs)
    monkeypatch.setattr(bindings.NativeLibrary, "attention", spy)
    for other in (SdpaBackend, TorchReferenceBackend):
        monkeypatch.setattr(other, "forward", lambda *a, **k: fallbacks.append(a) or pytest.fail("fallback ran"))
    prompt, images = CASES[0]
    assert _generate(llm, prompt, images) == hf_generate(gemma3_vl_hf, prompt, images)
    assert not fallbacks
    with_spans = [ends for ends in spans if ends is not None]
    # causal ends rise by one a token: a repeated end is an image run's tokens seeing the whole run
    assert with_spans and len(set(with_spans[0].tolist())) < len(with_spans[0])


def test_chunked_prefill_never_splits_an_image_run(llm, gemma3_vl_hf, monkeypatch):
    processor = gemma3_vl_hf[1]
    prompt = f"hello world, the quick brown fox jumps over the {IMG} over the lazy dog"
    images = [make_image(8)]
    ids = processor(text=prompt, images=images)["input_ids"][0]
    offset = ids.index(processor.tokenizer.image_token_id)
    assert offset < BUDGET < offset + IMAGE_TOKENS  # a budget-sized first chunk would end inside the run
    seen = chunks_seen(llm, monkeypatch)
    assert _generate(llm, prompt, images) == hf_generate(gemma3_vl_hf, prompt, images)
    ends = [c.seq_len for c in seen]
    assert ends[0] == offset  # the first chunk stopped before the run
    assert not any(offset < e < offset + IMAGE_TOKENS for e in ends)
    run_chunk = next(c for c in seen if c.attend_ends is not None)
    assert run_chunk.attend_ends[:IMAGE_TOKENS].tolist() == [offset + IMAGE_TOKENS] * IMAGE_TOKENS


def test_prefix_hit_same_image_miss_other_image(llm, gemma3_vl_hf):
    prompt = f"the lazy dog {IMG} paged attention keeps a block table"
    processor = gemma3_vl_hf[1]
    offset = processor(text=prompt, images=[make_image(30)])["input_ids"][0].index(processor.tokenizer.image_token_id)
    first = _generate(llm, prompt, [make_image(30)])
    out = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": [make_image(30)]}}], GREEDY,
                       use_tqdm=False)[0]
    assert out.num_cached_tokens > IMAGE_TOKENS  # the block hashes cover the image: a hit past its run
    assert list(out.outputs[0].token_ids) == first == hf_generate(gemma3_vl_hf, prompt, [make_image(30)])
    other = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": [make_image(31)]}}], GREEDY,
                         use_tqdm=False)[0]
    assert other.num_cached_tokens <= offset  # only text before the image can hit
    assert list(other.outputs[0].token_ids) == hf_generate(gemma3_vl_hf, prompt, [make_image(31)])


WIDE = make_image(90, (260, 800))  # pan-and-scan: 3 crops of 267x260 (>= pan_and_scan_min_crop_size, 256)
SMALL_CROPS = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16}


def test_pan_and_scan_crops_match_transformers(llm, gemma3_vl_hf):
    """do_pan_and_scan per request (off by default): the whole image's run, then one run per crop,
    each its own item (encoded, cached and attended to both ways alone); runs are never split by
    chunked prefill (BUDGET 16, 4 runs of 4 tokens amid the text)."""
    prompt, token = f"the quick {IMG} brown fox", gemma3_vl_hf[1].tokenizer.image_token_id
    out = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": [WIDE]},
                         "mm_processor_kwargs": {"do_pan_and_scan": True}}], GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids.count(token) == 4 * IMAGE_TOKENS
    assert list(out.outputs[0].token_ids) == hf_generate(gemma3_vl_hf, prompt, [WIDE], do_pan_and_scan=True)
    plain = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": [WIDE]}}], GREEDY, use_tqdm=False)[0]
    assert plain.prompt_token_ids.count(token) == IMAGE_TOKENS  # off by default
    assert list(plain.outputs[0].token_ids) == hf_generate(gemma3_vl_hf, prompt, [WIDE])


def test_pan_and_scan_two_images_and_crop_hashes(llm, gemma3_vl_hf):
    """A wide and a tall image (3 and 2 crops with a 16-pixel minimum crop): outputs equal
    transformers', each crop's item is named by its pixels (a repeated prompt hits past every run)."""
    prompt = f"{IMG} paged attention {IMG} keeps a block table"
    images = [make_image(91, (40, 120)), make_image(92, (60, 30))]
    items = llm.llm_engine.multimodal.process(prompt, {"image": images}, SMALL_CROPS)[1]
    assert len(items) == 2 + 3 + 2 and len({item.hash for item in items}) == len(items)
    request = {"prompt": prompt, "multi_modal_data": {"image": images}, "mm_processor_kwargs": SMALL_CROPS}
    outs = [llm.generate([request], GREEDY, use_tqdm=False)[0] for _ in range(2)]
    assert outs[1].num_cached_tokens >= items[-1].end - items[-1].end % 8
    for out in outs:
        assert list(out.outputs[0].token_ids) == hf_generate(gemma3_vl_hf, prompt, images, **SMALL_CROPS)


def test_pan_and_scan_as_the_engine_default(gemma3_vl_dir, gemma3_vl_hf):
    """mm_processor_kwargs at engine level: every prompt's images are cropped; a request's own
    do_pan_and_scan=False turns it off for that request."""
    engine = LLM(model=gemma3_vl_dir, max_model_len=256, kv_cache_memory=2**22, max_num_batched_tokens=BUDGET,
                 block_size=8, mm_processor_kwargs=SMALL_CROPS)
    try:
        prompt, image = f"the quick {IMG} brown fox", make_image(93, (40, 120))
        assert _generate(engine, prompt, [image]) == hf_generate(gemma3_vl_hf, prompt, [image], **SMALL_CROPS)
        off = engine.generate([{"prompt": prompt, "multi_modal_data": {"image": [image]},
                                "mm_processor_kwargs": {"do_pan_and_scan": False}}], GREEDY, use_tqdm=False)[0]
        assert off.prompt_token_ids.count(gemma3_vl_hf[1].tokenizer.image_token_id) == IMAGE_TOKENS
        assert list(off.outputs[0].token_ids) == hf_generate(gemma3_vl_hf, prompt, [image])
    finally:
        engine.llm_engine.shutdown()


def test_prefix_hit_ending_inside_an_image_run(llm, gemma3_vl_hf, monkeypatch):
    """A prefix hit may end inside a run (its cached head's K/V were computed with the whole run
    visible): the next chunk starts there and takes the rest of the run whole, and the output is
    still transformers'."""
    image = make_image(40)
    first, second = f"the lazy dog {IMG} paged attention keeps", f"the lazy dog {IMG} hello world"
    processor = gemma3_vl_hf[1]
    offset = processor(text=second, images=[image])["input_ids"][0].index(processor.tokenizer.image_token_id)
    assert offset < 8 < offset + IMAGE_TOKENS  # block_size 8: the shared full block ends inside the run
    _generate(llm, first, [image])
    seen = chunks_seen(llm, monkeypatch)
    out = llm.generate([{"prompt": second, "multi_modal_data": {"image": [image]}}], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 8
    assert seen[0].start == 8 and seen[0].seq_len >= offset + IMAGE_TOKENS
    end = offset + IMAGE_TOKENS
    assert seen[0].attend_ends[:end - 8].tolist() == [end] * (end - 8)  # the run's tail sees its whole run
    assert list(out.outputs[0].token_ids) == hf_generate(gemma3_vl_hf, second, [image])


def test_cut_before_split_runs():
    """A chunk stops before a bidirectional run it would end inside, waits (0) when it starts
    inside one it cannot finish, and passes runs that are not bidirectional (LLaVA's) unless
    every item must stay whole (disable_chunked_mm_input)."""
    from pagedllm.multimodal.inputs import MultiModalItem, attend_ends, cut_before_split_runs
    both_ways = MultiModalItem(b"a", 10, 6, {}, bidirectional=True)
    causal = MultiModalItem(b"b", 30, 6, {})
    assert cut_before_split_runs([both_ways], 0, 12) == 10
    assert cut_before_split_runs([both_ways], 0, 16) == 16
    assert cut_before_split_runs([both_ways], 12, 2) == 0
    assert cut_before_split_runs([both_ways], 12, 4) == 4
    assert cut_before_split_runs([causal], 28, 4) == 4
    assert cut_before_split_runs([causal], 28, 4, every_item=True) == 2  # disable_chunked_mm_input
    assert cut_before_split_runs([causal], 32, 2, every_item=True) == 0
    assert attend_ends([both_ways, causal], 8, 9).tolist() == [9, 10, 16, 16, 16, 16, 16, 16, 17]
    assert attend_ends([causal], 28, 4) is None


def test_preemption_keeps_outputs_exact(gemma3_vl_dir, gemma3_vl_hf):
    """A KV cache too small for every image prompt at once: requests are preempted (recompute),
    their runs prefilled whole again; outputs stay exact."""
    cases = [(f"the quick brown fox {IMG} jumps", [make_image(80 + i)]) for i in range(4)]
    assert_preemption_keeps_outputs_exact(gemma3_vl_dir, gemma3_vl_hf, cases, max_model_len=64,
                                          num_gpu_blocks_override=10, block_size=8, max_num_batched_tokens=BUDGET)


def test_image_token_past_the_vocabulary_embeds(gemma3_vl_dir):
    """An image token id past the text vocabulary (which transformers allows) is looked up as
    token 0, as transformers does; its row is replaced by the image's anyway."""
    import transformers as tf

    from pagedllm.attention.torch_ref import TorchReferenceBackend
    from pagedllm.distributed.parallel_state import TensorParallelGroup
    from pagedllm.models.gemma3_vl import Gemma3ForConditionalGeneration
    cfg = tf.AutoConfig.from_pretrained(gemma3_vl_dir)
    cfg.image_token_id = cfg.text_config.vocab_size + 7
    model = Gemma3ForConditionalGeneration(cfg, TorchReferenceBackend(), 64, TensorParallelGroup())
    torch.nn.init.normal_(model.language_model.model.embed_tokens.weight)
    rows = model.embed_input_ids(torch.tensor([cfg.image_token_id, 0, 5]))
    assert torch.equal(rows[0], rows[1]) and not torch.equal(rows[1], rows[2])
