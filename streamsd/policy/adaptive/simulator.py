"""Torch-free discrete-event simulator of the serving loop, for choosing and checking policies.

Each event is one engine step: admit arrivals (closed loop at fixed ``concurrency``, or Poisson
at ``arrival_rate``), spend up to ``prefill_chunk`` prompt tokens, let the policy choose k_i for
the decoding requests, then advance the clock by the *true* step time — the roofline model of
the target (``RooflineModel.llama3_8b_h200``: 16 GB bf16 weights at 4.25 TB/s vs 790 TFLOP/s,
the KV read of every running context, a fixed overhead), padded to the CUDA-graph bucket, plus
the draft model's steps and catch-up when any request speculates, times multiplicative noise —
and emit each request's accepted prefix plus one token.

Policies: ``plain``; ``fixed:k`` (every request drafts min(k, cap)); ``adaptive`` (the planner,
the acceptance estimator and a cost table built from the roofline with per-bucket noise and
corrected online from the measured step times — it never sees the true α or the true costs).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field

from streamsd.policy.adaptive.acceptance import AcceptanceConfig, AcceptanceEstimator
from streamsd.policy.adaptive.cost import CostTable, StepTable
from streamsd.policy.adaptive.planner import PlannerState, plan
from streamsd.policy.adaptive.roofline import RooflineModel
from streamsd.policy.adaptive.workload import (
    ProposerSpec,
    SimRequest,
    default_buckets,
    make_request,
    pad,
    poisson_arrivals,
)


@dataclass(frozen=True, slots=True)
class SimConfig:
    proposer: ProposerSpec = field(default_factory=ProposerSpec.draft_model)
    target: RooflineModel = field(default_factory=RooflineModel.llama3_8b_h200)
    max_k: int = 6
    duration_s: float = 2.0
    warmup_s: float = 0.0  # simulated time not counted in the result
    warm_start: bool = True  # closed loop: the first batch starts decoding mid-output
    concurrency: int | None = 16  # closed loop; None → Poisson at arrival_rate
    arrival_rate: float = 0.0  # requests per second
    max_batch: int = 256
    prompt_len: tuple[int, int] = (64, 256)
    output_len: tuple[int, int] = (128, 1024)
    prefill_chunk: int = 512
    buckets: tuple[int, ...] = field(default_factory=default_buckets)
    spec_overhead_s: float = 1e-4  # rejection sampler and bookkeeping of a speculative step
    step_noise: float = 0.02  # sd of the true step time's multiplicative noise
    table_noise: float = 0.01  # ± error of the start-up cost table, per bucket (timed medians)
    table_scale: float = 1.0  # systematic error of the start-up table (e.g. timed at another context)
    # Whether plans are made a step ahead, as the engine does for drafters without a cache: step N+1
    # is planned while step N runs, having learnt from steps up to N-1 (see AdaptivePolicy.plans_ahead).
    plan_ahead: bool = True
    seed: int = 0


@dataclass(slots=True)
class StepRecord:
    time_s: float
    batch: int
    drafts: int
    draft_steps: int
    prefill: int
    predicted_s: float
    measured_s: float
    tokens: int


@dataclass(slots=True)
class SimResult:
    policy: str
    tokens: int = 0
    elapsed_s: float = 0.0
    steps: int = 0
    switches: int = 0  # plain ↔ speculative step transitions
    prefill_toggles: int = 0  # steps whose "has a prefill chunk" differs from the previous step
    k_hist: Counter[int] = field(default_factory=Counter)
    tpot_s: list[float] = field(default_factory=list)  # per finished request: seconds per output token
    records: list[StepRecord] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def switches_per_100(self) -> float:
        return 100.0 * self.switches / max(self.steps, 1)

    @property
    def mean_tpot_s(self) -> float:
        return sum(self.tpot_s) / len(self.tpot_s) if self.tpot_s else 0.0


class AdaptivePolicy:
    """Estimator + cost table + planner, driven only by what an engine can observe."""

    def __init__(self, cfg: SimConfig, acceptance: AcceptanceConfig | None = None, hysteresis: float = 0.02):
        draft = cfg.proposer.draft if cfg.proposer.kind == "draft" else None
        self.cost = _startup_table(cfg, draft)
        self.estimator = AcceptanceEstimator(acceptance or AcceptanceConfig(max_k=cfg.max_k))
        self.state = PlannerState()
        self.max_k, self.hysteresis, self.draft = cfg.max_k, hysteresis, draft is not None
        self.kind = cfg.proposer.kind
        self.pending: list[tuple] = []  # steps run and not yet learnt from

    def choose(self, reqs: list[SimRequest], caps: list[int], prefill: int, backlog: bool,
               oracle: list[float] | None) -> list[int]:
        views = []
        for i, (r, cap) in enumerate(zip(reqs, caps, strict=True)):
            if r.acceptance is None:
                r.acceptance = self.estimator.new_request(self.kind)
            view = self.estimator.view(r.acceptance, r.rid, cap, r.behind if self.draft else 0, r.remaining)
            if oracle is not None:  # the true α: an upper reference for the estimator
                view.alphas = view.mean_alphas = (oracle[i],) * self.max_k
                view.probe = False
            views.append(view)
        return plan(views, self.cost, self.max_k, self.hysteresis, state=self.state, prefill_tokens=prefill,
                    prefill_backlog=backlog, cold=oracle is None and self.estimator.cold(self.kind),
                    guessing=oracle is None and not self.estimator.informed(self.kind))

    def feedback(self, reqs: list[SimRequest], ks: list[int], accepted: list[int], measured: float) -> None:
        """Queues what a step showed; learnt once the plans made before it are used (`learn`)."""
        st = self.state
        self.pending.append((reqs, ks, accepted, measured, st.predicted_raw_s, st.verify_tokens, st.draft_steps))

    def learn(self, keep: int) -> None:
        """Learns every queued step but the newest ``keep``."""
        while len(self.pending) > keep:
            reqs, ks, accepted, measured, raw, verify, drafts = self.pending.pop(0)
            for r, k, a in zip(reqs, ks, accepted, strict=True):
                assert r.acceptance is not None
                self.estimator.observe(r.acceptance, k, a)
            self.estimator.tick()
            self.cost.observe(raw, measured, verify_tokens=verify, draft_steps_k=drafts)


def simulate(cfg: SimConfig, policy: str, *, keep_records: bool = False) -> SimResult:
    """Run ``policy`` for ``cfg.duration_s`` simulated seconds.

    "plain", "fixed:K", "adaptive", or "oracle" (the planner fed the true α: a reference only).
    """
    rng = random.Random(cfg.seed ^ 0xA11)
    spec = cfg.proposer
    adaptive = AdaptivePolicy(cfg) if policy in ("adaptive", "oracle") else None
    fixed_k = int(policy.split(":")[1]) if policy.startswith("fixed:") else 0
    arrivals = [] if cfg.concurrency else poisson_arrivals(cfg.arrival_rate, cfg.duration_s, cfg.seed)
    new = lambda rid: make_request(rid, cfg.seed, spec, cfg.prompt_len, cfg.output_len)  # noqa: E731
    result, now, was_spec, had_prefill = SimResult(policy), 0.0, False, False
    ahead = cfg.plan_ahead and spec.kind != "draft"  # the engine's rule: a draft model plans after the step
    active = [_warm(new(rid)) for rid in range(cfg.concurrency or 0)] if cfg.warm_start else []
    next_rid = len(active)
    while now < cfg.duration_s:
        while len(active) < (cfg.concurrency or 0):
            active.append(new(next_rid))
            next_rid += 1
        while next_rid < len(arrivals) and arrivals[next_rid] <= now and len(active) < cfg.max_batch:
            active.append(new(next_rid))
            next_rid += 1
        if not active:
            now = arrivals[next_rid] if next_rid < len(arrivals) else cfg.duration_s
            continue
        decoding = [r for r in active if r.context > 0]
        prefill, started = _prefill(active, cfg.prefill_chunk)
        for r in decoding:
            r.advance_proposer(spec, cfg.max_k)
        caps = [min(cfg.max_k, r.match_len, r.remaining - 1) for r in decoding]
        if adaptive:
            truth = [r.alpha(spec, now) for r in decoding] if policy == "oracle" else None
            backlog = any(r.prompt_left for r in active)
            adaptive.learn(keep=int(ahead))
            ks = adaptive.choose(decoding, caps, prefill, backlog, truth)
        else:
            ks = [min(fixed_k, c) for c in caps]
        measured = _true_step_time(cfg, decoding, ks, prefill, rng)
        accepted = [r.draw_accepted(k, r.alpha(spec, now)) for r, k in zip(decoding, ks, strict=True)]
        if adaptive:
            adaptive.feedback(decoding, ks, accepted, measured)
        now += measured
        emitted = len(started)
        for r in started:
            r.first_token_s = now
        for r, k, a in zip(decoding, ks, accepted, strict=True):
            n = min(a + 1, r.remaining)
            r.remaining -= n
            r.context += n
            r.generated += n
            r.behind = 0 if k > 0 else r.behind + n
            emitted += n
            if r.remaining == 0 and r.first_token_s > cfg.warmup_s and r.generated > 1:
                result.tpot_s.append((now - r.first_token_s) / (r.generated - 1))
        active = [r for r in active if r.remaining > 0]
        if now <= cfg.warmup_s:
            continue
        spec_step = any(ks)
        result.switches += spec_step != was_spec and result.steps > 0
        result.prefill_toggles += (prefill > 0) != had_prefill and result.steps > 0
        was_spec, had_prefill = spec_step, prefill > 0
        result.steps += 1
        result.tokens += emitted
        result.k_hist.update(ks)
        if keep_records:
            predicted = adaptive.state.predicted_s if adaptive else 0.0
            result.records.append(StepRecord(now, len(decoding), sum(ks), max(ks, default=0), prefill,
                                             predicted, measured, emitted))
    result.elapsed_s = now - cfg.warmup_s
    return result


def _startup_table(cfg: SimConfig, draft: RooflineModel | None) -> CostTable:
    """What start-up timing would measure: the roofline at the bucket edges, with timing noise."""
    rng = random.Random(cfg.seed ^ 0xC057)
    exact = CostTable.from_roofline(cfg.target, draft, cfg.buckets, spec_overhead_s=cfg.spec_overhead_s)

    def measured(table: StepTable) -> dict[int, float]:
        noise = cfg.table_noise
        return {k: v * cfg.table_scale * (1.0 + rng.uniform(-noise, noise)) for k, v in zip(table.keys, table.values, strict=True)}

    return CostTable.from_samples(measured(exact.verify), measured(exact.draft),
                                  kv_per_request_s=exact.kv_per_request_s * cfg.table_scale,
                                  spec_overhead_s=cfg.spec_overhead_s)


def _warm(r: SimRequest) -> SimRequest:
    # Closed loop starts in steady state: prompt done, a uniform share of the output already out.
    done = r.rng.randint(0, r.remaining - 1)
    r.prompt_left, r.context, r.remaining = 0, r.prompt + 1 + done, r.remaining - done
    return r


def _prefill(active: list[SimRequest], chunk: int) -> tuple[int, list[SimRequest]]:
    """Spend the chunk budget on prompts first-come first-served; a finished prompt emits a token.

    Returns (prompt tokens processed, requests whose first token came out); they decode next step.
    """
    budget, started = chunk, []
    for r in active:
        if budget == 0:
            break
        if r.context > 0:
            continue
        n = min(budget, r.prompt_left)
        r.prompt_left -= n
        budget -= n
        if r.prompt_left == 0:
            r.context = r.prompt + 1
            r.remaining -= 1
            r.generated = 1
            started.append(r)
    return chunk - budget, started


def _true_step_time(cfg: SimConfig, reqs: list[SimRequest], ks: list[int], prefill: int, rng: random.Random) -> float:
    b, drafts = len(reqs), sum(ks)
    ctx = sum(r.context for r in reqs)
    t = cfg.target.step_time(b, pad(b + drafts + prefill, cfg.buckets), ctx)
    draft = cfg.proposer.draft
    if drafts:
        t += cfg.spec_overhead_s
        if cfg.proposer.kind == "draft" and draft is not None:
            spec = [r for r, k in zip(reqs, ks, strict=True) if k > 0]
            dctx = sum(r.context for r in spec)
            catchup = sum(r.behind for r in spec)
            t += draft.step_time(len(spec), pad(len(spec) + catchup, cfg.buckets), dctx)
            t += (max(ks) - 1) * draft.step_time(len(spec), pad(len(spec), cfg.buckets), dctx)
    return t * math.exp(rng.gauss(0.0, cfg.step_noise))
