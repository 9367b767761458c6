"""The n-gram proposer's per-request index answers what a scan of the whole context answers, and only a
draft asked for brings it up to date."""

from __future__ import annotations

import random

import pytest

from streamsd.request import Request, SamplingParams
from streamsd.spec_decode.ngram import NgramIndex, NgramProposer, ngram_lookup
from streamsd.spec_decode.proposer import ProposeItem


@pytest.mark.parametrize(("n_max", "n_min", "window", "vocab"), [(4, 1, 4096, 6), (3, 2, 4096, 3), (4, 1, 20, 4),
                                                                  (2, 0, 9, 5)])
def test_index_drafts_what_a_scan_of_the_context_drafts_as_the_tokens_grow(n_max, n_min, window, vocab):
    rnd = random.Random(n_max * 100 + window)
    for _ in range(20):
        tokens = [rnd.randrange(vocab) for _ in range(rnd.randrange(0, 5))]
        index = NgramIndex(n_max, n_min, window)
        for _ in range(60):
            k = rnd.randrange(0, 5)
            assert index.lookup(tokens, k) == ngram_lookup(tokens, k, n_max, n_min, window), tokens
            tokens += [rnd.randrange(vocab) for _ in range(rnd.randrange(1, 6))]


def test_index_catches_up_only_when_asked_and_only_over_the_tokens_since():
    index = NgramIndex(4, 1)
    tokens = [1, 2, 3, 4, 1, 2]
    assert index.lookup(tokens, 0) == []  # no draft asked for: nothing indexed
    assert index.indexed == -1
    assert index.lookup(tokens, 2) == [3, 4]
    assert index.indexed == len(tokens) - 1
    tokens += [3, 4, 9] * 50  # plain steps: the index does not follow them
    assert index.indexed == 5
    assert index.lookup(tokens, 3) == ngram_lookup(tokens, 3, 4, 1)
    assert index.indexed == len(tokens) - 1


def test_proposer_keeps_one_index_per_request_across_steps():
    proposer = NgramProposer(4, 1)
    a = Request("a", [5, 6, 7, 5, 6], SamplingParams(max_tokens=8), seed=0, arrival=0.0, spec_k=4)
    b = Request("b", [1, 1, 1], SamplingParams(max_tokens=8), seed=0, arrival=0.0, spec_k=4)
    items = [ProposeItem(a, [*a.prompt_ids], 3, 5, 0), ProposeItem(b, [*b.prompt_ids], 2, 3, 0)]
    assert [p.draft_ids for p in proposer.propose(items)] == [[7, 5, 6], [1]]
    index = a.draft_state
    a.output_ids += [7, 5]
    assert proposer.propose([ProposeItem(a, a.all_ids, 2, 7, 0)])[0].draft_ids == [6, 7]
    assert a.draft_state is index and b.draft_state is not index
