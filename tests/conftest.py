from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # The Triton kernels are tested under the interpreter on CPUs. triton reads this when it
    # decorates its own helpers, i.e. on first import, which transformers' modeling code
    # (imported by tiny.py) already triggers: so set it before that.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.tiny import build_model, build_perturbed, build_tokenizer  # noqa: E402

# The engine tests compare against HF transformers on the CPU in float32, token for token: on a GPU
# machine an engine left to choose would run CUDA in bf16 and differ by numerics, not by a bug. The
# CUDA tests name their device (and dtype).
os.environ.setdefault("STREAMSD_DEVICE", "cpu")
# ... and in float32: `auto` would take bf16 on CPUs that multiply it natively.
os.environ.setdefault("STREAMSD_DTYPE", "float32")
# Every test profiles its own engine, as it did before profiles were kept: a cached table would make a
# test's policy depend on what an earlier run measured (tests of the cache itself turn it on).
os.environ.setdefault("STREAMSD_PROFILE_CACHE", "off")

# Tiny models run fastest single-threaded, and the CI machine has two cores shared with servers.
torch.set_num_threads(1)

# Test processes running side by side on one GPU (pytest -n N) share it: each engine sizes its KV cache
# within its process's share (engine/kv_sizing.py), not within everything the GPU has free, which the
# first engine to start would take from the others.
if torch.cuda.is_available() and "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.cuda.set_per_process_memory_fraction(0.9 / int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """On a GPU, an engine a test built holds its KV cache until it is collected: collect after each test,
    so that the next test's engines size their caches against a GPU the last one no longer holds."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """Tiny random Llama target (2 layers, hidden 64)."""
    return build_model(tmp_path_factory.mktemp("target"), seed=0, tokenizer=tiny_tokenizer, weight_scale=4.0,
                       max_pos=4096)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """Tiny random Llama draft: different weights from the target, same vocabulary."""
    return build_model(
        tmp_path_factory.mktemp("draft"), seed=1, tokenizer=tiny_tokenizer, layers=1, hidden=32, heads=2,
        kv_heads=1, intermediate=64, weight_scale=4.0,
    )


@pytest.fixture(scope="session")
def close_draft_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """A draft that often agrees with the target (its weights plus noise): high, imperfect acceptance."""
    return build_perturbed(tiny_model_dir, tmp_path_factory.mktemp("close_draft"), noise=0.03)


@pytest.fixture(scope="session")
def qwen_target_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    return build_model(tmp_path_factory.mktemp("qwen"), family="qwen2", seed=5, tokenizer=tiny_tokenizer,
                       weight_scale=4.0)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """HF transformers' greedy answers of the tiny target to tests/engine/engine_helpers.py's prompts."""
    from tests.engine.engine_helpers import MAX_TOKENS, PROMPTS, hf_greedy

    return hf_greedy(tiny_model_dir, PROMPTS, MAX_TOKENS)
