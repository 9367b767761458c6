"""Budget search for the planner: the best prefix of the batch's drafts ranked by survival.

See ``planner.py`` for the objective.  ``Search.run`` takes per-request survival lists (expected
and pessimistic), ranks every (request, depth) draft by expected survival, and for each depth
limit scores the ends of the cost model's flat segments with prefix sums, so a step over B
requests and K depths costs O(B·K log(B·K)) for the sort and a few dozen cost lookups per level.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, zip_longest
from operator import mul
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamsd.policy.adaptive.cost import CostTable
    from streamsd.policy.adaptive.planner import RequestView


@dataclass(slots=True)
class Plan:
    rate: float  # expected tokens/s from the posterior means
    ks: list[int]


@dataclass(slots=True)
class Search:
    requests: Sequence[RequestView]
    cost: CostTable
    prefill: int
    credit: float  # output-token worth of the prefill
    prefill_s: float  # seconds charged to the prefill rather than to decoding
    horizon: int
    lagging: bool = False  # any request with draft catch-up
    top: float = 0.0  # the best expected rate scored by any search so far, whatever its gate said

    def __post_init__(self) -> None:
        self.lagging = any(r.catchup_tokens for r in self.requests)

    def run(self, mean: Sequence[list[float]], safe: Sequence[list[float]], eligible: Sequence[int],
            floor: float, keep_depth: int = 0, margin: float = 0.0, mean_floor: float = 0.0,
            deepen_margin: float = 0.0) -> Plan | None:
        """Highest expected-rate plan whose pessimistic rate beats ``floor`` and whose expected rate
        reaches ``mean_floor``, if any.

        Draft steps are shared by the batch (the drafter runs max k_i times), and on a GPU the verify
        graph is as wide as the deepest request (a graph replay pads every request to 1 + max k_i), so
        plans are searched per depth limit L; the search stops after two levels in a row that did not improve (one
        is not enough: a noisy cost key can dent an otherwise rising curve).

        ``keep_depth``: the depth limit of the last plan, kept unless another beats it by ``margin``:
        a step queued ahead (worker/lookahead.py) has the last plan's shape, and a new depth drops it, a
        whole GPU step wasted (on an H200 at B = 64 the plan flipped between near-tied k = 1 and 2).
        A deeper one must also beat it by ``deepen_margin`` (the planner's: what pays for the switch
        before the batch ends).
        """
        ranked = sorted((-m, j, i) for i in eligible for j, m in enumerate(mean[i]))
        if not ranked:
            return None
        deepest = max(j for _, j, _ in ranked) + 1
        if self.cost.depth_is_free:  # no draft forward and no padded graph width: one level
            return self._level(ranked, safe, floor, mean_floor)[0]
        best: Plan | None = None
        levels: dict[int, Plan | None] = {}
        top, misses = 0.0, 0
        for depth in range(1, deepest + 1):
            level, rate = self._level([it for it in ranked if it[1] < depth], safe, floor, mean_floor)
            levels[depth] = level
            if level is not None and (best is None or level.rate > best.rate):
                best = level
            misses = misses + 1 if rate <= top else 0
            top = max(top, rate)
            if misses == 2:
                break
        if best is None or not 0 < keep_depth <= deepest:
            return best
        if keep_depth not in levels:
            levels[keep_depth] = self._level([it for it in ranked if it[1] < keep_depth], safe, floor, mean_floor)[0]
        kept = levels[keep_depth]
        need = max(margin, deepen_margin) if max(best.ks) > keep_depth else margin
        return kept if kept is not None and kept.rate * (1.0 + need) >= best.rate else best

    def _level(self, items: list[tuple[float, int, int]], safe: Sequence[list[float]],
               floor: float, mean_floor: float) -> tuple[Plan | None, float]:
        """Best prefix of ``items`` (ranked drafts); also the best expected rate ignoring ``floor``."""
        b, n = len(self.requests), len(items)
        # Prefix sums over the ranking; a request's first item is always its j = 0 (ranking is by
        # survival, then depth), so drafting requests and their catch-up count at j = 0 items.
        exp_mean = list(accumulate((-neg for neg, _, _ in items), initial=b + self.credit))
        exp_safe = list(accumulate((safe[i][j] for _, j, i in items), initial=b + self.credit))
        depths = [j for _, j, _ in items]
        n_spec = list(accumulate((j == 0 for j in depths), initial=0))
        if self.lagging:
            lags = [self.requests[i].catchup_tokens if j == 0 else 0 for _, j, i in items]
            catchup = list(accumulate(lags, initial=0))
        else:
            catchup = [0] * (n + 1)
        # Where each depth first appears; the number of draft steps of a prefix counts those before it.
        firsts = [depths.index(d) for d in range(max(depths) + 1)]
        base = b + self.prefill
        budgets = {n, *firsts[1:], *(e - base for e in self.cost.verify.keys if 0 < e - base < n)}
        budgets.update(1 << p for p in range(n.bit_length()) if 1 << p < n)
        best_rate, best_s, top = 0.0, 0, 0.0
        for s_idx in budgets:
            steps = bisect_left(firsts, s_idx)
            t = self.step_time(base + s_idx, steps, n_spec[s_idx], catchup[s_idx]) - self.prefill_s
            rate = exp_mean[s_idx] / t
            top = max(top, rate)
            if exp_safe[s_idx] / t > floor and rate >= mean_floor and rate > best_rate:
                best_rate, best_s = rate, s_idx
        self.top = max(self.top, top)
        if best_s == 0:
            return None, top
        ks = [0] * b
        for _, j, i in items[:best_s]:
            ks[i] = max(ks[i], j + 1)
        return Plan(best_rate, ks), top

    def hopeless(self, caps: list[int], safe_floor: float, mean_floor: float) -> float | None:
        """The ceiling of the expected rate when no budget can pass the gate (`run`'s floors), else None.
        A batch that plain decoding wins by far (B = 256 on an H200) is then planned in O(B + K²)
        instead of ranking its B·K drafts: 4 ms of Python a plan there, beside 9 ms steps, and each
        plan's step read slower. ``caps``: each request's k cap."""
        drafting = [(r.alphas[:cap], (r.alphas if r.mean_alphas is None else r.mean_alphas)[:cap])
                    for r, cap in zip(self.requests, caps, strict=True) if cap]
        safe_best = [max(column) for column in zip_longest(*(a for a, _ in drafting), fillvalue=0.0)]
        mean_best = [max(column) for column in zip_longest(*(m for _, m in drafting), fillvalue=0.0)]
        # The best survival at depth j is at most the product of the best α's up to j.
        bands = self.ceiling(list(accumulate(safe_best, mul)), list(accumulate(mean_best, mul)))
        if any(sr > safe_floor and mr >= mean_floor for sr, mr in bands):
            return None
        return max((mr for _, mr in bands), default=0.0)

    def ceiling(self, safe: Sequence[float], mean: Sequence[float]) -> list[tuple[float, float]]:
        """Upper bounds on the (pessimistic, expected) rate of any budget ``run`` could choose, one per
        depth band L: a budget of ((L − 1)·B, L·B] drafts has at least L draft steps (a request drafts
        at most one per depth), each draft at depth j survives at most ``safe[j]`` / ``mean[j]`` (the
        batch's best survival there, falling with depth), and its step costs at least the cheapest
        step of at least that many tokens at any depth ≥ L with one request drafting and no
        catch-up. The tables are monotone and each correction flat within its token bucket, so that
        step is read at the band's first token and at the first token of each bucket it crosses.
        O(K² · buckets crossed) cost lookups, whatever the batch: a plan that cannot pass is known
        without ranking B·K drafts."""
        b, depth = len(self.requests), len(safe)
        base = b + self.prefill
        edges = self.cost.verify.keys
        bounds = []
        exp_safe = exp_mean = b + self.credit
        for band in range(1, depth + 1):
            exp_safe += b * safe[band - 1]
            exp_mean += b * mean[band - 1]
            lo, hi = base + (band - 1) * b + 1, base + band * b
            starts = [lo, *(e + 1 for e in edges[bisect_left(edges, lo):bisect_right(edges, hi - 1)])]
            t = min(self.step_time(n, k, 1, 0) for n in starts for k in range(band, depth + 1)) - self.prefill_s
            # A step priced at or below the prefill's share bounds nothing (a correction far below 1).
            bounds.append((exp_safe / t, exp_mean / t) if t > 0 else (math.inf, math.inf))
        return bounds

    def step_time(self, n: int, kmax: int, n_spec: int, catchup: int) -> float:
        b = len(self.requests)
        t = self.cost.predict(b, n, kmax, draft_batch=n_spec, prefill_tokens=self.prefill)
        if catchup:
            full = self.cost.predict(b, n, kmax, draft_batch=n_spec, draft_extra_tokens=catchup,
                                     prefill_tokens=self.prefill)
            t += (full - t) / self.horizon
        return t
