"""LLaVA-NeXT (anyres tiles, unpadding, image_newline rows) end to end against transformers:
images of different aspect ratios take different numbers of rows; chunked prefill splits them."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.multimodal.llava_fixtures import make_image, make_llava_next_dir

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
BUDGET = 160  # max_num_batched_tokens: a 2x2-grid image takes 135 rows


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory):
    return make_llava_next_dir(tmp_path_factory.mktemp("llava-next"))


@pytest.fixture(scope="module")
def oracle(next_dir):
    import transformers as tf
    return (tf.LlavaNextForConditionalGeneration.from_pretrained(next_dir, dtype=torch.float32).eval(),
            tf.AutoProcessor.from_pretrained(next_dir))


@pytest.fixture(scope="module")
def llm(next_dir):
    engine = LLM(model=next_dir, max_model_len=512, kv_cache_memory=2**23, max_num_batched_tokens=BUDGET,
                 block_size=8)
    yield engine
    engine.llm_engine.shutdown()


def _reference(oracle, text: str, images: list) -> list[int]:
    model, processor = oracle
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


LONG = "the quick brown fox jumps over the lazy dog paged attention keeps a block table hello world"
CASES = [
    ("the quick <image> fox", [make_image(1, (40, 90))]),  # a 1x2 grid
    ("hello world, this is a tiny tokenizer", []),
    ("<image> a <image> b", [make_image(2, (90, 40)), make_image(3, (50, 50))]),  # 2x1 and 2x2 grids
    (f"{LONG} {LONG} <image> jumps", [make_image(4, (60, 60))]),  # the first chunk ends inside the run
]


def test_greedy_matches_transformers(llm, oracle):
    prompts = [{"prompt": t, "multi_modal_data": {"image": imgs}} if imgs else t for t, imgs in CASES]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for (text, images), out in zip(CASES, outs):
        assert list(out.outputs[0].token_ids) == _reference(oracle, text, images), text
    lengths = {i.length for o in prompts if isinstance(o, dict)
               for i in llm.llm_engine.input_processor.tokenize_multimodal(o)[2]}
    assert len(lengths) >= 3  # the aspect ratios give different row counts
    last = llm.llm_engine.input_processor.tokenize_multimodal(prompts[-1])[2][0]
    assert last.offset < BUDGET < last.end  # a step's budget from its start ends inside its image's run


def test_images_change_the_output(llm):
    """The oracle comparison means something: an image's content reaches the logits."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    tops = [llm.generate([{"prompt": "the quick <image> fox", "multi_modal_data": {"image": make_image(s)}}], params,
                         use_tqdm=False)[0].outputs[0].logprobs[0] for s in (11, 12)]
    assert {t: round(v.logprob, 4) for t, v in tops[0].items()} != {t: round(v.logprob, 4) for t, v in tops[1].items()}


def test_prefix_hit_and_miss(llm, oracle):
    text = f"{LONG} <image> the lazy dog"
    def run(seed):
        return llm.generate([{"prompt": text, "multi_modal_data": {"image": make_image(seed, (60, 45))}}], GREEDY,
                            use_tqdm=False)[0]
    first, same, other = run(21), run(21), run(22)
    offset = first.prompt_token_ids.index(368)
    assert same.num_cached_tokens > offset and other.num_cached_tokens <= offset
    assert list(same.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    assert list(other.outputs[0].token_ids) == _reference(oracle, text, [make_image(22, (60, 45))])


def test_memory_profile_encodes_the_largest_image(llm):
    """The runner's memory profile runs the tower on the most tiles any image can take."""
    runner = llm.llm_engine.executor.runner
    model = runner.model
    dummy = model.dummy_image()
    assert dummy["pixel_values"].shape[1] == 5  # the 2x2 grid and the base view
    assert model.encode_image(dummy).shape[0] == model.image_rows(model.config, dummy) == 135
    runner._profile_encoder()
