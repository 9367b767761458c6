"""Printing and plotting the cells of `streamsd bench offline`."""

from __future__ import annotations

from typing import Any

COLUMNS = (  # (JSON key, header, format)
    ("engine", "engine", "{}"), ("method", "method", "{}"), ("acceptance_rate", "α set", "{:.2f}"), ("batch", "B", "{}"),
    ("tpot_ms", "TPOT ms", "{:.2f}"),
    ("tokens_per_s", "tok/s", "{:.0f}"), ("acceptance", "α", "{:.2f}"), ("tau", "τ", "{:.2f}"), ("c", "c", "{:.3f}"),
    ("analytic_speedup", "analytic", "{:.2f}×"), ("measured_speedup", "measured", "{:.2f}×"),
    ("decode_speedup", "decode ×plain", "{:.2f}×"),
    ("spec_efficiency", "spec eff", "{:.2f}"), ("floor_tpot_ms", "floor ms", "{:.2f}"),
    ("floor_ratio", "÷floor", "{:.2f}×"), ("decode_step_ms", "decode step ms", "{:.2f}"),
    ("decode_step_floor_ratio", "step÷floor", "{:.2f}×"), ("host_ms_per_step", "host ms/step", "{:.2f}"),
    ("pred_err_pct", "pred err %", "{:.1f}"), ("pred_err_shape_pct", "shape err %", "{:.1f}"),
    ("plain_step_share", "plain steps", "{:.0%}"),
    ("x_hf_tokens_per_s", "×HF tok/s", "{:.1f}×"), ("note", "note", "{}"),
)


def _fmt(cell: dict[str, Any], key: str, fmt: str) -> str:
    v = cell.get(key)
    if v is None or (key in ("acceptance", "tau") and cell.get("method") == "plain"):
        return "-"
    return fmt.format(v)


def print_table(doc: dict[str, Any]) -> None:
    title = (f"streamsd bench offline — {doc['model']} on {doc['device']} ({doc['dtype']}), "
             f"{doc['max_tokens']} tokens/request, k={doc['k']}"
             + (f", SYNTHETIC acceptance α={doc['acceptance_rate']}" if doc.get("acceptance_rate") is not None else "")
             + (f", {doc['speculation_policy']} k" if doc.get("speculation_policy") else ""))
    note = ("decode step ms: median wall time of steps with no prefill chunk (TPOT also carries other requests' "
            "prefill); decode ×plain: tokens/s of those steps over plain's; step÷floor: that ÷ the HBM floor step; pred err %: mean |predicted/measured − 1| of the "
            "adaptive policy's step times; shape err %: worst |Σ predicted/Σ measured − 1| over the step shapes "
            "(batch × verify tokens) run ≥ 10 times")
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text when rich is missing
        print(title)
        print(" | ".join(h for _, h, _ in COLUMNS))
        for c in doc["cells"]:
            print(" | ".join(_fmt(c, k, f) for k, _, f in COLUMNS))
        print(note)
        return
    table = Table(title=title, caption=note)
    for _, header, _ in COLUMNS:
        table.add_column(header, justify="right")
    for c in doc["cells"]:
        table.add_row(*(_fmt(c, k, f) for k, _, f in COLUMNS))
    Console(width=200).print(table)


def plot(doc: dict[str, Any], path: str) -> None:
    """TPOT per batch size (ours, HF, the floor) and speculative speedups (measured vs analytic)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = doc["cells"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    series: dict[str, list[tuple[int, float]]] = {}
    for c in cells:
        if c.get("tpot_ms") is not None:  # a cell with only a note (HF cannot run that shape) has no point
            series.setdefault(f"{c['engine']} {c['method']}", []).append((c["batch"], c["tpot_ms"]))
    for name, pts in series.items():
        xs, ys = zip(*sorted(pts), strict=True)
        ax1.plot(xs, ys, marker="o", label=name)
    floor = sorted({(c["batch"], c["floor_step_ms"]) for c in cells if c.get("method") == "plain" and "floor_step_ms" in c})
    if floor:
        xs, ys = zip(*floor, strict=True)
        ax1.plot(xs, ys, "k--", label="HBM floor (plain)")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("batch size")
    ax1.set_ylabel("TPOT (ms)")
    ax1.set_title(f"{doc['model']} on {doc['device']}")
    ax1.legend(fontsize=8)
    spec = [c for c in cells if c.get("analytic_speedup") is not None]
    if not spec:
        ax2.axis("off")
        ax2.text(0.5, 0.5, "no speculative cells in this run", ha="center", va="center")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return
    labels = [f"{c['method']} B={c['batch']}" + (f" α={c['acceptance_rate']}" if c.get("acceptance_rate") is not None
                                                 else "") for c in spec]
    bars = range(len(spec))
    ax2.bar([x - 0.2 for x in bars], [c["measured_speedup"] for c in spec], width=0.4, label="measured")
    ax2.bar([x + 0.2 for x in bars], [c["analytic_speedup"] for c in spec], width=0.4, label="analytic")
    ax2.set_xticks(list(bars), labels, rotation=20, fontsize=8)
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_ylabel("speedup over plain (×)")
    ax2.set_title("speculation" + (" (SYNTHETIC acceptance)" if doc.get("acceptance_rate") is not None else ""))
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
