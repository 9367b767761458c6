"""Adaptive speculation's planner (policy/adaptive/planner.py, budget.py): k, hysteresis, depth, probes."""

from __future__ import annotations

import random

import pytest

from streamsd.policy.adaptive import (
    CostTable,
    PlannerConfig,
    PlannerState,
    RequestView,
    kv_slots_needed,
    plan,
)
from streamsd.policy.adaptive.planner import expected_tokens
from streamsd.policy.adaptive.shape import ShapeTable
from tests.policy.adaptive_helpers import entry_gain, graph_shape, h200_cost


@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.7, 0.9])
def test_expected_tokens_closed_form(alpha: float) -> None:
    for k in range(8):
        assert expected_tokens([alpha], k) == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha))


def test_kv_reserved_is_one_plus_k_per_request() -> None:
    rng = random.Random(5)
    cost, st = h200_cost(), PlannerState()
    for _ in range(50):
        views = [RequestView(i, rng.randint(0, 8), [rng.uniform(0.1, 0.95)] * 6) for i in range(rng.randint(1, 96))]
        ks = plan(views, cost, 6, state=st)
        assert all(0 <= k <= min(v.max_k, 6) for k, v in zip(ks, views, strict=True))
        assert kv_slots_needed(ks) == sum(1 + k for k in ks) == st.verify_tokens
        assert st.expected_tokens == pytest.approx(sum(expected_tokens(v.alphas, k) for v, k in zip(views, ks, strict=True)))


def test_planner_follows_the_roofline() -> None:
    cost = h200_cost()
    small = plan([RequestView(i, 6, [0.8] * 6) for i in range(4)], cost, 6)
    assert all(k >= 2 for k in small)  # memory-bound: speculate deep
    large = plan([RequestView(i, 6, [0.6] * 6) for i in range(256)], cost, 6)
    assert large == [0] * 256  # compute-bound: plain


def test_planner_gives_k_per_request() -> None:
    views = [RequestView(i, 6, [0.9 if i % 2 else 0.2] * 6) for i in range(64)]
    ks = plan(views, h200_cost(draft=False), 6)
    assert min(ks[1::2]) > max(ks[0::2])


def test_hysteresis_enters_late_and_leaves_only_when_plain_is_better() -> None:
    cost = h200_cost()
    views = [RequestView(i, 6, [0.45] * 6) for i in range(96)]
    gain = entry_gain(views, cost, 6)
    assert 0.0 < gain < 0.2
    assert plan(views, cost, 6, gain + 0.01) == [0] * 96  # not enough to enter
    st = PlannerState(speculating=True)
    assert any(plan(views, cost, 6, gain + 0.01, state=st))  # but enough to stay
    assert st.switches == 0


def test_probes_only_when_speculation_could_pay() -> None:
    cost = h200_cost()
    for batch, expect in ((8, True), (256, False)):
        st = PlannerState()
        views = [RequestView(i, 6, [0.05] * 6, probe=True, catchup_tokens=80) for i in range(batch)]
        probed = sum(any(plan(views, cost, 6, state=st)) for _ in range(200))
        assert (probed > 0) == expect
        assert probed <= 200 // st.config.probe_every


def test_probes_are_spaced_by_what_they_cost() -> None:
    # A padded graph makes a probe of 4 requests cost the whole batch the wide graph: here (B = 8) 4.8 ms
    # against a 4.16 ms plain step, 15 % more, so at a 0.5 % budget one probe per 31 steps, not per 16.
    cost = CostTable.from_samples({1: 4e-3, 256: 9e-3}, shape=graph_shape())
    st = PlannerState()
    views = [RequestView(i, 4, [0.05] * 4, probe=True) for i in range(8)]
    probed = [step for step in range(200) if any(plan(views, cost, 4, state=st))]
    gaps = {b - a for a, b in zip(probed, probed[1:], strict=False)}
    extra = cost.predict(8, 12, 1) / cost.predict(8, 8, 0) - 1.0
    assert extra == pytest.approx(0.8 / 5.2, rel=0.05)
    assert gaps == {int(extra / st.config.probe_budget) + 1}


def test_free_drafts_in_a_padded_graph_are_planned_per_depth() -> None:
    # The H200's 8B graphs at B = 64 (a profile): widths 1, 2, 3, 5 replay in 5.64, 5.87, 6.89,
    # 8.92 ms. Drafts cost nothing (synthetic / n-gram), but the graph pads every request to the widest
    # one: a plan putting a few confident requests at k = 4 makes all 64 pay width 5. Searched as one
    # ranked level, the plan mixed depths (k = 1 / 2 / 4 for 1480 / 463 / 165 choices, 7.2 ms
    # steps); per depth limit, the best plan is the best uniform k.
    widths, ms = (1, 2, 3, 5), (5.64, 5.87, 6.89, 8.92)
    samples = {(b, w): t * 1e-3 * (0.8 + 0.2 * b / 64) for b in (1, 16, 64) for w, t in zip(widths, ms, strict=True)}
    cost = CostTable.from_samples({1: 5e-3, 64: 6e-3, 512: 0.02}, shape=ShapeTable.from_samples(samples, padded=True))
    assert not cost.depth_is_free
    rng = random.Random(7)
    means = [rng.uniform(0.55, 0.85) for _ in range(64)]
    views = [RequestView(i, 4, [m - 0.05] * 4, mean_alphas=[m] * 4) for i, m in enumerate(means)]
    st = PlannerState()
    ks = plan(views, cost, 4, state=st)

    def rate(k: int) -> float:
        return sum(expected_tokens([m] * 4, k) for m in means) / cost.predict(64, 64 * (1 + k), k)

    best = max(range(1, 5), key=rate)
    assert ks == [best] * 64
    assert st.spec_rate == pytest.approx(rate(best))
    assert rate(best) > 1.02 * max(rate(k) for k in range(1, 5) if k != best)  # the choice is not a near-tie
    # Where steps are queued ahead a new depth drops the queued one: the last plan's depth is kept
    # unless another beats it by the margin.
    for last in range(1, 5):
        st = PlannerState(config=PlannerConfig(depth_hysteresis=0.05), speculating=True, depth=last)
        kept = plan(views, cost, 4, state=st)
        assert kept == [last if rate(last) * 1.05 >= rate(best) else best] * 64, last
    assert any(rate(k) * 1.05 >= rate(best) for k in range(1, 5) if k != best)  # some depth was kept
    assert any(rate(k) * 1.05 < rate(best) for k in range(1, 5))  # and some was not
    # Eager steps (no graph) keep the one-level search: depth costs nothing there.
    assert CostTable.from_samples({1: 5e-3}, shape=ShapeTable.from_samples(samples, padded=False)).depth_is_free


def test_a_cold_prior_probes_the_whole_batch_once() -> None:
    """A large batch that the default prior keeps plain would never learn that its drafts are good:
    per-request probes (four at most) cost the padded step of them all and teach the prior little.
    While the proposer's prior holds no evidence, every request probes in one step, once; the
    evidence then decays with the steps and the prior goes cold again when it has forgotten."""
    from streamsd.policy.adaptive import AcceptanceConfig, AcceptanceEstimator

    cost = h200_cost()
    views = [RequestView(i, 4, [0.5] * 4) for i in range(128)]
    assert plan(views, cost, 4, 0.05) == [0] * 128  # the default prior alone: plain
    st = PlannerState()
    assert plan(views, cost, 4, 0.05, state=st, cold=True) == [1] * 128
    assert plan(views, cost, 4, 0.05, state=st, cold=True) == [0] * 128  # once, not at every plan
    hopeless = [RequestView(i, 4, [0.5] * 4) for i in range(256)]  # B = 256: even alpha 0.9 would not pay
    assert plan(hopeless, cost, 4, 0.10, state=PlannerState(), cold=True) == [0] * 256
    est = AcceptanceEstimator(AcceptanceConfig(max_k=4))
    assert est.cold()
    est.observe(est.new_request(), 1, 1)
    assert not est.cold()
    for _ in range(60):
        est.tick()
    assert est.cold()


def test_entering_speculation_must_pay_for_the_switch_before_the_batch_ends() -> None:
    """An excursion costs ~2 plain steps beyond its own (the entering step proposes without verifying,
    the steps around a switch wait for the host): a batch a few tokens from its end stays plain, one
    already speculating goes on."""
    cost = h200_cost()

    def views(left: int) -> list[RequestView]:
        return [RequestView(i, min(4, left - 1), [0.8] * 4, remaining=left) for i in range(64)]

    assert max(plan(views(200), cost, 4)) > 0
    assert plan(views(3), cost, 4) == [0] * 64
    assert max(plan(views(3), cost, 4, state=PlannerState(speculating=True))) > 0


def test_deeper_drafts_where_steps_queue_ahead_must_pay_for_the_switch_before_the_batch_ends() -> None:
    """Deepening drops the step queued ahead, a switch like entering: k = 1 -> 4 at alpha 0.9 (an H200's
    B = 64 graphs: +28 % a step) deepens mid-batch but not 4 tokens from the end, where it cannot pay
    back the ~2 steps a switch costs (at B = 256 on an H200, k = 1 -> 2 ten tokens from the end took a
    29 ms and a 44 ms step and the cell read 0.98x plain). Going shallower drops nothing: it is not held."""
    widths, ms = (1, 2, 3, 5), (5.64, 5.87, 6.89, 8.92)
    samples = {(b, w): t * 1e-3 for b in (1, 16, 64) for w, t in zip(widths, ms, strict=True)}
    cost = CostTable.from_samples({1: 5e-3, 64: 6e-3, 512: 0.02}, shape=ShapeTable.from_samples(samples, padded=True))
    queued = PlannerConfig(depth_hysteresis=0.05)

    def ks(left: int, alpha: float, depth: int) -> list[int]:
        views = [RequestView(i, min(4, left - 1), [alpha - 0.02] * 4, mean_alphas=[alpha] * 4, remaining=left)
                 for i in range(64)]
        return plan(views, cost, 4, state=PlannerState(config=queued, speculating=True, depth=depth))

    assert ks(60, 0.9, 1) == [4] * 64
    assert ks(5, 0.9, 1) == [1] * 64
    assert ks(5, 0.9, 4) == [4] * 64  # already deep: nothing to pay for
    assert ks(60, 0.5, 4) == ks(5, 0.5, 4) == [1] * 64  # shallower, whatever is left
    # Without steps queued ahead (no depth hysteresis) a new depth costs nothing more: it is taken.
    views = [RequestView(i, 4, [0.88] * 4, mean_alphas=[0.9] * 4, remaining=5) for i in range(64)]
    assert plan(views, cost, 4, state=PlannerState(speculating=True, depth=1)) == [4] * 64


def test_a_plan_of_no_requests_leaves_no_probe_granted() -> None:
    """The policy carries each granted probe by request id until it is verified (policy/policy.py): a plan of
    an empty batch must not leave the last plan's grants behind (the engine plans while a request ends)."""
    cost, st = h200_cost(), PlannerState()
    views = [RequestView(f"r{i}", 4, [0.5] * 4) for i in range(128)]
    assert plan(views, cost, 4, 0.05, state=st, cold=True) == [1] * 128
    assert st.probed == [f"r{i}" for i in range(128)]
    assert plan([], cost, 4, 0.05, state=st, cold=True) == [] and st.probed == []


def _random_cost(rng: random.Random) -> CostTable:
    """A measured-looking table: padded graphs, eager steps or tokens only; a draft table or none; and
    online corrections learnt per key, some far below 1 (so a wider shape may read cheaper)."""
    batches, widths = (1, 4, 16, 64, 256), (1, 2, 3, 5)
    per = rng.uniform(5e-6, 6e-5)
    samples = {(b, w): 4e-3 + per * b * w * rng.uniform(0.8, 1.2) for b in batches for w in widths}
    kind = rng.choice(("padded", "eager", "tokens"))
    shape = None if kind == "tokens" else ShapeTable.from_samples(samples, padded=kind == "padded")
    verify = {n: 4e-3 + per * n for n in (1, 8, 64, 256, 512, 1024, 2048)}
    draft = {b: 2e-4 + 3e-6 * b for b in (1, 16, 256)} if rng.random() < 0.5 else None
    cost = CostTable.from_samples(verify, draft, shape=shape, spec_overhead_s=rng.choice((0.0, 1e-4)))
    for _ in range(40):
        b, k = rng.choice(batches), rng.randrange(0, 5)
        prefill = rng.choice((0, 0, 300))
        tokens = b * (1 + k) + prefill
        raw = cost.predict_raw(b, tokens, k, prefill_tokens=prefill)
        for _ in range(3):
            cost.observe(raw, raw * rng.uniform(0.4, 1.6), verify_tokens=tokens, draft_steps_k=k, batch_size=b,
                         prefill_tokens=prefill)
    return cost


def test_the_plans_ceiling_never_changes_a_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch that no budget could make pass the gate is planned plain without ranking its drafts
    (``Search.hopeless``: at B = 256 on an H200 the ranking took ~4 ms a plan). Its bound must hold
    wherever the search might look: with and without it, every plan and planner state is the same."""
    from streamsd.policy.adaptive.budget import Search

    rng = random.Random(11)
    real = Search.hopeless
    calls: list[float | None] = []

    def watched(search: Search, *args: object) -> float | None:
        calls.append(real(search, *args))  # type: ignore[arg-type]
        return calls[-1]

    fired = 0
    for case in range(300):
        cost = _random_cost(rng)
        b = rng.choice((1, 3, 16, 40, 128, 256))
        level = rng.uniform(0.05, 0.95)
        views = []
        for i in range(b):
            mean = [min(max(level + rng.uniform(-0.3, 0.3), 0.0), 1.0) for _ in range(4)]
            safe = [m * rng.uniform(0.6, 1.0) for m in mean]
            views.append(RequestView(i, rng.choice((0, 1, 2, 4, 4)), safe, probe=rng.random() < 0.05,
                                     catchup_tokens=rng.choice((0, 0, 5, 60)), mean_alphas=mean,
                                     remaining=rng.choice((3, 50, 1 << 30))))
        kwargs = dict(prefill_tokens=rng.choice((0, 0, 0, 300)), prefill_backlog=rng.random() < 0.2,
                      cold=rng.random() < 0.1, guessing=rng.random() < 0.2)
        start = dict(speculating=rng.random() < 0.15, depth=rng.randrange(0, 5), since_probe=rng.randrange(0, 40))
        hysteresis = rng.choice((0.0, 0.02, 0.05))
        fast, slow = PlannerState(**start), PlannerState(**start)  # type: ignore[arg-type]
        calls.clear()
        monkeypatch.setattr(Search, "hopeless", watched)
        got = plan(views, cost, 4, hysteresis, state=fast, **kwargs)  # type: ignore[arg-type]
        monkeypatch.setattr(Search, "hopeless", lambda *a: None)
        want = plan(views, cost, 4, hysteresis, state=slow, **kwargs)  # type: ignore[arg-type]
        assert got == want, case
        for name in ("speculating", "switches", "depth", "probed", "since_probe", "probe_steps", "plain_rate",
                     "spec_rate", "verify_tokens", "draft_steps", "predicted_s", "expected_tokens"):
            assert getattr(fast, name) == getattr(slow, name), (case, name)
        if calls and calls[0] is not None:
            fired += 1
            assert fast.top_rate >= slow.top_rate * (1 - 1e-12), case  # a ceiling of what the search scored
    assert fired >= 20, fired  # the cases are not all ones the ceiling leaves to the search
