"""Step-time cost model: what one engine step costs for a given batch shape.

A step over B decoding requests that speculate k_i drafts each costs

    t(B, N, k) = verify(N) + B · kv_per_request + [k > 0] · (spec_overhead + draft(B_d + c) + (k − 1) · draft(B_d))

where N = B + Σ k_i (+ prefill chunk tokens) is the number of tokens the target verifies, k the
number of sequential draft steps (the largest k_i), B_d the number of requests that draft and c
the draft-KV catch-up tokens of requests resuming speculation (folded into the first draft
forward, which is where the engine replays them; an EAGLE head replays them in a pass of its own,
priced by the ``catchup`` table).  A plain step (every k_i = 0) pays only the
first two terms: it is the engine's genuine plain step, with no drafter and no rejection sampler.

Why a measured table and not acceptance alone: whether speculation pays is a question of where N
sits on the target's roofline.  While N is memory-bound the extra verify tokens are nearly free;
past the ridge they cost compute, which is why k must shrink as the batch grows.

``StepTable`` holds measured seconds at bucket edges (the CUDA-graph capture sizes on a GPU, the
size classes on a CPU).  A pass over n tokens is padded to the next edge, so the table is *flat
within a bucket* and a lookup returns the value at the smallest edge ≥ n.  Measurements are noisy,
so the values are made monotone (running maximum): more tokens never predict less time, which
would otherwise lure the planner into a noisy dip.  Past the largest edge the engine runs eager and
unpadded; the table extrapolates proportionally to n, a pessimistic choice so that unmeasured
territory never attracts speculation.

Shape tables (``shape.py``): when the profile timed the engine's real step shape — B requests ×
(1 + k) tokens, through the CUDA graphs on a GPU — the verify term of a decode/verify step comes
from it instead: ``shape(B, N, 1 + max k_i)``, flat per graph on a GPU, interpolated on a CPU.
Prefill chunks then add what a one-sequence pass over their tokens costs beyond a one-token pass
(on a GPU a step with a chunk runs eagerly and is priced by the token table, as before).

Online correction: the true step time drifts (context lengths grow, clocks change) and the
start-up table has per-bucket errors.  ``CostTable.observe`` keeps a global EMA of the
measured/predicted ratio, which carries drift to every bucket at once, and, per (verify bucket,
draft steps) key, a relative ratio to that global one that fixes the table's shape.  Each step
is read as measured ÷ raw prediction (the start-up table alone).  Unseen keys use the global ratio
alone: optimistic on purpose, since a shape priced too high is never chosen and so never corrected
(pricing unseen speculative shapes like the learnt ones kept a CPU batch class from ever
speculating), while one priced too low costs the few steps that teach it.  Only plain decode steps
move the global ratio: a speculative step's error is mostly its own host work (proposer, rejection sampler) that the profile never timed, and
were it drift, it would also raise the predicted price of plain decoding, the very step the planner
compares speculation against (on an H200 at B = 64, alpha 0.3, that made speculation look cheap and
cost 47 % of the throughput).

Outliers: each correction follows the median of its key's last three samples, the current
estimate counting as the first two, so one odd step moves nothing and a real change is learnt
from its second step.  One stall — a kernel compile, a collection pause, a slow host turn — must
not teach the table that a speculative shape costs 4× (or 1.6×): the planner would avoid that shape
from then on, so no later step could correct it (on an H200 a batch of 4 never speculated again
after one compile inside its first speculative step, and at B = 64 one slow step sent a batch
plain for 8 steps).
A tail that recurs is priced, though: where two or more of a key's last 12 samples are slow (but not the
last two: a shift, which the median follows), it follows their mean instead (``_tail_of_recent``), so a
shape whose every fifth step takes twice the others costs its mean, and a lone stall among steady steps
still moves nothing.
A key follows its samples 4x faster than the global ratio (a 5-step EMA past its first samples),
so a key that stops being observed keeps the price of its last few steps (a 20-step EMA read worse on
an H200: adaptive EAGLE at batch 1 1.12x plain against 1.35x).

Speculative steps on a CPU (an unpadded shape table): priced as the plain step of their batch,
corrected as plain steps are, plus what their drafts' rows add, and their key's correction applies to
that addition alone (``_on_plain``). The drafts are what the planner weighs against their tokens, and
a correction of the whole step mostly learnt the plain step's error: it never priced the drafts.

``CostTable.from_roofline`` is the analytic fallback before anything is measured (roofline.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from streamsd.policy.adaptive.roofline import RooflineModel
from streamsd.policy.adaptive.shape import ShapeTable

RATIO_CLAMP = (0.25, 4.0)  # one outlier step (a GC pause, a recompile) moves a measured/predicted ratio this far at most

CorrectionKey = tuple[int, ...]
_GLOBAL: CorrectionKey = ()
TAIL_WINDOW, TAIL_MIN = 12, 6  # a key's recent samples whose mean prices it where slow ones recur
# A speculative step priced on the plain step (``CostTable._on_plain``) teaches its key only where its
# drafts add this share of the plain step's raw time: below, the plain step's own noise is most of the reading.
MIN_EXTRA = 0.03
FIRST_KEPT = 6  # a key's first samples, kept for the benchmarks' summary (see ``CostTable.first``)
CALIBRATION_STEPS = 8  # the global ratio's first plain steps: calibration, not drift (see ``_rebase``)


@dataclass(frozen=True, slots=True)
class StepTable:
    """Monotone, bucket-flat seconds per forward, keyed by bucket edge (tokens or requests)."""

    keys: tuple[int, ...] = ()
    values: tuple[float, ...] = ()

    @classmethod
    def from_samples(cls, samples: Mapping[int, float]) -> StepTable:
        keys = sorted(k for k in samples if k > 0)
        values: list[float] = []
        highest = 0.0
        for k in keys:
            highest = max(highest, float(samples[k]))
            values.append(highest)
        return cls(tuple(keys), tuple(values))

    def bucket(self, n: int) -> int:
        """Index of the edge a pass over ``n`` pads to; ``len(keys)`` past the last edge."""
        return bisect.bisect_left(self.keys, n)

    def __call__(self, n: int) -> float:
        if n <= 0 or not self.keys:
            return 0.0
        i = bisect.bisect_left(self.keys, n)
        if i < len(self.keys):
            return self.values[i]
        return self.values[-1] * n / self.keys[-1]


@dataclass(slots=True)
class CostTable:
    """Predicted step seconds from measured tables, corrected online by measured/predicted."""

    verify: StepTable
    draft: StepTable = field(default_factory=StepTable)
    kv_per_request_s: float = 0.0
    spec_overhead_s: float = 0.0
    ema: float = 0.05
    global_ratio: float = 1.0
    relative: dict[CorrectionKey, float] = field(default_factory=dict)
    seen: dict[CorrectionKey, int] = field(default_factory=dict)
    observations: int = 0
    shape: ShapeTable | None = None  # the engine's own step shape, when profiled (see the module doc)
    # Seconds to catch a head up on n positions it skipped (an EAGLE head resuming after plain steps:
    # its own pass, not a draft forward), by n; empty where catch-up rides on the draft forward.
    catchup: StepTable = field(default_factory=StepTable)
    # Seconds of a whole draft-tree step of the engine's tree shape, by batch (worker/profile.py's
    # time_tree_steps); empty where the engine drafts chains. The step chooser reads it (policy/chooser.py).
    tree: StepTable = field(default_factory=StepTable)
    # The last three samples per key (``_GLOBAL`` for the global ratio): see the module doc.
    recent: dict[CorrectionKey, list[float]] = field(default_factory=dict)
    tails: dict[CorrectionKey, list[float]] = field(default_factory=dict)  # the last TAIL_WINDOW samples per key
    # The first FIRST_KEPT samples (measured / raw) per key. A key priced high by its first steps is never
    # chosen again, so never corrected: these say whether those steps were steady or a pass's start-up
    # transients (on an H200 at B = 64 three early steps priced k = 1 at 1.38x its profile for good).
    first: dict[CorrectionKey, list[float]] = field(default_factory=dict)

    @classmethod
    def from_samples(
        cls,
        verify: Mapping[int, float],
        draft: Mapping[int, float] | None = None,
        *,
        kv_per_request_s: float = 0.0,
        spec_overhead_s: float = 0.0,
        shape: ShapeTable | None = None,
    ) -> CostTable:
        """``verify``: tokens → seconds per target pass; ``draft``: batch → seconds per draft step
        (omit for n-gram lookup, whose draft cost is zero); ``shape``: the engine's step shape."""
        return cls(StepTable.from_samples(verify), StepTable.from_samples(draft or {}),
                   kv_per_request_s, spec_overhead_s, shape=shape)

    @classmethod
    def from_roofline(
        cls,
        target: RooflineModel,
        draft: RooflineModel | None,
        buckets: Iterable[int],
        *,
        spec_overhead_s: float = 0.0,
    ) -> CostTable:
        """The fallback before measurements: sample the roofline at the bucket edges."""
        edges = sorted(set(buckets))
        verify = {n: target.step_time(0, n) for n in edges}
        drafts = {n: draft.step_time(n, n) for n in edges} if draft else {}
        return cls.from_samples(verify, drafts, kv_per_request_s=target.kv_seconds(target.context_len),
                                spec_overhead_s=spec_overhead_s)

    @property
    def depth_is_free(self) -> bool:
        """Whether the deepest request's k adds nothing by itself: no draft forward per depth (n-gram,
        synthetic drafts) and no graph padding every request to the widest query (an eager step).
        Otherwise one request at k = 4 makes all of them pay a width-5 verify."""
        return not self.draft.keys and (self.shape is None or not self.shape.padded)

    def predict_raw(
        self, batch_size: int, verify_tokens: int, draft_steps_k: int, *,
        draft_batch: int | None = None, draft_extra_tokens: int = 0, prefill_tokens: int = 0,
        verify_width: int | None = None,
    ) -> float:
        """``verify_width``: the widest request's verified tokens when it is not 1 + ``draft_steps_k``
        (a step entering speculation verifies no drafts yet and proposes k; one leaving it verifies
        its last drafts and proposes none)."""
        width = draft_steps_k + 1 if verify_width is None else verify_width
        t = self._verify_seconds(batch_size, verify_tokens, width - 1, prefill_tokens)
        if draft_steps_k > 0:
            drafting = batch_size if draft_batch is None else draft_batch
            extra = draft_extra_tokens
            if self.catchup.keys:  # replayed in a pass of its own, not in the first draft forward
                t += self.catchup(extra)
                extra = 0
            t += self.spec_overhead_s + self.draft(drafting + extra) + (draft_steps_k - 1) * self.draft(drafting)
        return t

    def _verify_seconds(self, batch: int, tokens: int, drafts: int, prefill: int) -> float:
        shape = self.shape
        if shape is None or batch <= 0 or (shape.padded and (prefill or not shape.covers(batch, drafts + 1))):
            return self.verify(tokens) + batch * self.kv_per_request_s
        t = shape(batch, tokens - prefill, drafts + 1)
        if prefill:  # a chunk's tokens beyond what the one-token pass already paid for
            t += max(self.verify(prefill) - self.verify(1), 0.0)
        return t

    def predict(
        self, batch_size: int, verify_tokens: int, draft_steps_k: int, *,
        draft_batch: int | None = None, draft_extra_tokens: int = 0, prefill_tokens: int = 0,
    ) -> float:
        """Corrected seconds for a step; ``draft_batch`` defaults to ``batch_size``; ``prefill_tokens``
        are the prompt-chunk tokens among ``verify_tokens``."""
        return self.predict_with_raw(batch_size, verify_tokens, draft_steps_k, draft_batch=draft_batch,
                                     draft_extra_tokens=draft_extra_tokens, prefill_tokens=prefill_tokens)[0]

    def predict_with_raw(
        self, batch_size: int, verify_tokens: int, draft_steps_k: int, *,
        draft_batch: int | None = None, draft_extra_tokens: int = 0, prefill_tokens: int = 0,
        verify_width: int | None = None,
    ) -> tuple[float, float]:
        """(``predict``, ``predict_raw``) of a step, the table read once. The correction is the verify
        shape's: its graph is most of the step."""
        raw = self.predict_raw(batch_size, verify_tokens, draft_steps_k, draft_batch=draft_batch,
                               draft_extra_tokens=draft_extra_tokens, prefill_tokens=prefill_tokens,
                               verify_width=verify_width)
        drafts = draft_steps_k if verify_width is None else verify_width - 1
        if self._on_plain(drafts or draft_steps_k, batch_size):
            base_raw, base = self._plain_of(batch_size, prefill_tokens)
            extra = self.relative.get(self.key(verify_tokens, drafts, batch_size=batch_size,
                                               prefill_tokens=prefill_tokens), 1.0)
            return base + max(raw - base_raw, 0.0) * self.global_ratio * extra, raw
        return raw * self.ratio(verify_tokens, drafts, batch_size=batch_size, prefill_tokens=prefill_tokens), raw

    def _on_plain(self, drafts: int, batch_size: int | None) -> bool:
        """Whether a step is priced as the plain step of its batch plus what its drafts add: a speculative
        step that runs eagerly and unpadded (a CPU's), whose drafts are rows beside the batch's own. Its
        key's correction then prices those rows alone. A correction of the whole step was the plain
        step's in disguise: on a 2-core CPU at B = 32 it priced a draft at 1.3 ms against a measured 2.1
        (the base step 25 % under the start-up table, the drafts' rows 25 % over it), and steps of one
        or two drafts read cheaper than the plain step itself, so drafts accepted 40 % of the time were
        verified where they could not pay."""
        return drafts > 0 and batch_size is not None and self.shape is not None and not self.shape.padded

    def _plain_of(self, batch_size: int, prefill_tokens: int) -> tuple[float, float]:
        """(raw, corrected) seconds of the plain step of this batch and prompt chunk."""
        raw = self.predict_raw(batch_size, batch_size + prefill_tokens, 0, prefill_tokens=prefill_tokens)
        return raw, raw * self.ratio(batch_size + prefill_tokens, 0, batch_size=batch_size,
                                     prefill_tokens=prefill_tokens)

    def key(self, verify_tokens: int, draft_steps_k: int = 0, *, batch_size: int | None = None,
            prefill_tokens: int = 0) -> CorrectionKey:
        """The correction key of a step: the measured cell it was priced from (a graph on a GPU), so
        each cell's own error — host work the profile does not see, a speculative step's rejection
        sampler and proposer — is learned separately."""
        shape = self.shape
        if shape is None or batch_size is None:
            return (self.verify.bucket(verify_tokens), draft_steps_k)
        b, w = shape.key(batch_size, draft_steps_k + 1)
        if shape.padded:
            if prefill_tokens:
                # A step with a prompt chunk runs eagerly, priced by the token table, whose error there
                # is the chunk's, the same whatever the drafts: one key for every k. Per k, the drafting
                # steps that fill a batch learnt 0.32 while k = 0 kept its 1.08 from one early sample,
                # so on an H200 drafts looked to make a 50 ms admission step 3x cheaper, and every
                # admission step at B = 256 verified a draft (TTFT +5-10 %, TPOT -1 %).
                return (-1, self.verify.bucket(verify_tokens))
            if not shape.covers(batch_size, draft_steps_k + 1):
                return (-1, self.verify.bucket(verify_tokens), draft_steps_k)  # eager step
            return (b, w)
        # Unpadded: the size class, speculative or not, and whether a chunk rode along. Not per k: what
        # the table misses is mostly per-step host work (rejection sampler, proposer) that any k
        # pays, and one key per k would learn it k times over.
        return (b, int(draft_steps_k > 0), int(prefill_tokens > 0))

    def ratio(self, verify_tokens: int, draft_steps_k: int = 0, *, batch_size: int | None = None,
              prefill_tokens: int = 0) -> float:
        key = self.key(verify_tokens, draft_steps_k, batch_size=batch_size, prefill_tokens=prefill_tokens)
        return self.global_ratio * self.relative.get(key, 1.0)

    def observe(
        self, raw: float, measured: float, *, verify_tokens: int | None = None, draft_steps_k: int = 0,
        batch_size: int | None = None, prefill_tokens: int = 0,
    ) -> None:
        """Feed back one step: ``raw`` is what ``predict_raw`` returned for it (with the same
        ``batch_size`` and ``prefill_tokens``). measured ÷ raw is the ratio the step shows, however
        much was learnt between its pricing and now (the engine learns a step while the next runs).

        Without ``verify_tokens`` only the global ratio moves.
        """
        if raw <= 0.0 or measured <= 0.0:
            return
        sample = min(max(measured / raw, RATIO_CLAMP[0]), RATIO_CLAMP[1])
        if verify_tokens is not None and self._on_plain(draft_steps_k, batch_size):
            assert batch_size is not None
            base_raw, base = self._plain_of(batch_size, prefill_tokens)
            if raw - base_raw < MIN_EXTRA * base_raw:
                return  # drafts too few to tell from the plain step's own noise
            # What the drafts added, read against the plain step's price: the key learns it as a ratio to
            # the global one, as any key does.
            sample = min(max((measured - base) / (raw - base_raw), 0.0), 4.0 * self.global_ratio)
        if verify_tokens is None or (draft_steps_k == 0 and prefill_tokens == 0):  # drift: plain decode only
            self.observations += 1
            robust = self._median_of_recent(_GLOBAL, sample, self.global_ratio)
            # The median itself while young (a start-up table that is off by host overhead the profile
            # does not see is corrected within a few steps), then a running mean, then an EMA.
            old = self.global_ratio
            self.global_ratio += _weight(self.observations, self.ema) * (robust - self.global_ratio)
            if self.observations <= CALIBRATION_STEPS:
                self._rebase(old / self.global_ratio)
        if verify_tokens is None:
            return
        key = self.key(verify_tokens, draft_steps_k, batch_size=batch_size, prefill_tokens=prefill_tokens)
        n = self.seen.get(key, 0) + 1
        self.seen[key] = n
        if n <= FIRST_KEPT:
            self.first.setdefault(key, []).append(round(sample, 3))
        rel = self.relative.get(key, 1.0)
        robust = self._median_of_recent(key, sample / self.global_ratio, rel)
        tail = self._tail_of_recent(key, sample / self.global_ratio)
        self.relative[key] = rel + _weight(n, 4.0 * self.ema) * ((robust if tail is None else tail) - rel)

    def _rebase(self, factor: float) -> None:
        """Keep every learnt key's price while the global ratio calibrates: what the first plain
        steps teach it is the plain step's own unprofiled host work, not drift common to every key.
        (A speculative key learnt before them would otherwise pay that work twice: on this CPU that
        priced k = 4 at 3.6 ms against a true 2.1 and kept B = 1 plain.)"""
        for key in self.relative:
            self.relative[key] *= factor
            if key in self.recent:
                self.recent[key] = [v * factor for v in self.recent[key]]
            if key in self.tails:
                self.tails[key] = [v * factor for v in self.tails[key]]

    def _tail_of_recent(self, key: CorrectionKey, value: float) -> float | None:
        """The mean of the key's last TAIL_WINDOW samples where at least two of them are slow (over 1.5x
        their median) but not the last two (a shift in the key's cost, which the median follows faster),
        else None (the median of three prices the key): a tail of slow steps that recurs is part of a
        shape's price, which the median never sees, while a lone stall is left out. On the
        H200 one step in 4-10 of a speculative shape took twice the others (a queued step dropped, a
        slow host turn): priced at the median, B = 256 at alpha 0.9 entered speculation for a predicted
        +10 % its mean step time did not have. (Taking the larger of this and the median of three
        overpriced such a shape by 17 %: the median jumps to a slow step whenever two of three are.)"""
        window = self.tails.setdefault(key, [])
        window.append(value)
        del window[:-TAIL_WINDOW]
        if len(window) < TAIL_MIN:
            return None
        median = sorted(window)[len(window) // 2]
        slow = [v > 1.5 * median for v in window]
        # The last two slow as well: the key's cost is shifting, which the median of three follows.
        if sum(slow) < 2 or (slow[-1] and slow[-2]):
            return None
        return sum(window) / len(window)

    def _median_of_recent(self, key: CorrectionKey, value: float, current: float) -> float:
        window = self.recent.setdefault(key, [current, current])
        window.append(value)
        del window[:-3]
        return sorted(window)[1]


def _weight(n: int, ema: float) -> float:
    """How far the n-th sample moves an estimate: all the way for the first three (each already a
    median), then a running mean that settles into an EMA."""
    return 1.0 if n <= 3 else max(1.0 / n, ema)
