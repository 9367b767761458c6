"""Prefix caching end to end on tiny models: the same text with and without it (plain decoding and every
proposer, greedy and seeded sampling), blocks shared by reference, eviction, preemption and abort."""

from __future__ import annotations

import pytest

from streamsd import LLM, SamplingParams
from tests.engine.engine_helpers import PROMPTS
from tests.tiny import CORPUS

QUESTIONS = [
    "Speculative decoding proposes tokens with a cheap draft and verifies them with the target model at once.",
    " Why does the target accept some drafts?",
    " And what happens to the rejected ones?",
    " Say it again in fewer words.",
    " Thanks. One more question, about caches.",
]


@pytest.fixture(scope="module")
def eagle_head(tiny_model_dir, tmp_path_factory):
    from tests.spec_decode.eagle_helpers import train_tiny_head

    return train_tiny_head(tiny_model_dir, tmp_path_factory.mktemp("prefix_head"), "eagle3", epochs=5)


def _engine(model_dir, method: str, draft_dir, head_dir, cache: bool, **kw) -> LLM:
    spec = {"plain": {}, "ngram": {"speculative_method": "ngram"},
            "draft": {"draft_model": str(draft_dir)},
            "eagle": {"speculative_method": "eagle", "draft_model": str(head_dir)},
            # the head's chains queued behind each verify (worker/lookahead.py), and draft trees
            "eagle-pipelined": {"speculative_method": "eagle", "draft_model": str(head_dir), "pipeline": True},
            "eagle-tree": {"speculative_method": "eagle", "draft_model": str(head_dir), "speculative_tree": "3,2,2,6"},
            }[method]
    return LLM(str(model_dir), enable_prefix_caching=cache, **spec, **kw)


def _chat(llm: LLM, params: SamplingParams) -> tuple[list[list[int]], list[int], list[int]]:
    """Five turns, each prompt the previous prompt, its answer and a new question: (answers, cached
    tokens, drafts accepted) per turn."""
    tok = llm.tokenizer
    prompt: list[int] = []
    answers, cached, accepted = [], [], []
    for q in QUESTIONS:
        prompt = prompt + tok.encode(q, add_special_tokens=not prompt)
        res = llm.generate([prompt], params)[0]
        answers.append(res.outputs[0].token_ids)
        cached.append(res.num_cached_tokens)
        accepted.append(res.spec_stats.accepted)
        prompt = prompt + res.outputs[0].token_ids
    return answers, cached, accepted


def _assert_released(llm: LLM, caching: bool) -> None:
    s = llm.core.scheduler
    pool = s.blocks
    assert not s.running and not s.waiting and not llm.core.trackers
    assert pool.num_free == pool.total, "KV blocks leaked"
    assert all(pool.refs(b) == 0 for b in range(pool.total))
    assert len(s.q_slots_free) == s.q_slots_total, "q slots leaked"
    if not caching:
        assert pool.num_unused == pool.total and pool.num_cached == 0


@pytest.mark.parametrize("method", ["plain", "ngram", "draft", "eagle", "eagle-pipelined", "eagle-tree"])
def test_a_five_turn_chat_is_token_identical_with_and_without_the_prefix_cache(
        tiny_model_dir, close_draft_dir, request, method):
    head = request.getfixturevalue("eagle_head") if method.startswith("eagle") else None
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    runs = {}
    for cache in (False, True):
        llm = _engine(tiny_model_dir, method, close_draft_dir, head, cache)
        runs[cache] = _chat(llm, params)
        _assert_released(llm, cache)
        if cache:
            assert llm.core.scheduler.blocks.num_cached > 0
    assert runs[True][0] == runs[False][0]
    # A drafter's KV over the cached blocks is what it would have computed itself: the same drafts pass.
    assert runs[True][2] == runs[False][2]
    if method not in ("plain", "ngram"):  # n-gram guesses on this text fail
        assert sum(runs[True][2]) > 0
    assert runs[False][1] == [0] * 5
    # every later turn finds the earlier turns' full blocks cached (all but the last prompt token's block)
    assert runs[True][1][0] == 0 and all(c >= 16 for c in runs[True][1][1:]), runs[True][1]
    assert all(c % 16 == 0 for c in runs[True][1])


@pytest.mark.parametrize("method", ["plain", "ngram", "draft", "eagle", "eagle-tree"])
def test_seeded_sampling_is_identical_with_and_without_the_prefix_cache(tiny_model_dir, close_draft_dir, request,
                                                                        method):
    head = request.getfixturevalue("eagle_head") if method.startswith("eagle") else None
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=11, ignore_eos=True)
    runs = [_chat(_engine(tiny_model_dir, method, close_draft_dir, head, cache), params) for cache in (False, True)]
    assert runs[0][0] == runs[1][0]
    assert sum(runs[1][1]) > 0


def test_two_requests_sharing_a_prefix_share_its_blocks_then_release_them(tiny_model_dir, close_draft_dir):
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir))
    core, sched = llm.core, llm.core.scheduler
    shared = llm.tokenizer.encode(CORPUS[0] + CORPUS[1])[:50]  # three full blocks and two tokens
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    a = core.add_request("a", shared + [5, 6, 7], greedy)
    core.step()  # a's prompt computed (target and draft): its full blocks are cached
    assert a.prefix_blocks == 3
    b = core.add_request("b", shared + [9, 8], greedy)
    core.step()
    assert b.cached_tokens == 48 and b.blocks[:3] == a.blocks[:3]
    assert [sched.blocks.refs(x) for x in a.blocks[:3]] == [2, 2, 2]
    assert b.blocks[3] != a.blocks[3]  # the block holding the rest is private
    while core.has_work:
        core.step()
    _assert_released(llm, True)
    assert sched.blocks.num_cached >= 3 and sched.blocks.num_unused < sched.blocks.total
    assert sched.blocks.queries == len(a.prompt_ids) + len(b.prompt_ids) and sched.blocks.hits == 48
    # the same requests without a cache write the same tokens
    plain = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir), enable_prefix_caching=False)
    outs = plain.generate([a.prompt_ids, b.prompt_ids], greedy)
    assert [o.outputs[0].token_ids for o in outs] == [a.output_ids, b.output_ids]
    _assert_released(plain, False)


def test_a_small_pool_evicts_the_least_recently_released_prefix(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_cache_tokens=128)  # 8 blocks
    pool = llm.core.scheduler.blocks
    tok = llm.tokenizer
    prompts = [tok.encode(text * 3)[:70] for text in CORPUS[:4]]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    first = [r.outputs[0].token_ids for r in llm.generate(prompts, greedy)]  # one after another, or some at once
    assert pool.num_cached <= pool.total
    again = llm.generate(prompts[-1:], greedy)[0]  # the last released prefix is still cached
    assert again.num_cached_tokens == 64 and again.outputs[0].token_ids == first[-1]
    evicted = llm.generate(prompts[:1], greedy)[0]  # the first one's blocks went to the later prompts
    assert evicted.num_cached_tokens == 0 and evicted.outputs[0].token_ids == first[0]
    _assert_released(llm, True)
    plain = LLM(str(tiny_model_dir), kv_cache_tokens=128, enable_prefix_caching=False)
    assert [r.outputs[0].token_ids for r in plain.generate(prompts, greedy)] == first


@pytest.mark.parametrize("method", ["draft", "eagle", "eagle-tree"])
def test_preempting_requests_that_hold_shared_blocks_stays_exact_and_leaks_nothing(
        tiny_model_dir, close_draft_dir, request, method):
    head = request.getfixturevalue("eagle_head") if method.startswith("eagle") else None
    tok_prefix = None
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = {}
    for cache in (False, True):
        llm = _engine(tiny_model_dir, method, close_draft_dir, head, cache, kv_cache_tokens=192)  # 12 blocks
        core = llm.core
        tok_prefix = llm.tokenizer.encode(CORPUS[2] * 2)[:40]
        core.add_request("first", tok_prefix + [3], greedy)
        core.step()
        for i in range(4):  # every other one decodes with the target alone: its drafter lags behind
            params = greedy if i % 2 == 0 else SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                              speculative=False)
            core.add_request(f"r{i}", tok_prefix + [10 + i, 20 + i], params)
        reqs = [t.request for t in core.trackers.values()]
        preempted_holding_shared = 0
        while core.has_work:
            holding = {id(r): any(core.scheduler.blocks.refs(b) > 1 for b in r.blocks) for r in reqs}
            plan, aborted = core._schedule()
            preempted_holding_shared += sum(holding[id(r)] for r in plan.preempted)
            core.postprocess(plan, core.execute(plan), aborted)
        outs[cache] = [r.output_ids for r in reqs]
        assert sum(r.num_preemptions for r in reqs) > 0
        if cache:
            assert preempted_holding_shared > 0
            assert sum(r.cached_tokens for r in reqs) >= 4 * 32
        _assert_released(llm, cache)
    assert outs[True] == outs[False]


def test_aborting_a_request_that_shares_blocks_releases_only_its_references(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), speculative_method="ngram")
    core, pool = llm.core, llm.core.scheduler.blocks
    prefix = llm.tokenizer.encode(CORPUS[3] * 2)[:36]
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    a = core.add_request("a", prefix + [1], greedy)
    core.step()
    b = core.add_request("b", prefix + [2, 3], greedy)
    core.step()
    shared = b.blocks[:2]
    assert shared == a.blocks[:2] and [pool.refs(x) for x in shared] == [2, 2]
    core.abort("b")
    outs = core.step()
    assert any(o.request_id == "b" and o.finish_reason == "cancelled" for o in outs)
    assert not b.blocks and [pool.refs(x) for x in shared] == [1, 1]
    while core.has_work:
        core.step()
    _assert_released(llm, True)
    plain = LLM(str(tiny_model_dir), speculative_method="ngram", enable_prefix_caching=False)
    assert plain.generate([a.prompt_ids], greedy)[0].outputs[0].token_ids == a.output_ids


@pytest.mark.parametrize("method", ["draft", "eagle", "eagle-tree"])
def test_blocks_the_drafter_never_computed_are_a_hit_and_the_drafter_catches_up_on_them(
        tiny_model_dir, close_draft_dir, eagle_head, method):
    """A request that does not speculate decodes with the target alone: the drafter (a draft model's
    cache, an EAGLE head's) never sees its answer. A speculating request that continues that answer
    takes the target's blocks all the same, and its drafter catches up on them: the same tokens and
    the same drafts accepted as without a cache."""
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    runs = []
    for cache in (False, True):
        llm = _engine(tiny_model_dir, method, close_draft_dir, eagle_head, cache)
        prompt = llm.tokenizer.encode(PROMPTS[4])  # one the head learnt the answers to
        first = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True,
                                                      speculative=False))[0]
        follow = prompt + first.outputs[0].token_ids + [7, 8, 9]
        res = llm.generate([follow], greedy)[0]
        runs.append((res.outputs[0].token_ids, res.spec_stats.accepted, res.num_cached_tokens))
        _assert_released(llm, cache)
    (plain_ids, plain_acc, _), (ids, acc, cached) = runs
    assert ids == plain_ids and acc == plain_acc and plain_acc > 0
    # Every full block of the first request's tokens (the last one, partial, was never cached), though
    # the drafter computed none of them.
    known = len(prompt) + 48 - 1  # its last token was sampled, never computed
    assert cached == known // 16 * 16, (cached, known)


def test_an_eagle_heads_block_is_a_hit_only_when_the_token_after_it_matches_too(tiny_model_dir, eagle_head):
    """The head's slot t holds (target stream h_t, token t + 1): a prompt that leaves another one's
    tokens exactly at a block boundary cannot take the block before it, whose last slot read the
    other prompt's next token. The target alone could; with the head it is recomputed."""
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    runs = []
    for cache in (False, True):
        llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(eagle_head),
                  enable_prefix_caching=cache)
        prompt = llm.tokenizer.encode(PROMPTS[4])  # one the head learnt the answers to
        other = prompt[:32] + [(prompt[32] + 1) % 300] + prompt[33:]  # two whole blocks, then another token
        llm.generate([other], greedy)
        res = llm.generate([prompt], greedy)[0]
        runs.append((res.outputs[0].token_ids, res.spec_stats.accepted, res.num_cached_tokens))
        _assert_released(llm, cache)
    (plain_ids, plain_acc, _), (ids, acc, cached) = runs
    assert ids == plain_ids and acc == plain_acc and plain_acc > 0
    assert cached == 16


@pytest.mark.parametrize("method", ["plain", "ngram", "draft", "eagle-tree"])
def test_a_request_answered_in_its_first_step_leaves_its_prompt_cached(tiny_model_dir, close_draft_dir, request,
                                                                        method):
    head = request.getfixturevalue("eagle_head") if method.startswith("eagle") else None
    llm = _engine(tiny_model_dir, method, close_draft_dir, head, True)
    prompt = llm.tokenizer.encode(CORPUS[0] + CORPUS[1])[:50]  # three full blocks and two tokens
    one = SamplingParams(temperature=0.0, max_tokens=1)
    first = llm.generate([prompt], one)[0]
    again = llm.generate([prompt], one)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 48
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    _assert_released(llm, True)
