"""vLLM's LLM surface past generate (issue 31): ``chat`` with tools, documents, template variables
and continue_final_message, rendered exactly as transformers' ``apply_chat_template`` renders
them; ``RequestOutputKind``; the tokenizer and model-config accessors."""
from __future__ import annotations

import copy

import pytest
from transformers import AutoTokenizer

from pagedllm import LLM, RequestOutputKind, SamplingParams
from pagedllm import sampling_params as sp_module

TEMPLATE = (
    "{%- if tools %}TOOLS:{{ tools | tojson }}\n{% endif -%}"
    "{%- if documents %}DOCS:{% for d in documents %}[{{ d['title'] }}]{{ d['text'] }}{% endfor %}\n{% endif -%}"
    "{%- if enable_thinking is defined and not enable_thinking %}NOTHINK\n{% endif -%}"
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
DOCS = [{"title": "fox", "text": "the quick brown fox"}]
CHAT = [{"role": "user", "content": "hello world"}]
GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir):
    with LLM(llama_dir, num_gpu_blocks_override=64, max_model_len=256, num_threads=1) as engine:
        yield engine


@pytest.fixture(scope="module")
def tok(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def hf_ids(tok, messages, **kwargs) -> list[int]:
    out = tok.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def prompt_of(llm, messages, **kwargs) -> list[int]:
    return llm.chat(messages, GREEDY, use_tqdm=False, chat_template=TEMPLATE, **kwargs)[0].prompt_token_ids


def test_tools_documents_and_template_kwargs_render_as_transformers(llm, tok):
    got = prompt_of(llm, CHAT, tools=TOOLS, documents=DOCS, chat_template_kwargs={"enable_thinking": False})
    want = hf_ids(tok, CHAT, tools=TOOLS, documents=DOCS, add_generation_prompt=True, enable_thinking=False)
    assert got == want
    text = tok.decode(got)
    assert "get_weather" in text and "DOCS:[fox]" in text and "NOTHINK" in text  # each really reached the template


def test_continue_final_message_leaves_the_answer_open(llm, tok):
    messages = CHAT + [{"role": "assistant", "content": "the answer is"}]
    got = prompt_of(llm, messages, add_generation_prompt=False, continue_final_message=True)
    assert got == hf_ids(tok, messages, add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(got).endswith("the answer is")
    with pytest.raises(ValueError, match="continue_final_message=True and add_generation_prompt=True"):
        llm.chat(messages, GREEDY, use_tqdm=False, chat_template=TEMPLATE, continue_final_message=True)


def test_content_parts_as_string_or_openai(llm, tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}]
    joined = [{"role": "user", "content": "hello\nworld"}]
    assert prompt_of(llm, parts) == hf_ids(tok, joined, add_generation_prompt=True)
    assert prompt_of(llm, parts, chat_template_content_format="openai") == hf_ids(tok, parts,
                                                                                  add_generation_prompt=True)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="'image_url' part"):
        prompt_of(llm, image)


@pytest.mark.parametrize("kwargs, match", [
    (dict(lora_request="adapter"), "lora_request='adapter' is not supported"),
    (dict(mm_processor_kwargs={"num_crops": 4}), "mm_processor_kwargs="),
    (dict(chat_template_content_format="xml"), "chat_template_content_format='xml'"),
    (dict(chat_template_kwargs={"tools": []}), r"chat_template_kwargs repeats \['tools'\]"),
])
def test_refused_chat_arguments_are_named(llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(CHAT, GREEDY, use_tqdm=False, chat_template=TEMPLATE, **kwargs)


def test_request_output_kind_delta_streams_only_new_tokens(llm):
    assert sp_module.RequestOutputKind is RequestOutputKind
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    assert params.output_kind == RequestOutputKind.DELTA == "delta"
    engine = llm.llm_engine
    engine.add_request("delta", {"prompt_token_ids": [5, 6, 7]}, params)
    pieces = []
    while engine.has_unfinished_requests():
        pieces += [out.outputs[0].token_ids for out in engine.step()]
    whole = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert all(len(p) == 1 for p in pieces) and sum(pieces, []) == whole


def test_tokenizer_and_model_config_accessors(llm, tok):
    engine = llm.llm_engine
    assert engine.get_model_config().max_model_len == 256
    original = llm.get_tokenizer()
    assert engine.get_tokenizer() is original
    templated = copy.deepcopy(tok)
    templated.chat_template = TEMPLATE
    llm.set_tokenizer(templated)
    try:
        assert llm.get_tokenizer() is templated
        out = llm.chat(CHAT, GREEDY, use_tqdm=False)[0]  # the new tokenizer's template
        assert out.prompt_token_ids == hf_ids(tok, CHAT, add_generation_prompt=True)
    finally:
        llm.set_tokenizer(original)
