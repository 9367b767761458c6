"""A batch whose proposer's running prior holds no evidence: it probes before it speculates.

The configured default prior is a guess, not evidence. On this CPU's SmolLM2 at a batch of 32 (the
eager step of the start-up profile below: width 2 costs 1.25 plain steps, width 5 twice one) a fresh
batch entered speculation on that guess alone, at the depth the guess chose, and n-gram drafts of
everyday chat were accepted a quarter of the time: every speculative step was slower than a plain one.
"""

from __future__ import annotations

from streamsd.policy.adaptive import CostTable, PlannerState, RequestView, plan
from streamsd.policy.adaptive.shape import ShapeTable

# ms per step of this CPU's start-up profile, by batch: widths 1..5.
CPU_MS = {1: (53.47, 57.22, 62.87, 62.87, 78.28), 8: (87.85, 120.01, 132.28, 144.54, 156.81),
          32: (228.32, 284.54, 340.75, 396.97, 453.19), 64: (357.08, 498.45, 639.82, 781.19, 922.56)}


def cpu_cost() -> CostTable:
    samples = {(b, w + 1): ms * 1e-3 for b, row in CPU_MS.items() for w, ms in enumerate(row)}
    return CostTable.from_samples({1: CPU_MS[1][0] * 1e-3}, shape=ShapeTable.from_samples(samples, padded=False))


def fresh(batch: int, remaining: int = 64) -> list[RequestView]:
    """Requests with no evidence of their own, read against the configured default prior (0.6): its
    lower quarter with the pseudo-count a request borrows."""
    return [RequestView(i, 4, [0.52, 0.45, 0.4, 0.36], mean_alphas=[0.6] * 4, remaining=remaining)
            for i in range(batch)]


def test_a_cold_large_batch_probes_at_k_one_instead_of_speculating_on_the_default_prior() -> None:
    cost, st = cpu_cost(), PlannerState()
    ks = plan(fresh(32), cost, 4, state=st, cold=True, guessing=True)
    assert not st.speculating  # no excursion on a guess
    assert max(ks) == 1 and st.probed  # the probe step: one draft each, the cheapest step that teaches
    # Until the probe's evidence arrives the batch stays plain: one probe step, not one per plan.
    assert plan(fresh(32), cost, 4, state=st, cold=True, guessing=True) == [0] * 32
    assert not st.speculating


def test_evidence_from_a_cold_probe_decides_entry_on_the_pessimistic_bound() -> None:
    cost = cpu_cost()
    # Drafts accepted a quarter of the time: k = 1 yields 1.25 tokens for 1.25 plain steps: plain.
    poor = [RequestView(i, 4, [0.2] * 4, mean_alphas=[0.27] * 4) for i in range(32)]
    st = PlannerState()
    assert plan(poor, cost, 4, state=st) == [0] * 32 and not st.speculating
    # Drafts accepted 90 % of the time pay at once.
    good = [RequestView(i, 4, [0.85] * 4, mean_alphas=[0.9] * 4) for i in range(32)]
    st = PlannerState()
    assert max(plan(good, cost, 4, state=st)) > 0 and st.speculating


def test_a_cold_small_batch_may_still_enter_on_the_strict_gate() -> None:
    """Up to 16 requests an excursion is a few requests' steps: a cold small batch is not held to a probe
    first (on a forgotten prior it gates on its means, see the planner's Small batches)."""
    cost = cpu_cost()
    good = [RequestView(0, 4, [0.8] * 4, mean_alphas=[0.85] * 4)]
    for guessing in (False, True):
        st = PlannerState()
        assert max(plan(good, cost, 4, state=st, cold=True, guessing=guessing)) > 0 and st.speculating


def test_a_request_read_against_a_cold_prior_rereads_it_as_soon_as_evidence_arrives() -> None:
    """Requests that only borrowed the configured default (read while the prior held no evidence) must
    see the probe's evidence at the next plan, not after the refresh interval: at α 0.25 on the CPU
    table, requests still reading the default 0.6 entered speculation at k = 2 right after the probe."""
    from streamsd.policy.adaptive import AcceptanceConfig, AcceptanceEstimator

    est = AcceptanceEstimator(AcceptanceConfig(max_k=4))
    waiting = est.new_request()
    assert est.mean(waiting)[0] == 0.6  # the default, read while the prior is cold
    for _ in range(32):  # a probe step: every draft rejected
        est.observe(est.new_request(), 1, 0)
    est.tick()
    assert est.mean(waiting)[0] < 0.3
    assert est.estimate(waiting)[0] < 0.25


def _decoding(n: int) -> list:
    from streamsd.request import Request, SamplingParams

    reqs = []
    for i in range(n):
        r = Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=64, temperature=0.0), seed=i, arrival=0.0, spec_k=4)
        r.output_ids.append(5)
        r.computed = r.num_tokens - 1
        reqs.append(r)
    return reqs


def _run_probe(short_drafts_fail: bool) -> tuple[list[float], list[float]]:
    """A cold batch of 32 probes at k = 1; the proposer finds a draft for half of the requests, and
    every draft it proposes is accepted. Returns each request's failures at position 0 and the prior's
    mean there once the probe is learnt."""
    from streamsd.policy.policy import AdaptivePolicy
    from streamsd.sched.plan import Scheduled, StepPlan

    policy = AdaptivePolicy(4, cpu_cost(), draft_has_cache=False, short_drafts_fail=short_drafts_fail)
    reqs = _decoding(32)
    proposing = policy.choose(reqs, 0, False)
    assert all(proposing.ks[r.request_id] == 1 for r in reqs)  # the cold probe asks each for one draft
    policy.commit(proposing, StepPlan([Scheduled(r, r.computed, 1, 0, 1) for r in reqs]))
    policy.observe(proposing, [(r, 0, 0) for r in reqs], 0.23)
    for i, r in enumerate(reqs):  # the step ran: one token emitted, the proposer's drafts cached
        r.output_ids.append(6)
        r.computed += 1
        r.draft_ids = [7] if i % 2 else []
    verifying = policy.choose(reqs, 0, False)
    policy.commit(verifying, StepPlan([Scheduled(r, r.computed, 1, len(r.draft_ids), 0) for r in reqs]))
    policy.observe(verifying, [(r, len(r.draft_ids), len(r.draft_ids)) for r in reqs], 0.28)
    policy.learn()
    prior = policy.estimator.priors["greedy"]
    return [r.acceptance.failures[0] for r in reqs], list(prior.means[:1])


def test_a_draft_the_proposer_did_not_propose_counts_as_rejected() -> None:
    """A lookup that finds no match proposes nothing, and a draft never proposed yields no token: read
    as acceptance per draft proposed, n-gram drafts of chat on SmolLM2 (0.28, while 59 % of the drafts
    asked for were never proposed) priced k = 1 at 1.28 tokens a step where it yielded 1.11."""
    failures, (mean,) = _run_probe(short_drafts_fail=True)
    assert failures == [0.0 if i % 2 else 1.0 for i in range(32)]
    assert 0.4 < mean < 0.6  # half of the drafts asked for were accepted
    # A proposer that always proposes what it is asked learns per draft proposed, as before.
    failures, (mean,) = _run_probe(short_drafts_fail=False)
    assert failures == [0.0] * 32 and mean > 0.9


def test_the_ngram_proposer_declares_that_it_may_propose_fewer_drafts_than_asked() -> None:
    from streamsd.spec_decode.draft_model import DraftModelProposer
    from streamsd.spec_decode.ngram import NgramProposer

    assert NgramProposer.may_propose_fewer and not DraftModelProposer.may_propose_fewer
