"""Planner: how many drafts k_i each decoding request verifies this step (torch-free).

Objective: expected tokens per second of the step.  With per-position acceptance estimates
a_i0, a_i1, … the (j+1)-th draft of request i survives with s_ij = Π_{l≤j} a_il, and a step yields
Σ_i (1 + Σ_{j<k_i} s_ij) tokens in expectation — (1 − α^(k+1)) / (1 − α) per request for a constant α.

Search.  Inside a request survival falls with depth, so a total draft budget S is best spent on
the S largest survivals across the batch (ties to the shallower draft); each request then drafts
a prefix.  The drafter runs max k_i sequential steps for the whole batch, and a CUDA graph pads
every request to the widest query, so the ranking is cut per depth limit L = 1, 2, … (stopping
after two levels without gain; one level only when depth is free: n-gram or synthetic drafts in
an eager step).  Within a level only the ends of the cost model's flat segments are
scored — S that fills a verify bucket, S just before max k_i grows, powers of two, all of it —
since inside a segment more tokens cost nothing more.  Plain decoding (S = 0) is always a candidate.

Two estimates.  Survivals are computed from the posterior means (the expected rate, which picks
the plan) and from the lower quantiles (the safe rate, which must beat plain decoding for any
plan to be allowed).  Over-estimating α only hurts when it makes speculation slower than plain,
and that is what the gate tests with the pessimistic numbers; choosing depth from the means
avoids compounding every position's pessimism into needlessly shallow drafts.

Ceiling.  A batch that is not speculating and owes no probe is first bounded (``Search.hopeless``):
per depth band, its best survivals at the cheapest step of that many drafts.  Where no band could
pass the gate the plan is plain without ranking the B·K drafts, and it is the plan the search would
have made (tested): at B = 256 the ranking was most of a 2-4 ms plan.

Prefill.  Chunks add verify tokens.  Normally prefill is owed either way, so it is charged what
it adds to a plain step and speculation pays for what it adds on top (past the compute ridge,
much).  When prompts are queued behind the chunk budget (``prefill_backlog``) admission is the
bottleneck and every second a step takes delays them, so prefill tokens count as output tokens.

Draft catch-up.  A draft model resuming after plain steps replays what its KV missed
(``catchup_tokens``).  The replay is paid once and serves later steps, so it is amortised over
``catchup_horizon`` steps; the plan restricted to requests with little lag is tried too, since
resuming a long-plain batch at once rarely pays while resuming its newest requests often does.

Hysteresis.  Entering speculation needs a safe rate better than plain by ``hysteresis``; leaving
happens as soon as plain is predicted better; a new depth limit must beat the last plan's by
``depth_hysteresis`` (changing it drops the step queued ahead).  The band stops a batch near break-even from
flapping between the engine's plain and speculative paths; its asymmetry keeps the failure we
guard against — speculating while slower than plain — outside it.  Entering must also pay for
itself before the batch ends: an excursion costs about ``entry_steps`` plain steps beyond its
own (the entering step proposes without verifying, and the steps around a switch wait for the
host), so a gain g needs ``left · (1 − 1/g) ≥ entry_steps`` with ``left`` the median tokens the
batch's requests may still emit (on an H200 at B = 256, alpha 0.9, a 14 % gain entered 14 tokens
before its requests' end and lost 1-16 % of the pass).  Deeper drafts, where steps queue ahead, are
such a switch too (the queued step is dropped, the step that deepens waits for the host): a new depth
must pay for itself the same way (at B = 256, alpha 0.9, k = 1 went to 2 ten tokens before the end
with a 29 ms step and a 44 ms one, and the cell read 0.98x).

Probing.  A request flagged ``probe`` (long at k = 0) drafts ``probe_k`` for free when the step
speculates anyway; in a plain step one probe step per ``probe_every`` steps is spent, only while
an optimistic α (``probe_alpha``) for the probed requests would make speculation pay at this batch
— a compute-bound batch never pays for probes it could not use — and no more often than keeps the
probes' extra time under ``probe_budget`` of the steps between them (the larger of the table's
price and what the probes so far were measured to cost: on this CPU at 32 requests the table's
unseen speculative shape priced them at a fraction of their cost, and they took 3 % of the time).  While the proposer's
running prior is ``cold`` (no evidence yet, or forgotten) every request may probe, at once: a CUDA
graph pads the batch to its widest request, so at B = 128 four probes cost the step of 128 and one
step of them all is what teaches the prior; without it a large batch that the default prior keeps
plain never learnt that its drafts were good (B = 128 at alpha 0.9 on an H200). Such a batch does not
enter speculation before that probe's evidence is in: the default prior is a guess, and on a CPU at
B = 32 (a width-2 step 1.25 plain ones, width 5 two) a fresh batch entered at k = 2 on it while n-gram
drafts of chat were accepted a quarter of the time. The probe is the cheapest step that teaches (one
draft each); the entry is then the strict gate's, on the lower quantiles the evidence gives. A small
batch may still enter on the strict gate: its excursion is a few requests' steps, and in the simulator
at batch 2 waiting for a probe's evidence first cost n-gram drafts 2 % of their gain.

Small batches.  Up to ``small_batch`` requests, a plan passes when its *expected* rate clears the
floor and its pessimistic rate loses at most ``small_batch_loss`` against plain (unless the
running prior has never held evidence, ``guessing``: its means are then only the configured
default).  Forgotten evidence does not count as none here: at batch 1 the prior forgets within ~60
steps, so on an H200 it was cold nearly always and adaptive eagle still stayed plain.  A request with no
evidence of its own reads as the crowd's lower quarter, and a small batch's step is decided by a
few such requests: with a speculative step costing ~1.9 plain ones (the shipped EAGLE head at batch
1 on an H200) the quartiles needed more certainty than one request's life gathers, so adaptive
eagle stayed plain (1.01x) where fixed k = 4 ran 1.44x at T = 0.  Each request's own observations
correct its means within a few steps, so a misjudged one loses at most the bound for those steps.
A large batch keeps the strict gate: it feeds the running prior B observations a step, always
holds requests with evidence, and near break-even the softer gate flapped (7 switches per 100 steps
in the simulator at B = 256).

KV: a request verifying k_i drafts needs 1 + k_i slots: reserve ``kv_slots_needed(ks)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from streamsd.policy.adaptive.budget import Search

if TYPE_CHECKING:
    from streamsd.policy.adaptive.cost import CostTable

_MIN_SURVIVAL = 0.01  # a draft this unlikely to be reached is never worth a verify slot


@dataclass(slots=True)
class RequestView:
    """What the planner needs of one decoding request."""

    request_id: object
    max_k: int  # cap: per-request setting, remaining max_tokens − 1, n-gram match length, context room
    alphas: Sequence[float]  # pessimistic α_j per draft position (lower quantile); covers max_k positions
    probe: bool = False
    catchup_tokens: int = 0  # draft-model KV to replay before drafting (0 for n-gram / synthetic)
    mean_alphas: Sequence[float] | None = None  # posterior means; None → ``alphas``
    remaining: int = 1 << 30  # tokens the request may still emit (max_tokens left)


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    probe_every: int = 16  # one probe step in 16 plain ones, only where an optimistic α would pay
    max_probes: int = 4
    probe_alpha: float = 0.9
    probe_k: int = 1  # drafts a probe verifies: deeper probes see more positions per probe
    # Probes are spaced so that their predicted extra time stays under this share of the steps':
    # a probe at B = 256 replays the width-2 graph for all 256 requests (1.66x a plain step on the
    # H200), one at B = 16 costs a few percent of one.
    probe_budget: float = 0.005
    # A new depth must beat the last plan's by this much (see ``Search.run``): set where steps are
    # queued ahead, where changing depth wastes one.
    depth_hysteresis: float = 0.0
    catchup_horizon: int = 4
    entry_steps: float = 2.0  # plain steps an excursion costs beyond its own steps (see Hysteresis)
    fresh_lag: int = 16  # requests at most this far behind form the "resume the fresh ones" plan
    small_batch: int = 16  # batches up to this size gate on the means, within a loss bound (see Small batches)
    small_batch_loss: float = 0.2  # how much slower than plain such a plan may be at the pessimistic read


@dataclass(slots=True)
class PlannerState:
    """Carried from step to step by the scheduler; the last decision is kept for metrics."""

    config: PlannerConfig = field(default_factory=PlannerConfig)
    speculating: bool = False
    depth: int = 0  # the largest k of the last plan (before probes)
    steps: int = 0
    switches: int = 0
    since_probe: int = 0
    probe_steps: int = 0
    probed: list[object] = field(default_factory=list)  # request ids the last plan granted a probe
    # What a probe was measured to cost, in plain steps beyond its own (the policy's record of its steps):
    # the table prices a speculative shape it never saw at the global ratio alone, optimistic on purpose.
    probe_extra: float = 0.0
    predicted_s: float = 0.0  # full predicted time of the planned step: feed to CostTable.observe
    predicted_raw_s: float = 0.0  # the same from the start-up table alone (no online correction)
    batch: int = 0  # decoding requests of the planned step
    prefill_tokens: int = 0
    expected_tokens: float = 0.0
    plain_rate: float = 0.0
    spec_rate: float = 0.0
    top_rate: float = 0.0  # the best expected rate of any plan scored, passed or refused (a cut-short plan: its ceiling)
    verify_tokens: int = 0
    draft_steps: int = 0
    draft_extra_tokens: int = 0  # draft-model catch-up priced into predicted_s


def kv_slots_needed(ks: Sequence[int]) -> int:
    """KV slots a step needs: 1 + k_i per request (not 1 + K)."""
    return sum(1 + k for k in ks)


def expected_tokens(alphas: Sequence[float], k: int) -> float:
    """Expected tokens from verifying k drafts: 1 + Σ_{j≤k} Π_{i<j} α_i."""
    total = survival = 1.0
    for j in range(k):
        survival *= alphas[min(j, len(alphas) - 1)]
        total += survival
    return total


def plan(
    requests: Sequence[RequestView],
    cost: CostTable,
    max_k: int,
    hysteresis: float = 0.02,
    *,
    state: PlannerState | None = None,
    prefill_tokens: int = 0,
    prefill_backlog: bool = False,
    cold: bool = False,
    guessing: bool = False,
) -> list[int]:
    """k_i for each request (0..max_k); updates ``state`` in place when given.

    ``prefill_tokens``: prompt tokens this step also verifies.  ``prefill_backlog``: prompts are
    waiting for prefill beyond this step (admission is limited by prefill, not by the batch cap).
    ``cold``: the acceptance prior has no evidence (see Probing). ``guessing``: it never had any (see
    Small batches).
    """
    st = state if state is not None else PlannerState()
    cfg = st.config
    b = len(requests)
    st.steps += 1
    st.since_probe += 1
    st.probed = []
    if b == 0:
        return []
    plain_t = cost.predict(b, b + prefill_tokens, 0, prefill_tokens=prefill_tokens)
    if prefill_backlog:
        credit, prefill_s = float(prefill_tokens), 0.0
    else:
        credit, prefill_s = 0.0, plain_t - cost.predict(b, b, 0) if prefill_tokens else 0.0
    plain_rate = (b + credit) / (plain_t - prefill_s)
    caps = [max(0, min(r.max_k, max_k)) for r in requests]
    floor = plain_rate * (1.0 if st.speculating else 1.0 + hysteresis)
    # A small batch's floor is on its expected rate, its pessimistic one only bounds the loss.
    small = b <= cfg.small_batch and not guessing
    safe_floor, mean_floor = (plain_rate * (1.0 - cfg.small_batch_loss), floor) if small else (floor, 0.0)
    search = Search(requests, cost, prefill_tokens, credit, prefill_s, cfg.catchup_horizon)
    if not st.speculating and not _probe_may_be_due(requests, caps, st, cold):
        top = search.hopeless(caps, safe_floor, mean_floor)
        if top is not None:  # no budget can pass the gate: plain, without ranking the batch's drafts
            st.plain_rate, st.spec_rate, st.top_rate, st.depth = plain_rate, 0.0, top, 0
            ks = [0] * b
            _record(st, requests, ks, (), cost, prefill_tokens)
            return ks
    mean, safe = zip(*(_survivals(r, cap) for r, cap in zip(requests, caps, strict=True)), strict=True)
    everyone = range(b)
    fresh = [i for i in everyone if requests[i].catchup_tokens <= cfg.fresh_lag]
    left = sorted(r.remaining for r in requests)[b // 2]
    # Deeper drafts drop the step queued ahead (where one is: depth_hysteresis), a switch like entering.
    deepen = _payback_margin(left, cfg.entry_steps) if cfg.depth_hysteresis else 0.0
    plans = [search.run(mean, safe, group, safe_floor, st.depth, cfg.depth_hysteresis, mean_floor, deepen)
             for group in ((everyone, fresh) if len(fresh) < b else (everyone,))]
    best = max((p for p in plans if p is not None), key=lambda p: p.rate, default=None)
    if best is not None and not st.speculating:
        if cold and b > cfg.small_batch:
            best = None  # no entry on the configured default: the cold probe below gathers evidence first
        elif best.rate / plain_rate - 1.0 < _payback_margin(left, cfg.entry_steps):
            best = None  # too close to the batch's end to pay for the switch
    speculate = best is not None
    st.switches += speculate != st.speculating
    st.speculating = speculate
    st.plain_rate, st.spec_rate, st.top_rate = plain_rate, best.rate if best else 0.0, search.top
    ks = best.ks if best else [0] * b
    st.depth = max(ks)
    flagged = [i for i in everyone if (requests[i].probe or cold) and ks[i] == 0 and caps[i] >= 1]
    # The least-behind requests probe first: their draft catch-up is the cheapest.
    due = sorted(flagged, key=lambda i: requests[i].catchup_tokens)[: b if cold else cfg.max_probes]
    if due and (speculate or _probe_pays(search, due, fresh, caps, (mean, safe), plain_rate * (1.0 + hysteresis),
                                         st, plain_t - prefill_s, cold)):
        for i in due:
            ks[i] = min(caps[i], cfg.probe_k)
        st.probed = [requests[i].request_id for i in due]
    _record(st, requests, ks, mean, cost, prefill_tokens)
    return ks


def _payback_margin(left: int, switch_steps: float) -> float:
    """The gain g − 1 over the current plan that a switch costing ``switch_steps`` steps needs to pay for
    itself within the ``left`` tokens the batch's requests may still emit: left · (1 − 1/g) ≥ switch_steps."""
    return switch_steps / (left - switch_steps) if left > switch_steps else math.inf


def _probe_may_be_due(requests: Sequence[RequestView], caps: list[int], st: PlannerState, cold: bool) -> bool:
    """Whether this plan may grant probes (what ``_probe_pays`` would be asked about)."""
    return cold or (st.since_probe >= st.config.probe_every
                    and any(r.probe and cap >= 1 for r, cap in zip(requests, caps, strict=True)))


def _survivals(r: RequestView, cap: int) -> tuple[list[float], list[float]]:
    means = r.alphas if r.mean_alphas is None else r.mean_alphas
    mean_out: list[float] = []
    safe_out: list[float] = []
    m = s = 1.0
    for j in range(min(cap, len(r.alphas), len(means))):
        m *= means[j]
        s *= r.alphas[j]
        if m < _MIN_SURVIVAL:
            break
        mean_out.append(m)
        safe_out.append(s)
    return mean_out, safe_out


def _probe_pays(search: Search, due: list[int], fresh: list[int], caps: list[int],
                survivals: tuple[Sequence[list[float]], Sequence[list[float]]], floor: float, st: PlannerState,
                plain_s: float, cold: bool = False) -> bool:
    """Whether the due requests probe: if they drafted at the optimistic alpha, would a plan pay with
    everyone else's numbers as the gate reads them (means choose, lower quantiles must beat plain)?"""
    cfg = st.config
    if st.since_probe < cfg.probe_every and not (cold and st.probe_steps == 0):
        return False
    if not cold:  # a cold prior is worth a probe step whatever it costs
        ks = [min(caps[i], cfg.probe_k) for i in due]
        probe_s = search.step_time(len(search.requests) + search.prefill + sum(ks), max(ks), len(due),
                                   sum(search.requests[i].catchup_tokens for i in due)) - search.prefill_s
        if st.since_probe * cfg.probe_budget < max(probe_s / plain_s - 1.0, st.probe_extra):
            return False
    mean, safe = list(survivals[0]), list(survivals[1])
    for i in due:
        mean[i] = safe[i] = [cfg.probe_alpha ** (j + 1) for j in range(caps[i])]
    if search.run(mean, safe, sorted(set(due) | set(fresh)), floor) is None:
        return False
    st.since_probe = 0
    st.probe_steps += 1
    return True


def _record(st: PlannerState, requests: Sequence[RequestView], ks: list[int], mean: Sequence[list[float]],
            cost: CostTable, prefill: int) -> None:
    drafting = [i for i, k in enumerate(ks) if k > 0]
    st.verify_tokens = len(requests) + sum(ks) + prefill
    st.draft_steps = max(ks)
    st.expected_tokens = len(requests) + sum(sum(mean[i][: ks[i]]) for i in drafting)
    st.batch, st.prefill_tokens = len(requests), prefill
    st.draft_extra_tokens = sum(requests[i].catchup_tokens for i in drafting)
    st.predicted_s, st.predicted_raw_s = cost.predict_with_raw(
        len(requests), st.verify_tokens, st.draft_steps, draft_batch=len(drafting), prefill_tokens=prefill,
        draft_extra_tokens=st.draft_extra_tokens)
