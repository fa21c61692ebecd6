"""``OpenAIServing``: every endpoint family's handlers on one object over one AsyncLLMEngine.

Each family lives in its own module with its routes (completions.py, chat.py, embeddings.py,
tokenization.py; later families add theirs); all share serving_base.py's path from an HTTP request
to engine requests. The app keeps one ``OpenAIServing`` in ``app.state.serving``, so a handler in
one family can call another's public methods (the Responses API runs through ``start_chat``,
``render_chat`` and ``chat_response``). The names other modules import from here are re-exported.
"""
from __future__ import annotations

from pagedllm.entrypoints.http_common import error_body, sse

from .chat import ChatServing, render_chat
from .completions import CompletionServing
from .embeddings import EmbeddingServing, _encode_embedding
from .response_pieces import ResponseOptions
from .serving_base import RequestGroup, ServingError, check_fields, collect, response_id, start_streaming
from .tokenization import TokenizationServing

__all__ = ["OpenAIServing", "RequestGroup", "ResponseOptions", "ServingError", "_encode_embedding", "check_fields",
           "collect", "error_body", "render_chat", "response_id", "sse", "start_streaming"]


class OpenAIServing(CompletionServing, ChatServing, EmbeddingServing, TokenizationServing):
    """Completion, chat, embedding, tokenizer and legacy handlers over one AsyncLLMEngine."""
