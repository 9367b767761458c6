"""Pure figure math for the benchmark: percentiles, latency summaries, speculation totals."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Summary:
    """Distribution of one latency figure, in milliseconds; all None when nothing was measured."""

    count: int
    mean: float | None
    median: float | None
    p90: float | None
    p99: float | None
    std: float | None
    min: float | None
    max: float | None


@dataclass(frozen=True)
class SpecTotals:
    """Speculation figures summed over requests (from each request's `usage.speculative`)."""

    requests: int
    drafted: int
    accepted: int
    acceptance_rate: float | None
    mean_accepted_length: float | None


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q out of range: {q}")
    ordered = sorted(values)
    rank = q / 100.0 * (len(ordered) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summarize(values: Iterable[float]) -> Summary:
    data = [float(v) for v in values]
    if not data:
        return Summary(0, None, None, None, None, None, None, None)
    mean = sum(data) / len(data)
    std = math.sqrt(sum((v - mean) ** 2 for v in data) / len(data))
    return Summary(
        count=len(data),
        mean=mean,
        median=percentile(data, 50),
        p90=percentile(data, 90),
        p99=percentile(data, 99),
        std=std,
        min=min(data),
        max=max(data),
    )


def tpot(e2e_s: float, ttft_s: float | None, output_tokens: int) -> float | None:
    """Time per output token after the first, as vLLM defines it; None for single-token replies."""
    if ttft_s is None or output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


def spec_totals(usages: Iterable[tuple[int, dict | None]]) -> SpecTotals | None:
    """Aggregate `(completion_tokens, usage.speculative)` pairs; None when no request reported any.

    The mean accepted length is tokens per verify step over all requests, so each request's
    step count is recovered as completion_tokens / its own mean_accepted_length.
    """
    n = drafted = accepted = 0
    tokens = 0
    steps = 0.0
    for completion_tokens, spec in usages:
        if not spec:
            continue
        n += 1
        drafted += int(spec.get("drafted") or 0)
        accepted += int(spec.get("accepted") or 0)
        mal = spec.get("mean_accepted_length")
        if mal:
            tokens += completion_tokens
            steps += completion_tokens / float(mal)
    if n == 0:
        return None
    return SpecTotals(
        requests=n,
        drafted=drafted,
        accepted=accepted,
        acceptance_rate=accepted / drafted if drafted else None,
        mean_accepted_length=tokens / steps if steps else None,
    )


def ms(values: Iterable[float | None]) -> list[float]:
    """Seconds to milliseconds, dropping figures a request could not provide."""
    return [v * 1000.0 for v in values if v is not None]
