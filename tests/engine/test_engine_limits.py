"""The engine's size limits as a vLLM user sets them: `max_model_len` honoured or refused, and the KV
cache sized by `gpu_memory_utilization` (vLLM's share of the GPU's whole memory)."""

from __future__ import annotations

import pytest

from streamsd import LLM, SamplingParams
from streamsd.config import EngineConfig
from streamsd.engine.builder import kv_cache_bytes

GIB = 2**30


def test_max_model_len_bounds_every_request(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), max_model_len=40)
    assert llm.core.scheduler.cfg.max_model_len == 40
    with pytest.raises(ValueError, match="context window"):
        llm.generate([[5] * 30], SamplingParams(max_tokens=11))
    out = llm.generate([[5] * 30], SamplingParams(max_tokens=10, ignore_eos=True, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 10


def test_a_max_model_len_the_engine_cannot_hold_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="--max-model-len 100000 is more than this engine can hold"):
        LLM(str(tiny_model_dir), max_model_len=100_000)
    with pytest.raises(ValueError, match="the KV cache 256"):
        LLM(str(tiny_model_dir), max_model_len=1024, kv_cache_tokens=256)


def test_the_kv_cache_takes_its_share_of_what_the_server_may_use():
    # All that is free once the weights are loaded (the default) ...
    assert kv_cache_bytes(100 * GIB, 140 * GIB, None, 0.85) == int(100 * GIB * 0.85)
    # ... or vLLM's share of the whole memory, less what the weights already use.
    assert kv_cache_bytes(130 * GIB, 140 * GIB, 0.9, 0.85) == int((126 - 10) * GIB * 0.85)
    assert kv_cache_bytes(130 * GIB, 140 * GIB, 1.0, 0.85) == int(130 * GIB * 0.85)  # never more than is free
    with pytest.raises(ValueError, match="leaves no memory for the KV cache: 70.0 of 140.0 GiB"):
        kv_cache_bytes(70 * GIB, 140 * GIB, 0.5, 0.85)


def test_gpu_memory_utilization_is_checked_and_refused_where_it_means_nothing(tiny_model_dir):
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            EngineConfig(model="m", gpu_memory_utilization=bad)
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(model="m", gpu_memory_utilization=0.9, kv_cache_tokens=4096)
    with pytest.raises(ValueError, match="on a CPU give --kv-cache-tokens"):
        LLM(str(tiny_model_dir), device="cpu", gpu_memory_utilization=0.9)
