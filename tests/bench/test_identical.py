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
