"""Presenting results: rich tables (laid out like `vllm bench serve`'s), the JSON file, PNG plots."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from streamsd.bench.compare import SLOWER, Comparison, lower_median
from streamsd.bench.metrics_scrape import SpecCounters
from streamsd.bench.results import CellResult
from streamsd.bench.stats import Summary

DETAIL_MAX_CELLS = 4  # wider than this, the per-metric table stops fitting a terminal

Row = tuple[str, Callable[[CellResult], str]]


def _console() -> Console:
    console = Console()
    # Piped output (CI logs, tests) would otherwise wrap at 80 columns.
    return console if console.is_terminal else Console(width=160)


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100.0 * value:.1f}"


def _latency_rows(title: str, short: str, pick: Callable[[CellResult], Summary]) -> list[Row]:
    return [
        (f"--- {title} ---", lambda c: ""),
        (f"Mean {short} (ms)", lambda c: _f(pick(c).mean)),
        (f"Median {short} (ms)", lambda c: _f(pick(c).median)),
        (f"P90 {short} (ms)", lambda c: _f(pick(c).p90)),
        (f"P99 {short} (ms)", lambda c: _f(pick(c).p99)),
    ]


def _errors(c: CellResult) -> str:
    return ", ".join(f"{k}: {v}" for k, v in c.requests.errors_by_status.items()) or "-"


def _usage_rate(c: CellResult) -> str:
    return _pct(c.speculation.usage.acceptance_rate) if c.speculation.usage else "-"


def _usage_len(c: CellResult) -> str:
    return _f(c.speculation.usage.mean_accepted_length) if c.speculation.usage else "-"


def _metric(c: CellResult, name: str, fmt: Callable[[Any], str]) -> str:
    m = c.speculation.metrics
    return "-" if m is None else fmt(getattr(m, name))


def _per_pos(c: CellResult) -> str:
    m = c.speculation.metrics
    return "-" if m is None or not m.per_position_acceptance else ", ".join(
        f"{100 * v:.0f}" for v in m.per_position_acceptance
    )


def _ms_by(pick: Callable[[SpecCounters], dict[str, float]]) -> Callable[[CellResult], str]:
    """A row of one of the /metrics delta's ms-by-name dicts (its step or request times)."""
    def row(c: CellResult) -> str:
        by = pick(c.speculation.metrics) if c.speculation.metrics is not None else {}
        return ", ".join(f"{name} {ms:.2f}" for name, ms in by.items()) or "-"

    return row


DETAIL_ROWS: list[Row] = [
    ("Successful requests", lambda c: str(c.requests.completed)),
    ("Failed requests", lambda c: str(c.requests.failed)),
    ("Errors by status", _errors),
    ("Benchmark duration (s)", lambda c: _f(c.duration_s)),
    ("Total input tokens", lambda c: str(c.tokens.input)),
    ("Total generated tokens", lambda c: str(c.tokens.output)),
    ("Request throughput (req/s)", lambda c: _f(c.throughput.request_per_s)),
    ("Output token throughput (tok/s)", lambda c: _f(c.throughput.output_tokens_per_s)),
    ("Total token throughput (tok/s)", lambda c: _f(c.throughput.total_tokens_per_s)),
    *_latency_rows("Time to First Token", "TTFT", lambda c: c.ttft_ms),
    *_latency_rows("Time per Output Token (excl. 1st token)", "TPOT", lambda c: c.tpot_ms),
    *_latency_rows("Inter-token Latency (between chunks)", "ITL", lambda c: c.itl_ms),
    *_latency_rows("End-to-end Latency", "E2E", lambda c: c.e2e_ms),
    ("Server ms per request, /metrics", _ms_by(lambda m: m.request_ms)),
    ("--- Speculative Decoding ---", lambda c: ""),
    ("Acceptance rate, usage (%)", _usage_rate),
    ("Mean accepted length, usage", _usage_len),
    ("Acceptance rate, /metrics (%)", lambda c: _metric(c, "acceptance_rate", _pct)),
    ("Acceptance length, /metrics", lambda c: _metric(c, "mean_acceptance_length", _f)),
    ("Drafts", lambda c: _metric(c, "num_drafts", lambda v: f"{v:.0f}")),
    ("Draft tokens", lambda c: _metric(c, "draft_tokens", lambda v: f"{v:.0f}")),
    ("Accepted tokens", lambda c: _metric(c, "accepted_tokens", lambda v: f"{v:.0f}")),
    ("Per-position acceptance (%)", _per_pos),
    ("Step ms by kind, /metrics", _ms_by(lambda m: m.step_ms)),
]

SUMMARY_ROWS: list[Row] = [
    ("ok", lambda c: str(c.requests.completed)),
    ("failed", lambda c: str(c.requests.failed)),
    ("req/s", lambda c: _f(c.throughput.request_per_s)),
    ("out tok/s", lambda c: _f(c.throughput.output_tokens_per_s, 1)),
    ("TTFT p50", lambda c: _f(c.ttft_ms.median, 1)),
    ("TTFT p99", lambda c: _f(c.ttft_ms.p99, 1)),
    ("TPOT p50", lambda c: _f(c.tpot_ms.median, 1)),
    ("ITL p50", lambda c: _f(c.itl_ms.median, 1)),
    ("E2E p50", lambda c: _f(c.e2e_ms.median, 1)),
    ("E2E p99", lambda c: _f(c.e2e_ms.p99, 1)),
    ("accept %", lambda c: _metric(c, "acceptance_rate", _pct) if c.speculation.metrics else _usage_rate(c)),
    ("accept len", lambda c: _metric(c, "mean_acceptance_length", _f) if c.speculation.metrics else _usage_len(c)),
]


def print_serve(config: dict[str, Any], cells: Sequence[CellResult], console: Console | None = None) -> None:
    console = console or _console()
    title = f"Serving Benchmark Result — {config['model']} ({config['endpoint']}, {config['dataset']})"
    if len(cells) <= DETAIL_MAX_CELLS:
        table = Table(title=title, title_justify="left")
        table.add_column("metric")
        for cell in cells:
            table.add_column(cell.label, justify="right")
        for name, get in DETAIL_ROWS:
            section = name.startswith("---")
            table.add_row(name.strip("- ") if section else name, *(get(c) for c in cells),
                          style="bold cyan" if section else None)
        console.print(table)
    if len(cells) > 1:
        summary = Table(title="Per cell (latencies in ms)", title_justify="left")
        summary.add_column("cell")
        for name, _ in SUMMARY_ROWS:
            summary.add_column(name, justify="right")
        for cell in cells:
            summary.add_row(cell.label, *(get(cell) for _, get in SUMMARY_ROWS))
        console.print(summary)


def print_comparisons(comparisons: Sequence[Comparison], console: Console | None = None) -> None:
    """Speculation ÷ plain per setting: each round's ratio, their median, and the plain cells' spread."""
    console = console or _console()
    table = Table(title="Speculation ÷ plain (output tokens/s; TPOT: plain ÷ speculation)", title_justify="left")
    for name in ("setting", "rounds", "tok/s ratios", "TPOT ratios", "median", "plain A/A spread", "verdict"):
        table.add_column(name, justify="left" if name in ("setting", "verdict") else "right")
    for c in comparisons:
        style = "red" if c.verdict == SLOWER else None
        table.add_row(c.setting, str(len(c.rounds)), " ".join(f"{r.ratio:.3f}" for r in c.rounds),
                      " ".join("-" if r.tpot_ratio is None else f"{r.tpot_ratio:.3f}" for r in c.rounds),
                      f"{c.median_ratio:.3f}", _pct(c.plain_spread), c.verdict, style=style)
    console.print(table)


def print_pairs(title: str, rows: Sequence[tuple[str, str]], ok: bool, console: Console | None = None) -> None:
    """A two-column table (the soak report); the title turns red when the run failed."""
    console = console or _console()
    table = Table(title=title, title_justify="left", title_style="bold green" if ok else "bold red")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)


def print_grid(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]], caption: str | None = None,
               console: Console | None = None) -> None:
    """A table of figures, one row per cell: the first column left-aligned, the figures right."""
    console = console or _console()
    # As wide as the title, up to the terminal: a narrow table would wrap it over several lines.
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left",
                  min_width=min(len(title), console.width))
    for i, name in enumerate(headers):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)


def write_json(path: str | Path, document: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(document, indent=2, allow_nan=False) + "\n", encoding="utf-8")


def _series_name(speculative: bool | None) -> str:
    return {None: "default", False: "spec off", True: "spec on"}[speculative]


def _cell_style(cell: CellResult, cells: Sequence[CellResult]) -> dict[str, Any]:
    # One colour per setting, dashed when speculation was switched off, so on/off pairs read together.
    settings = list(dict.fromkeys((c.concurrency, c.request_rate) for c in cells))
    colour = f"C{settings.index((cell.concurrency, cell.request_rate)) % 10}"
    return {"color": colour, "linestyle": "--" if cell.speculative is False else "-"}


def _setting(cell: CellResult, axis: str) -> float | None:
    """The cell's max concurrency (`axis` "concurrency") or its request rate ("rate"); None: unbounded."""
    return cell.concurrency if axis == "concurrency" else cell.request_rate


def _swept(cells: Sequence[CellResult]) -> str | None:
    """What the sweep figures plot against: max concurrency where it varies, else the request rate."""
    for axis in ("concurrency", "rate"):
        if len({_setting(c, axis) for c in cells} - {None}) > 1:
            return axis
    return None


def plot_serve(path: str | Path, cells: Sequence[CellResult]) -> None:
    """Latency CDFs per cell; when concurrency or the request rate was swept, a second row of figures
    against it (one series per speculation switch and, where both were swept, per request rate)."""
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    axis = _swept(cells)
    rows = 2 if axis else 1
    fig, axes = plt.subplots(rows, 3, figsize=(16, 4.5 * rows), squeeze=False)
    for ax, (key, name) in zip(axes[0], (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E latency")),
                               strict=True):
        for cell in cells:
            data = sorted(getattr(cell.samples, key))
            if data:
                ax.step(data, [(i + 1) / len(data) for i in range(len(data))], where="post", label=cell.label,
                        **_cell_style(cell, cells))
        ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize="small")
    if axis:
        _plot_sweep(axes[1], cells, axis)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


AXES = {"concurrency": ("concurrency", "max concurrency"), "rate": ("request rate", "requests/s")}


def _series_label(switch: bool | None, other: str, setting: float | None, several: bool) -> str:
    """A sweep series' name: its speculation switch, and its other setting where that varies too."""
    label = _series_name(switch)
    if several and setting is not None:
        label += f", c={setting:g}" if other == "concurrency" else f", rate={setting:g}/s"  # as cell labels say
    return label


def _plot_sweep(axes: Sequence[Any], cells: Sequence[CellResult], axis: str) -> None:
    """TPOT, throughput and TTFT against the swept `axis`, the median of a setting's rounds."""
    other = "rate" if axis == "concurrency" else "concurrency"
    figures = (
        ("TPOT median (ms)", lambda c: c.tpot_ms.median),
        ("Output throughput (tok/s)", lambda c: c.throughput.output_tokens_per_s),
        ("TTFT median (ms)", lambda c: c.ttft_ms.median),
    )
    xs = sorted({x for c in cells if (x := _setting(c, axis)) is not None})
    series = sorted(dict.fromkeys((c.speculative, _setting(c, other)) for c in cells),
                    key=lambda k: (k[0] is not None, bool(k[0]), k[1] is not None, k[1] or 0))
    several = len({setting for _, setting in series}) > 1
    title, xlabel = AXES[axis]
    for ax, (name, pick) in zip(axes, figures, strict=True):
        for switch, setting in series:
            by_x: dict[float, list[float]] = {}
            for c in cells:
                x, y = _setting(c, axis), pick(c)
                if c.speculative is switch and _setting(c, other) == setting and x is not None and y is not None:
                    by_x.setdefault(x, []).append(y)
            points = [(x, lower_median(v)) for x, v in sorted(by_x.items())]  # rounds of --repeats: their median
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=_series_label(switch, other, setting, several))
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.minorticks_off()
        ax.set(title=f"{name} vs {title}", xlabel=xlabel, ylabel=name)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
