"""Prompts to token ids, off the event loop.

Tokenising a megabyte of text takes seconds; on the loop it would freeze every stream and /health
meanwhile. Chat templates are rendered and text is tokenised on a thread pool of its own, sized by the
cores (tokenizers releases the GIL while it encodes: a burst of long prompts, such as 32 chats sharing a
2,000-token system prompt, would otherwise queue behind two threads for tens of milliseconds before the
engine sees the last of them), and a prompt whose length in characters already proves it cannot fit
the context window is refused before any of that (token_bound.py). A chat of a few messages whose long
ones were tokenised before (the piece cache, engine/pieces.py) skips the pool: rendering it and
tokenising its new characters takes less of the loop than the hop to a thread and back.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from streamsd.config import helper_threads
from streamsd.engine.info import EngineInfo
from streamsd.engine.text import ChatText
from streamsd.engine.warm_up import CHAT_MESSAGE
from streamsd.request import ParamError
from streamsd.server.protocol import ChatMessage
from streamsd.server.state import ApiError
from streamsd.server.token_bound import max_chars_per_token

# A chat is rendered on the event loop when it has at most INLINE_MESSAGES messages of INLINE_CHARS
# characters in all (~0.1 ms of template for 10,000 characters on a 2-core EPYC), and tokenised there
# when at most INLINE_NEW_CHARS of it are new to the piece cache (0.3 ms), as is a text prompt of at
# most that many characters; the rest goes to the pool.
INLINE_MESSAGES = 16
INLINE_CHARS = 32_768
INLINE_NEW_CHARS = 512

T = TypeVar("T")
Tokenized = tuple[list[int], list[str] | None]  # the ids, and their token strings when asked for
Observe = Callable[[float], None]


def tokenizer_threads(cores: int | None) -> int:
    """`helper_threads`, and at least 2: one long prompt must not hold up every other."""
    return max(2, helper_threads(cores))


class PromptEncoder:
    def __init__(self, text: ChatText, info: EngineInfo, observe: Observe | None = None):
        """`observe`: called with the seconds each prompt took from its request to its token ids (waiting
        for a thread, rendering, tokenising), for the server's metrics."""
        self.chat_text = text
        self.max_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.chars_per_token = max_chars_per_token(text.tokenizer.backend_tokenizer)
        self.observe = observe
        # The first render of a chat template compiles it (4 ms on a CPU core), once per process: the
        # engine's warm-up has rendered this one (engine/warm_up.py, warm_up_chat_prompt).
        self.threads = tokenizer_threads(os.cpu_count())
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="streamsd-tokenize")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def warm(self) -> None:
        """One chat prompt through each of the pool's threads, before the first request: a thread's first
        render and encode took 1.7 ms against 0.4-0.7 ms for its later ones (its start, the tokenizer's
        state per thread), which landed in the first requests' time to first token."""
        barrier = threading.Barrier(self.threads)
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self._pool, self._warm_one, barrier) for _ in range(self.threads)))

    def _warm_one(self, barrier: threading.Barrier) -> None:
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=10)  # holds each thread until all are started: every thread takes one
        try:
            self.chat_text.encode_chat([{"role": "user", "content": CHAT_MESSAGE}])
        except ParamError:  # a model without a chat template: the completions routes' encoding only
            self.chat_text.encode_prompt(CHAT_MESSAGE)

    async def text(self, prompt: str, max_tokens: int) -> list[int]:
        self._check_length(len(prompt), max_tokens, "prompt")
        start = time.monotonic()
        if len(prompt) <= INLINE_NEW_CHARS:  # tokenised here, as a chat's few new characters are
            ids = self.chat_text.encode_prompt(prompt)
        else:
            ids = await self._run(self.chat_text.encode_prompt, prompt)
        return self._observed(start, ids)

    async def chat(self, messages: list[ChatMessage], max_tokens: int) -> list[int]:
        dicts = _as_dicts(messages)
        start = time.monotonic()
        if len(dicts) > INLINE_MESSAGES or sum(len(m["content"]) for m in dicts) > INLINE_CHARS:
            return self._observed(start, await self._run(self._chat, dicts, max_tokens))
        # A chat whose long messages were seen before (the system prompt, the turns before this one) is
        # rendered and its few new characters tokenised right here: the hop to a thread and back cost
        # ~5 ms of waiting at 32 concurrent requests, for ~0.1 ms of work.
        text = self._rendered(dicts, max_tokens)
        ids = self.chat_text.encode_rendered_chat_within(text, INLINE_NEW_CHARS)
        if ids is None:
            ids = await self._run(self.chat_text.encode_rendered_chat, text)
        return self._observed(start, ids)

    def _chat(self, messages: list[dict[str, Any]], max_tokens: int) -> list[int]:
        """On the pool: render, refuse what cannot fit, tokenise."""
        return self.chat_text.encode_rendered_chat(self._rendered(messages, max_tokens))

    def _rendered(self, messages: list[dict[str, Any]], max_tokens: int) -> str:
        """The chat rendered for a reply, refused when its characters prove it cannot fit."""
        text = self._render(messages, add_generation_prompt=True)
        self._check_length(len(text), max_tokens, "messages")
        return text

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        try:
            return self.chat_text.render_chat(messages, add_generation_prompt)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from exc
        except Exception as exc:  # chat templates raise their own errors for unsupported role orders
            raise ApiError(400, f"the chat template rejected these messages: {exc}", param="messages") from exc

    # -- /tokenize and /detokenize: no context bound, the caller asks about the text itself ------
    async def tokenize_text(self, prompt: str, add_special_tokens: bool, with_strs: bool) -> Tokenized:
        return await self._run(self._tokenize, prompt, add_special_tokens, with_strs)

    async def tokenize_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                            add_special_tokens: bool, with_strs: bool) -> Tokenized:
        def run() -> Tokenized:
            text = self._render(_as_dicts(messages), add_generation_prompt)
            return self._tokenize(text, add_special_tokens, with_strs)

        return await self._run(run)

    def _tokenize(self, text: str, add_special_tokens: bool, with_strs: bool) -> Tokenized:
        tok = self.chat_text.tokenizer
        ids = list(tok.encode(text, add_special_tokens=add_special_tokens))
        return ids, (list(tok.convert_ids_to_tokens(ids)) if with_strs else None)

    async def detokenize(self, ids: list[int]) -> str:
        return await self._run(self._decode, ids)

    def _decode(self, ids: list[int]) -> str:
        vocab = self.vocab_size
        if any(t >= vocab for t in ids):  # negative ids are refused by the wire type
            raise ApiError(400, f"tokens must be token ids in [0, {vocab})", param="tokens")
        return self.chat_text.tokenizer.decode(ids)

    def _check_length(self, chars: int, max_tokens: int, param: str) -> None:
        if self.chars_per_token is None:
            return
        least = math.ceil(chars / self.chars_per_token)
        if least + max_tokens > self.max_len:
            raise ApiError(400, f"prompt (at least {least} tokens) + max_tokens ({max_tokens}) exceeds the context "
                                f"window of {self.max_len} tokens", param=param, code="context_length_exceeded")

    def _observed(self, start: float, ids: list[int]) -> list[int]:
        if self.observe is not None:
            self.observe(time.monotonic() - start)
        return ids

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)


def _as_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [{"role": m.role, "content": m.text()} for m in messages]
