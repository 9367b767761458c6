"""The tokeniser pool: its size (half the cores, never fewer than two threads nor more than eight), its
warm-up, and the chats that skip it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from streamsd.engine.info import EngineInfo
from streamsd.server.prompts import tokenizer_threads


@pytest.mark.parametrize("cores,threads", [(None, 2), (1, 2), (2, 2), (4, 2), (6, 3), (12, 6), (16, 8), (128, 8)])
def test_tokenizer_threads_follow_the_cores(cores, threads):
    assert tokenizer_threads(cores) == threads


def test_warm_runs_a_chat_prompt_on_every_thread_of_the_pool(tiny_model_dir):
    """Before the first request each of the pool's threads has started and encoded once (a thread's
    first encode is the slow one)."""
    from streamsd.engine.llm import LLM
    from streamsd.server.prompts import PromptEncoder

    core = LLM(str(tiny_model_dir), device="cpu").core
    encoder = PromptEncoder(core.text, EngineInfo.of(core))
    before = set(threading.enumerate())
    try:
        asyncio.run(encoder.warm())
        started = [t for t in threading.enumerate() if t not in before and t.name.startswith("streamsd-tokenize")]
        assert len(started) == encoder.threads
    finally:
        encoder.close()


def test_a_chat_of_seen_messages_is_tokenised_without_the_pool(tiny_model_dir):
    """A chat whose long messages were tokenised before is rendered and tokenised on the event loop:
    with the pool shut, it still gets the engine's ids, while a chat with a long new message (or more
    messages than are rendered inline) needs the pool."""
    from streamsd.engine.llm import LLM
    from streamsd.server.prompts import INLINE_MESSAGES, INLINE_NEW_CHARS, PromptEncoder
    from streamsd.server.protocol import ChatMessage

    core = LLM(str(tiny_model_dir), device="cpu").core
    timed: list[float] = []
    encoder = PromptEncoder(core.text, EngineInfo.of(core), observe=timed.append)
    system = "You answer in one short sentence, and only about the weather. " * 40
    first = [ChatMessage(role="system", content=system), ChatMessage(role="user", content="Is it raining?")]
    second = [first[0], ChatMessage(role="user", content="And tomorrow?")]
    fresh = [ChatMessage(role="system", content=system[::-1]), first[1]]
    many = [ChatMessage(role="user", content="hi")] * (INLINE_MESSAGES + 1)
    assert len(system) > INLINE_NEW_CHARS

    def want(chat: list[ChatMessage]) -> list[int]:
        return core.text.encode_chat([{"role": m.role, "content": m.text()} for m in chat])

    async def main() -> None:
        assert await encoder.chat(first, 8) == want(first)  # on the pool
        encoder.close()
        assert await encoder.chat(second, 8) == want(second)
        for chat in (fresh, many):
            with pytest.raises(RuntimeError, match="shutdown"):
                await encoder.chat(chat, 8)

    asyncio.run(main())
    assert len(timed) == 2


def test_a_short_text_prompt_is_tokenised_without_the_pool(tiny_model_dir):
    from streamsd.engine.llm import LLM
    from streamsd.server.prompts import INLINE_NEW_CHARS, PromptEncoder

    core = LLM(str(tiny_model_dir), device="cpu").core
    encoder = PromptEncoder(core.text, EngineInfo.of(core))
    encoder.close()
    short, long = "Once upon a time", "Once upon a time " * (INLINE_NEW_CHARS // 10)

    async def main() -> None:
        assert await encoder.text(short, 8) == core.text.encode_prompt(short)
        with pytest.raises(RuntimeError, match="shutdown"):
            await encoder.text(long, 8)

    asyncio.run(main())
