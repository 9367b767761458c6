"""The adaptive-speculation simulator's claims (8B target, H200 roofline); policy/adaptive needs no torch."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from statistics import median

import pytest

from streamsd.policy.adaptive.simulator import SimConfig, simulate
from streamsd.policy.adaptive.workload import AlphaDrift, ProposerSpec

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
FIXED = tuple(f"fixed:{k}" for k in range(1, 7))
DRIFT = AlphaDrift(base=0.55, amplitude=0.3, period_s=4.0)


def proposer(kind: str, alpha: AlphaDrift = DRIFT, **kw: object) -> ProposerSpec:
    if kind == "draft":
        return ProposerSpec.draft_model(alpha, **kw)
    return ProposerSpec(kind, alpha, **kw)  # type: ignore[arg-type]


def workload(batch: int) -> tuple[float, int]:
    """(simulated seconds, seeds): a batch of one request is noisy, a batch of 256 slow to simulate."""
    return (4.0, 2) if batch <= 4 else (2.5, 1) if batch <= 64 else (1.0, 1)


def run(cfg: SimConfig, *policies: str, seeds: int = 1) -> dict[str, float]:
    """Tokens/s per policy, averaged over ``seeds`` workloads (the same ones for every policy)."""
    rates = {p: 0.0 for p in policies}
    for seed in range(seeds):
        for p in policies:
            rates[p] += simulate(replace(cfg, seed=seed), p).tokens_per_s / seeds
    return rates


def test_package_imports_no_torch() -> None:
    code = ("import sys, streamsd.policy.adaptive, streamsd.policy.adaptive.simulator; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize("kind", ["draft", "ngram", "synthetic"])
def test_adaptive_never_slower_than_plain(kind: str) -> None:
    for batch in SIZES:
        seconds, seeds = workload(batch)
        got = run(SimConfig(proposer(kind), concurrency=batch, duration_s=seconds), "plain", "adaptive", seeds=seeds)
        assert got["adaptive"] / got["plain"] >= 0.99, batch


@pytest.mark.parametrize("kind,alpha", [("draft", AlphaDrift(0.7)), ("synthetic", AlphaDrift(0.6)),
                                        ("draft", AlphaDrift(0.6, 0.15, period_s=20.0))])
def test_adaptive_within_one_percent_of_best_fixed_k(kind: str, alpha: AlphaDrift) -> None:
    for batch in SIZES:
        seconds, seeds = workload(batch)
        cfg = SimConfig(proposer(kind, alpha), concurrency=batch, duration_s=seconds)
        got = run(cfg, "plain", "adaptive", *FIXED, seeds=seeds)
        assert got["adaptive"] >= 0.99 * max(got[p] for p in ("plain", *FIXED)), batch


@pytest.mark.parametrize("kind", ["draft", "synthetic"])
@pytest.mark.parametrize("batch", [64, 128])
def test_mixed_acceptance_batch_beats_every_single_k(kind: str, batch: int) -> None:
    cfg = SimConfig(proposer(kind, alpha_choices=(0.9, 0.2)), concurrency=batch, duration_s=1.5)
    got = run(cfg, "plain", "adaptive", *FIXED)
    assert got["adaptive"] >= 1.03 * max(got[p] for p in ("plain", *FIXED))


@pytest.mark.parametrize("kind", ["draft", "ngram", "synthetic"])
def test_switches_are_bounded(kind: str) -> None:
    # Without prefill the step conditions only drift: the decision must not flap.  A probe step
    # (at most one per 64 plain steps) is two switches.
    for batch in (96, 160, 256):
        cfg = SimConfig(proposer(kind), concurrency=batch, duration_s=1.0, prompt_len=(0, 0))
        assert simulate(cfg, "adaptive").switches_per_100 <= 4.0, batch
    # With prefill chunks a switch may follow each chunk (a compute-bound step drops drafts), no more.
    for batch in (64, 128):
        got = simulate(SimConfig(proposer(kind), concurrency=batch, duration_s=1.0), "adaptive")
        assert got.switches <= got.prefill_toggles + 2 * got.steps / 100, batch


def test_poisson_load_sweep() -> None:
    for rate in (8.0, 32.0, 96.0, 160.0):
        cfg = SimConfig(proposer("draft"), concurrency=None, arrival_rate=rate, duration_s=3.0, output_len=(64, 512))
        plain, adaptive = simulate(cfg, "plain"), simulate(cfg, "adaptive")
        assert adaptive.tokens_per_s >= 0.99 * plain.tokens_per_s, rate
        assert adaptive.mean_tpot_s <= plain.mean_tpot_s, rate


def test_online_correction_tracks_a_wrong_startup_table() -> None:
    cfg = SimConfig(proposer("draft"), concurrency=32, duration_s=1.5, table_scale=0.85, table_noise=0.03)
    got = simulate(cfg, "adaptive", keep_records=True)
    errors = [abs(r.predicted_s / r.measured_s - 1.0) for r in got.records[50:]]
    assert median(errors) < 0.03
