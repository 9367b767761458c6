"""The engine's AdaptivePolicy (policy/policy.py): when it plans, how it prices and learns its steps."""

from __future__ import annotations

import pytest

from streamsd.policy.adaptive import CostTable, RequestView, plan
from streamsd.policy.adaptive.cost import StepTable
from tests.policy.adaptive_helpers import entry_gain, graph_shape, h200_cost


def test_an_eagle_heads_settled_lag_is_no_catch_up() -> None:
    # A caught-up head lacks only the pending token's slot (its streams come with the next verify):
    # the planner must price no catch-up there, and every position of a plain stretch beyond it.
    from streamsd.policy.policy import AdaptivePolicy
    from streamsd.request import Request, SamplingParams

    extra = []
    for behind in (0, 7):
        cost = CostTable.from_samples({1: 4e-3, 64: 5e-3})
        cost.catchup = StepTable.from_samples({1: 1e-4, 64: 4e-4})
        policy = AdaptivePolicy(4, cost, draft_has_cache=True, settled_lag=1)
        r = Request("a", list(range(10)), SamplingParams(max_tokens=50), seed=0, arrival=0.0, spec_k=4)
        r.output_ids.append(5)
        r.computed = r.num_tokens - 1
        r.draft_computed = r.computed - behind
        decision = policy.choose([r], 0, False)
        assert decision.ks["a"] > 0  # a cold prior probes
        extra.append(decision.draft_extra_tokens)
    assert extra == [0, 7]


def test_plain_steps_between_plans_keep_the_table_calibrated() -> None:
    """Under a batch where plain decoding wins, most steps skip the planner; their measured cost must
    still correct the table (a start-up profile blind to per-request host work, as at B = 128-256 on
    an H200), or the next plan compares speculation against a plain step it misprices."""
    from streamsd.policy.policy import AdaptivePolicy, StepShape, acceptance_class
    from streamsd.request import Request, SamplingParams

    shape = graph_shape()
    cost = CostTable.from_samples({1: 4e-3, 256: 9e-3}, shape=shape)
    policy = AdaptivePolicy(4, cost, draft_has_cache=False, plan_budget=0.0)  # every REPLAN_EVERY, however slow
    built = StepShape(batch=64, verify_tokens=64, draft_steps=0, draft_batch=0, prefill_tokens=0, verify_width=1)
    reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=500), seed=i, arrival=0.0, spec_k=4)
            for i in range(64)]
    for r in reqs:
        r.output_ids.append(5)
        r.computed = r.num_tokens - 1
    true_plain = shape(64, 64, 1) * 1.35  # what the profile missed: 35 %
    known = policy.estimator.new_request(acceptance_class(reqs[0]))  # drafts known to be poor: no cold probe
    for _ in range(8):
        policy.estimator.observe(known, 4, 0)
    planned = []
    for step in range(1, 41):
        decision = policy.choose(reqs, 0, False)
        assert not any(decision.ks.values())  # acceptance is known low: nothing is ever drafted here
        if decision.planned:
            planned.append(step)
        policy.commit_shape(decision, built, [0] * 64)
        policy.observe(decision, [(r, 0, 0) for r in reqs], true_plain)
    policy.learn()  # the next choice would: observing is only queueing, off the step's serial path
    assert policy.record.plain_steps == 40
    # Soon after going plain (a close call may have sent it there), then every REPLAN_EVERY steps.
    assert planned == [1, 2, 4, 8, 16, 24, 32, 40]
    assert cost.seen[cost.key(64, 0, batch_size=64)] == 40  # every step taught it, not only the planned 5
    assert cost.predict(64, 64, 0) == pytest.approx(true_plain, rel=0.02)
    kinds = policy.summary()["prediction_error"]
    assert isinstance(kinds, dict) and kinds["plain"]["steps"] == 40
    # A step that carried a prompt chunk is not a plain step's cost: left out.
    decision = policy.choose(reqs, 0, False)
    assert not decision.planned
    policy.commit_shape(decision, StepShape(batch=64, verify_tokens=364, draft_steps=0, draft_batch=0, prefill_tokens=300,
                                              verify_width=1),
                  [0] * 64)
    policy.observe(decision, [(r, 0, 0) for r in reqs], 10 * true_plain)
    policy.learn()
    assert cost.seen[cost.key(64, 0, batch_size=64)] == 40


def test_an_idle_batch_replans_no_more_often_than_its_plans_are_worth() -> None:
    from streamsd.policy.policy import REPLAN_EVERY, _replan_due, idle_replan_every

    assert idle_replan_every(0.4e-3, 6e-3, 0.01) == REPLAN_EVERY  # cheap plans: every 8 steps
    assert idle_replan_every(4e-3, 9e-3, 0.01) == 45  # B = 256 on an H200: ~4 ms plans beside 9 ms steps
    assert idle_replan_every(4e-3, 0.0, 0.01) == idle_replan_every(4e-3, 9e-3, 0.0) == REPLAN_EVERY
    due = [n for n in range(1, 200) if _replan_due(n, 45)]
    assert due == [1, 2, 4, 8, 16, 32, 45, 64, 90, 128, 135, 180]
    assert sum(4e-3 for n in due if n > 8) / ((199 - 8) * 9e-3) < 0.02


def test_an_idle_batchs_backoff_plans_fit_the_plan_budget_too() -> None:
    """The backoff (1, 2, 4, ... steps after going plain) re-checks a close call while plans are cheap
    beside the steps; where they are not (B = 256 on an H200: 4 ms plans, 9 ms steps) its six plans in
    a 64-token pass cost 4-6 % against plain, so they too must fit the budget (the first one is free)."""
    from streamsd.policy.policy import _replan_due, idle_plan_fits, idle_replan_every

    def idle_plans(plan_s: float, step_s: float, budget: float = 0.01, steps: int = 100) -> list[int]:
        made: list[int] = []
        for n in range(1, steps + 1):
            if (_replan_due(n, idle_replan_every(plan_s, step_s, budget))
                    and idle_plan_fits(len(made), plan_s, n, step_s, budget)):
                made.append(n)
        return made

    assert idle_plans(4e-3, 9e-3) == [1, 90]
    assert idle_plans(0.1e-3, 5e-3)[:5] == [1, 4, 8, 16, 24]  # cheap plans keep most of the backoff
    for plan_s, step_s in ((4e-3, 9e-3), (1e-3, 5e-3), (0.3e-3, 5e-3), (0.1e-3, 5e-3)):
        made = idle_plans(plan_s, step_s, steps=400)
        assert (len(made) - 1) * plan_s <= 0.01 * 400 * step_s  # within the budget, bar the free first
    assert idle_plans(4e-3, 9e-3, budget=0.0, steps=40) == [1, 2, 4, 8, 16, 24, 32, 40]  # no budget: the old rule
    # The plans of a filling batch (its first step, each doubling) are not the idle schedule's: the first
    # idle step after them still plans (where a cold prior gets its probe).
    from streamsd.policy.policy import AdaptivePolicy, acceptance_class
    from streamsd.request import Request, SamplingParams

    policy = AdaptivePolicy(4, CostTable.from_samples({1: 4e-3, 256: 9e-3}, shape=graph_shape()),
                            draft_has_cache=False)
    reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=500), seed=i, arrival=0.0, spec_k=4)
            for i in range(64)]
    for r in reqs:
        r.output_ids.append(5)
        r.computed = r.num_tokens - 1
    known = policy.estimator.new_request(acceptance_class(reqs[0]))  # drafts known to be poor: every plan says plain
    for _ in range(8):
        policy.estimator.observe(known, 4, 0)
    policy.estimator.tick()
    assert policy.choose(reqs[:16], 0, False).planned and policy.choose(reqs[:40], 0, False).planned  # filling
    assert not policy.planner.speculating
    planned = []
    for _ in range(14):  # idle steps 3 ... 16, each plan as dear as at B = 256 on an H200
        policy.plan_seconds, policy.record.last_measured = 4e-3, 9e-3
        planned.append(policy.choose(reqs[:40], 0, False).planned)
    assert planned.index(True) == 1 and sum(planned) == 1  # idle step 4 is the first due: free; then over budget


def test_entering_speculation_needs_more_where_steps_queue_ahead() -> None:
    from streamsd.policy.policy import ENTRY_HYSTERESIS, QUEUED_ENTRY_HYSTERESIS, AdaptivePolicy

    cost = h200_cost()
    views = [RequestView(i, 4, [0.5] * 4) for i in range(128)]
    gain = entry_gain(views, cost, 4)
    assert ENTRY_HYSTERESIS < gain < QUEUED_ENTRY_HYSTERESIS  # enough for an eager engine, not a queued one
    assert any(plan(views, cost, 4, ENTRY_HYSTERESIS))
    assert plan(views, cost, 4, QUEUED_ENTRY_HYSTERESIS) == [0] * 128
    assert AdaptivePolicy(4, cost, draft_has_cache=False, queues_ahead=True).hysteresis == QUEUED_ENTRY_HYSTERESIS
    assert AdaptivePolicy(4, cost, draft_has_cache=False).hysteresis == ENTRY_HYSTERESIS


def test_a_step_entering_speculation_is_priced_as_the_plain_graph_plus_drafting_and_teaches_no_key() -> None:
    """The first step after plain ones verifies no drafts yet (none are cached) and proposes k: it
    replays the plain graph. Priced as a width-5 step it read 1.5x its measured time on an H200,
    and learnt, it taught the speculative key that speculation is cheap."""
    from streamsd.policy.policy import AdaptivePolicy, Decision, StepShape

    cost = CostTable.from_samples({1: 4e-3, 64: 4.5e-3, 256: 9e-3}, shape=graph_shape(), spec_overhead_s=3e-4)
    plain_graph, spec_graph = 4e-3 + 2e-5 * 64, 4e-3 + 2e-5 * 320
    assert cost.predict_with_raw(64, 64, 4, verify_width=1)[0] == pytest.approx(plain_graph + 3e-4)
    assert cost.predict_with_raw(64, 320, 0, verify_width=5)[0] == pytest.approx(spec_graph)  # leaving it
    policy = AdaptivePolicy(4, cost, draft_has_cache=False)
    entering = Decision({}, planned=True)
    policy.commit_shape(entering, StepShape(64, 64, 4, 64, 0, verify_width=1), [4] * 64)
    assert entering.predicted_s == pytest.approx(plain_graph + 3e-4)
    policy.observe(entering, [], 2 * entering.predicted_s)
    policy.learn()
    assert cost.seen == {}  # neither the plain key nor the speculative one learnt it
    assert policy.summary()["prediction_error"]["speculative"]["steps"] == 1  # type: ignore[index]


def test_the_first_speculative_step_after_plain_ones_teaches_no_key() -> None:
    """It could not be queued behind the step before (that one drafted nothing), so it pays its host work
    serially where its successors hide it: at B = 128 on an H200 two such steps measured 1.28x their
    prediction, and once learnt the batch never speculated again. Likewise a step of a new depth, which
    also waits for the dropped queued step (2x)."""
    from streamsd.policy.policy import AdaptivePolicy, Decision, StepShape

    cost = CostTable.from_samples({1: 4e-3, 64: 4.5e-3, 256: 9e-3}, shape=graph_shape())
    policy = AdaptivePolicy(4, cost, draft_has_cache=False)
    spec_key = cost.key(320, 4, batch_size=64)
    shapes = {"plain": StepShape(64, 64, 0, 0, 0, 1), "entering": StepShape(64, 64, 4, 64, 0, 1),
              "spec": StepShape(64, 320, 4, 64, 0, 5)}
    shapes["k2"] = StepShape(64, 192, 2, 64, 0, 3)
    for kind, slow, learnt in (("entering", 1.0, 0), ("spec", 1.3, 0), ("spec", 1.0, 1), ("spec", 1.0, 2),
                               ("plain", 1.0, 2), ("spec", 1.3, 2), ("spec", 1.0, 3),
                               ("k2", 2.0, 3), ("spec", 2.0, 3), ("spec", 1.0, 4)):  # a new depth: the same
        d = Decision({}, planned=True)
        policy.commit_shape(d, shapes[kind], [4 if kind != "plain" else 0] * 64)
        policy.observe(d, [], slow * d.predicted_raw_s)
        policy.learn()
        assert cost.seen.get(spec_key, 0) == learnt, kind
    assert cost.predict(64, 320, 4) == pytest.approx(cost.predict_raw(64, 320, 4), rel=0.01)  # the slow ones left out


def test_the_plan_made_ahead_sees_the_batch_as_the_running_step_leaves_it() -> None:
    """plan_ahead runs while a step executes: prompts that step completes decode next (they must be
    in the plan, not priced as a prefill chunk that has already run), a mid-prompt chunk leaves only
    its remainder to prefill; the plan is used once, by the next schedule."""
    from streamsd.config import SchedulerConfig
    from streamsd.policy.policy import Decision, FixedPolicy
    from streamsd.request import Request, SamplingParams
    from streamsd.sched.scheduler import Scheduler

    seen: list[tuple[list[str], int]] = []

    class Recording(FixedPolicy):
        plans_ahead = True

        def choose(self, decoding: list[Request], prefill_tokens: int, backlog: bool) -> Decision:
            seen.append(([r.request_id for r in decoding], prefill_tokens))
            return super().choose(decoding, prefill_tokens, backlog)

    sched = Scheduler(SchedulerConfig(num_blocks=64, max_model_len=512, max_num_batched_tokens=40),
                      policy=Recording())
    for rid, n in (("short", 10), ("long", 50)):
        sched.add(Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=8), seed=0, arrival=0.0, spec_k=2))
    plan, _ = sched.schedule()  # "short" whole (10 tokens), "long" a 30-token chunk
    assert [(e.request.request_id, e.num_tokens) for e in plan.entries] == [("short", 10), ("long", 30)]
    sched.plan_ahead(plan)
    assert seen[-1] == (["short"], 20)  # decoding after this step; 20 of "long" left to prefill
    calls = len(seen)
    sched.schedule()
    assert len(seen) == calls  # the next schedule used the plan made ahead, not a new one
    # A draft model that replays its KV when it resumes plans after the step (see plans_ahead).
    from streamsd.policy.policy import AdaptivePolicy

    cost = CostTable.from_samples({1: 4e-3, 256: 9e-3})
    assert AdaptivePolicy(4, cost, draft_has_cache=False).plans_ahead
    assert not AdaptivePolicy(4, cost, draft_has_cache=True).plans_ahead


def test_probes_are_spaced_by_what_they_were_measured_to_cost() -> None:
    """A probe's steps take the shapes no steady step teaches the table, which prices such a shape at
    the global ratio alone: optimistic, so its real cost must come from its own steps. 32 requests whose
    drafts fail: probe steps measured at 3x a plain one are granted far more rarely than at 1x."""
    from streamsd.policy.policy import AdaptivePolicy, StepShape
    from streamsd.request import Request, SamplingParams

    def grants(probe_cost: float) -> int:
        policy = AdaptivePolicy(4, CostTable.from_samples({1: 1.0e-3, 256: 1.1e-3}, {1: 0.05e-3, 256: 0.06e-3}),
                                draft_has_cache=False, plan_budget=0.0)
        reqs = []
        for i in range(32):
            r = Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=100_000), seed=i, arrival=0.0, spec_k=4)
            r.output_ids.append(5)
            r.computed = r.num_tokens - 1
            reqs.append(r)
        for _ in range(1500):
            d = policy.choose(reqs, 0, False)
            ks = [d.ks.get(r.request_id, policy.default_k(r)) for r in reqs]
            # As the engine builds a probe's first step: it proposes, verifies nothing (no steady shape).
            policy.commit_shape(d, StepShape(32, 32, max(ks), sum(k > 0 for k in ks), 0, 1), ks)
            policy.observe(d, [(r, k, 0) for r, k in zip(reqs, ks, strict=True)],
                           (probe_cost if any(ks) else 1.0) * 1.0e-3)
        return policy.planner.probe_steps

    cheap, dear = grants(1.0), grants(3.0)
    assert cheap >= 10 and dear <= cheap / 3, (cheap, dear)
