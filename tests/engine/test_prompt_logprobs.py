"""Prompt logprobs (SamplingParams.prompt_logprobs) on tiny models: every prompt token's logprob and
top alternatives equal a plain transformers forward's log_softmax, however the prefill is chunked,
with speculation on, next to requests that score nothing, and whatever the prefix cache holds."""

from __future__ import annotations

import pytest
import torch

from streamsd import LLM, SamplingParams
from tests.tiny import CORPUS, hf_logprobs

PROMPT = " ".join(CORPUS[:4])


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return hf_logprobs(tiny_model_dir)


def _check(scored, ids: list[int], expected: torch.Tensor, top: int) -> None:
    assert scored[0] is None and len(scored) == len(ids)
    for p in range(1, len(ids)):
        logprob, alternatives = scored[p]
        assert logprob == pytest.approx(expected[p - 1, ids[p]].item(), abs=1e-4)
        vals, tops = expected[p - 1].topk(top)
        assert [t for t, _ in alternatives] == tops.tolist()
        assert [v for _, v in alternatives] == pytest.approx(vals.tolist(), abs=1e-4)


@pytest.mark.parametrize("chunk", [16, 2048], ids=["chunked-prefill", "one-chunk"])
def test_prompt_logprobs_equal_a_plain_forward_with_speculation_and_a_neighbour(tiny_model_dir, close_draft_dir,
                                                                                reference, chunk):
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir), num_speculative_tokens=3,
              max_num_batched_tokens=chunk)
    ids = llm.tokenizer.encode(PROMPT)
    assert len(ids) > 3 * 16
    scored, plain = llm.generate([ids, ids[:20]], [SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=3),
                                                   SamplingParams(max_tokens=6, temperature=0)])
    _check(scored.prompt_logprobs, ids, reference(ids), 3)
    assert plain.prompt_logprobs is None
    alone = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0))[0]
    assert scored.outputs[0].token_ids == alone.outputs[0].token_ids  # scoring changes no answer


def test_a_request_scoring_its_prompt_takes_no_prefix_cache_hits(tiny_model_dir, reference):
    llm = LLM(str(tiny_model_dir), max_num_batched_tokens=32)
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=2, temperature=0)
    llm.generate([ids], params)
    scored = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))[0]
    assert scored.num_cached_tokens == 0
    _check(scored.prompt_logprobs, ids, reference(ids), 0)
    assert llm.generate([ids], params)[0].num_cached_tokens > 0  # the cache still serves the others


def test_prompt_logprobs_survive_preemption_by_recompute(tiny_model_dir, close_draft_dir, reference):
    # 6 blocks of 16 tokens cannot hold four prompts of 20-40 tokens and their answers at once.
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir), kv_cache_tokens=96, max_num_batched_tokens=16)
    prompts = [llm.tokenizer.encode(text)[:40] for text in CORPUS[:4]]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, prompt_logprobs=1)
    requests = [llm.core.add_request(f"r{i}", ids, params) for i, ids in enumerate(prompts)]
    scored: dict[str, list] = {}
    while llm.core.has_work:
        for out in llm.core.step():
            assert out.request_id not in scored or out.prompt_logprobs is None  # once, with the first output
            if out.prompt_logprobs is not None:
                scored[out.request_id] = [None, *out.prompt_logprobs]
    assert sum(r.num_preemptions for r in requests) >= 2
    for ids, r in zip(prompts, requests, strict=True):
        _check(scored[r.request_id], ids, reference(ids), 1)


def test_max_tokens_0_scores_the_prompt_and_generates_nothing(tiny_model_dir, close_draft_dir, reference):
    """A prompt-only request beside generating ones, with speculation on: its scores as a plain forward's,
    no token, finished by length, its blocks released. Where the drafter keeps no KV of its own (n-gram),
    they are cached for later requests too."""
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir), num_speculative_tokens=3)
    ids = llm.core.text.encode_prompt(PROMPT)
    only, other = llm.generate([PROMPT, "Once upon a time"],
                               [SamplingParams(max_tokens=0, prompt_logprobs=2, temperature=0),
                                SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)])
    assert only.outputs[0].token_ids == [] and only.outputs[0].text == "" and only.outputs[0].finish_reason == "length"
    assert only.spec_stats.drafted == 0 and len(other.outputs[0].token_ids) == 12
    _check(only.prompt_logprobs, ids, reference(ids), 2)
    sched = llm.core.scheduler
    assert sched.blocks.num_free == sched.blocks.total
    ngram = LLM(str(tiny_model_dir), speculative_method="ngram")
    ngram.generate([PROMPT], SamplingParams(max_tokens=0))
    assert ngram.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0))[0].num_cached_tokens > 0
