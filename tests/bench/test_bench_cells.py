"""`streamsd bench` cells: plans, run documents, reports, comparisons; the soak's tally and refusals."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from streamsd.bench import serve, soak
from streamsd.bench.client import RequestResult
from streamsd.bench.compare import FASTER, SLOWER, UNKNOWN, WITHIN_NOISE, compare
from streamsd.bench.report import plot_serve
from streamsd.bench.results import FIGURE_GROUPS, CellPlan, CellResult, build_cell, run_document
from streamsd.bench.soak_tally import Tally


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


def test_plan_cells_sweeps_the_request_rate() -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--base-url", "http://x", "--sweep-request-rate", "5,10,2.5"])
    assert [p.label for p in serve.plan_cells(args)] == ["rate=5/s", "rate=10/s", "rate=2.5/s"]
    args = parser.parse_args(["--base-url", "http://x", "--sweep-request-rate", "5,10", "--sweep-concurrency", "8,32",
                              "--compare-speculation"])
    assert [p.label for p in serve.plan_cells(args)] == [
        "c=8 rate=5/s spec off", "c=8 rate=5/s spec on", "c=8 rate=10/s spec off", "c=8 rate=10/s spec on",
        "c=32 rate=5/s spec off", "c=32 rate=5/s spec on", "c=32 rate=10/s spec off", "c=32 rate=10/s spec on"]
    with pytest.raises(ValueError, match="alternatives"):
        serve.plan_cells(parser.parse_args(["--base-url", "http://x", "--sweep-request-rate", "5",
                                            "--request-rate", "5"]))
    for bad in ("0", "5,-1", "inf", "nan", ","):
        with pytest.raises(ValueError, match="sweep-request-rate"):
            serve.parse_rates(bad)


def _png_height(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[20:24], "big")  # the IHDR chunk: width, then height


def test_a_request_rate_sweep_plots_its_figures_against_the_rate(tmp_path: Path) -> None:
    results = [_result(), _result()]
    swept = [build_cell(CellPlan(32, rate, s), results, 1.0 + rate / 100, None) for rate in (5.0, 10.0, 20.0)
             for s in (False, True)]
    plot_serve(tmp_path / "sweep.png", swept)
    plot_serve(tmp_path / "one.png", swept[:2])
    # The sweep adds the row of figures against the rate to the CDFs: twice the height.
    assert _png_height(tmp_path / "sweep.png") == 2 * _png_height(tmp_path / "one.png")
    both = [build_cell(CellPlan(c, rate, None), results, 1.0, None) for c in (8, 32) for rate in (5.0, 10.0)]
    plot_serve(tmp_path / "both.png", both)
    assert _png_height(tmp_path / "both.png") == _png_height(tmp_path / "sweep.png")


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
