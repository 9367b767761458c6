"""The start-up's warm-up requests (engine/warm_up.py) run every model's steps and leave nothing behind."""

from __future__ import annotations

import dataclasses

import pytest

from streamsd import LLM, SamplingParams
from streamsd.engine.warm_up import ALONE_TOKENS, NEW_TOKENS, warm_up, warm_up_prompt
from tests.engine.engine_helpers import hf_greedy

PROMPTS = ["The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12 13"]


@pytest.mark.parametrize("pipeline", [False, True])
def test_an_engine_starts_warmed_up_and_untouched(tiny_model_dir, close_draft_dir, pipeline):
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir), num_speculative_tokens=3, pipeline=pipeline)
    rt, sched = llm.core.rt, llm.core.scheduler
    worker = rt.worker
    draft = worker.proposer.draft_model()
    # The warm-up ran the target and the draft model: both caches hold what it wrote.
    assert worker.cache.data.abs().sum() > 0 and draft.cache.data.abs().sum() > 0
    # ... under a scheduler of its own: the engine's has seen nothing.
    assert sched.blocks.num_free == sched.blocks.total and sched.blocks.num_cached == 0
    assert (sched.blocks.queries, sched.blocks.hits) == (0, 0) and not sched.has_work
    assert llm.core.totals.drafted == 0 and worker.lookahead.queued is None
    # A first request reads none of it: the target's own greedy answer.
    got = llm.generate(PROMPTS, [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 2)
    assert [r.outputs[0].token_ids for r in got] == hf_greedy(str(tiny_model_dir), PROMPTS, [12, 12])
    assert sum(r.spec_stats.drafted for r in got) > 0


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_the_warm_up_drafts_and_frees_every_block(tiny_model_dir, close_draft_dir, method):
    """Run again on a built engine's worker: its requests (a pair, then one alone with speculation off
    and one with it) reach their ends in a few steps each, a draft model drafts for them (n-gram drafts
    only where the tiny model's answer repeats its prompt), and every block comes back (warm_up asserts
    that)."""
    draft = str(close_draft_dir) if method == "draft" else None
    llm = LLM(str(tiny_model_dir), speculative_method=method, draft_model=draft, num_speculative_tokens=3)
    rt = llm.core.rt
    warm = warm_up(rt.worker, rt.scheduler_config, llm.core.spec, rt.eos_ids, rt.q_slots)
    assert 3 * 2 <= warm.steps <= NEW_TOKENS + 2 * ALONE_TOKENS and warm.seconds > 0
    assert warm.drafted > 0 or method == "ngram"
    assert len(warm_up_prompt(rt.args.vocab_size)) > 16  # a prompt over two KV blocks


def test_an_engine_without_speculation_warms_up_plain(tiny_model_dir):
    llm = LLM(str(tiny_model_dir))
    rt = llm.core.rt
    warm = warm_up(rt.worker, rt.scheduler_config, llm.core.spec, rt.eos_ids, rt.q_slots)
    assert warm.drafted == 0 and warm.steps == NEW_TOKENS + ALONE_TOKENS  # the pair, then one alone: a token a step


def test_an_engine_with_a_small_pool_warms_up(tiny_model_dir):
    """The warm-up fits the smallest pool an engine accepts (its two requests take turns there)."""
    llm = LLM(str(tiny_model_dir), speculative_method="ngram", num_speculative_tokens=2, kv_cache_tokens=64)
    got = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert got[0].outputs[0].token_ids == hf_greedy(str(tiny_model_dir), PROMPTS[:1], [8])[0]


def test_a_server_admitting_one_waiting_request_warms_up(tiny_model_dir):
    """The warm-up's two requests are not held to the engine's queue bound (`--max-queue 1`)."""
    from streamsd.config import EngineConfig, SpecConfig
    from streamsd.engine.builder import build_runtime

    rt = build_runtime(EngineConfig(model=str(tiny_model_dir), spec=SpecConfig(method="ngram"), device="cpu",
                                    max_queue=1))
    assert rt.scheduler_config.max_queue == 1


def test_the_requests_alone_take_a_real_chats_prompt_where_it_fits(tiny_model_dir, tiny_tokenizer):
    """The requests alone prefill the model's chat template around a short message (a first chat
    request's shape), and the synthetic prompt where the model has no template or the chat does not fit."""
    from streamsd.engine.warm_up import CHAT_MESSAGE, _fits, warm_up_chat_prompt
    from streamsd.model.tokenizer import read_tokenizer

    ours = read_tokenizer(tiny_model_dir)
    chat = warm_up_chat_prompt(ours, None)
    text = tiny_tokenizer.apply_chat_template([{"role": "user", "content": CHAT_MESSAGE}], tokenize=False,
                                              add_generation_prompt=True)
    assert chat == list(tiny_tokenizer.encode(text, add_special_tokens=False)) and len(chat) > 16
    assert warm_up_chat_prompt(ours, "{{ messages[0]['content'] }}") == list(
        tiny_tokenizer.encode(CHAT_MESSAGE, add_special_tokens=False))
    llm = LLM(str(tiny_model_dir))
    rt = llm.core.rt
    assert _fits(chat, rt.scheduler_config, 0)
    assert not _fits(chat, dataclasses.replace(rt.scheduler_config, max_model_len=len(chat)), 0)
    # With the chat prompt the warm-up still runs the pair, then a request alone, a token a step, and
    # frees every block (warm_up asserts that)
    warm = warm_up(rt.worker, rt.scheduler_config, llm.core.spec, rt.eos_ids, rt.q_slots, chat)
    assert warm.steps == NEW_TOKENS + ALONE_TOKENS
    assert rt.worker.cache.data.abs().sum() > 0
