"""The tokeniser pool's size: half the cores, never fewer than two threads nor more than eight."""

from __future__ import annotations

import pytest

from streamsd.server.prompts import tokenizer_threads


@pytest.mark.parametrize("cores,threads", [(None, 2), (1, 2), (2, 2), (4, 2), (6, 3), (12, 6), (16, 8), (128, 8)])
def test_tokenizer_threads_follow_the_cores(cores, threads):
    assert tokenizer_threads(cores) == threads
