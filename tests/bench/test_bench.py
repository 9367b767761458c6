"""`streamsd bench serve` / `bench soak`: pure figure math and parsing, then runs against a real
`streamsd serve` subprocess with the tiny target and draft models."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import streamsd
from streamsd.bench import serve, soak
from streamsd.bench.client import (
    RequestResult,
    RequestSpec,
    chunk_text,
    parse_sse_line,
    sampling_fields,
    stream_sse,
)
from streamsd.bench.compare import FASTER, SLOWER, UNKNOWN, WITHIN_NOISE, compare
from streamsd.bench.datasets import load_dataset, load_mt_bench, load_sharegpt, random_prompts, shared_prefix
from streamsd.bench.metrics_scrape import parse_metrics, spec_delta
from streamsd.bench.report import plot_serve
from streamsd.bench.results import FIGURE_GROUPS, CellPlan, CellResult, build_cell, run_document
from streamsd.bench.soak_tally import Tally
from streamsd.bench.stats import percentile, spec_totals, summarize, tpot
from tests.server_util import metric, start_server

MT_BENCH = Path(__file__).resolve().parents[3] / "shared" / "data" / "mt_bench_questions.jsonl"


# ---------------------------------------------------------------- datasets


def test_mt_bench_first_turns(tmp_path: Path) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text('{"question_id": 1, "turns": ["first?", "second?"]}\n\n{"turns": []}\n{"turns": ["b"]}\n')
    assert [p.text for p in load_mt_bench(path)] == ["first?", "b"]
    assert [p.follow_up for p in load_mt_bench(path)] == ["second?", None]
    if MT_BENCH.is_file():
        prompts = load_dataset(str(MT_BENCH), 100)
        assert len(prompts) == 100 and prompts[0].text.startswith("Compose an engaging travel blog")
        assert prompts[80].text == prompts[0].text  # 80 questions, cycled


def test_shipped_chat_prompts_load_as_mt_bench_questions_with_follow_ups() -> None:
    path = Path(streamsd.__file__).parent / "assets" / "bench" / "chat-prompts.jsonl"
    prompts = load_mt_bench(path)
    assert len(prompts) == 42 and len({p.text for p in prompts}) == 42
    assert all(p.follow_up for p in prompts)
    assert [p.text for p in load_dataset(str(path), 44)][42:] == [prompts[0].text, prompts[1].text]


def test_sharegpt_human_turn_and_output_len(tmp_path: Path) -> None:
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "Hello there"}, {"from": "gpt", "value": "a b c"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "no human"}]},
        {"id": "c", "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "Q"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    prompts = load_sharegpt(path)
    assert [(p.text, p.output_len) for p in prompts] == [("Hello there", 3), ("Q", None)]
    assert [p.text for p in load_dataset(str(path), 3)] == ["Hello there", "Q", "Hello there"]


def test_random_prompts_are_seeded_and_sized() -> None:
    a, b = random_prompts(4, 10, 7, seed=3), random_prompts(4, 10, 7, seed=3)
    assert a == b and len({p.text for p in a}) == 4
    assert all(len(p.text.split(": ", 1)[1].split()) == 10 and p.output_len == 7 for p in a)
    assert len(load_dataset("random:5", 2)[0].text.split()) == 6  # index prefix + 5 words
    with pytest.raises(FileNotFoundError):
        load_dataset("/nonexistent.jsonl", 1)


# ---------------------------------------------------------------- stats


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


# ---------------------------------------------------------------- /metrics

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


# ---------------------------------------------------------------- SSE client


def test_sse_line_and_chunk_parsing() -> None:
    assert parse_sse_line("data: [DONE]") == "[DONE]" and parse_sse_line(": keepalive") is None
    assert parse_sse_line("") is None and parse_sse_line('data:{"a":1}') == {"a": 1}
    chat = {"choices": [{"delta": {"content": "Hi"}, "finish_reason": None,
                         "streamsd": {"tokens": [{"id": 1, "text": "H", "draft": True}, {"id": 2, "text": "i"}]}}]}
    assert chunk_text(chat) == ("Hi", 2, None)
    assert chunk_text({"choices": [{"text": "x", "finish_reason": "length"}]}) == ("x", 1, "length")
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ("", 0, None)


def _sse(*events: object) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def _run_sse(payload: bytes, status: int = 200, disconnect_after: int | None = None) -> RequestResult:
    async def go() -> RequestResult:
        transport = httpx.MockTransport(lambda request: httpx.Response(status, content=payload))
        async with httpx.AsyncClient(transport=transport) as client:
            spec = RequestSpec("chat", "m", "hello", 8)
            return await stream_sse(client, "http://test", spec, disconnect_after=disconnect_after)

    return asyncio.run(go())


def _delta(text: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                                  "speculative": {"drafted": 4, "accepted": 2, "mean_accepted_length": 1.5}}}


def test_stream_sse_outcomes() -> None:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    ok = _run_sse(_sse(role, _delta("a"), _delta("b"), _delta("c"), USAGE, "[DONE]"))
    assert ok.ok and ok.text == "abc" and ok.output_tokens == 3 and ok.prompt_tokens == 4
    assert ok.spec == USAGE["usage"]["speculative"] and len(ok.itl) == 2 and ok.ttft is not None
    lost = _run_sse(_sse(_delta("a"), _delta("b")))
    assert lost.outcome == "lost" and lost.error_kind == "no_done" and lost.text == "ab"
    failed = _run_sse(_sse(_delta("a"), {"error": {"message": "boom"}}, "[DONE]"))
    assert failed.outcome == "error" and failed.error_kind == "stream_error"
    refused = _run_sse(b'{"error": {"message": "bad temperature"}}', status=400)
    assert (refused.outcome, refused.error_kind, refused.message) == ("error", "400", "bad temperature")
    cut = _run_sse(_sse(_delta("a"), _delta("b"), _delta("c"), "[DONE]"), disconnect_after=2)
    assert cut.outcome == "disconnected" and cut.text == "ab"


# ---------------------------------------------------------------- cells, report, soak bookkeeping


def _result(outcome: str = "completed", text: str = "abc", kind: str | None = None) -> RequestResult:
    spec = {"drafted": 4, "accepted": 3, "acceptance_rate": 0.75, "mean_accepted_length": 2.0}
    return RequestResult(outcome, kind, "", text, "length", 0.05, (0.01, 0.02), 0.2, 5, 4, spec)


def test_cell_document_has_every_figure_group(tmp_path: Path) -> None:
    results = [_result(), _result(), _result("error", "", "429")]
    cells = [build_cell(CellPlan(c, math.inf, s), results, 2.0, None) for c in (1, 4) for s in (False, True)]
    doc = run_document({"model": "m"}, cells)
    json.dumps(doc, allow_nan=False)
    for cell in doc["cells"]:
        assert set(FIGURE_GROUPS) <= set(cell)
        assert cell["requests"] == {"total": 3, "completed": 2, "failed": 1, "errors_by_status": {"429": 1}}
    assert cells[0].throughput.output_tokens_per_s == pytest.approx(4.0)
    assert cells[0].tpot_ms.mean == pytest.approx(50.0)
    plot_serve(tmp_path / "p.png", cells)
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_plan_cells_interleaves_speculation() -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--base-url", "http://x", "--sweep-concurrency", "1,4", "--compare-speculation"])
    assert [p.label for p in serve.plan_cells(args)] == ["c=1 spec off", "c=1 spec on", "c=4 spec off", "c=4 spec on"]
    args = parser.parse_args(["--base-url", "http://x", "--request-rate", "2.5"])
    assert [p.label for p in serve.plan_cells(args)] == ["rate=2.5/s"]
    with pytest.raises(ValueError):
        serve.parse_sweep("1,0")


def test_repeats_alternate_the_order_of_off_and_on() -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--base-url", "http://x", "--sweep-concurrency", "1,32", "--compare-speculation",
                              "--repeats", "3"])
    assert [p.label for p in serve.plan_cells(args)] == [
        "c=1 spec off #1", "c=1 spec on #1", "c=1 spec on #2", "c=1 spec off #2", "c=1 spec off #3", "c=1 spec on #3",
        "c=32 spec off #1", "c=32 spec on #1", "c=32 spec on #2", "c=32 spec off #2", "c=32 spec off #3",
        "c=32 spec on #3"]
    with pytest.raises(ValueError):
        serve.plan_cells(parser.parse_args(["--base-url", "http://x", "--repeats", "0"]))


def _timed_cell(concurrency: int, speculative: bool, seconds: float, rnd: int) -> CellResult:
    """A cell whose 2 requests of 5 tokens took `seconds` in all: 10 / seconds output tokens/s."""
    return build_cell(CellPlan(concurrency, math.inf, speculative, rnd), [_result(), _result()], seconds, None)


def test_compare_reads_speculation_against_the_plain_cells_spread() -> None:
    # c = 1: on is 10 % slower in every round, the plain cells agree within 2 %: a loss.
    # c = 32: on is 4 % slower at the median, the plain cells spread 10 %: within noise.
    cells = [_timed_cell(1, False, 1.00, 0), _timed_cell(1, True, 1.10, 0),
             _timed_cell(1, True, 1.12, 1), _timed_cell(1, False, 1.02, 1),
             _timed_cell(32, False, 1.00, 0), _timed_cell(32, True, 1.05, 0),
             _timed_cell(32, True, 1.02, 1), _timed_cell(32, False, 1.10, 1),
             _timed_cell(32, False, 1.05, 2), _timed_cell(32, True, 1.09, 2)]
    slow, noisy = compare(cells)
    assert slow.setting == "c=1" and len(slow.rounds) == 2
    assert slow.rounds[0].ratio == pytest.approx(1.0 / 1.1)
    assert slow.plain_spread == pytest.approx(0.02)
    assert slow.median_ratio == pytest.approx(1.0 / 1.1)  # the lower of two: no lean towards speculation
    assert slow.verdict == SLOWER
    assert noisy.setting == "c=32" and noisy.plain_spread == pytest.approx(0.10)
    assert noisy.median_ratio == pytest.approx(1.05 / 1.09) and noisy.verdict == WITHIN_NOISE
    assert compare(cells[:2])[0].verdict == UNKNOWN  # one round: no A/A to read it against
    faster = compare([_timed_cell(4, False, 1.2, 0), _timed_cell(4, True, 1.0, 0)])[0]
    assert faster.median_ratio == pytest.approx(1.2) and faster.verdict == FASTER
    doc = run_document({"model": "m"}, cells, compare(cells))
    assert [c["verdict"] for c in doc["comparisons"]] == [SLOWER, WITHIN_NOISE]
    json.dumps(doc, allow_nan=False)


def test_tally_classifies_streams() -> None:
    tally = Tally()
    tally.record(_result(text="abc"), "abc", None)
    tally.record(_result(text="abd"), "abc", False)
    tally.record(_result("disconnected", "ab"), "abc", None)
    tally.record(_result("cancelled", "x"), "abc", None)
    tally.record(_result("lost", "a", "no_done"), "abc", None)
    tally.record(_result("error", "", "429"), "abc", None)
    tally.record(_result("error", "", "500"), "abc", None)
    tally.bad_input_answer("400", True, "n_2")
    tally.bad_input_answer("200", False, "n_2")
    assert (tally.completed, tally.garbled, tally.disconnects, tally.cancelled, tally.lost) == (1, 2, 1, 1, 1)
    assert (tally.load_shed, tally.unexpected_errors, tally.expected_errors) == (1, 2, 1)


@pytest.mark.parametrize("url", ["http://10.0.0.5:8000", "http://example.com", "ftp://127.0.0.1", "http://0.0.0.0:1"])
def test_soak_refuses_non_loopback(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert soak.main(["--base-url", url, "--duration", "1", "--clients", "1"]) == 2
    assert "loopback" in capsys.readouterr().err


def test_soak_refuses_unbounded_runs() -> None:
    assert soak.main(["--base-url", "http://127.0.0.1:1", "--duration", "0", "--clients", "1"]) == 2
    assert soak.main(["--base-url", "http://[::1]:1", "--duration", "1", "--clients", "5000"]) == 2
    assert soak.main(["--base-url", "http://localhost:1", "--duration", "1", "--clients", "1",
                      "--disconnect-rate", "1.5"]) == 2


# ---------------------------------------------------------------- against a real server


@pytest.fixture(scope="module")
def server_url(tiny_model_dir: Path, tiny_draft_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = start_server(tiny_model_dir, tmp_path_factory.mktemp("server"), "--draft-model", str(tiny_draft_dir),
                          "--speculative-method", "draft", "--speculation-policy", "fixed",
                          env={"NO_PROXY": "*"}, timeout=180)
    try:
        yield server.url
    finally:
        server.stop()


def test_serve_json_has_every_figure_group(server_url: str, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    dataset = str(MT_BENCH) if MT_BENCH.is_file() else "random:40"
    rc = serve.main(["--base-url", server_url, "--dataset", dataset, "--num-prompts", "8", "--max-concurrency", "4",
                     "--max-tokens", "16", "--compare-speculation", "--output-json", str(out), "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert len(doc["cells"]) == 2 and [c["speculative"] for c in doc["cells"]] == [False, True]
    for cell in doc["cells"]:
        assert set(FIGURE_GROUPS) <= set(cell), cell.keys()
        assert cell["requests"]["completed"] == 8 and cell["requests"]["failed"] == 0
        assert cell["tokens"]["output"] > 0 and cell["ttft_ms"]["count"] == 8
        assert cell["e2e_ms"]["p99"] >= cell["e2e_ms"]["median"] > 0
    off, on = doc["cells"]
    assert off["speculation"]["metrics"]["draft_tokens"] == 0
    assert on["speculation"]["metrics"]["draft_tokens"] > 0
    assert on["speculation"]["usage"]["drafted"] > 0
    for cell in doc["cells"]:  # the server's side of each request's TTFT, stage by stage
        split = cell["speculation"]["metrics"]["request_ms"]
        assert set(split) == {"tokenize", "queue", "prefill", "ttft"}, split
        assert 0 < split["prefill"] <= split["ttft"] <= cell["ttft_ms"]["mean"]
    (comparison,) = doc["comparisons"]
    assert comparison["setting"] == "c=4" and len(comparison["rounds"]) == 1
    assert comparison["median_ratio"] == pytest.approx(
        on["throughput"]["output_tokens_per_s"] / off["throughput"]["output_tokens_per_s"])


def test_serve_warm_ups_run_the_first_cells_requests_unmeasured(server_url: str, tmp_path: Path) -> None:
    def finished() -> float:  # over every finish reason
        text = httpx.get(f"{server_url}/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("streamsd:request_success_total{"))

    out = tmp_path / "warm.json"
    before = finished()
    rc = serve.main(["--base-url", server_url, "--dataset", "random:10", "--num-prompts", "3", "--max-concurrency", "3",
                     "--max-tokens", "4", "--num-warmups", "2", "--output-json", str(out), "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    (cell,) = doc["cells"]
    assert doc["config"]["num_warmups"] == 2 and cell["requests"]["completed"] == 3
    # the probe, two warm-ups of three and the measured three
    assert finished() == before + 1 + 2 * 3 + 3


def test_serve_multi_turn_sends_each_second_turn_with_the_first_answer(server_url: str, tmp_path: Path) -> None:
    data = tmp_path / "q.jsonl"
    data.write_text('{"turns": ["Tell me about Paris.", "And about Rome?"]}\n{"turns": ["Count to five."]}\n')
    out = tmp_path / "turns.json"
    hits = metric(server_url, "streamsd:prefix_cache_hits_total")
    rc = serve.main(["--base-url", server_url, "--dataset", str(data), "--num-prompts", "4", "--max-concurrency", "2",
                     "--max-tokens", "24", "--ignore-eos", "--multi-turn", "--output-json", str(out), "--no-progress"])
    assert rc == 0
    first, second = json.loads(out.read_text())["cells"]
    assert (first["label"], second["label"]) == ("c=2 turn 1", "c=2 turn 2")
    assert first["requests"]["completed"] == second["requests"]["completed"] == 4
    # the second turn's prompt holds the first turn, its 24-token answer and the new question
    assert second["tokens"]["input"] > first["tokens"]["input"] + 4 * 24
    assert metric(server_url, "streamsd:prefix_cache_hits_total") > hits
    with pytest.raises(ValueError, match="--endpoint chat"):
        parser = argparse.ArgumentParser()
        serve.add_arguments(parser)
        serve.plan_cells(parser.parse_args(["--base-url", "x", "--multi-turn", "--endpoint", "completions"]))


def test_chat_history_goes_before_the_new_question() -> None:
    spec = RequestSpec("chat", "m", "And Rome?", 8, history=(("Paris?", "A city."),))
    assert sampling_fields(spec)["messages"] == [{"role": "user", "content": "Paris?"},
                                                 {"role": "assistant", "content": "A city."},
                                                 {"role": "user", "content": "And Rome?"}]


def test_shared_prefix_is_seeded_and_leads_every_prompt() -> None:
    assert shared_prefix(50, 3) == shared_prefix(50, 3) != shared_prefix(50, 4)
    assert len(shared_prefix(50, 3).split()) == 50
    chat = sampling_fields(RequestSpec("chat", "m", "Paris?", 8, system="Be brief."))
    assert chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"}]
    assert sampling_fields(RequestSpec("completions", "m", "Paris?", 8, system="Be brief."))["prompt"] == \
        "Be brief.\n\nParis?"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_serve_shared_prefix_mode_hits_the_prefix_cache_and_names_itself(server_url: str, tmp_path: Path,
                                                                        endpoint: str) -> None:
    out = tmp_path / "prefix.json"
    hits = metric(server_url, "streamsd:prefix_cache_hits_total")
    rc = serve.main(["--base-url", server_url, "--endpoint", endpoint, "--dataset", "random:6", "--num-prompts", "4",
                     "--max-concurrency", "1", "--max-tokens", "4", "--shared-prefix-tokens", "96",
                     "--output-json", str(out), "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["shared_prefix_tokens"] == 96
    (cell,) = doc["cells"]
    assert cell["label"] == "c=1 prefix=96" and cell["shared_prefix_tokens"] == 96
    assert cell["requests"]["completed"] == 4 and cell["tokens"]["input"] > 4 * 96
    # one request at a time: each after the first finds the prefix's blocks cached
    assert metric(server_url, "streamsd:prefix_cache_hits_total") >= hits + 3 * 64


def test_serve_response_format_constrains_every_request(server_url: str, tmp_path: Path) -> None:
    # A schema with one constant member: each answer is `{"a": 1}` and then must end, far below
    # max_tokens, where a random tiny model left alone would run to the limit.
    schema = tmp_path / "one.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"],
                                  "additionalProperties": False}))
    out = tmp_path / "structured.json"
    rc = serve.main(["--base-url", server_url, "--endpoint", "chat", "--dataset", "random:6", "--num-prompts", "4",
                     "--max-concurrency", "2", "--max-tokens", "60", "--response-format", str(schema),
                     "--output-json", str(out), "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["response_format"] == str(schema)
    (cell,) = doc["cells"]
    assert cell["requests"]["completed"] == 4
    assert 4 * 3 <= cell["tokens"]["output"] < 4 * 30


def test_serve_sweep_writes_png(server_url: str, tmp_path: Path) -> None:
    plot, out = tmp_path / "sweep.png", tmp_path / "sweep.json"
    rc = serve.main(["--base-url", server_url, "--endpoint", "completions", "--dataset", "random:12",
                     "--num-prompts", "6", "--sweep-concurrency", "1,2,4", "--max-tokens", "12",
                     "--compare-speculation", "--plot", str(plot), "--output-json", str(out), "--no-progress"])
    assert rc == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 20_000
    assert [c["concurrency"] for c in json.loads(out.read_text())["cells"]] == [1, 1, 2, 2, 4, 4]


def _soak(server_url: str, tmp_path: Path, duration: int, clients: int) -> dict:
    out = tmp_path / "soak.json"
    rc = soak.main(["--base-url", server_url, "--duration", str(duration), "--clients", str(clients),
                    "--disconnect-rate", "0.2", "--bad-input-rate", "0.05", "--websocket-share", "0.3",
                    "--max-tokens", "16", "--output-json", str(out)])
    report = json.loads(out.read_text())["soak"]
    assert (report["lost"], report["garbled"], report["unexpected_errors"]) == (0, 0, 0), report["problems"]
    assert report["final"]["running"] == 0 and report["final"]["kv_usage"] == 0 and report["final"]["drained"]
    assert report["completed"] > 0 and report["disconnects"] > 0 and report["expected_errors"] > 0
    assert rc == 0
    return report


def test_soak_short(server_url: str, tmp_path: Path) -> None:
    _soak(server_url, tmp_path, duration=10, clients=16)


@pytest.mark.slow
def test_soak_60s_64_clients(server_url: str, tmp_path: Path) -> None:
    _soak(server_url, tmp_path, duration=60, clients=64)
