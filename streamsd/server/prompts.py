"""Prompts to token ids, off the event loop.

Tokenising a megabyte of text takes seconds; on the loop it would freeze every stream and /health
meanwhile. Chat templates are rendered and text is tokenised on a small thread pool of its own
(tokenizers releases the GIL), and a prompt whose length in characters already proves it cannot
fit the context window is refused before any of that (token_bound.py).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from streamsd.engine.core import EngineCore
from streamsd.server.protocol import ChatMessage
from streamsd.server.state import ApiError
from streamsd.server.token_bound import max_chars_per_token

T = TypeVar("T")
TOKENIZER_THREADS = 2


class PromptEncoder:
    def __init__(self, core: EngineCore):
        from transformers import PreTrainedTokenizerFast  # loaded with the model; not before the port opens

        self.core = core
        self.max_len = core.scheduler.cfg.max_model_len
        tok = core.tokenizer
        self.chars_per_token = max_chars_per_token(tok.backend_tokenizer) \
            if isinstance(tok, PreTrainedTokenizerFast) else None
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="streamsd-tokenize")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def text(self, prompt: str, max_tokens: int) -> list[int]:
        self._check_length(len(prompt), max_tokens, "prompt")
        return await self._run(self.core.encode_prompt, prompt)

    async def chat(self, messages: list[ChatMessage], max_tokens: int) -> list[int]:
        return await self._run(self._chat, [{"role": m.role, "content": m.text()} for m in messages], max_tokens)

    def _chat(self, messages: list[dict[str, Any]], max_tokens: int) -> list[int]:
        """On the pool: render, refuse what cannot fit, tokenise."""
        try:
            text = self.core.render_chat(messages)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from exc
        except Exception as exc:  # chat templates raise their own errors for unsupported role orders
            raise ApiError(400, f"the chat template rejected these messages: {exc}", param="messages") from exc
        self._check_length(len(text), max_tokens, "messages")
        return self.core.encode_rendered_chat(text)

    def _check_length(self, chars: int, max_tokens: int, param: str) -> None:
        if self.chars_per_token is None:
            return
        least = math.ceil(chars / self.chars_per_token)
        if least + max_tokens > self.max_len:
            raise ApiError(400, f"prompt (at least {least} tokens) + max_tokens ({max_tokens}) exceeds the context "
                                f"window of {self.max_len} tokens", param=param, code="context_length_exceeded")

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
