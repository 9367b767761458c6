"""What the `streamsd bench` tests share: where MT-Bench's questions are, when the checkout has them."""

from __future__ import annotations

from pathlib import Path

MT_BENCH = Path(__file__).resolve().parents[3] / "shared" / "data" / "mt_bench_questions.jsonl"
