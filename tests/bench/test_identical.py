"""`streamsd bench offline --check-identical`'s verdict over the cells it fills in."""

from __future__ import annotations

from streamsd.bench.identical import batch_invariance, identical, problems, report


def test_plain_cells_are_compared_with_the_smallest_batch_on_their_common_prompts():
    small = [[1, 2], [3, 4]]
    assert batch_invariance(small, None) == {}
    assert batch_invariance([[1, 2], [3, 5], [9]], (2, small)) == {"identical_to_smallest_batch": "1/2",
                                                                  "smallest_batch": 2}
    assert identical([[1], [2]], [[1], [2], [3]]) == 2


def test_check_fails_on_any_cell_whose_output_differs_and_names_it(capsys):
    cells = [
        {"engine": "streamsd", "method": "plain", "batch": 1},
        {"engine": "streamsd", "method": "ngram", "batch": 1, "identical_to_plain": "1/1"},
        {"engine": "streamsd", "method": "plain", "batch": 16, "identical_to_smallest_batch": "1/1"},
        {"engine": "streamsd", "method": "ngram", "batch": 16, "identical_to_plain": "15/16"},
        {"engine": "hf", "method": "plain", "batch": 16, "identical_to_plain": "0/16"},
    ]
    assert problems(cells) == ["ngram at batch 16: identical_to_plain 15 of 16 requests"]
    assert report(cells) == 1
    assert "1 of 3 compared cells differ" in capsys.readouterr().out
    cells[3]["identical_to_plain"] = "16/16"
    assert report(cells) == 0


def test_exact_offline_bench_finds_every_batch_and_speculation_identical(tmp_path, tiny_model_dir):
    import json

    from streamsd.cli import build_parser

    out = tmp_path / "exact.json"
    args = build_parser().parse_args(["bench", "offline", "--device", "cpu", "--max-tokens", "12", "--model",
                                      str(tiny_model_dir), "--speculative-method", "ngram", "--batch-sizes", "1,3",
                                      "--no-hf", "--exact", "--check-identical", "--output-json", str(out)])
    assert args.func(args) == 0
    doc = json.loads(out.read_text())
    assert doc["exact"] is True
    plain3 = next(c for c in doc["cells"] if c["method"] == "plain" and c["batch"] == 3)
    assert plain3["identical_to_smallest_batch"] == "1/1"
    assert [c["identical_to_plain"] for c in doc["cells"] if c["method"] == "ngram"] == ["1/1", "3/3"]
