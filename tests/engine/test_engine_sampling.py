"""Sampled speculation end to end: seeds, log-probabilities and the target's exact distribution."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from streamsd import LLM, SamplingParams
from tests.engine.engine_helpers import PROMPTS, assert_pairs_follow_target


def test_seeded_output_is_independent_of_batch(tiny_model_dir, close_draft_dir):
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir))
    for temp in (0.5, 1.0):  # one-hot drafts below the threshold, dense q above it
        p = SamplingParams(temperature=temp, top_p=0.95, max_tokens=20, seed=1234, ignore_eos=True)
        alone = llm.generate(PROMPTS[0], p)[0].outputs[0].token_ids
        others = [SamplingParams(temperature=1.0, max_tokens=n, seed=i, ignore_eos=True) for i, n in enumerate(range(3, 21))]
        batch = llm.generate(PROMPTS * 3 + PROMPTS[:1], others + [p])
        assert batch[-1].outputs[0].token_ids == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    a, b = llm.generate([PROMPTS[0]] * 2, unseeded)
    assert a.outputs[0].token_ids != b.outputs[0].token_ids


def test_logprobs_are_the_target_log_softmax(tiny_model_dir, close_draft_dir):
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir))
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True))[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    n = len(out.prompt_token_ids)
    for j, t in enumerate(out.outputs[0].tokens):
        assert abs(t.logprob - logp[n - 1 + j, t.id].item()) < 1e-4
        assert t.top_logprobs[0][0] == t.id and len(t.top_logprobs) == 3


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(0.5, 0, 1.0, 0.0), (1.0, 8, 1.0, 0.0), (1.5, 0, 0.9, 0.0), (1.2, 0, 1.0, 0.05)],
)
def test_end_to_end_sampling_matches_target_distribution(tiny_model_dir, close_draft_dir, temperature, top_k,
                                                         top_p, min_p):
    """3000 seeds: the joint of the first two tokens is the target's exact warped p (t2 comes from verification)."""
    n = 3000
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir), num_speculative_tokens=3,
              max_num_seqs=n, kv_cache_tokens=n * 48, max_num_batched_tokens=16384)
    prompt = llm.core.text.encode_prompt("Once upon a time")
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, max_tokens=4,
                             seed=s, ignore_eos=True) for s in range(n)]
    res = llm.generate([prompt] * n, params)
    assert sum(r.spec_stats.accepted for r in res) > 0
    assert_pairs_follow_target(tiny_model_dir, prompt, res, (temperature, top_k, top_p, min_p))
