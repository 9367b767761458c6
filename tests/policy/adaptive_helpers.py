"""Cost tables the adaptive-speculation tests share: an H200 roofline's, and a padded graph table; and
the planner's predicted gain over plain decoding."""

from __future__ import annotations

from streamsd.policy.adaptive import CostTable, PlannerState, RequestView, RooflineModel, plan
from streamsd.policy.adaptive.shape import ShapeTable
from streamsd.policy.adaptive.workload import default_buckets


def h200_cost(draft: bool = True) -> CostTable:
    return CostTable.from_roofline(RooflineModel.llama3_8b_h200(), RooflineModel.llama32_1b_h200() if draft else None,
                                   default_buckets(), spec_overhead_s=1e-4)


def entry_gain(views: list[RequestView], cost: CostTable, max_k: int) -> float:
    """How much better than plain decoding the planner's best plan is predicted (no hysteresis)."""
    probe = PlannerState()
    plan(views, cost, max_k, 0.0, state=probe)
    return probe.spec_rate / probe.plain_rate - 1.0


# -- step-shape tables (the engine's own B x (1 + k) shape; CUDA graphs on a GPU) ------------------
def graph_shape() -> ShapeTable:
    """Graph replay times of an 8B-like target with widths (1, K + 1) = (1, 5) captured."""
    samples = {(b, w): 4e-3 + 2e-5 * b * w for b in (1, 2, 4, 8, 16, 32, 64) for w in (1, 5)}
    return ShapeTable.from_samples(samples, padded=True)
