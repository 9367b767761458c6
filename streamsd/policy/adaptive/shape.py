"""Step time measured in the engine's own step shape: B requests × w query tokens each.

Why not a pass over N tokens of one sequence (what the first profile timed): the engine never runs
that shape for decoding.  On a GPU a decode/verify step replays the CUDA graph of the smallest
(batch bucket ≥ B, query width ≥ 1 + max k_i); the graph pads both, so its time is flat in
Σ k_i and jumps with max k_i (with widths (1, K + 1) captured, any speculation pays the full
K + 1 width).  On a CPU the step runs eagerly and unpadded, and attention is one call per request,
so B costs on its own besides the tokens: a single-sequence profile predicted 2 ms for a 64-request
step that took 13 ms.

``ShapeTable`` keeps seconds per (batch edge, width).  ``padded`` (graphs): a lookup returns the
value of the smallest covering edge and width.  Unpadded (eager): linear in the tokens per request
between and past the measured widths, and linear in B between batch edges (proportional past the
last, a pessimistic extrapolation).  Values are made monotone along both axes (running maximum) so
timing noise never predicts that more work is cheaper.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ShapeTable:
    batches: tuple[int, ...]
    widths: tuple[int, ...]
    values: tuple[tuple[float, ...], ...]  # [batch edge][width] seconds per target pass
    padded: bool
    timed: int = 0  # cells actually measured (the others were filled from their neighbours)

    @classmethod
    def from_samples(cls, samples: Mapping[tuple[int, int], float], *, padded: bool,
                     batches: Iterable[int] = (), widths: Iterable[int] = ()) -> ShapeTable:
        """``samples``: (batch, width) → seconds; cells of ``batches`` × ``widths`` (default: those
        sampled) that were not timed are filled from their neighbours: a row's first and last widths
        scaled from a smaller batch (profiling ran out of time: pessimistic), the widths between on the
        row's line between its nearest timed or filled widths (the CPU times the middle widths of small
        steps only)."""
        batches = tuple(sorted({*batches, *(b for b, _ in samples)}))
        widths = tuple(sorted({*widths, *(w for _, w in samples)}))
        rows: list[tuple[float, ...]] = []
        below = [0.0] * len(widths)
        for b in batches:
            known = {w: float(v) for (pb, w), v in samples.items() if pb == b}
            for w in (widths[0], widths[-1]):  # a row's ends, out of time: scaled from a smaller batch
                prev = None if w in known else next((pb for pb in reversed(batches) if pb < b and (pb, w) in samples),
                                                    None)
                if prev:
                    known[w] = samples[(prev, w)] * b / prev
            row, left = [], 0.0
            for j, w in enumerate(widths):
                lo = max((x for x in known if x <= w), default=None)
                hi = min((x for x in known if x >= w), default=None)
                if lo is None or hi is None or lo == hi:  # timed, or past the row's known widths
                    v = known.get(w, left)
                else:  # on the row's line between its nearest known widths
                    v = known[lo] + (known[hi] - known[lo]) * (w - lo) / (hi - lo)
                left = max(left, below[j], v)
                row.append(left)
            below = row
            rows.append(tuple(row))
        return cls(batches, widths, tuple(rows), padded, len(samples))

    def covers(self, batch: int, width: int) -> bool:
        return bool(self.batches) and batch <= self.batches[-1] and width <= self.widths[-1]

    def key(self, batch: int, width: int) -> tuple[int, int]:
        """Which measured cell a step falls in: its graph on a GPU, its size class on a CPU."""
        return bisect.bisect_left(self.batches, batch), bisect.bisect_left(self.widths, width)

    def __call__(self, batch: int, tokens: int, width: int) -> float:
        """Seconds of a pass over ``batch`` requests with ``tokens`` query tokens in all and at most
        ``width`` per request."""
        if batch <= 0 or not self.batches:
            return 0.0
        if self.padded:
            i, j = self.key(batch, width)
            return self.values[min(i, len(self.batches) - 1)][min(j, len(self.widths) - 1)]
        per_request = max(tokens / batch, 1.0)
        i = bisect.bisect_left(self.batches, batch)
        if i == 0:
            return self._row(0, per_request) * batch / self.batches[0] if batch < self.batches[0] else \
                self._row(0, per_request)
        if i == len(self.batches):
            return self._row(i - 1, per_request) * batch / self.batches[-1]
        lo, hi = self.batches[i - 1], self.batches[i]
        f = (batch - lo) / (hi - lo)
        return (1.0 - f) * self._row(i - 1, per_request) + f * self._row(i, per_request)

    def _row(self, i: int, per_request: float) -> float:
        """One batch edge's seconds at ``per_request`` tokens each: piecewise linear in the width."""
        ws, vs = self.widths, self.values[i]
        if len(ws) == 1:
            return vs[0] * per_request / ws[0]
        j = min(max(bisect.bisect_left(ws, per_request), 1), len(ws) - 1)
        w0, w1, v0, v1 = ws[j - 1], ws[j], vs[j - 1], vs[j]
        return max(v0 + (v1 - v0) * (per_request - w0) / (w1 - w0), 0.0)
