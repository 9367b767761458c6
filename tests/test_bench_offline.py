"""`streamsd bench offline` on the tiny models, on the CPU: cells, JSON, plot, and losslessness."""

from __future__ import annotations

import json

import pytest
import torch

from streamsd.bench import offline_run
from streamsd.cli import build_parser
from streamsd.spec.synthetic import SyntheticProposer


def _args(*extra: str):
    return build_parser().parse_args(["bench", "offline", "--device", "cpu", "--max-tokens", "12", *extra])


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_draft_cells_json_plot_and_hf(tmp_path, tiny_model_dir, tiny_draft_dir):
    out, png = tmp_path / "o.json", tmp_path / "o.png"
    args = _args("--model", str(tiny_model_dir), "--draft-model", str(tiny_draft_dir), "--speculative-method",
                 "draft", "--batch-sizes", "1,2", "--output-json", str(out), "--plot", str(png))
    assert args.func(args) == 0
    doc = json.loads(out.read_text())
    assert png.stat().st_size > 1000
    cells = {(c["engine"], c["method"], c["batch"]): c for c in doc["cells"]}
    assert set(cells) == {("streamsd", "plain", 1), ("streamsd", "draft", 1), ("hf", "plain", 1),
                          ("hf", "assisted", 1), ("streamsd", "plain", 2), ("streamsd", "draft", 2),
                          ("hf", "plain", 2)}
    spec = cells[("streamsd", "draft", 2)]
    assert spec["same_output_as_plain"]  # lossless: greedy speculation == plain greedy, token for token
    assert spec["c"] > 0 and spec["analytic_speedup"] > 0 and spec["tokens"] == 2 * 12
    plain = cells[("streamsd", "plain", 1)]
    assert plain["tokens"] == 12 and plain["tpot_ms"] > 0 and plain["floor_ratio"] > 1
    assert plain["hf_tpot_ms"] > 0 and plain["x_hf_tokens_per_s"] > 0


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_synthetic_acceptance_is_what_was_asked(tmp_path, tiny_model_dir, alpha):
    out = tmp_path / "s.json"
    args = _args("--model", str(tiny_model_dir), "--speculative-method", "synthetic", "--acceptance-rate", str(alpha),
                 "--batch-sizes", "4", "--max-tokens", "40", "--no-hf", "--output-json", str(out))
    assert args.func(args) == 0
    cell = next(c for c in json.loads(out.read_text())["cells"] if c["method"] == "synthetic")
    assert cell["same_output_as_plain"] and cell["desyncs"] == 0 and cell["c"] == 0
    if alpha == 1.0:
        assert cell["acceptance"] == 1.0 and cell["tau"] > 4.0
    else:
        assert 0.3 < cell["acceptance"] < 0.7


def test_ngram_runs_and_stays_lossless(tmp_path, tiny_model_dir):
    out = tmp_path / "n.json"
    args = _args("--model", str(tiny_model_dir), "--speculative-method", "ngram", "--batch-sizes", "1",
                 "--no-hf", "--output-json", str(out))
    assert args.func(args) == 0
    cell = next(c for c in json.loads(out.read_text())["cells"] if c["method"] == "ngram")
    assert cell["same_output_as_plain"] and cell["c"] == 0


def test_analytic_speedup_and_floor_math():
    assert offline_run.analytic_speedup(0.0, 4, 0.0) == 1.0
    assert offline_run.analytic_speedup(1.0, 4, 0.0) == 5.0
    assert abs(offline_run.analytic_speedup(0.8, 4, 0.05) - (1 - 0.8**5) / 0.2 / 1.2) < 1e-12


def test_synthetic_proposer_desyncs_when_history_leaves_the_oracle(tiny_model_dir):
    from streamsd.request import Request, SamplingParams
    from streamsd.spec.base import ProposeItem

    prop = SyntheticProposer({(1, 2): [5, 6, 7, 8, 9]}, alpha=1.0, vocab=50)
    r = Request("a", [1, 2], SamplingParams(), seed=3, arrival=0.0)
    assert prop.propose([ProposeItem(r, [1, 2, 5], 3, 3, 0)])[0].draft_ids == [6, 7, 8]
    assert prop.counters.desyncs == 0
    drafts = prop.propose([ProposeItem(r, [1, 2, 5, 4], 3, 4, 0)])[0].draft_ids  # 4 is not the oracle's 6
    assert prop.counters.desyncs == 1 and len(drafts) == 3


def test_random_weight_preset_runs_with_hf_sharing_its_weights(tmp_path, monkeypatch):
    """The preset path (random weights made on the device, synthetic tokenizer, HF model built on
    the same tensors) with a tiny shape standing in for the 8B one."""
    from types import MappingProxyType

    from streamsd.model import presets

    tiny = dict(presets.PRESETS["llama-3.2-1b"], vocab_size=512, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=2048)
    monkeypatch.setattr(presets, "PRESETS", MappingProxyType({**presets.PRESETS, "tiny-preset": tiny}))
    monkeypatch.setenv("STREAMSD_HOME", str(tmp_path))
    out = tmp_path / "p.json"
    args = _args("--model", "tiny-preset", "--draft-model", "tiny-preset", "--speculative-method", "synthetic",
                 "--batch-sizes", "2", "--prompt-len", "16", "--output-json", str(out))
    assert args.func(args) == 0
    cells = json.loads(out.read_text())["cells"]
    spec = next(c for c in cells if c["method"] == "synthetic")
    assert spec["same_output_as_plain"] and 0 < spec["c"] and spec["desyncs"] == 0
    assert any(c["engine"] == "hf" for c in cells)
