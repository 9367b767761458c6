"""Speculation on against off, read against the run's own noise (`bench serve --compare-speculation`).

One on/off pair says little on a shared machine: on this 2-core CPU two cells of a server that
cannot speculate differed by up to 15 %, in either direction. With `--repeats N` every setting runs
N rounds in ABBA order (off, on | on, off | ...), so a machine drifting over the run favours neither
side. The rounds' off cells against each other are an A/A test: their spread is the noise this run
saw, and a deficit of speculation is a loss only beyond it. `bench offline`'s paired cells read
their plain passes the same way (`verdict`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `bench offline` reads verdicts too, and must not need the HTTP client's packages
    from streamsd.bench.results import CellResult

FASTER, WITHIN_NOISE, SLOWER, UNKNOWN = "faster", "within noise", "slower", "no A/A (one round)"


@dataclass(frozen=True, slots=True)
class Round:
    off_tokens_per_s: float
    on_tokens_per_s: float
    ratio: float  # on ÷ off output tokens/s
    tpot_ratio: float | None  # off TPOT ÷ on TPOT (above 1: speculation faster)


@dataclass(frozen=True, slots=True)
class Comparison:
    setting: str  # the cells' label without the switch and the round
    rounds: tuple[Round, ...]
    median_ratio: float  # of an even number of rounds the lower middle one: no lean towards speculation
    plain_spread: float | None  # max ÷ min − 1 of the off cells' tokens/s: the A/A noise (None with one round)
    verdict: str


def lower_median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def compare(cells: Sequence[CellResult]) -> list[Comparison]:
    """One comparison per setting that ran with speculation both off and on, in run order."""
    groups: dict[tuple[int | None, float | None], list[CellResult]] = {}
    for c in cells:
        if c.speculative is not None:
            groups.setdefault((c.concurrency, c.request_rate), []).append(c)
    out = []
    for group in groups.values():
        off = [c for c in group if c.speculative is False]
        on = [c for c in group if c.speculative is True]
        rounds = tuple(_round(a, b) for a, b in zip(off, on, strict=False))
        if not rounds:
            continue
        median = lower_median([r.ratio for r in rounds])
        spread = spread_of([c.throughput.output_tokens_per_s for c in off])
        out.append(Comparison(_setting(group[0].label), rounds, median, spread, verdict(median, spread)))
    return out


def _round(off: CellResult, on: CellResult) -> Round:
    a, b = off.throughput.output_tokens_per_s, on.throughput.output_tokens_per_s
    tpot = off.tpot_ms.median / on.tpot_ms.median if off.tpot_ms.median and on.tpot_ms.median else None
    return Round(a, b, b / a if a > 0 else 0.0, tpot)


def spread_of(values: Sequence[float]) -> float | None:
    """max ÷ min − 1 of an A/A sample (the plain passes or cells of one setting); None below two."""
    if len(values) < 2 or min(values) <= 0:
        return None
    return max(values) / min(values) - 1.0


def verdict(median: float, spread: float | None) -> str:
    """Speculation ÷ plain at its median against the plain side's own spread in the same run."""
    if median >= 1.0:
        return FASTER
    if spread is None:
        return UNKNOWN
    return WITHIN_NOISE if 1.0 - median <= spread else SLOWER


def _setting(label: str) -> str:
    words = [w for w in label.split() if w not in ("spec", "on", "off") and not w.startswith("#")]
    return " ".join(words)
