"""The step chooser of an engine whose drafts are trees: each step, a whole tree step or a plain one,
from the measured cost of both at this batch and what the batch's requests accept.

A tree step over B requests costs t_tree(B) (a whole step of the configured tree shape, timed per
batch bucket at start-up: worker/profile.py's ``time_tree_steps``) and emits Σ τ_i tokens, τ_i the
tokens request i is expected to take per tree step (its accepted nodes and the bonus token). A plain
step costs t_plain(B) and emits B. Trees pay where Σ τ_i / t_tree(B) beats B / t_plain(B); for a
batch whose requests accept alike, where τ exceeds the break-even τ*(B) = t_tree(B) / t_plain(B).
Those break-evens are the chooser's switch points, logged at start-up (``switch_points``): every model
and device gets its own from its own profile, none is a tuned constant.

Entering costs more than the step: a resuming head first catches up on the positions it skipped
(the profile's catch-up table, by positions), after the target has recomputed the streams of those
a plain stretch kept none of (a target pass over them: the verify table, by tokens; after
``keep_streams_steps`` plain steps a batch stops writing streams, StepPlan.wants_streams), the entering step grows trees without verifying
any, and the steps around each switch wait for the host (``entry_steps``). Trees are entered only where that extra time is won back over the tokens the batch may still
emit (capped at ``horizon_steps`` plain steps), and by ``hysteresis`` at least; they are left as soon
as plain is predicted faster.

Learning. τ per request and per acceptance class (greedy or sampled) from each tree step's own
accepted count: a request starts at its class's running mean, which starts at ``prior_tau``. Costs:
each steady step (of the same kind as the step before, no prompt chunk) corrects its (kind, batch)
cell by the median of its last measured/predicted ratios; an unseen tree cell borrows the plain
cell's ratio of its batch (drift shared by both). While the batch decodes plain, a class's mean drifts
back toward ``prior_tau`` (half-way per ``retry_steps`` steps), so a batch that went plain on a run of
rejections tries trees again, once they would pay at the prior. A tree cell's cost ratio relaxes the
same way toward its batch's plain ratio (the profile's relation between the two): tree steps measured
slow a few times (a host stall between steps, another process on the GPU) would otherwise keep trees
off for good, since only tree steps correct it. Each sample is clamped as the cost table's are.

Backing off. Each excursion into trees is judged once it ends: its steps' seconds, entering and
leaving included, against what plain steps would have taken for the tokens it emitted. One that lost
doubles the half-life of both drifts (up to ``max_backoff`` times), one that paid resets it: where tree
steps cost more in service than the profile says and keep losing, the retries thin out geometrically
instead of costing a losing excursion every few ``retry_steps``. At a
batch where trees cannot pay even if every node were accepted, the chooser stays plain at the cost of
one comparison. Each switch is logged at debug level with the prices that made it.

Torch-free, like the other policies; the scheduler calls it once per step.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from streamsd.policy.adaptive.cost import RATIO_CLAMP
from streamsd.policy.policy import Decision, StepShape, acceptance_class, cap_k
from streamsd.request import Request

if TYPE_CHECKING:
    from streamsd.policy.adaptive.cost import CostTable
    from streamsd.sched.plan import StepPlan

RATIO_SAMPLES = 5  # a cost cell follows the median of its last few measured/predicted ratios

log = logging.getLogger("streamsd.policy.chooser")
REQUEST_WINDOW = 16  # a request's τ follows its last ~16 tree steps


@dataclass(slots=True)
class _Tau:
    """A running mean of tokens per tree step: the first samples averaged with a prior's weight, then
    an exponential mean over ``window``."""

    value: float
    n: int = 0

    def add(self, x: float, prior_weight: float, window: int) -> None:
        self.n += 1
        self.value += (x - self.value) / min(self.n + prior_weight, window)


@dataclass(slots=True)
class TreeChooser:
    cost: CostTable  # with its `tree` table: the profile's whole tree steps by batch
    depth: int  # the tree's depth D: a tree step emits at most D + 1 tokens a request
    # The largest batch whose tree step replays a graph (the tree graphs' largest bucket on CUDA), past
    # which one runs eagerly at many times the cost the profile's table extrapolates; 0: every batch
    # runs its tree steps alike (a CPU, or CUDA without graphs), and the table's extrapolation holds.
    max_batch: int = 0
    prior_tau: float = 0.0  # tokens per tree step before any is seen (0: 1 + D / 2)
    settled_lag: int = 1  # an EAGLE head's slot of the pending token waits for its streams
    hysteresis: float = 0.02  # the gain over plain that entering trees needs
    horizon_steps: int = 64  # entering must pay back within at most this many steps' tokens
    # Plain steps an excursion costs beyond its own steps: the steps around each switch wait for the
    # host instead of being queued ahead (the adaptive planner's `entry_steps`).
    entry_steps: float = 2.0
    retry_steps: int = 64  # half-life, in plain steps, of a class's drift back to its prior
    max_backoff: int = 64  # the half-life grows to at most this many times retry_steps after losing excursions
    # Plain steps after the last tree step that still write the head's streams: a batch that goes back
    # to trees soon finds them kept; one that stays plain stops paying for them (10-13 % of a plain
    # step at batch 64 on a GPU) and recomputes the positions it skipped when it resumes.
    keep_streams_steps: int = 16
    prior_weight: float = 2.0  # a request's class mean counts as this many of its own tree steps
    speculating: bool = False
    plans_ahead: bool = False  # a comparison per step: nothing to hide behind the device
    classes: dict[str, _Tau] = field(default_factory=dict)
    requests: dict[object, _Tau] = field(default_factory=dict)
    ratios: dict[tuple[bool, int], deque[float]] = field(default_factory=dict)  # by (tree step, batch bucket)
    last_kind: tuple[int, int] = (1, 0)  # (verify width, draft steps) of the last step seen
    plain_steps: int = 0  # since the batch last took a tree step
    switches: int = 0
    chosen: dict[bool, int] = field(default_factory=lambda: {False: 0, True: 0})  # steps by kind (trees: True)
    backoff: int = 1  # the drifts' half-life, in retry_steps
    excursion: list[float] = field(default_factory=lambda: [0.0, 0.0])  # its seconds; plain's for its tokens

    def __post_init__(self) -> None:
        if self.prior_tau <= 0.0:
            self.prior_tau = 1.0 + self.depth / 2

    # -- prices ----------------------------------------------------------------------------------
    def _ratio(self, tree: bool, batch: int) -> float:
        """A cell's measured/predicted ratio. A tree cell's relaxes toward its batch's plain ratio over
        the plain steps since the last tree step (an unseen one is the plain ratio)."""
        samples = self.ratios.get((tree, _bucket(batch)))
        if not tree:
            return statistics.median(samples) if samples else 1.0
        plain = self._ratio(False, batch)
        if not samples:
            return plain
        return plain + (statistics.median(samples) - plain) * self._kept()

    def _kept(self) -> float:
        """The share of a tree cell's own ratio (over its batch's plain one) still kept after the plain
        steps since the last tree step: half per `retry_steps` times the backoff."""
        return 0.5 ** (self.plain_steps / (self.retry_steps * self.backoff))

    def plain_seconds(self, batch: int, raw: bool = False) -> float:
        t = self.cost.predict_raw(batch, batch, 0)
        return t if raw else t * self._ratio(False, batch)

    def tree_seconds(self, batch: int, raw: bool = False) -> float:
        """A tree step's price at `batch`; none (infinite) past `max_batch`, where a tree step would run
        eagerly instead of replaying a graph (on an H100 host 30-37 ms at batch 32 against 1.8 for the
        graph's at 16, which extrapolating the table had called 3.4)."""
        if not self.cost.tree.keys or (self.max_batch and batch > self.max_batch):
            return float("inf")
        t = self.cost.tree(batch)
        return t if raw else t * self._ratio(True, batch)

    def catchup_seconds(self, positions: int) -> float:
        return self.cost.catchup(positions) if positions > 0 and self.cost.catchup.keys else 0.0

    def recompute_seconds(self, positions: int) -> float:
        """The target's pass over `positions` whose streams plain steps did not keep (worker/stream_catchup.py)."""
        return self.cost.verify(positions) if positions > 0 else 0.0

    def break_even(self, batch: int) -> float:
        """The τ above which a tree step out-emits a plain one at this batch (per unit of time)."""
        return self.tree_seconds(batch) / self.plain_seconds(batch)

    def switch_points(self) -> dict[int, float]:
        """Break-even τ per tree-table batch bucket: trees pay where the batch's τ is above it."""
        return {b: round(self.break_even(b), 2) for b in self.cost.tree.keys}

    def largest_tree_batch(self, tau: float | None = None) -> int:
        """The largest bucket where trees pay at τ (default: the prior); 0 where none does."""
        t = self.prior_tau if tau is None else tau
        return max((b for b in self.cost.tree.keys if self.break_even(b) * (1.0 + self.hysteresis) < t), default=0)

    @property
    def plain_step_share(self) -> float:
        steps = self.chosen[False] + self.chosen[True]
        return self.chosen[False] / steps if steps else 0.0

    def summary(self) -> dict[str, object]:
        """For benchmarks and /metrics: what the chooser decided and what it learnt."""
        return {
            "tree_steps": self.chosen[True], "plain_steps": self.chosen[False], "switches": self.switches,
            "plain_step_share": round(self.plain_step_share, 4), "backoff": self.backoff,
            "switch_points": self.switch_points(), "prior_tau": self.prior_tau,
            "class_tau": {name: round(t.value, 3) for name, t in self.classes.items()},
            "cost_ratios": {f"{'tree' if tree else 'plain'}x{b}": round(self._ratio(tree, b), 3)
                            for (tree, b), r in sorted(self.ratios.items()) if r},
        }

    # -- the step ---------------------------------------------------------------------------------
    def choose(self, decoding: list[Request], prefill_tokens: int, backlog: bool) -> Decision:
        b = len(decoding)
        drafting = [r for r in decoding if r.spec_k > 0]  # speculation off for the others: 1 token a step
        if b:
            trees = bool(drafting) and self._trees_pay(decoding, drafting)
            if trees != self.speculating:
                self.switches += 1
                if log.isEnabledFor(logging.DEBUG):
                    taus = [self._tau(r) for r in drafting] or [0.0]
                    log.debug("%s at batch %d: tau %.2f, tree step %.2f ms (x%.2f), plain %.2f ms (x%.2f)",
                              "trees" if trees else "plain", b, sum(taus) / len(taus),
                              1e3 * self.tree_seconds(b), self._ratio(True, b), 1e3 * self.plain_seconds(b),
                              self._ratio(False, b))
            self.speculating = trees
            self.chosen[trees] += 1
        # every request takes default_k; a batch where nobody may draft keeps no streams either
        keep = bool(drafting) and self.plain_steps < self.keep_streams_steps
        return Decision({}, streams=self.speculating or keep)

    def _trees_pay(self, decoding: list[Request], drafting: list[Request]) -> bool:
        """`drafting`: the requests of `decoding` that may draft (the others emit one token a step)."""
        b = len(decoding)
        plain_s, tree_s = self.plain_seconds(b), self.tree_seconds(b)
        if tree_s >= plain_s * (self.depth + 1):  # not even a tree accepted whole could pay
            return False
        self._retire(decoding)
        taus = [self._tau(r) for r in drafting]
        tree_rate, plain_rate = (sum(taus) + b - len(drafting)) / tree_s, b / plain_s
        if self.speculating:
            return tree_rate > plain_rate
        if tree_rate <= plain_rate * (1.0 + self.hysteresis):
            return False
        # The excursion's extra time: the target's recompute of the streams the plain steps kept none
        # of, the head's catch-up and an entering step that grows without verifying.
        lag = sum(max(r.num_tokens - self.settled_lag - r.draft_computed, 0) for r in drafting)
        extra = (self.recompute_seconds(sum(map(_streams_missing, drafting))) + self.catchup_seconds(lag)
                 + max(tree_s - plain_s, 0.0) + self.entry_steps * plain_s)
        left = sorted(r.remaining_tokens for r in decoding)[b // 2]
        tokens = b * min(left, self.horizon_steps)
        return extra + tokens / tree_rate < tokens / plain_rate

    def _tau(self, r: Request) -> float:
        est = self.requests.get(r.request_id)
        cls = self._class(acceptance_class(r))
        if est is None:
            est = self.requests[r.request_id] = _Tau(cls.value)
        elif self.plain_steps:  # drifts back toward the class as the class drifts back toward the prior
            est.value = max(est.value, cls.value)
        return est.value

    def _class(self, name: str) -> _Tau:
        cls = self.classes.get(name)
        if cls is None:
            cls = self.classes[name] = _Tau(self.prior_tau)
        return cls

    def _retire(self, decoding: list[Request]) -> None:
        """Forgets requests no longer decoding, once the table holds many more than the batch."""
        if len(self.requests) > 2 * len(decoding) + 64:
            live = {r.request_id for r in decoding}
            self.requests = {k: v for k, v in self.requests.items() if k in live}

    def default_k(self, r: Request) -> int:
        return cap_k(r) if self.speculating else 0

    def joining_k(self, r: Request, batch: int) -> int:
        """A tree for a request joining decoding where trees pay at the batch it joins, for a request
        accepting as its class does (entering them needs the hysteresis): a wave of requests reaching a
        small batch would otherwise grow a tree for each of them in its prompt step, and the next step,
        plain at the wave's size, would drop them all; a request reaching an idle engine grows its
        first tree with its prompt. None for one joining a batch that decodes plain: that batch enters
        trees only where `_trees_pay` finds entering pays (the streams, the catch-up and the entering
        step priced), and its entering step grows every request's tree; until then, the next plain
        step would drop the joiner's (at T = 1 and concurrency 16, 44 of 54 such trees were)."""
        if not self.speculating and batch > 1:
            return 0
        margin = 1.0 if self.speculating else 1.0 + self.hysteresis
        pays = self._class(acceptance_class(r)).value > self.break_even(batch) * margin
        return cap_k(r) if pays else 0

    def commit(self, decision: Decision, plan: StepPlan) -> None:
        decision.shape = plan.shape()[0]

    def observe(self, decision: Decision, verified: list[tuple[Request, int, int]], seconds: float) -> None:
        shape = decision.shape
        if shape is None:
            return
        trees = False
        for r, drafted, accepted in verified:
            if drafted <= 0:
                continue
            trees = True
            tau = accepted + 1.0
            self._class(acceptance_class(r)).add(tau, self.prior_weight, 4 * REQUEST_WINDOW)
            est = self.requests.get(r.request_id)
            if est is not None:
                est.add(tau, self.prior_weight, REQUEST_WINDOW)
        if trees:
            if self.plain_steps:  # the relaxation read so far becomes the cells' samples
                self._settle_tree_ratios()
            self.plain_steps = 0
        elif shape.batch:
            self.plain_steps += 1
            self._drift_to_prior()
        self._follow_excursion(shape, trees or shape.draft_steps > 0, verified, seconds)
        self._learn_cost(shape, seconds)

    def _follow_excursion(self, shape: StepShape, tree_step: bool, verified: list[tuple[Request, int, int]],
                          seconds: float) -> None:
        """Adds a step that drafts or verifies trees to the excursion; the first step that does neither
        ends it, and the backoff follows its verdict. Steps with a prompt chunk are left out of both
        sides (their time is the prompt's)."""
        spent, plain = self.excursion
        if not tree_step:
            if spent > 0.0:
                lost = spent > plain
                self.backoff = min(2 * self.backoff, self.max_backoff) if lost else 1
                log.debug("trees for %.1f ms where plain steps would have taken %.1f ms: retries every %d plain "
                          "steps", 1e3 * spent, 1e3 * plain, self.retry_steps * self.backoff)
                self.excursion = [0.0, 0.0]
            return
        if shape.batch and not shape.prefill_tokens and seconds > 0.0:
            tokens = shape.batch + sum(a for _, d, a in verified if d > 0)
            self.excursion = [spent + seconds, plain + tokens * self.plain_seconds(shape.batch) / shape.batch]

    def _drift_to_prior(self) -> None:
        rate = 1.0 - 0.5 ** (1.0 / (self.retry_steps * self.backoff))
        for cls in self.classes.values():
            if cls.value < self.prior_tau:
                cls.value += (self.prior_tau - cls.value) * rate

    def _settle_tree_ratios(self) -> None:
        """Before a tree step's sample joins its cell: each tree cell's samples relaxed as `_ratio`
        reads them, so that the new sample is weighed against what the chooser has been pricing."""
        kept = self._kept()
        for (tree, bucket), samples in self.ratios.items():
            if tree:
                plain = self._ratio(False, bucket)
                for i, x in enumerate(samples):
                    samples[i] = plain + (x - plain) * kept

    def _learn_cost(self, shape: StepShape, seconds: float) -> None:
        kind = (shape.verify_width, shape.draft_steps)
        settled, self.last_kind = kind == self.last_kind, kind
        steady = shape.verify_width == shape.draft_steps + 1
        if not (settled and steady and shape.batch and not shape.prefill_tokens and seconds > 0):
            return
        tree = shape.draft_steps > 0
        raw = self.tree_seconds(shape.batch, raw=True) if tree else self.plain_seconds(shape.batch, raw=True)
        if raw <= 0.0 or raw == float("inf"):
            return
        sample = min(max(seconds / raw, RATIO_CLAMP[0]), RATIO_CLAMP[1])
        self.ratios.setdefault((tree, _bucket(shape.batch)), deque(maxlen=RATIO_SAMPLES)).append(sample)


def _streams_missing(r: Request) -> int:
    """Positions of a decoding request (its pending token's excluded) whose streams its head needs
    and the store lacks."""
    if r.streams_missing_from is None:
        return 0
    return max(r.num_tokens - 1 - max(r.streams_missing_from, r.draft_computed), 0)


def _bucket(batch: int) -> int:
    """Batches priced alike: powers of two, as the graphs pad them."""
    return 1 << max(batch - 1, 0).bit_length()
