"""`streamsd bench` figure math: percentiles, summaries (bench/stats.py) and /metrics deltas."""

from __future__ import annotations

import pytest

from streamsd.bench.metrics_scrape import parse_metrics, spec_delta
from streamsd.bench.stats import percentile, spec_totals, summarize, tpot


def test_percentile_matches_linear_interpolation() -> None:
    values = [float(v) for v in range(1, 11)]
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile([3.0], 99) == 3.0 and percentile([5.0, 1.0], 0) == 1.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summarize_and_tpot() -> None:
    s = summarize([2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0])
    assert (s.count, s.mean, s.median, s.std, s.min, s.max) == (8, 5.0, 4.5, 2.0, 2.0, 9.0)
    assert summarize([]).mean is None and summarize([]).count == 0
    assert tpot(1.0, 0.1, 10) == pytest.approx(0.1) and tpot(1.0, 0.1, 1) is None and tpot(1.0, None, 5) is None


def test_spec_totals_weights_steps_by_tokens() -> None:
    usages = [(10, {"drafted": 8, "accepted": 6, "mean_accepted_length": 2.5}),
              (6, {"drafted": 4, "accepted": 0, "mean_accepted_length": 1.0}), (5, None)]
    totals = spec_totals(usages)
    assert totals is not None and (totals.requests, totals.drafted, totals.accepted) == (2, 12, 6)
    assert totals.acceptance_rate == pytest.approx(0.5)
    assert totals.mean_accepted_length == pytest.approx(16 / (4 + 6))
    assert spec_totals([(3, None)]) is None


METRICS_BEFORE = """# TYPE streamsd:spec_decode_num_drafts_total counter
streamsd:spec_decode_num_drafts_total 10.0
# TYPE streamsd:spec_decode_num_draft_tokens_total counter
streamsd:spec_decode_num_draft_tokens_total 40.0
# TYPE streamsd:spec_decode_num_accepted_tokens_total counter
streamsd:spec_decode_num_accepted_tokens_total 20.0
# TYPE streamsd:spec_decode_num_accepted_tokens_per_pos_total counter
streamsd:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 8.0
streamsd:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 6.0
# TYPE streamsd:kv_cache_usage_perc gauge
streamsd:kv_cache_usage_perc 0.5
"""


def test_metrics_parse_and_spec_delta() -> None:
    before = parse_metrics(METRICS_BEFORE)
    assert before.get("kv_cache_usage_perc") == 0.5 and before.get("num_requests_running") is None
    after = parse_metrics(
        METRICS_BEFORE.replace(" 10.0", " 30.0").replace(" 40.0", " 120.0").replace(" 20.0", " 70.0")
        .replace('"0"} 8.0', '"0"} 26.0').replace('"1"} 6.0', '"1"} 16.0')
        + 'streamsd:spec_decode_num_accepted_tokens_per_pos_total{position="3"} 4.0\n'
    )
    delta = spec_delta(before, after)
    assert delta is not None
    assert (delta.num_drafts, delta.draft_tokens, delta.accepted_tokens) == (20.0, 80.0, 50.0)
    assert delta.acceptance_rate == pytest.approx(50 / 80)
    assert delta.mean_acceptance_length == pytest.approx(1 + 50 / 20)
    assert delta.per_position_acceptance == pytest.approx((18 / 20, 10 / 20, 0.0, 4 / 20))
    assert spec_delta(None, after) is None and spec_delta(parse_metrics(""), parse_metrics("")) is None
    vllm = parse_metrics("# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.25\n")
    assert vllm.get("kv_cache_usage_perc") == 0.25


def test_spec_delta_reads_the_mean_step_time_of_each_kind() -> None:
    """Speculative steps' cost in service beside plain ones': the mean of `step_duration_seconds` per kind
    between two scrapes; a kind without steps in the interval is left out."""
    def steps(verify: tuple[float, int], decode: tuple[float, int]) -> str:
        return METRICS_BEFORE + "# TYPE streamsd:step_duration_seconds histogram\n" + "".join(
            f'streamsd:step_duration_seconds_bucket{{kind="{k}",le="+Inf"}} {n}\n'
            f'streamsd:step_duration_seconds_count{{kind="{k}"}} {n}\n'
            f'streamsd:step_duration_seconds_sum{{kind="{k}"}} {t}\n'
            for k, (t, n) in (("prompt", (0.5, 2)), ("verify", verify), ("decode", decode)))

    delta = spec_delta(parse_metrics(steps((0.1, 40), (1.0, 900))), parse_metrics(steps((0.16, 60), (1.2, 1100))))
    assert delta is not None and set(delta.step_ms) == {"verify", "decode"}
    assert delta.step_ms["verify"] == pytest.approx(3.0) and delta.step_ms["decode"] == pytest.approx(1.0)


def test_spec_delta_splits_the_servers_ttft_by_stage() -> None:
    """Where a request's time to first token went on the server, per request over the interval: the
    means of the request histograms' deltas; a histogram the server lacks is left out."""
    def hist(queue: tuple[float, int], ttft: tuple[float, int]) -> str:
        return METRICS_BEFORE + "".join(
            f"# TYPE streamsd:{name} histogram\n"
            f'streamsd:{name}_bucket{{le="+Inf"}} {n}\nstreamsd:{name}_count {n}\nstreamsd:{name}_sum {t}\n'
            for name, (t, n) in (("request_queue_time_seconds", queue), ("time_to_first_token_seconds", ttft)))

    delta = spec_delta(parse_metrics(hist((1.0, 10), (2.0, 10))), parse_metrics(hist((1.3, 20), (2.8, 20))))
    assert delta is not None and set(delta.request_ms) == {"queue", "ttft"}
    assert delta.request_ms["queue"] == pytest.approx(30.0) and delta.request_ms["ttft"] == pytest.approx(80.0)
