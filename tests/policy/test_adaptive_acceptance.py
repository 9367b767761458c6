"""Adaptive speculation's acceptance estimator (policy/adaptive/acceptance.py, beta.py)."""

from __future__ import annotations

import json
import random

import pytest

from streamsd.policy.adaptive import AcceptanceConfig, AcceptanceEstimator
from streamsd.policy.adaptive.acceptance import depth_steps_of
from streamsd.policy.adaptive.beta import beta_quantile, beta_quantile_approx


def test_beta_quantile_exact_and_approximation() -> None:
    assert beta_quantile(0.25, 1.0, 1.0) == pytest.approx(0.25, abs=1e-9)
    assert beta_quantile(0.25, 1.0, 3.0) == pytest.approx(1.0 - 0.75 ** (1 / 3), abs=1e-9)
    assert beta_quantile(0.5, 4.0, 4.0) == pytest.approx(0.5, abs=1e-9)
    z = -0.6744897501960817  # Φ⁻¹(0.25)
    for a in (1.0, 2.0, 5.0, 16.0, 60.0, 300.0):
        for b in (1.0, 2.0, 5.0, 16.0, 60.0, 300.0):
            if a + b >= 4:
                assert abs(beta_quantile_approx(a, b, z) - beta_quantile(0.25, a, b)) < 0.012, (a, b)


def drive(est: AcceptanceEstimator, states: list, alphas: tuple[float, ...], steps: int, k: int,
          rng: random.Random) -> None:
    for _ in range(steps):
        for st in states:
            accepted = 0
            while accepted < k and rng.random() < alphas[accepted]:
                accepted += 1
            est.observe(st, k, accepted)
        est.tick()


def test_observe_counts_the_accepted_prefix() -> None:
    est = AcceptanceEstimator(AcceptanceConfig(max_k=4, request_decay=1.0))
    st = est.new_request()
    est.observe(st, 3, 1)
    assert st.successes == [1.0, 0.0, 0.0, 0.0] and st.failures == [0.0, 1.0, 0.0, 0.0]
    est.observe(st, 3, 3)  # all accepted: nothing rejected, position 3 never reached
    assert st.successes == [2.0, 1.0, 1.0, 0.0] and st.failures == [0.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        est.observe(st, 2, 3)


def test_estimator_converges_to_true_alpha() -> None:
    truth = (0.8, 0.6, 0.7)
    rng = random.Random(7)
    est = AcceptanceEstimator(AcceptanceConfig(max_k=3))
    states = [est.new_request() for _ in range(64)]
    drive(est, states, truth, 300, 3, rng)
    for j, alpha in enumerate(truth):
        assert est.prior("default").means[j] == pytest.approx(alpha, abs=0.02)
        assert sum(est.mean(st)[j] for st in states) / len(states) == pytest.approx(alpha, abs=0.02)
    # One request, remembering everything it saw.
    lone = AcceptanceEstimator(AcceptanceConfig(max_k=3, request_decay=1.0))
    st = lone.new_request()
    drive(lone, [st], truth, 3000, 3, rng)
    assert lone.mean(st) == pytest.approx(truth, abs=0.02)


def test_a_waves_last_requests_do_not_become_the_running_prior() -> None:
    """The running prior is the crowd's: 128 requests at alpha 0.9 for 20 steps, then the last two of
    them alone for 23 steps, every draft rejected (a request whose drafts never match). At full weight
    per observation their failures took position 0 to 0.77 here, and on an H200 (B = 128) to 0.67, where
    the next wave of 128 then decoded plain; weighed by how much each request was observed itself, the
    crowd's 0.9 holds, and each request's own estimate still falls to what it saw."""
    est = AcceptanceEstimator(AcceptanceConfig(max_k=4))
    wave = [est.new_request() for _ in range(128)]
    drive(est, wave, (0.9,) * 4, 20, 4, random.Random(3))
    assert est.prior("default").means[0] == pytest.approx(0.9, abs=0.02)
    for step in range(23):
        for st in wave[: 2 if step < 12 else 1]:
            est.observe(st, 4, 0)
        est.tick()
    assert est.prior("default").means[0] > 0.82
    assert est.mean(wave[0])[0] < 0.6  # its own failures still pull its own estimate down
    # A new request's first observations weigh in full: probes still teach a prior they are all of.
    fresh = AcceptanceEstimator(AcceptanceConfig(max_k=4))
    for _ in range(4):
        fresh.observe(fresh.new_request(), 1, 1)
    assert sum(fresh.prior("default").successes) == pytest.approx(4.0)


def test_refreshing_many_requests_at_once_reads_what_one_at_a_time_does() -> None:
    """The planner refreshes every decoding request's posterior in one numpy pass: same numbers as the
    per-request path, idle decay and stale flags included."""
    ests = [AcceptanceEstimator(AcceptanceConfig(max_k=4)) for _ in range(2)]
    states = [[e.new_request() for _ in range(40)] for e in ests]
    for step in range(30):
        for e, sts in zip(ests, states, strict=True):
            r = random.Random(step)  # both estimators see the same history
            for i, st in enumerate(sts):
                drafted = 0 if (i + step) % 5 == 0 else r.randint(1, 4)  # some requests idle this step
                accepted = sum(1 for _ in range(drafted) if r.random() < 0.7)
                e.observe(st, drafted, min(accepted, drafted))
            e.tick()
        ests[0].refresh_many(states[0])
        for a, b in zip(states[0], states[1], strict=True):
            assert not a.stale
            assert ests[1].estimate(b) == pytest.approx(a.safe, abs=1e-12)
            assert ests[1].mean(b) == pytest.approx(a.mean, abs=1e-12)
            assert ests[0].estimate(a) is a.safe  # already fresh: read as is


def test_estimate_is_pessimistic() -> None:
    rng = random.Random(3)
    est = AcceptanceEstimator(AcceptanceConfig(max_k=2))
    states = [est.new_request() for _ in range(32)]
    over = total = 0
    for _ in range(200):
        drive(est, states, (0.7, 0.7), 1, 2, rng)
        over += sum(est.estimate(st)[0] > 0.7 for st in states)
        total += len(states)
    assert over / total < 0.25  # read at the 25% quantile: over-estimates are the rare side
    assert all(s < m for st in states for s, m in zip(est.estimate(st), est.mean(st), strict=True))


def test_idle_request_decays_to_prior_and_probes() -> None:
    cfg = AcceptanceConfig(max_k=2, probe_after=20)
    est = AcceptanceEstimator(cfg)
    good = [est.new_request() for _ in range(8)]
    drive(est, good, (0.8, 0.8), 100, 2, random.Random(0))
    bad = est.new_request()
    for _ in range(60):
        est.observe(bad, 2, 0)
    assert est.mean(bad)[0] < 0.3
    for step in range(1, 200):
        est.observe(bad, 0, 0)
        assert est.wants_probe(bad) == (step >= cfg.probe_after)
    assert est.mean(bad)[0] == pytest.approx(est.prior("default").means[0], abs=0.02)
    est.observe(bad, 1, 1)
    assert not est.wants_probe(bad)


def test_depth_steps_raise_the_prior_of_deep_positions_only_and_never_above_the_ceiling() -> None:
    assert depth_steps_of([[0.6, 0.66, 0.6], [0.5, 0.6, 0.7]]) == pytest.approx((1.1, 1.0))
    assert depth_steps_of([]) == ()
    cfg = AcceptanceConfig(max_k=4, prior_mean=0.5, depth_steps=(("default", (1.2, 1.5, 1.5)),), depth_ceiling=0.9)
    est = AcceptanceEstimator(cfg)
    mean = est.mean(est.new_request())
    assert mean == pytest.approx((0.5, 0.6, 0.9, 0.9))
    # The scalar and the batched refresh agree.
    states = [est.new_request() for _ in range(40)]
    for i, st in enumerate(states):
        est.observe(st, 4, i % 5)
    est.refresh_many(states)
    batched = [est.mean(st) for st in states]
    for st in states:
        st.stale = True
        est._refresh(st)
    scalar = [est.mean(st) for st in states]
    # Flattened: approx compares flat sequences of numbers only.
    assert [m for means in scalar for m in means] == pytest.approx([m for means in batched for m in means])
    assert [len(means) for means in scalar] == [len(means) for means in batched]


def test_a_heads_report_gives_greedy_and_sampled_depth_steps(tmp_path) -> None:
    from streamsd.spec_decode.eagle.checkpoint import measured_depth_steps

    (tmp_path / "eval_report.json").write_text(json.dumps({"results": {
        "T=0": {"conditional_acceptance": [0.6, 0.66, 0.6]},
        "T=0.7": {"conditional_acceptance": [0.5, 0.6, 0.75]}}}))
    steps = dict(measured_depth_steps(tmp_path))
    assert steps["greedy"] == pytest.approx((1.1, 1.0)) and steps["sampled"] == pytest.approx((1.2, 1.25))
    assert measured_depth_steps(tmp_path / "missing") == ()
    cfg = AcceptanceConfig(max_k=4, depth_steps=tuple(steps.items()))
    assert cfg.depth_step(1, "sampled") == pytest.approx(1.2) and cfg.depth_step(3, "greedy") == 1.0
    assert cfg.depth_step(1, "default") == 1.0
