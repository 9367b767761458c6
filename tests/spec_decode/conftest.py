"""Trained EAGLE heads on the tiny target, for the speculative-decoding tests. Package-scoped: training
is seeded, so every module reads the same heads, trained once a run."""

from __future__ import annotations

import pytest

from tests.spec_decode.eagle_helpers import train_tiny_head


@pytest.fixture(scope="package")
def heads(tiny_model_dir, tmp_path_factory):
    return {kind: train_tiny_head(tiny_model_dir, tmp_path_factory.mktemp(kind), kind)
            for kind in ("eagle3", "eagle1", "eagle3_norm_first")}


@pytest.fixture(scope="package")
def head(tiny_model_dir, tmp_path_factory):
    return train_tiny_head(tiny_model_dir, tmp_path_factory.mktemp("tree_head"), "eagle3_norm_first")
