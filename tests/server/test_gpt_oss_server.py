"""A GPT-OSS model behind the server with the harmony format: a tokenizer holding harmony's
special tokens and a chat template that renders the published format (tools as a ``namespace
functions`` developer message, the prompt ending in ``<|start|>assistant``), served with
``--tool-call-parser openai`` (which implies the ``openai_gptoss`` reasoning parser); checked
with the real openai client."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from chat_server import WEATHER_TOOL, script_engine
from conftest import make_model_dir
from live_server import start_server

from pagedllm.entrypoints.openai.chat_features import ChatOptions

HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
# the harmony rendering (openai/harmony's format): system, developer tools, conversation, then the
# assistant's turn left open; {{ '\n' }}: transformers renders with trim_blocks
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>You are a tiny test model.{{ '\\n' }}Reasoning: low{{ '\\n' }}"
    "# Valid channels: analysis, commentary, final.<|end|>"
    "{% if tools %}<|start|>developer<|message|># Tools{{ '\\n' }}namespace functions {{ '{' }}"
    "{% for t in tools %}{{ '\\n' }}// {{ t.function.description }}{{ '\\n' }}type {{ t.function.name }} = "
    "(_: {{ t.function.parameters | tojson }}) => any;{% endfor %}{{ '\\n' }}{{ '}' }} // namespace functions<|end|>"
    "{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|start|>functions.{{ m.name }} to=assistant<|channel|>"
    "commentary<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'assistant' and m.tool_calls %}{% for c in m.tool_calls %}<|start|>assistant<|channel|>"
    "commentary to=functions.{{ c.function.name }} <|constrain|>json<|message|>{{ c.function.arguments }}<|call|>"
    "{% endfor %}{% elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
REPLY = ('<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant<|channel|>commentary '
         'to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}<|call|>')
USER = {"role": "user", "content": "weather in Rome?"}


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory):
    from transformers import AutoTokenizer
    path = make_model_dir(tmp_path_factory.mktemp("gpt_oss_harmony"), "gpt_oss")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tokenizer.chat_template = HARMONY_TEMPLATE
    tokenizer.save_pretrained(path)
    options = ChatOptions(enable_auto_tool_choice=True, tool_call_parser="openai")
    srv = start_server(path, chat_options=options, max_model_len=512)
    yield srv, tokenizer
    srv.stop()


def test_the_chat_template_renders_harmony_with_single_token_markers(harmony_server):
    srv, tokenizer = harmony_server
    body = {"model": "tiny", "messages": [USER], "add_generation_prompt": True}
    response = httpx.post(f"{srv.url}/tokenize", json=body, timeout=30)
    assert response.status_code == 200, response.text
    ids = response.json()["tokens"]
    text = tokenizer.decode(ids)
    assert text.endswith("<|start|>user<|message|>weather in Rome?<|end|><|start|>assistant")
    for marker in ("<|start|>", "<|message|>", "<|end|>"):  # each one token, not spelled in bytes
        assert ids.count(tokenizer.convert_tokens_to_ids(marker)) == text.count(marker)


def test_harmony_reasoning_and_tool_call_through_the_openai_client(harmony_server, monkeypatch):
    srv, _ = harmony_server
    prompts = script_engine(monkeypatch, srv, [REPLY])
    with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        reply = client.chat.completions.create(model="tiny", messages=[USER], tools=[WEATHER_TOOL])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert choice.message.reasoning_content == "The user wants the weather."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}
    rendered = prompts[0]["prompt"]
    assert "namespace functions {\n// Current weather in a city\ntype get_weather = " in rendered  # tools rendered


def test_the_gpt_oss_model_answers_through_the_server(harmony_server):
    """Unscripted: the GPT-OSS model itself generates (sinks, windows, experts) behind the parsers."""
    srv, _ = harmony_server
    with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=120) as client:
        reply = client.chat.completions.create(model="tiny", messages=[USER], max_tokens=6, temperature=0)
    assert reply.usage.completion_tokens == 6 and reply.choices[0].finish_reason == "length"
