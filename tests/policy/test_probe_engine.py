"""A probe in the real engine: the planner grants a request k >= 1 while the batch decodes plain, so
that its drafts are verified and teach the acceptance estimate. Drafts proposed in one step are
verified in the next, and a step that takes a plain step queued ahead proposes nothing, so a grant
must outlive the plan that made it; on an H200 a batch of one granted ~30 probes in 3000 steps and
not one of them was verified (its prior stayed at the default and adaptive EAGLE stayed plain)."""

from __future__ import annotations

import pytest

from streamsd import LLM, SamplingParams
from streamsd.policy.adaptive import CostTable
from streamsd.policy.policy import AdaptivePolicy
from tests.engine.engine_helpers import PROMPTS, assert_free, hf_greedy

MAX_TOKENS = 40


@pytest.mark.parametrize("pipeline", [False, True], ids=["sequential", "pipelined"])
def test_a_granted_probe_is_verified_and_teaches_the_prior(tiny_model_dir, close_draft_dir, pipeline, monkeypatch):
    # Priced so that the default prior (0.6) keeps the batch plain while an optimistic alpha (0.9) would
    # pay: the planner probes. Learning the costs is switched off so that this host's speed decides nothing.
    monkeypatch.setattr(AdaptivePolicy, "_learn_cost", lambda self, *a: None)
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir), speculation_policy="adaptive",
              num_speculative_tokens=2, pipeline=pipeline)
    policy = llm.core.scheduler.policy
    policy.cost = CostTable.from_samples({1: 1e-3, 256: 1e-3}, {1: 0.05e-3}, spec_overhead_s=0.6e-3)
    granted: dict[str, int] = {}  # request id -> the choose call that granted it a probe
    verified: dict[str, int] = {}  # request id -> drafts it verified in steps after its grant
    choose, observe = AdaptivePolicy.choose, AdaptivePolicy.observe

    def spy_choose(self, decoding, prefill_tokens, backlog):
        decision = choose(self, decoding, prefill_tokens, backlog)
        for rid in self.planner.probed if decision.planned else ():
            granted.setdefault(rid, self.choices)
        return decision

    def spy_observe(self, decision, done, seconds):
        for r, drafted, _ in done:
            if r.request_id in granted:
                verified[r.request_id] = verified.get(r.request_id, 0) + drafted
        return observe(self, decision, done, seconds)

    monkeypatch.setattr(AdaptivePolicy, "choose", spy_choose)
    monkeypatch.setattr(AdaptivePolicy, "observe", spy_observe)
    prompts = PROMPTS[:3]
    res = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)] * 3)
    assert [r.outputs[0].token_ids for r in res] == hf_greedy(tiny_model_dir, prompts, [MAX_TOKENS] * 3)
    assert granted, "no probe was granted: the prices above no longer make the planner probe"
    assert all(verified.get(rid, 0) > 0 for rid in granted), (granted, verified)
    assert policy.estimator.informed("greedy")  # the probes' evidence reached the running prior
    assert_free(llm)
