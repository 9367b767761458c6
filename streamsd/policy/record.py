"""What the adaptive policy decided and how well it predicted, for metrics and benchmark summaries.

Torch-free, off the decisions: the policy feeds it the steps it built (`built`), the steps it learnt
from (`learnt`) and its first plans (`planned`); /metrics reads the counters, `summary` the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamsd.policy.adaptive import CostTable, PlannerState
    from streamsd.policy.adaptive.planner import RequestView

KEPT = 96  # first steps and plans a benchmark can read back


@dataclass(slots=True)
class PolicyRecord:
    # Of the steps built: k per decoding request (a histogram, for metrics), plain steps.
    chosen_k: dict[int, int] = field(default_factory=dict)
    plain_steps: int = 0
    steps: int = 0
    last_predicted: float = 0.0
    last_measured: float = 0.0
    abs_error_sum: float = 0.0  # Σ |predicted / measured − 1| over observed steps
    observed_steps: int = 0
    # The same per kind of step (0: plain, 1: speculative), corrected and from the start-up table
    # alone: [Σ corrected error, Σ raw error, steps].
    errors: dict[int, list[float]] = field(default_factory=dict)
    # Per step shape (batch, verify tokens): [Σ predicted s, Σ measured s, steps]. The per-step error
    # above also holds each step's own jitter; these sums say whether the table is right per shape.
    shapes: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    # The first steps learnt: (batch, verify width, draft steps, taught the table, raw / corrected
    # predicted ms, measured ms).
    trace: list[tuple[int, int, int, int, float, float, float]] = field(default_factory=list)
    # The first plans: (step, batch, plain tok/s, best expected tok/s scored, chosen plan's, max k, the
    # first request's catch-up lag, means and lower quantiles): whether the gate or the means refused.
    plans: list[tuple[object, ...]] = field(default_factory=list)

    def built(self, batch: int, plain: bool, ks: list[int]) -> None:
        if batch:
            self.steps += 1
            self.plain_steps += plain
            for k in ks:
                self.chosen_k[k] = self.chosen_k.get(k, 0) + 1

    def planned(self, step: int, views: list[RequestView], st: PlannerState, ks: list[int]) -> None:
        if views and len(self.plans) < KEPT:
            v = views[0]
            self.plans.append((step, len(views), round(st.plain_rate, 1), round(st.top_rate, 1), round(st.spec_rate, 1),
                               max(ks), v.catchup_tokens, [round(a, 3) for a in (v.mean_alphas or ())[:4]],
                               [round(a, 3) for a in v.alphas[:4]]))

    def learnt(self, shape: tuple[int, int, int, int], taught: bool, predicted: float, raw: float,
               seconds: float) -> None:
        """shape: (batch, verify tokens, verify width, draft steps) of a step whose time was measured."""
        batch, tokens, width, drafts = shape
        if len(self.trace) < KEPT:
            self.trace.append((batch, width, drafts, int(taught), round(raw * 1e3, 3), round(predicted * 1e3, 3),
                               round(seconds * 1e3, 3)))
        t = self.shapes.setdefault((batch, tokens), [0.0, 0.0, 0])
        t[0] += predicted
        t[1] += seconds
        t[2] += 1
        self.last_predicted, self.last_measured = predicted, seconds
        self.abs_error_sum += abs(predicted / seconds - 1.0)
        self.observed_steps += 1
        e = self.errors.setdefault(int(width > 1 or drafts > 0), [0.0, 0.0, 0])
        e[0] += abs(predicted / seconds - 1.0)
        e[1] += abs(raw / seconds - 1.0)
        e[2] += 1

    @property
    def plain_step_share(self) -> float:
        return self.plain_steps / self.steps if self.steps else 0.0

    @property
    def mean_abs_prediction_error(self) -> float | None:
        """Mean |predicted / measured − 1| over the steps learnt from so far."""
        return self.abs_error_sum / self.observed_steps if self.observed_steps else None

    def summary(self) -> dict[str, object]:
        return {
            "steps": self.steps,
            "plain_step_share": self.plain_step_share,
            "chosen_k": dict(sorted(self.chosen_k.items())),
            "mean_abs_prediction_error": self.mean_abs_prediction_error,
            "observed_steps": self.observed_steps,
            # Corrected (what the planner used) and raw (the start-up table alone), per kind of step.
            "prediction_error": {
                ("plain", "speculative")[kind]: {"mean_abs": e[0] / e[2], "mean_abs_raw": e[1] / e[2], "steps": e[2]}
                for kind, e in sorted(self.errors.items()) if e[2]
            },
            # Σ predicted / Σ measured per (batch, verify tokens) shape of step, and its mean measured time.
            "by_shape": {f"{b}x{n}": {"ratio": t[0] / t[1], "measured_ms": 1e3 * t[1] / t[2], "steps": t[2]}
                         for (b, n), t in sorted(self.shapes.items()) if t[1] > 0},
            "trace": self.trace,
            "plans": self.plans,
        }


def profile_ms(cost: CostTable) -> dict[str, object]:
    """The start-up table's smallest batch row, draft and catch-up steps, in ms."""
    def ms(t: float) -> float:
        return round(t * 1e3, 4)

    out: dict[str, object] = {"spec_overhead": ms(cost.spec_overhead_s),
                              "draft": dict(zip(cost.draft.keys[:4], map(ms, cost.draft.values[:4]), strict=True)),
                              "catchup": dict(zip(cost.catchup.keys[:6], map(ms, cost.catchup.values[:6]), strict=True))}
    if cost.shape is not None and cost.shape.batches:
        out["verify"] = {"batch": cost.shape.batches[0],
                         "by_width": dict(zip(cost.shape.widths, map(ms, cost.shape.values[0]), strict=True))}
    return out
