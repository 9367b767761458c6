"""The price of drafts on a CPU: an unpadded step is the plain step of its batch plus its drafts' rows."""

from __future__ import annotations

import random

import pytest

from streamsd.policy.adaptive.cost import CostTable
from streamsd.policy.adaptive.shape import ShapeTable

# A CPU-like profile: 32 requests at width 1 and 2, one at width 1 and 2 (seconds).
PROFILE = {(1, 1): 0.054, (1, 2): 0.054, (32, 1): 0.212, (32, 2): 0.266}


def cpu_cost() -> CostTable:
    return CostTable.from_samples({1: 0.054}, shape=ShapeTable.from_samples(PROFILE, padded=False))


def feed(cost: CostTable, drafts: int, measured: float) -> None:
    verify = 32 + drafts
    k = 1 if drafts else 0
    cost.observe(cost.predict_raw(32, verify, k), measured, verify_tokens=verify, draft_steps_k=k, batch_size=32)


def test_drafts_are_priced_by_what_they_add_to_the_plain_step() -> None:
    # The machine: its plain step runs at 0.75x the profile, each draft's row costs 2.1 ms where the
    # profile's line says 1.69. A ratio of the whole step learnt ~0.75 and priced a draft at 1.3 ms.
    cost, rng = cpu_cost(), random.Random(3)
    plain_s, per_draft = 0.159, 2.1e-3
    for step in range(200):
        drafts = 0 if step % 3 else rng.choice((6, 8, 13, 20))
        feed(cost, drafts, (plain_s + per_draft * drafts) * rng.uniform(0.98, 1.02))
    base = cost.predict(32, 32, 0)
    assert base == pytest.approx(plain_s, rel=0.03)
    for drafts in (2, 8, 16):
        assert (cost.predict(32, 32 + drafts, 1) - base) / drafts == pytest.approx(per_draft, rel=0.15)


def test_a_speculative_step_never_reads_cheaper_than_the_plain_one() -> None:
    # Speculative steps that measured below the plain step (noise, or drafts never proposed) teach
    # their rows a price of zero at most: a step with drafts still costs what the plain one does.
    cost = cpu_cost()
    for step in range(60):
        feed(cost, 0 if step % 2 else 13, 0.16 if step % 2 else 0.14)
    assert cost.predict(32, 33, 1) >= cost.predict(32, 32, 0)
    assert cost.predict(32, 45, 1) >= cost.predict(32, 32, 0)


def test_one_draft_among_many_rows_teaches_nothing() -> None:
    # One draft adds 0.8 % to a 32-request step: the plain step's own noise, not a reading of the draft.
    cost = cpu_cost()
    feed(cost, 0, 0.16)
    before = dict(cost.seen)
    feed(cost, 1, 0.20)
    assert cost.seen == before
