"""How many drafts each request verifies this step: a fixed k, or the adaptive planner.

Torch-free: the scheduler asks `choose` once per step for its decoding requests — while the previous
step still runs when the policy `plans_ahead`, so that planning hides behind the GPU — `commit`s the
decision with the shape of the step it actually built, and feeds the step back through `observe`.
The adaptive policy (streamsd.policy.adaptive) maximises expected tokens per second from a measured cost
table and per-request acceptance estimates, with plain decoding (k = 0 for everyone) always a
candidate.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from streamsd.policy.adaptive import AcceptanceConfig, AcceptanceEstimator, CostTable, PlannerState, plan
from streamsd.policy.probes import Probes
from streamsd.policy.record import PolicyRecord, profile_ms
from streamsd.request import Request

if TYPE_CHECKING:
    from streamsd.sched.plan import StepPlan

REPLAN_EVERY = 8
ENTRY_HYSTERESIS = 0.02  # the gain over plain decoding that entering speculation needs
QUEUED_DEPTH_HYSTERESIS = 0.05  # the gain deeper drafts need where deepening drops the step queued ahead
# ... and entering speculation where steps queue ahead. The queued step is taken across every switch
# but a deeper one (Lookahead.follow), yet an excursion still runs three steps nothing was
# queued behind: the entering one, the first speculative one and the first plain one after it, each
# waiting for the host. (While switches dropped the queued step, 10 % was needed: one excursion had
# cost alpha 0.7 at B = 128 9 % against plain on an H200.)
QUEUED_ENTRY_HYSTERESIS = 0.05


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step computes, as the cost table prices it."""

    batch: int  # decoding requests
    verify_tokens: int  # every token the target computes, prompt chunks included
    draft_steps: int  # the drafter's sequential steps after the verify (the largest k)
    draft_batch: int  # requests drafting
    prefill_tokens: int
    verify_width: int  # the widest request's 1 + drafts verified (1 + draft_steps but when k changes)


@dataclass(slots=True)
class Decision:
    """One step's k per decoding request, and what `observe` learns from the step once it ran."""

    ks: dict[str, int]  # by request id; a request not in it takes `default_k`
    planned: bool = False  # the planner ran (else: a plain step between re-plans, or a fixed k)
    planned_shape: StepShape | None = None
    draft_extra_tokens: int = 0  # draft-model catch-up the plan priced in
    predicted_s: float = 0.0  # of the step as built (`commit`)
    predicted_raw_s: float = 0.0  # the same from the start-up table alone
    shape: StepShape | None = None  # as built
    # Drafts to verify where `ks` says fewer: a probe's, proposed in the step before (policy/probes.py).
    verify: dict[str, int] = field(default_factory=dict)
    probing: bool = False  # carries a probe in a batch that is not speculating: its extra time is the probe's
    # The target's forwards write an EAGLE head's streams (model/stream_store.py). A batch that has
    # decoded plain for a while stops: the head recomputes what it missed once it drafts again.
    streams: bool = True
    # Requests whose proposer proposed fewer drafts than the step before asked, all of them verified
    # here: their chain ended where the drafts ran out (AdaptivePolicy.short_drafts_fail).
    short: set[str] = field(default_factory=set)


class SpeculationPolicy(Protocol):
    @property
    def plans_ahead(self) -> bool:
        """Whether the engine may choose step N+1's k while step N runs (see Scheduler.plan_ahead)."""
        ...

    def choose(self, decoding: list[Request], prefill_tokens: int, backlog: bool) -> Decision: ...

    def default_k(self, r: Request) -> int: ...

    def joining_k(self, r: Request, batch: int) -> int:
        """The k of a request whose prompt completes this step, when `batch` requests may decode in the
        next: drafts it proposes now are verified only if the batch it joins speculates."""
        ...

    def commit(self, decision: Decision, plan: StepPlan) -> None: ...

    def observe(self, decision: Decision, verified: list[tuple[Request, int, int]], seconds: float) -> None: ...


def acceptance_class(r: Request) -> str:
    """The running prior a request's acceptance borrows from: greedy and sampled requests of one proposer
    accept differently (the shipped EAGLE head at position 0: 0.67 at T = 0, 0.55 at T = 0.7), and
    pooled, a stretch of sampled requests would price the next greedy one at their level."""
    return "greedy" if r.params.greedy else "sampled"


def cap_k(r: Request) -> int:
    """The most drafts worth verifying: the request's own k, and no more than it can still emit."""
    return max(0, min(r.spec_k, r.remaining_tokens - 1))


def _replan_due(idle_steps: int, every: int = REPLAN_EVERY) -> bool:
    """Plain steps since the batch last speculated after which to plan again: 1, 2, 4, 8, then every
    `every`. Soon after a switch, which may have been a close call or a misjudged step, while a
    batch that plain decoding keeps winning costs a plan per `every` steps only."""
    return idle_steps % every == 0 or idle_steps & (idle_steps - 1) == 0


def idle_plan_fits(plans: int, plan_s: float, idle_steps: int, step_s: float, budget: float) -> bool:
    """Whether one more plan keeps an idle batch's plans, the backoff's included, within `budget` of
    its idle time. The first one is free (the switch to plain may have been a close call). On the
    H200 at B = 256 the backoff's six 4 ms plans in 64 steps of 9 ms read as 4-6 % against plain."""
    if plans == 0 or budget <= 0.0 or step_s <= 0.0:
        return True
    return (plans + 1) * plan_s <= budget * idle_steps * step_s


def idle_replan_every(plan_s: float, step_s: float, budget: float) -> int:
    """Plain steps between two plans of a batch that is not speculating: REPLAN_EVERY, or more where
    a plan costs more than `budget` of the steps between (at B = 256 on an H200 a plan took ~4 ms of
    host time beside 9 ms steps, and each planned step read 4-5 ms slower than the others)."""
    if step_s <= 0.0 or budget <= 0.0:
        return REPLAN_EVERY
    return max(REPLAN_EVERY, math.ceil(plan_s / (budget * step_s)))


class FixedPolicy:
    """k = K for every request, while at most `max_batch` requests decode (0: any number); plain steps
    above it. The gate is set per step by `choose`, so requests joining the step follow it too."""

    plans_ahead = False  # its choice is a lookup: nothing to hide

    def __init__(self, max_batch: int = 0):
        self.max_batch = max_batch
        self.speculating = True

    def choose(self, decoding: list[Request], prefill_tokens: int, backlog: bool) -> Decision:
        self.speculating = not self.max_batch or len(decoding) <= self.max_batch
        return Decision({})  # every request takes default_k

    def default_k(self, r: Request) -> int:
        return cap_k(r) if self.speculating else 0

    def joining_k(self, r: Request, batch: int) -> int:
        return cap_k(r) if not self.max_batch or batch <= self.max_batch else 0

    def commit(self, decision: Decision, plan: StepPlan) -> None:
        pass

    def observe(self, decision: Decision, verified: list[tuple[Request, int, int]], seconds: float) -> None:
        pass


@dataclass(slots=True)
class AdaptivePolicy:
    max_k: int
    cost: CostTable
    draft_has_cache: bool  # a draft model (or EAGLE head) must replay what it missed while at k = 0
    # How far behind the target's tokens a caught-up proposer cache is: 1 for an EAGLE head, whose slot
    # of the pending token waits for that token's streams. Only the lag beyond it is catch-up.
    settled_lag: int = 0
    # Speculative steps are queued ahead (an EAGLE head, device-side synthetic drafts): a plan of a
    # new depth drops the queued step, so the planner keeps its depth unless another clearly wins.
    queues_ahead: bool = False
    # The proposer's measured depth steps per acceptance class (AcceptanceConfig.depth_steps).
    depth_steps: tuple[tuple[str, tuple[float, ...]], ...] = ()
    plan_budget: float = 0.01  # share of a plain batch's time its periodic re-plans may take
    # Plain steps after the batch last speculated that still write an EAGLE head's streams
    # (Decision.streams); later ones keep none, and a resuming head has them recomputed.
    keep_streams_steps: int = 16
    plan_seconds: float = 0.0  # host time of the last plan
    estimator: AcceptanceEstimator = field(init=False)
    planner: PlannerState = field(default_factory=PlannerState)
    record: PolicyRecord = field(default_factory=PolicyRecord)  # for /metrics and benchmarks
    choices: int = 0  # `choose` calls (one per step; the last one made ahead may go unused)
    idle_steps: int = 0
    idle_plans: int = 0  # the idle schedule's plans since the batch last speculated (`idle_plan_fits`)
    unticked: int = 0  # a small batch's plain steps between plans whose prior decay is still owed
    # Steps observed and not yet learnt from: `observe` runs between two steps, serially with the
    # GPU; `learn` runs at the next `choose`, which the engine overlaps with the GPU.
    unlearnt: list[tuple[Decision, list[tuple[Request, int, int]], float]] = field(default_factory=list)
    last_kind: tuple[int, int] = (1, 0)  # (verify width, draft steps) of the last step learnt: plain
    probes: Probes = field(default_factory=Probes)  # granted and not yet verified (policy/probes.py)
    # The proposer may propose fewer drafts than asked (n-gram lookup without a match). A draft never
    # proposed yields no token, as a rejected one: counted as a rejection where the drafts ran out, so
    # acceptance reads per draft asked. Per draft proposed, n-gram drafts of chat on SmolLM2 read 0.28
    # while 59 % of the drafts asked were never proposed, and k = 1 yielded 1.11 tokens a step, not 1.28.
    short_drafts_fail: bool = False
    asked: dict[str, int] = field(default_factory=dict)  # request id -> drafts the last step built asked for

    def __post_init__(self) -> None:
        self.estimator = AcceptanceEstimator(AcceptanceConfig(max_k=max(self.max_k, 1), depth_steps=self.depth_steps))
        if self.queues_ahead:
            self.planner.config = replace(self.planner.config, depth_hysteresis=QUEUED_DEPTH_HYSTERESIS)

    @property
    def hysteresis(self) -> float:
        """The gain over plain decoding that entering speculation needs."""
        return QUEUED_ENTRY_HYSTERESIS if self.queues_ahead else ENTRY_HYSTERESIS

    @property
    def plans_ahead(self) -> bool:
        """Planning while the previous step runs hides the planner's host time, but each plan has then
        learnt one step less. With a draft model that must replay its KV when it resumes, the staler
        switching cost more than it saved: in the simulator's Poisson sweep at 160 requests/s, 0.98x
        plain instead of 1.00x (6 seeds); with n-gram and synthetic drafts it was even or better."""
        return not self.draft_has_cache

    def choose(self, decoding: list[Request], prefill_tokens: int, backlog: bool) -> Decision:
        self.learn()
        self.choices += 1
        # While plain decoding wins, re-plan every few steps only: the planner's Python time is
        # then off the plain path, which must stay as fast as a server without speculation.
        speculating = self.planner.speculating
        self.idle_steps = self.idle_steps + 1 if not speculating else 0
        self.idle_plans = 0 if speculating else self.idle_plans
        # ... but at once on the very first step and when the batch at least doubled since the last
        # plan (a new wave of requests): otherwise a fresh batch decodes plain for REPLAN_EVERY steps
        # before its first plan. Not on every arrival: under churn that would re-plan each step.
        fresh = self.choices == 1 or len(decoding) >= 2 * max(self.planner.batch, 1)
        if self.probes:
            self.probes.age({r.request_id for r in decoding})
        if not (speculating or fresh or self._idle_plan_due()):
            # Every request takes default_k, 0 since the batch is not speculating; but a probe's.
            return self._with_probes(Decision({}, planned=bool(self.probes)))
        # Only the idle schedule's plans count against its budget: the first idle plan stays free after
        # the plans a filling batch made (a cold prior's probe waits for one: B = 128 on an H200).
        self.idle_plans += not (speculating or fresh)
        t0 = time.perf_counter()
        if self.unticked:
            self.estimator.tick(self.unticked)
            self.unticked = 0
        for r in decoding:
            if r.acceptance is None:
                r.acceptance = self.estimator.new_request(acceptance_class(r))
        # Cold (a whole-batch probe) and guessing (the strict gate) describe a batch that knows nothing:
        # a request of a new class among informed ones is probed, and corrected, like any other.
        classes = {r.acceptance.proposer for r in decoding}
        views = self.estimator.views([(r.acceptance, r.request_id, cap_k(r), self._lag(r), r.remaining_tokens)
                                      for r in decoding])
        st = self.planner
        ks = plan(views, self.cost, self.max_k, self.hysteresis, state=st, prefill_tokens=prefill_tokens,
                  prefill_backlog=backlog, cold=all(map(self.estimator.cold, classes)),
                  guessing=not any(map(self.estimator.informed, classes)))
        self.plan_seconds = time.perf_counter() - t0
        self.record.planned(self.choices, views, st, ks)
        by_id = {r.request_id: k for r, k in zip(decoding, ks, strict=True)}
        self.probes.grant(st.probed, by_id)
        shape = StepShape(st.batch, st.verify_tokens, st.draft_steps, sum(k > 0 for k in ks), st.prefill_tokens,
                          st.draft_steps + 1)
        return self._with_probes(Decision(by_id, True, shape, st.draft_extra_tokens, st.predicted_s,
                                          st.predicted_raw_s))

    def _lag(self, r: Request) -> int:
        """Draft catch-up owed beyond the settled lag: what a resuming proposer cache must replay, with
        the positions whose streams the target recomputes first counted again (the planner prices a
        resumption's replay by its tokens alone: a target pass over them is priced like the head's)."""
        if not self.draft_has_cache:
            return 0
        lag = max(r.num_tokens - self.settled_lag - r.draft_computed, 0)
        if r.streams_missing_from is not None:
            lag += max(r.num_tokens - 1 - max(r.streams_missing_from, r.draft_computed), 0)
        return lag

    def _with_probes(self, decision: Decision) -> Decision:
        """The decision with the probes in flight; one that changes k is priced as built."""
        if self.probes and self.probes.apply(decision.ks, decision.verify):
            decision.planned_shape = None
        decision.probing = bool(self.probes) and not self.planner.speculating
        decision.streams = self.planner.speculating or self.idle_steps < self.keep_streams_steps
        return decision

    def _idle_plan_due(self) -> bool:
        n = self.idle_steps
        return (_replan_due(n, idle_replan_every(self.plan_seconds, self.record.last_measured, self.plan_budget))
                and idle_plan_fits(self.idle_plans, self.plan_seconds, n, self.record.last_measured, self.plan_budget))

    def default_k(self, r: Request) -> int:
        """Drafts for a request finishing its prompt: follow the batch's current mode."""
        return cap_k(r) if self.planner.speculating else 0

    def joining_k(self, r: Request, batch: int) -> int:
        """The planner prices k per request at its next plan: a joining request follows the mode now."""
        return self.default_k(r)

    def commit(self, decision: Decision, plan: StepPlan) -> None:
        self.commit_shape(decision, *plan.shape())
        if self.short_drafts_fail:
            self._note_short(decision, plan)
        if self.probes:
            for e in plan.entries:
                if e.verifies and e.k_next:
                    self.probes.proposed(e.request.request_id)

    def _note_short(self, decision: Decision, plan: StepPlan) -> None:
        """Which requests verify every draft their proposer proposed after the step before, fewer than
        that step asked for; and what this step asks for."""
        asked, self.asked = self.asked, {}
        for e in plan.entries:
            rid = e.request.request_id
            if e.verifies and e.num_drafts == len(e.request.draft_ids) < asked.get(rid, 0):
                decision.short.add(rid)
            if e.k_next:
                self.asked[rid] = e.k_next

    def commit_shape(self, decision: Decision, shape: StepShape, ks: list[int]) -> None:
        """The step as the scheduler built it, which may differ from the plan: drafts verified are
        capped by those cached, requests finish or join, and a plan made while the previous step ran
        saw that step's batch. ``ks``: the k each decoding request got. The prediction `observe`
        checks, and the metrics, are the built step's."""
        decision.shape = shape
        self.record.built(shape.batch, shape.verify_width == 1 and not shape.draft_steps, ks)
        if shape == decision.planned_shape:
            return
        extra = decision.draft_extra_tokens if shape.draft_steps else 0
        decision.predicted_s, decision.predicted_raw_s = self.cost.predict_with_raw(
            shape.batch, shape.verify_tokens, shape.draft_steps, draft_batch=shape.draft_batch,
            draft_extra_tokens=extra, prefill_tokens=shape.prefill_tokens, verify_width=shape.verify_width)

    def observe(self, decision: Decision, verified: list[tuple[Request, int, int]], seconds: float) -> None:
        self.unlearnt.append((decision, verified, seconds))

    def learn(self) -> None:
        """Applies the steps observed since the last call, oldest first."""
        for decision, verified, seconds in self.unlearnt:
            self._learn_step(decision, verified, seconds)
        self.unlearnt.clear()

    def _learn_step(self, decision: Decision, verified: list[tuple[Request, int, int]], seconds: float) -> None:
        shape = decision.shape
        if shape is None or seconds <= 0:
            return
        if decision.probing and shape.batch and not shape.prefill_tokens:
            self.probes.charge(seconds, self.cost.predict(shape.batch, shape.batch, 0))
            self.planner.probe_extra = self.probes.mean_extra
        if not decision.planned:
            # A plain step between re-plans. Its cost still teaches the table (a lookup, no planning),
            # so the plain side of the next plan's comparison is as well calibrated as the speculative
            # one; steps with a prompt chunk are left out, their share of the time is not the plain step's.
            if shape.batch and not shape.prefill_tokens:
                self._learn_cost(decision, shape, seconds)
            if 0 < shape.batch <= self.planner.config.small_batch:
                # A small batch's running prior forgets per step, as the estimator's model says, not per
                # plan: one excursion that ended on a run of rejections (which is how excursions end)
                # otherwise ruled for thousands of steps. On an H200 at batch 1 it held the prior at
                # 0.45 for 2000 steps and no later request tried (adaptive eagle 1.00x, fixed k = 4
                # 1.44x). Requests' own idle decay still waits for the plans: per step, every request
                # whose drafts never pay would explore anew every few dozen steps. A large batch keeps
                # its prior through idle stretches, where a forgotten one means a whole-batch probe.
                # Counted here and forgotten at the next plan, in one power: the plain path stays O(1).
                self.unticked += 1
                self.planner.since_probe += 1
            return
        for r, drafted, accepted in verified:
            # All the drafts proposed accepted, fewer than asked: the next one, never proposed, failed.
            short = r.request_id in decision.short and accepted >= drafted
            if r.acceptance is not None:
                self.estimator.observe(r.acceptance, drafted + short, accepted)
            if (drafted or short) and self.probes:
                self.probes.verified(r.request_id)
        self.estimator.tick()
        if shape.batch:
            self._learn_cost(decision, shape, seconds)

    def _learn_cost(self, decision: Decision, shape: StepShape, seconds: float) -> None:
        # Only a steady step teaches the table: one of the same kind (verify width, draft steps) as the
        # step before. A step entering or leaving speculation (width and drafter steps disagree) is
        # neither the plain step nor the speculative one; a step of a new kind could not be queued
        # behind the one before (worker/lookahead.py) and waited for the queued step it dropped. Learnt, such
        # steps read 1.3-2x their steady cost on an H200 and priced their shape out for good.
        kind = (shape.verify_width, shape.draft_steps)
        steady = shape.verify_width == shape.draft_steps + 1
        settled, self.last_kind = kind == self.last_kind, kind
        if steady and settled:
            self.cost.observe(decision.predicted_raw_s, seconds, verify_tokens=shape.verify_tokens,
                              draft_steps_k=shape.draft_steps, batch_size=shape.batch,
                              prefill_tokens=shape.prefill_tokens)
        self.record.learnt((shape.batch, shape.verify_tokens, shape.verify_width, shape.draft_steps), steady and settled,
                           decision.predicted_s, decision.predicted_raw_s, seconds)

    def summary(self) -> dict[str, object]:
        """For benchmarks: how the policy decided and how well it predicted (every observed step learnt)."""
        self.learn()
        return {
            **self.record.summary(),
            "switches": self.planner.switches,
            # What the cost table has learnt (it outlives the pass): why a shape is or is not chosen.
            "cost_global_ratio": self.cost.global_ratio,
            # Per key: its relative ratio, its samples, its first samples (measured / raw).
            "cost_relative": {"x".join(map(str, key)): [rel, self.cost.seen.get(key, 0), self.cost.first.get(key, [])]
                              for key, rel in sorted(self.cost.relative.items())},
            "prior_means": {name: list(p.means) for name, p in self.estimator.priors.items()},
            "profile_ms": profile_ms(self.cost),
        }
