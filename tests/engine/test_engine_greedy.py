"""Greedy speculation end to end on tiny random models: token for token the target's greedy answers."""

from __future__ import annotations

import pytest

from streamsd import LLM
from tests.engine.engine_helpers import MAX_TOKENS, PROMPTS, assert_free, greedy_params, hf_greedy


@pytest.mark.parametrize("k", [1, 4, 7])
def test_greedy_draft_model_is_token_identical(tiny_model_dir, close_draft_dir, reference, k):
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir), num_speculative_tokens=k)
    res = llm.generate(PROMPTS, greedy_params())
    assert [r.outputs[0].token_ids for r in res] == reference
    stats = [r.spec_stats for r in res]
    assert sum(s.accepted for s in stats) > 0 and sum(s.drafted - s.accepted for s in stats) > 0
    assert_free(llm)


def test_greedy_plain_and_ngram_and_random_draft_are_token_identical(tiny_model_dir, tiny_draft_dir, reference):
    for kw in ({}, {"speculative_method": "ngram"}, {"draft_model": str(tiny_draft_dir)}):
        llm = LLM(str(tiny_model_dir), **kw)
        res = llm.generate(PROMPTS, greedy_params())
        assert [r.outputs[0].token_ids for r in res] == reference, kw
        assert_free(llm)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_chains_gated_by_the_batch_stay_exact(tiny_model_dir, close_draft_dir, reference, method):
    """speculative_max_batch=2 with a chain proposer: plain steps while three or more decode (a draft
    model falls behind and catches up once the batch is down to two), the same text as plain decoding."""
    draft = str(close_draft_dir) if method == "draft" else None
    llm = LLM(str(tiny_model_dir), speculative_method=method, draft_model=draft, speculative_max_batch=2)
    res = llm.generate(PROMPTS, greedy_params())
    assert [r.outputs[0].token_ids for r in res] == reference
    drafted = [r.spec_stats.drafted for r in res]
    # the longest answer (30 tokens, counting) drafts once the batch is down to two; those ending while
    # three or more decode verify no drafts
    assert drafted[2] > 0
    if method == "draft":  # a close draft model, caught up, is accepted (n-gram guesses on this text fail)
        assert res[2].spec_stats.accepted > 0
    assert all(d == 0 for d, n in zip(drafted, MAX_TOKENS, strict=True) if n <= 17), drafted
    assert_free(llm)


def test_qwen2_target_with_llama_draft(qwen_target_dir, tiny_draft_dir):
    ref = hf_greedy(qwen_target_dir, PROMPTS, MAX_TOKENS)
    llm = LLM(str(qwen_target_dir), draft_model=str(tiny_draft_dir), num_speculative_tokens=3)
    assert [r.outputs[0].token_ids for r in llm.generate(PROMPTS, greedy_params())] == ref


def test_tiny_kv_pool_preempts_repeatedly_and_stays_exact(tiny_model_dir, close_draft_dir, reference):
    # 6 blocks of 16 tokens cannot hold all six requests at once: preemption by recompute.
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir), kv_cache_tokens=96)
    preempted_drafts: list[tuple[str, list[int]]] = []
    verified_after: list[tuple[str, list[int]]] = []
    sched = llm.core.scheduler
    original = sched._preempt

    def spy(r):
        preempted_drafts.append((r.request_id, list(r.draft_ids)))
        original(r)

    sched._preempt = spy
    step = llm.core.rt.worker.step

    def spy_step(plan):
        for e in plan.entries:
            if e.verifies and e.request.num_preemptions and e.num_drafts:
                verified_after.append((e.request.request_id, e.request.draft_ids[: e.num_drafts]))
        return step(plan)

    llm.core.rt.worker.step = spy_step
    res = llm.generate(PROMPTS, greedy_params())
    assert [r.outputs[0].token_ids for r in res] == reference
    assert len(preempted_drafts) >= 3
    # A preempted request verifies the very drafts it held when it was preempted.
    with_drafts = [(rid, d) for rid, d in preempted_drafts if d]
    assert with_drafts and any(pair in verified_after for pair in with_drafts)
    assert_free(llm)


@pytest.mark.parametrize("kw", [{"speculative_method": "ngram"}, {"draft_model": "close"}], ids=["ngram", "draft"])
def test_adaptive_policy_keeps_greedy_output_identical(tiny_model_dir, close_draft_dir, reference, kw):
    kw = {k: str(close_draft_dir) if v == "close" else v for k, v in kw.items()}
    llm = LLM(str(tiny_model_dir), speculation_policy="adaptive", **kw)
    res = llm.generate(PROMPTS * 2, greedy_params() * 2)
    assert [r.outputs[0].token_ids for r in res] == reference * 2
    policy = llm.core.scheduler.policy
    assert policy.record.steps > 0 and sum(policy.record.chosen_k.values()) > 0
    assert policy.record.last_measured > 0 and policy.cost.verify.keys  # profiled at start, corrected online
    assert_free(llm)
