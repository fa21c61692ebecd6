"""A request's prompt blocks, hashed as the replica's engine will hash them.

The router tokenizes with the replicas' tokenizer and renders chat messages with the server's own
function (``openai_common.render_chat``, the same template choice: the request's, else the one the
replicas were started with, else the tokenizer's), then chains ``prefix_hash.extend_block_hashes``
over the token ids with the replicas' block size. For a pagedllm replica these are the very hashes
its prefix cache looks up; for another server they are a consistent key for the same prefix.
"""
from __future__ import annotations

import logging
from typing import Any

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from pagedllm.entrypoints.openai_common import render_chat, template_options
from pagedllm.kv_cache.prefix_hash import extend_block_hashes

logger = logging.getLogger(__name__)

# paths whose body carries a prompt the router can key on; others are routed by load alone
HASHED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")
# a longer prompt is keyed on its first this-many characters (bounded work on the router's thread);
# the block the cut falls in is dropped, since the cut may have changed its tokens
MAX_HASHED_CHARS = 65536


class PromptHasher:
    """Block hashes of a request body's prompt; not thread-safe (call from one thread)."""

    def __init__(self, tokenizer, block_size: int, chat_template: str | None = None):
        self.tokenizer, self.block_size, self.chat_template = tokenizer, block_size, chat_template

    @classmethod
    def load(cls, name: str, block_size: int, chat_template: str | None = None,
             trust_remote_code: bool = False) -> PromptHasher:
        from transformers import AutoTokenizer
        return cls(AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code), block_size,
                   chat_template)

    def block_hashes(self, path: str, data: Any, adapter: str | None = None) -> list[bytes]:
        """The chained hashes of the prompt's full blocks, from the request's parsed JSON body
        ``data`` (None when it did not parse); [] for a body the router cannot key on. ``adapter``:
        the LoRA adapter it runs with, mixed in (the replica keys its blocks by the adapter too, by
        an id the router does not know: the name is the router's consistent stand-in).

        Routing is advice: a body that does not parse or render is routed by load, and the replica
        answers it (with the proper 400) as it would without a router."""
        if path not in HASHED_PATHS or data is None:
            return []
        try:
            ids = self.prompt_ids(path, data)
        except Exception as exc:  # any parse/validation/template error: the replica will judge the request
            logger.debug("no prefix key for a %s body: %s", path, exc)
            return []
        hashes: list[bytes] = []
        salt = data.get("cache_salt") if isinstance(data, dict) else None
        # the replica mixes a request's cache_salt and adapter into every block hash (kv_cache_manager)
        extra = ((salt,) if isinstance(salt, str) and salt else ()) + ((("lora", adapter),) if adapter else ())
        extend_block_hashes(hashes, ids, self.block_size, extra)
        return hashes

    def prompt_ids(self, path: str, data: Any) -> list[int]:
        if path == "/v1/chat/completions":
            req = ChatCompletionRequest.model_validate(data)
            text = render_chat(self.tokenizer, self.chat_template, req.messages, req.add_generation_prompt,
                               **template_options(req))
            return self._encode(text, req.add_special_tokens)
        req = (EmbeddingRequest if path == "/v1/embeddings" else CompletionRequest).model_validate(data)
        prompt = req.input if path == "/v1/embeddings" else req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch: keyed on its first prompt
        return list(prompt) if isinstance(prompt, list) else self._encode(prompt, req.add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = self.tokenizer.encode(text[:MAX_HASHED_CHARS], add_special_tokens=add_special_tokens)
        if len(text) > MAX_HASHED_CHARS:
            ids = ids[:max(0, (len(ids) // self.block_size - 1) * self.block_size)]
        return ids
