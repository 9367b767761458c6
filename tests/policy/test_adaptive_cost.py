"""Adaptive speculation's step prices (policy/adaptive/cost.py, shape.py, roofline.py)."""

from __future__ import annotations

import pytest

from streamsd.policy.adaptive import CostTable, RooflineModel
from streamsd.policy.adaptive.cost import StepTable
from streamsd.policy.adaptive.shape import ShapeTable
from tests.policy.adaptive_helpers import graph_shape


def test_cost_table_is_monotone_and_flat_within_buckets() -> None:
    table = CostTable.from_samples({1: 2.0, 8: 1.9, 16: 2.5, 32: 2.4, 64: 4.0}, {1: 0.5, 4: 0.6})
    got = [table.verify(n) for n in range(1, 65)]
    assert got == sorted(got)  # the noisy dips at 8 and 32 are lifted
    assert table.verify(9) == table.verify(16) == 2.5  # padded to the 16 bucket
    assert table.verify(128) == pytest.approx(8.0)  # past the last edge: proportional (pessimistic)
    # predict = verify(N) + k × draft(B); a plain step pays no draft; no draft table → zero draft cost.
    assert table.predict(4, 16, 3) == pytest.approx(2.5 + 3 * 0.6)
    assert table.predict(4, 4, 0) == pytest.approx(2.0)
    ngram = CostTable.from_samples({1: 2.0, 16: 2.5})
    assert ngram.predict(4, 16, 3) == ngram.predict(4, 16, 0) == 2.5


def test_roofline_ridge_near_200_tokens() -> None:
    model = RooflineModel.llama3_8b_h200()
    assert model.step_time(1, 160, 0) == pytest.approx(model.step_time(1, 1, 0))  # memory-bound
    assert model.step_time(1, 256, 0) > 1.2 * model.step_time(1, 1, 0)  # past the ridge


def test_graph_table_prices_the_graph_a_step_replays() -> None:
    cost = CostTable.from_samples({1: 4e-3, 64: 4.5e-3, 256: 9e-3}, shape=graph_shape())
    # Any speculation replays the width-5 graph: k = 1 costs what k = 4 costs, flat within a bucket.
    assert cost.predict(64, 65, 1) == cost.predict(64, 320, 4) == pytest.approx(4e-3 + 2e-5 * 320)
    assert cost.predict(33, 33, 0) == cost.predict(64, 64, 0) == pytest.approx(4e-3 + 2e-5 * 64)
    # A prompt chunk, or a batch past the largest bucket, runs eagerly: priced by the token table.
    assert cost.predict(16, 16 + 200, 0, prefill_tokens=200) == pytest.approx(9e-3)
    assert cost.predict(100, 100, 0) == cost.verify(100)
    # Each graph has its own correction key; plain and speculative steps do not share one.
    assert cost.key(64, 0, batch_size=64) != cost.key(320, 4, batch_size=64) == cost.key(65, 1, batch_size=64)


def test_eager_table_counts_the_batch_and_interpolates() -> None:
    # CPU-like: attention is one call per request, so 64 requests x 1 token cost far more than a
    # 64-token pass of one sequence (what the first profile timed).
    samples = {(b, w): 1e-3 + 2e-4 * b + 3e-5 * b * w for b in (1, 16, 64) for w in (1, 5)}
    shape = ShapeTable.from_samples(samples, padded=False)
    cost = CostTable.from_samples({64: 2e-3}, shape=shape)
    assert cost.predict(64, 64, 0) == pytest.approx(samples[(64, 1)])
    assert cost.predict(64, 192, 2) == pytest.approx(1e-3 + 2e-4 * 64 + 3e-5 * 192)  # linear in tokens
    assert samples[(16, 1)] < cost.predict(40, 40, 0) < samples[(64, 1)]  # linear between batch edges
    assert cost.predict(128, 128, 0) == pytest.approx(2 * samples[(64, 1)])  # proportional past the last


def test_an_eagle_heads_catch_up_is_priced_by_its_own_table() -> None:
    # A draft model replays missed KV inside its first draft forward (batch + lag tokens); an EAGLE head
    # has no draft table (its chain is learnt per key) and replays in a pass of its own.
    draft = CostTable.from_samples({1: 4e-3, 64: 5e-3}, {1: 1e-3, 64: 2e-3})
    assert draft.predict(1, 5, 4, draft_extra_tokens=40) == pytest.approx(5e-3 + 2e-3 + 3 * 1e-3)
    head = CostTable.from_samples({1: 4e-3, 64: 5e-3})
    head.catchup = StepTable.from_samples({1: 2e-4, 16: 3e-4, 64: 6e-4})
    assert head.predict(1, 5, 4) == pytest.approx(5e-3)
    assert head.predict(1, 5, 4, draft_extra_tokens=40) == pytest.approx(5e-3 + 6e-4)
    assert head.predict(1, 5, 4, draft_extra_tokens=128) == pytest.approx(5e-3 + 2 * 6e-4)  # proportional past


def test_shape_table_fills_untimed_cells_pessimistically_and_stays_monotone() -> None:
    timed = {(1, 1): 1.0, (1, 5): 1.2, (2, 1): 0.9, (2, 5): 2.0, (4, 1): 2.5}  # (4, 5): out of time
    shape = ShapeTable.from_samples(timed, padded=True, batches=(1, 2, 4, 8), widths=(1, 5))
    assert shape.timed == 5
    assert shape.values[1][0] == 1.0  # noise below a smaller batch is lifted to it
    assert shape.values[2][1] == pytest.approx(4.0)  # (4, 5): (2, 5) scaled by the batch
    assert shape.values[3][0] == pytest.approx(5.0) and shape.values[3][1] == pytest.approx(8.0)
    for row in shape.values:
        assert list(row) == sorted(row)


def test_an_eager_table_prices_small_verifies_as_timed_and_fills_its_rows_between_timed_widths() -> None:
    # This CPU's SmolLM2 at batch 1: 31, 49, 58, 61 and 63 ms for 1..5 rows. A line from width 1 to 5 priced
    # width 2 at 39 ms, and k = 1 looked cheaper than it is; a batch of 8 is timed at widths 1, 2 and 5 only.
    samples = {(1, 1): 31e-3, (1, 2): 49e-3, (1, 3): 58e-3, (1, 4): 61e-3, (1, 5): 63e-3,
               (8, 1): 70e-3, (8, 2): 110e-3, (8, 5): 200e-3}
    shape = ShapeTable.from_samples(samples, padded=False)
    cost = CostTable.from_samples({1: 31e-3}, shape=shape)
    assert cost.predict(1, 2, 1) == pytest.approx(49e-3)
    assert cost.predict(1, 3, 2) == pytest.approx(58e-3)
    # (8, 3) and (8, 4) lie on the row's line from (8, 2) to (8, 5), not on batch 1's curve scaled by 8.
    assert shape.values[1][2] == pytest.approx(140e-3) and shape.values[1][3] == pytest.approx(170e-3)
    assert cost.predict(8, 8 * 4, 3) == pytest.approx(170e-3)
    # Out of time at a batch of 64 after its width 1: its width 5 is the 32 row's scaled, the middle on
    # that row's line (not a width-3 step at batch 1 times 64).
    late = ShapeTable.from_samples({**samples, (32, 1): 0.3, (32, 5): 0.8, (64, 1): 0.6}, padded=False)
    assert late.values[3][4] == pytest.approx(1.6) and late.values[3][2] == pytest.approx(1.1)
