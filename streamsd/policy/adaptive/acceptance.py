"""Acceptance model: per request and per draft position, how likely the next draft is accepted.

Model.  α_j = P(draft j accepted | drafts 0..j−1 accepted).  One verify of k drafts yields the
accepted prefix plus one target token (the correction, or the bonus when all k pass), so

    E[tokens | k] = 1 + Σ_{j=1..k} Π_{i<j} α_i,

which for a constant α is the familiar (1 − α^(k+1)) / (1 − α).  An observation "a of d drafts
accepted" is a success at positions 0..a−1 and, when a < d, a failure at position a; positions
after a are censored (never reached), not failures.

Posterior.  Position j of a request carries Beta(n_j m_j + s_j, n_j (1 − m_j) + f_j), where s_j,
f_j are the request's own evidence.  For j = 0 the prior mean m_0 is the proposer's *running
prior* (one per name: the engine keeps one for greedy and one for sampled requests): successes
and failures pooled over all its requests, forgotten per scheduler step (``tick``), capped so a
large batch cannot make it immovable, and weakly anchored to a configured default that it drifts
back to when starved of data.  It is the crowd's: a request's observation weighs in it less the
more the request has been observed itself (1 / (1 + n_own / request_strength), the symmetric of what
a request borrows from it), so the few requests left at a wave's end, observed at every step, do
not outvote the many before them.  For j ≥ 1, m_j is the request's own posterior mean at j − 1, times
the prior's *depth step* j where one was measured at a fixed depth (``depth_steps``: an EAGLE head's
evaluation report).  Consecutive positions accept alike, and a deep position is drafted only
while it is estimated high, so its own data — and the crowd's per-position counts, kept for
metrics — is adaptively sampled and runs low (≈ −0.1 at position 2 in the simulator); the
position before it is sampled whenever it is, and more.  Evidence decays per observation (α
drifts) and faster per step the request does not speculate, so a request left at k = 0 slides back
to the prior and can be tried again.  After ``probe_after`` such steps ``wants_probe`` says so and
the planner may grant a probe: without one, a request (or a proposer) whose estimate fell low
would never produce the data to raise it.

Pessimistic read.  ``estimate`` is the lower ``quantile`` (default 25%) of each posterior, and it
is what the planner's gate uses: speculation is allowed only if it beats plain decoding with these
numbers (the means then choose the plan's shape).  The two errors are not symmetric:
under-estimating α costs a little of the possible gain, over-estimating it is the thing that makes
speculation slower than plain decoding.  The quantile converges to the mean as evidence
accumulates and is lowest exactly where little is known (new requests, deep positions), which is
where over-estimates would come from.  Quantiles come from ``beta.py`` (no scipy).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

from streamsd.policy.adaptive.beta import beta_quantile_approx, beta_quantile_approx_many
from streamsd.policy.adaptive.planner import RequestView

_VECTOR_MIN = 32  # fewer requests than this refresh one by one (numpy's per-call cost dominates)


@dataclass(frozen=True, slots=True)
class AcceptanceConfig:
    max_k: int = 8
    prior_mean: float = 0.6  # per-position default before a proposer has data
    prior_anchor: float = 2.0  # pseudo-count pulling a data-starved running prior back to prior_mean
    prior_decay: float = 0.98  # per tick: the running prior remembers ~50 steps of every request
    prior_cap: float = 256.0  # ... but at most this many observations per position
    request_strength: float = 16.0  # pseudo-count a request borrows from the running prior
    chain_strength: float = 6.0  # pseudo-count position j borrows from the request's position j − 1
    request_decay: float = 0.99  # per speculative observation: ~100 steps of memory
    idle_decay: float = 0.97  # per non-speculating step: back to the prior in a few dozen steps
    quantile: float = 0.25
    # Not 64: with plain steps pipelined (worker/lookahead.py) plain is cheaper than the start-up table
    # says, the 0.6 prior stops paying at B = 64, and 64-token requests would end before any probe.
    probe_after: int = 16
    refresh_every: int = 8  # steps a posterior may go unread while only the prior or idle decay moved it
    # Per position j >= 1: how much likelier a draft is accepted there than at j - 1, as measured at a
    # fixed depth (an EAGLE head's evaluation report), where no depth was drafted only while estimated
    # high. Empty: alike. Conditional acceptance rises with depth (the shipped head: 0.67, 0.70, 0.78,
    # 0.81 greedy), since a prefix that survived is an easy stretch; read flat, a fresh request at batch 1
    # priced k = 4 at 1.97 tokens against fixed k = 4's 2.41 and never speculated on an H200.
    # By running prior (a head's greedy and sampled requests): (name, steps) pairs.
    depth_steps: tuple[tuple[str, tuple[float, ...]], ...] = ()
    depth_ceiling: float = 0.95  # the most a depth step may raise a prior to

    def depth_steps_for(self, prior: str) -> tuple[float, ...]:
        return next((steps for name, steps in self.depth_steps if name == prior), ())

    def depth_step(self, j: int, prior: str) -> float:
        return _depth_step(self.depth_steps_for(prior), j)


def _depth_step(steps: tuple[float, ...], j: int) -> float:
    return steps[j - 1] if 0 < j <= len(steps) else 1.0


def depth_steps_of(conditional: list[list[float]]) -> tuple[float, ...]:
    """Depth steps from measured conditional acceptance per position (one list per setting, e.g. per
    temperature): the smallest ratio of consecutive positions across settings, and never below 1.
    The smallest, because an over-estimate is what makes speculation slower than plain decoding."""
    depth = min((len(c) for c in conditional), default=0)
    steps = []
    for j in range(1, depth):
        ratios = [c[j] / c[j - 1] for c in conditional if c[j - 1] > 0.0]
        steps.append(max(min(ratios, default=1.0), 1.0))
    return tuple(steps)


@dataclass(slots=True)
class ProposerPrior:
    """Running per-position success/failure counts pooled over a proposer's requests."""

    successes: list[float]
    failures: list[float]
    means: tuple[float, ...] = ()  # refreshed by ``tick``
    version: int = 0
    observed: bool = False  # has ever held evidence (forgotten or not)

    def refresh(self, cfg: AcceptanceConfig) -> None:
        # Each position is anchored to the one before it (position 0 to the configured default),
        # so a deep position with little data reads like its predecessor.
        means, anchor = [], cfg.prior_mean
        for s, f in zip(self.successes, self.failures, strict=True):
            anchor = (s + cfg.prior_anchor * anchor) / (s + f + cfg.prior_anchor)
            means.append(anchor)
        self.means = tuple(means)
        self.version += 1


@dataclass(slots=True)
class RequestAcceptance:
    """Per-request estimator state; lives in the request, freed with it."""

    proposer: str
    successes: list[float]
    failures: list[float]
    idle_steps: int = 0
    pending_idle: int = 0  # idle decay steps not yet applied (applied lazily, in one power)
    safe: tuple[float, ...] = ()
    mean: tuple[float, ...] = ()
    stale: bool = True
    prior_version: int = -1
    # The last read borrowed a prior without evidence (the configured default): re-read at its next
    # change, so that a cold batch's probe informs the requests it did not probe at the next plan.
    read_cold: bool = False


@dataclass(slots=True)
class AcceptanceEstimator:
    config: AcceptanceConfig = field(default_factory=AcceptanceConfig)
    priors: dict[str, ProposerPrior] = field(default_factory=dict)
    z: float = 0.0

    def __post_init__(self) -> None:
        self.z = NormalDist().inv_cdf(self.config.quantile)

    def prior(self, proposer: str) -> ProposerPrior:
        p = self.priors.get(proposer)
        if p is None:
            k = self.config.max_k
            p = self.priors[proposer] = ProposerPrior([0.0] * k, [0.0] * k)
            p.refresh(self.config)
        return p

    def cold(self, proposer: str = "default") -> bool:
        """The proposer's running prior holds (next to) no evidence: never observed, or forgotten."""
        p = self.prior(proposer)
        return p.successes[0] + p.failures[0] < 1.0

    def informed(self, proposer: str = "default") -> bool:
        """The proposer's running prior has held evidence at some time: its means are no longer only
        the configured default, though they drift back to it while no request speculates."""
        return self.prior(proposer).observed

    def new_request(self, proposer: str = "default") -> RequestAcceptance:
        self.prior(proposer)
        k = self.config.max_k
        return RequestAcceptance(proposer, [0.0] * k, [0.0] * k)

    def observe(self, state: RequestAcceptance, num_drafted: int, num_accepted: int) -> None:
        """Record one step; ``num_drafted == 0`` is a step at k = 0 (call it for those too)."""
        cfg = self.config
        drafted = min(num_drafted, cfg.max_k)
        if drafted <= 0:
            state.idle_steps += 1
            state.pending_idle += 1
            # Idle decay is slow; re-reading the posterior every few idle steps is enough.
            state.stale = state.stale or state.pending_idle >= cfg.refresh_every
            return
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"accepted {num_accepted} of {num_drafted} drafts")
        accepted = min(num_accepted, drafted)
        state.idle_steps = 0
        # Every position forgets, reached or not: one left undrafted slides back to its prior,
        # which follows the position before it, so a low old estimate cannot freeze it at k below it.
        _decay(state, cfg.request_decay * cfg.idle_decay ** state.pending_idle)
        state.pending_idle = 0
        prior = self.prior(state.proposer)
        prior.observed = True
        # The crowd's prior, not the most observed request's: on an H200 at B = 128, alpha 0.9, a
        # synthetic request whose drafts all failed was alone for the last 20 steps of a wave and,
        # at full weight, left the prior at 0.67 for the next wave, which then decoded plain where
        # fixed k = 1 ran 1.3x.
        weight = 1.0 / (1.0 + (state.successes[0] + state.failures[0]) / cfg.request_strength)
        for j in range(accepted):
            state.successes[j] += 1.0
            prior.successes[j] += weight
        if accepted < drafted:
            state.failures[accepted] += 1.0
            prior.failures[accepted] += weight
        state.stale = True

    def tick(self, steps: int = 1) -> None:
        """Once per scheduler step (or once for ``steps`` of them): forget old evidence in the running priors."""
        decay, cap = self.config.prior_decay ** steps, self.config.prior_cap
        for p in self.priors.values():
            for j in range(len(p.successes)):
                # Capped as well as decayed: a large batch must not make the prior so heavy that,
                # once speculation stops, the few probe observations could never move it.
                n = p.successes[j] + p.failures[j]
                scale = decay * min(1.0, cap / n) if n > 0 else decay
                p.successes[j] *= scale
                p.failures[j] *= scale
            p.refresh(self.config)

    def estimate(self, state: RequestAcceptance) -> tuple[float, ...]:
        """Pessimistic per-position α_j: the posterior's lower ``quantile``."""
        self._refresh(state)
        return state.safe

    def mean(self, state: RequestAcceptance) -> tuple[float, ...]:
        """Posterior mean per position."""
        self._refresh(state)
        return state.mean

    def refresh_many(self, states: list[RequestAcceptance]) -> None:
        """What ``estimate`` and ``mean`` would recompute, for many requests at once (the planner reads
        every decoding request each step; per request in Python that was most of its time at B = 64)."""
        groups: dict[str, list[RequestAcceptance]] = {}
        for st in states:
            if self._due(st):
                groups.setdefault(st.proposer, []).append(st)
        for proposer, group in groups.items():
            if len(group) < _VECTOR_MIN:
                for st in group:
                    self._refresh(st)
                continue
            cfg, prior, cold = self.config, self.prior(proposer), self.cold(proposer)
            for st in group:
                self._apply_idle(st)
            s = np.array([st.successes for st in group])  # [n, K]
            f = np.array([st.failures for st in group])  # [n, K]
            safe, mean = np.empty_like(s), np.empty_like(s)  # [n, K]
            m = np.full(len(group), prior.means[0])  # [n]
            reach = np.ones(len(group))  # [n]
            steps = cfg.depth_steps_for(proposer)
            for j in range(s.shape[1]):
                n0 = cfg.request_strength if j == 0 else cfg.chain_strength
                m = np.minimum(m * _depth_step(steps, j), np.maximum(m, cfg.depth_ceiling)) if j else m
                a, b = n0 * m + s[:, j], n0 * (1.0 - m) + f[:, j]
                m = a / (a + b)
                mean[:, j] = m
                reach *= m
                safe[:, j] = np.where(reach >= 0.01, beta_quantile_approx_many(a, b, self.z), 0.0)
            for st, sa, me in zip(group, safe.tolist(), mean.tolist(), strict=True):
                st.safe, st.mean = tuple(sa), tuple(me)
                st.stale, st.prior_version, st.read_cold = False, prior.version, cold

    def _due(self, state: RequestAcceptance) -> bool:
        prior = self.prior(state.proposer)
        return (state.stale or prior.version - state.prior_version >= self.config.refresh_every
                or (state.read_cold and prior.version != state.prior_version))

    def _apply_idle(self, state: RequestAcceptance) -> None:
        if state.pending_idle:
            _decay(state, self.config.idle_decay ** state.pending_idle)
            state.pending_idle = 0

    def _refresh(self, state: RequestAcceptance) -> None:
        if not self._due(state):
            return
        prior = self.prior(state.proposer)
        cfg = self.config
        self._apply_idle(state)
        z = self.z
        safe, mean = [], []
        reach, m = 1.0, prior.means[0]
        steps = cfg.depth_steps_for(state.proposer)
        for j, (s, f) in enumerate(zip(state.successes, state.failures, strict=True)):
            n0 = cfg.request_strength if j == 0 else cfg.chain_strength
            # Position j's prior is this request's own estimate at j − 1 (position 0's is the
            # proposer's running prior): deep positions are drafted only while estimated high, so
            # their own data — and the crowd's — is adaptively sampled and biased low; the position
            # before them is sampled whenever they are, and more. The depth step is measured elsewhere.
            m = min(m * _depth_step(steps, j), max(m, cfg.depth_ceiling)) if j else m
            a, b = n0 * m + s, n0 * (1.0 - m) + f
            m = a / (a + b)
            mean.append(m)
            reach *= m
            # Positions the planner will never draft (survival below 1%) skip the quantile.
            safe.append(beta_quantile_approx(a, b, z) if reach >= 0.01 else 0.0)
        state.safe, state.mean = tuple(safe), tuple(mean)
        state.stale, state.prior_version, state.read_cold = False, prior.version, self.cold(state.proposer)

    def wants_probe(self, state: RequestAcceptance) -> bool:
        return state.idle_steps >= self.config.probe_after

    def view(self, state: RequestAcceptance, request_id: object, max_k: int, catchup_tokens: int = 0,
             remaining: int = 1 << 30) -> RequestView:
        """The planner's view of a request; ``max_k`` is its cap this step, ``remaining`` the tokens it may
        still emit."""
        return self.views([(state, request_id, max_k, catchup_tokens, remaining)])[0]

    def views(self, requests: list[tuple[RequestAcceptance, object, int, int, int]]) -> list[RequestView]:
        """``view`` of many requests, their posteriors refreshed at once: (state, request id, max_k,
        catch-up tokens, remaining) each. One pass, since the planner reads the whole batch each plan
        (at B = 256 the per-request calls were most of a plan that the ceiling cut short)."""
        self.refresh_many([r[0] for r in requests])
        probe_after = self.config.probe_after
        return [RequestView(rid, max_k, st.safe, st.idle_steps >= probe_after, catchup, st.mean, remaining)
                for st, rid, max_k, catchup, remaining in requests]


def _decay(state: RequestAcceptance, factor: float) -> None:
    for j in range(len(state.successes)):
        state.successes[j] *= factor
        state.failures[j] *= factor
