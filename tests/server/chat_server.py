"""A live server for tool calling and reasoning: a Hermes-style chat template that renders tools,
documents, tool calls and tool replies, and a way to script the engine's output text."""
from __future__ import annotations

import pytest
from live_server import start_server

from pagedllm.engine.async_engine import RequestStream
from pagedllm.entrypoints.openai.chat_features import ChatOptions
from pagedllm.outputs import CompletionOutput, RequestOutput

# Hermes / Qwen style: tools in the system turn, calls as <tool_call>{json}</tool_call>, replies in
# <tool_response>; enable_thinking=false closes an empty think block in the prompt (as Qwen3's does)
# (newlines are written {{ '\\n' }}: transformers renders with trim_blocks, which drops one right after a tag)
TOOL_TEMPLATE = (
    "{% if tools %}<s>system: You may call:{% for t in tools %} {{ t.function.name }}"
    "{{ t.function.parameters | tojson }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% if documents %}<s>system: Documents:{% for d in documents %} {{ d.text }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}<s>{{ m.role }}{% if m.name %}({{ m.name }}){% endif %}: "
    "{% if m.role == 'tool' %}<tool_response>{{ m.tool_call_id }} {{ m.content }}</tool_response>"
    "{% elif m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def tools_server(server_model_dir):
    """Hermes tool-call parser (auto tool choice on) and the qwen3 reasoning parser."""
    options = ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
    srv = start_server(server_model_dir, chat_template=TOOL_TEMPLATE, chat_options=options, max_model_len=512)
    yield srv
    srv.stop()


def script_engine(monkeypatch, server, pieces: list[str], finish: str = "stop") -> list:
    """The server's engine answers every request with ``pieces`` (one delta each when streaming,
    joined otherwise); returns the list the prompts it was given are appended to."""
    prompts = []

    async def add_requests(requests, params, arrival_time=None, queue=None, **options):
        streams = []
        for request_id, prompt in requests:
            prompts.append(prompt)
            stream = RequestStream(request_id, queue)
            chunks = pieces if params.output_kind == "delta" else ["".join(pieces)]
            for k, text in enumerate(chunks):
                last = k == len(chunks) - 1
                out = CompletionOutput(0, text, [5], None, None, finish if last else None)
                stream.put(RequestOutput(request_id, None, [1, 2, 3], [out], finished=last))
            streams.append(stream)
        return streams
    monkeypatch.setattr(server.engine, "add_requests", add_requests)
    return prompts
