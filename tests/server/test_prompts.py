"""The tokeniser pool: its size (half the cores, never fewer than two threads nor more than eight), and
its warm-up."""

from __future__ import annotations

import asyncio
import threading

import pytest

from streamsd.server.prompts import tokenizer_threads


@pytest.mark.parametrize("cores,threads", [(None, 2), (1, 2), (2, 2), (4, 2), (6, 3), (12, 6), (16, 8), (128, 8)])
def test_tokenizer_threads_follow_the_cores(cores, threads):
    assert tokenizer_threads(cores) == threads


def test_warm_runs_a_chat_prompt_on_every_thread_of_the_pool(tiny_model_dir):
    """Before the first request each of the pool's threads has started and encoded once (a thread's
    first encode is the slow one)."""
    from streamsd.engine.llm import LLM
    from streamsd.server.prompts import PromptEncoder

    encoder = PromptEncoder(LLM(str(tiny_model_dir), device="cpu").core)
    before = set(threading.enumerate())
    try:
        asyncio.run(encoder.warm())
        started = [t for t in threading.enumerate() if t not in before and t.name.startswith("streamsd-tokenize")]
        assert len(started) == encoder.threads
    finally:
        encoder.close()
