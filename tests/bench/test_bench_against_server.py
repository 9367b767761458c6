"""`streamsd bench serve` / `bench soak` against a real `streamsd serve` with the tiny target and draft."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from streamsd.bench import serve, soak
from streamsd.bench.results import FIGURE_GROUPS
from tests.bench.bench_helpers import MT_BENCH
from tests.server_util import metric, start_server


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


def test_serve_sweeps_the_request_rate(server_url: str, tmp_path: Path) -> None:
    plot, out = tmp_path / "rates.png", tmp_path / "rates.json"
    rc = serve.main(["--base-url", server_url, "--endpoint", "completions", "--dataset", "random:12",
                     "--num-prompts", "4", "--sweep-request-rate", "20,40", "--max-concurrency", "2",
                     "--max-tokens", "8", "--plot", str(plot), "--output-json", str(out), "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["sweep_request_rate"] == "20,40"
    assert [(c["concurrency"], c["request_rate"]) for c in doc["cells"]] == [(2, 20.0), (2, 40.0)]
    assert all(c["requests"]["completed"] == 4 for c in doc["cells"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
