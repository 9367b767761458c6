"""Adaptive speculation: k chosen per request and per step from measured step costs
and observed acceptance, so speculation is never slower than plain decoding at any load.

Torch-free: the scheduler calls it on the event-loop side.

    cost.py        step-time table (measured, monotone, bucket-flat) + online correction
                   (shape.py: the engine's B x (1 + k) step shape; roofline.py: the analytic fallback)
    acceptance.py  per-request, per-position Beta posteriors read at a lower quantile
    planner.py     per-step k_i maximising expected tokens per second, with hysteresis and probes
                   (budget.py: the search over ranked drafts; beta.py: scipy-free Beta quantiles)
    simulator.py   discrete-event simulator (workload.py: requests, proposers, α drift)

``python -m streamsd.policy.adaptive [out.json]`` prints the simulator's batch-size sweep.

Per scheduler step::

    views = [est.view(r.acceptance, r.id, cap_k(r), r.draft_lag) for r in decoding]
    ks = plan(views, cost, K, state=planner, prefill_tokens=chunk, prefill_backlog=queued)
    reserve(kv_slots_needed(ks)); result = run_step(ks)              # engine
    for r, k, a in zip(decoding, ks, result.accepted): est.observe(r.acceptance, k, a)
    est.tick(); cost.observe(planner.predicted_raw_s, result.seconds,
                             verify_tokens=planner.verify_tokens, draft_steps_k=planner.draft_steps)
"""

from __future__ import annotations

from streamsd.policy.adaptive.acceptance import AcceptanceConfig, AcceptanceEstimator, RequestAcceptance
from streamsd.policy.adaptive.cost import CostTable, StepTable
from streamsd.policy.adaptive.planner import (
    PlannerConfig,
    PlannerState,
    RequestView,
    expected_tokens,
    kv_slots_needed,
    plan,
)
from streamsd.policy.adaptive.roofline import RooflineModel

__all__ = [
    "AcceptanceConfig",
    "AcceptanceEstimator",
    "CostTable",
    "PlannerConfig",
    "PlannerState",
    "RequestAcceptance",
    "RequestView",
    "RooflineModel",
    "StepTable",
    "expected_tokens",
    "kv_slots_needed",
    "plan",
]
