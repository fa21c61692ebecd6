"""``POST /tokenize``, ``POST /detokenize`` and ``GET /v1/models``."""
from __future__ import annotations

from fastapi import APIRouter, Request

from .chat import image_urls, render_chat
from .protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from .serving_base import ERROR_RESPONSES, ServingBase, ServingError, check_fields, serving_of

router = APIRouter()


class TokenizationServing(ServingBase):
    """The tokenizer's endpoints (on tokenizer threads) and the model list."""

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """``POST /tokenize``: on a tokenizer thread (a 4 MiB body takes seconds)."""
        self.check_model(req.model)
        check_fields(req)
        if (req.prompt is None) == (req.messages is None):
            raise ServingError("give exactly one of prompt or messages", 400, "prompt")
        if req.messages is not None and (image_urls(req.messages) or image_urls(req.messages, "video_url")):
            raise ServingError("/tokenize does not process images or videos: image_url / video_url parts expand to a "
                               "number of tokens only the model's processor computes (the chat completion's usage "
                               "reports it)", 400, "messages")
        if req.messages is not None:  # rendered and encoded in one tokenizer-thread job (one hop, not two)
            ids = await self.engine.with_tokenizer(lambda tokenizer: _encode(tokenizer, render_chat(
                tokenizer, self.chat_template, req.messages, req.add_generation_prompt,
                content_format=self.chat_options.chat_template_content_format), False, "messages"))
        else:
            ids = await self.engine.with_tokenizer(
                lambda tokenizer: _encode(tokenizer, req.prompt, req.add_special_tokens, "prompt"))
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.model_config.max_model_len)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """``POST /detokenize``: on a tokenizer thread."""
        self.check_model(req.model)
        check_fields(req)
        self.check_token_ids(req.tokens, "tokens")
        text = await self.engine.with_tokenizer(lambda tokenizer: tokenizer.decode(req.tokens))
        return DetokenizeResponse(prompt=text)

    def models(self) -> ModelList:
        """The served names, then the LoRA adapters (with their ``parent``)."""
        cards = [ModelCard(id=name, root=self.model_config.model, max_model_len=self.model_config.max_model_len)
                 for name in self.served_model_names]
        if self.lora_models is not None:
            cards += self.lora_models.cards(self.model_config.max_model_len)
        return ModelList(data=cards)


def _encode(tokenizer, text: str, add_special_tokens: bool, param: str) -> list[int]:
    """/tokenize: no length bound (it reports the count against max_model_len)."""
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except (TypeError, ValueError) as exc:
        raise ServingError(f"cannot tokenize {param}: {exc}", 400, param) from None



@router.get("/v1/models")
async def show_models(raw: Request):
    return serving_of(raw).models()


@router.post("/tokenize", responses=ERROR_RESPONSES)
async def tokenize(request: TokenizeRequest, raw: Request):
    return await serving_of(raw).tokenize(request)


@router.post("/detokenize", responses=ERROR_RESPONSES)
async def detokenize(request: DetokenizeRequest, raw: Request):
    return await serving_of(raw).detokenize(request)
