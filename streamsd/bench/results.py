"""One benchmark cell's figures (a concurrency/rate/speculation setting) and the run's JSON document."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from streamsd.bench.client import RequestResult
from streamsd.bench.metrics_scrape import SpecCounters
from streamsd.bench.stats import SpecTotals, Summary, ms, spec_totals, summarize, tpot

# Every cell in the JSON carries each of these keys; tests and plotting rely on them.
FIGURE_GROUPS = (
    "requests", "throughput", "tokens", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "speculation", "samples",
)


@dataclass(frozen=True)
class CellPlan:
    concurrency: int | None  # None: unbounded (paced only by request_rate)
    request_rate: float  # requests/s of the Poisson arrivals; inf sends all at once
    speculative: bool | None  # per-request switch; None leaves the server's default
    round: int | None = None  # with --repeats: which round of the setting (labels gain `#n`)
    turn: int | None = None  # with --multi-turn: which turn of the conversations
    shared_prefix_tokens: int | None = None  # with --shared-prefix-tokens: every request's common prefix

    @property
    def label(self) -> str:
        parts = []
        if self.concurrency is not None:
            parts.append(f"c={self.concurrency}")
        if math.isfinite(self.request_rate):
            parts.append(f"rate={self.request_rate:g}/s")
        if not parts:
            parts.append("c=all")
        if self.speculative is not None:
            parts.append("spec on" if self.speculative else "spec off")
        if self.round is not None:
            parts.append(f"#{self.round + 1}")
        if self.turn is not None:
            parts.append(f"turn {self.turn}")
        if self.shared_prefix_tokens is not None:
            parts.append(f"prefix={self.shared_prefix_tokens}")
        return " ".join(parts)


@dataclass(frozen=True)
class RequestCounts:
    total: int
    completed: int
    failed: int
    errors_by_status: dict[str, int]


@dataclass(frozen=True)
class Throughput:
    request_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float


@dataclass(frozen=True)
class TokenTotals:
    input: int
    output: int


@dataclass(frozen=True)
class Speculation:
    """`usage` sums each request's usage.speculative; `metrics` is the /metrics counter delta."""

    usage: SpecTotals | None
    metrics: SpecCounters | None


@dataclass(frozen=True)
class Samples:
    """Per-request figures in ms, kept for CDF plots and for re-plotting from the JSON."""

    ttft_ms: tuple[float, ...]
    tpot_ms: tuple[float, ...]
    e2e_ms: tuple[float, ...]


@dataclass(frozen=True)
class CellResult:
    label: str
    concurrency: int | None
    request_rate: float | None  # None stands for infinity (JSON has no inf)
    speculative: bool | None
    shared_prefix_tokens: int | None  # about how many tokens every request's prompt shares (None: none)
    duration_s: float
    requests: RequestCounts
    throughput: Throughput
    tokens: TokenTotals
    ttft_ms: Summary
    tpot_ms: Summary
    itl_ms: Summary
    e2e_ms: Summary
    speculation: Speculation
    samples: Samples


def build_cell(
    plan: CellPlan, results: Sequence[RequestResult], duration_s: float, counters: SpecCounters | None
) -> CellResult:
    done = [r for r in results if r.ok]
    errors = Counter(r.error_kind or r.outcome for r in results if not r.ok)
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    span = max(duration_s, 1e-9)
    ttft = ms(r.ttft for r in done)
    tpots = ms(tpot(r.e2e, r.ttft, r.output_tokens) for r in done)
    e2e = ms(r.e2e for r in done)
    return CellResult(
        label=plan.label,
        concurrency=plan.concurrency,
        request_rate=plan.request_rate if math.isfinite(plan.request_rate) else None,
        speculative=plan.speculative,
        shared_prefix_tokens=plan.shared_prefix_tokens,
        duration_s=duration_s,
        requests=RequestCounts(len(results), len(done), len(results) - len(done), dict(sorted(errors.items()))),
        throughput=Throughput(len(done) / span, out_tokens / span, (in_tokens + out_tokens) / span),
        tokens=TokenTotals(in_tokens, out_tokens),
        ttft_ms=summarize(ttft),
        tpot_ms=summarize(tpots),
        itl_ms=summarize(ms(gap for r in done for gap in r.itl)),
        e2e_ms=summarize(e2e),
        speculation=Speculation(spec_totals((r.output_tokens, r.spec) for r in done), counters),
        samples=Samples(tuple(ttft), tuple(tpots), tuple(e2e)),
    )


def run_document(config: dict[str, Any], cells: Sequence[CellResult],
                 comparisons: Sequence[Any] = ()) -> dict[str, Any]:
    """The `--output-json` document: the run's settings, every cell's figure groups, and (with
    --compare-speculation) speculation against plain per setting (bench/compare.py)."""
    doc: dict[str, Any] = {"version": 1, "config": config, "cells": [dataclasses.asdict(c) for c in cells]}
    if comparisons:
        doc["comparisons"] = [dataclasses.asdict(c) for c in comparisons]
    return doc
