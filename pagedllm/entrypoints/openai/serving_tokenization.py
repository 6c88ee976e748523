"""POST /tokenize, POST /detokenize (vLLM's request and response shapes) and GET
/tokenizer_info (what lm-eval's remote tokenizer reads: the tokenizer's class, special tokens,
chat template and limits)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from pagedllm.entrypoints.openai.protocol import (
    APIError,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_engine import parse_body


class OpenAIServingTokenization:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat  # its template rendering and tokenizer

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        chat = self.chat
        chat.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            conversation = [chat._message(m, i) for i, m in enumerate(req.messages)]
            text = await chat.run_in_executor(chat._render, conversation, req)
            add_special = False  # the template has them
        else:
            text, add_special = req.prompt, req.add_special_tokens
        ids = await chat.tokenize(text, add_special_tokens=add_special)
        strs = None
        if req.return_token_strs:
            strs = await chat.run_in_executor(lambda: list(chat.tokenizer.convert_ids_to_tokens(ids)))
        return TokenizeResponse(count=len(ids), max_model_len=chat.max_model_len, tokens=ids,
                                token_strs=strs).model_dump(exclude_none=True)

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        chat = self.chat
        chat.check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < chat.vocab_size), None)
        if bad is not None:
            raise APIError(f"token id {bad} is out of vocabulary (size {chat.vocab_size})", param="tokens")
        return DetokenizeResponse(prompt=await chat.detokenize(req.tokens)).model_dump()

    def tokenizer_info(self) -> dict[str, Any]:
        tok = self.chat.tokenizer
        info: dict[str, Any] = {
            "tokenizer_class": type(tok).__name__,
            "model_max_length": self.chat.max_model_len,
            "vocab_size": self.chat.vocab_size,
            "chat_template": self.chat.chat_template or getattr(tok, "chat_template", None),
        }
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = getattr(tok, name, None)
            if isinstance(value, str):
                info[name] = value
        info["added_tokens_decoder"] = {
            str(i): {"content": t.content, "special": t.special}
            for i, t in getattr(tok, "added_tokens_decoder", {}).items()
        }
        return info


def add_tokenization_routes(app: FastAPI, serving: OpenAIServingTokenization) -> None:
    @app.post("/tokenize")
    async def tokenize(raw_request: Request) -> dict[str, Any]:
        return await serving.tokenize(await parse_body(raw_request, TokenizeRequest))

    @app.post("/detokenize")
    async def detokenize(raw_request: Request) -> dict[str, Any]:
        return await serving.detokenize(await parse_body(raw_request, DetokenizeRequest))

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return serving.tokenizer_info()
