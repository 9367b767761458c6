"""Tensor parallelism on the CPU: two ranks (rank 0 here, one gloo follower process) compute what
one rank computes, through the forward and through the whole engine."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from streamsd.engine.llm import LLM
from streamsd.model.kv_cache import BatchLayout, PagedKVCache
from streamsd.model.loader import ModelLoadError, load_model
from streamsd.model.parallel import RankLost
from streamsd.request import SamplingParams
from streamsd.worker.tp import TensorGroup
from tests.engine.engine_helpers import assert_free
from tests.tiny import build_model, build_tokenizer

CPU = torch.device("cpu")
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time there was", "1 2 3 4 5"]
MAX_TOKENS = [12, 9, 14, 10]


def greedy() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


def outputs(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    res = llm.generate(PROMPTS, params)
    assert all(r.error is None for r in res)
    return [r.outputs[0].token_ids for r in res]


@pytest.fixture(scope="module")
def qwen_odd_vocab_dir(tmp_path_factory) -> Path:
    """Tied embeddings, q/k/v biases, and a vocabulary two ranks split unevenly (383 rows)."""
    return build_model(tmp_path_factory.mktemp("qwen-odd"), family="qwen2", seed=4, tokenizer=build_tokenizer(383),
                       tied=True, weight_scale=4.0)


@pytest.mark.parametrize("model", ["tiny_model_dir", "qwen_odd_vocab_dir"])
def test_two_ranks_compute_the_logits_of_one_in_prefill_and_decode(model, request):
    model_dir = request.getfixturevalue(model)
    full, _ = load_model(str(model_dir), CPU, torch.float32)
    group, shard = TensorGroup.start(model_dir, 2, CPU, torch.float32, threads=1)
    try:
        blocks = 8
        group.share_blocks(blocks)
        whole, split = (PagedKVCache(m.layer_args, blocks, 16, torch.float32, CPU) for m in (full, shard))
        assert split.data.shape[-2] == whole.data.shape[-2] // 2  # each rank caches its kv heads only
        gen = torch.Generator().manual_seed(0)
        tables = [[1, 2], [5]]
        ids = torch.randint(0, full.args.vocab_size, (27,), generator=gen)
        prefill = BatchLayout.build([0, 0], [20, 7], tables, 16, CPU)
        rows = torch.arange(27)
        a, b = full(ids, prefill, whole, rows).logits, shard(ids, prefill, split, rows).logits
        assert b.shape == (27, full.args.vocab_size)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        step = torch.randint(0, full.args.vocab_size, (2,), generator=gen)
        decode = BatchLayout.build([20, 7], [1, 1], tables, 16, CPU)
        rows = torch.arange(2)
        torch.testing.assert_close(shard(step, decode, split, rows).logits, full(step, decode, whole, rows).logits,
                                   rtol=1e-5, atol=1e-5)
    finally:
        group.close()
    assert all(not p.is_alive() for p in group.procs)


def test_a_rank_count_that_does_not_divide_the_kv_heads_is_refused_at_start(tiny_model_dir):
    with pytest.raises(ModelLoadError, match="tensor_parallel_size 4 must divide.*kv heads \\(2\\)"):
        LLM(str(tiny_model_dir), device="cpu", dtype="float32", tensor_parallel_size=4)


@pytest.fixture(scope="module")
def single(tiny_model_dir, close_draft_dir):
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir), num_speculative_tokens=3, device="cpu",
              dtype="float32", kv_cache_tokens=1024, max_num_seqs=4)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def pair(tiny_model_dir, close_draft_dir):
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir), num_speculative_tokens=3, device="cpu",
              dtype="float32", kv_cache_tokens=1024, max_num_seqs=4, tensor_parallel_size=2)
    yield llm
    llm.close()


def test_greedy_output_at_two_ranks_is_that_of_one_without_speculation(single, pair):
    plain = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, speculative=False) for n in MAX_TOKENS]
    assert outputs(pair, plain) == outputs(single, plain)
    assert_free(pair)


def test_greedy_output_at_two_ranks_is_that_of_one_with_a_draft_model(single, pair):
    expected = outputs(single, greedy())
    assert outputs(pair, greedy()) == expected
    assert pair.core.totals.drafted > 0
    assert_free(pair)


def test_greedy_output_at_two_ranks_is_that_of_one_with_ngram_speculation(tiny_model_dir, single):
    expected = outputs(single, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, speculative=False)
                                for n in MAX_TOKENS])
    with LLM(str(tiny_model_dir), speculative_method="ngram", device="cpu", dtype="float32", kv_cache_tokens=1024,
             tensor_parallel_size=2) as llm:
        assert outputs(llm, greedy()) == expected
        assert_free(llm)


def test_a_gguf_model_at_two_ranks_answers_as_at_one(tiny_model_dir, tmp_path, monkeypatch):
    from tests.model.test_gguf import write_gguf

    monkeypatch.setenv("STREAMSD_HOME", str(tmp_path / "home"))
    gguf = write_gguf(tiny_model_dir, tmp_path / "tiny.gguf")
    with LLM(str(gguf), device="cpu", dtype="float32", kv_cache_tokens=1024) as one:
        expected = outputs(one, greedy())
    with LLM(str(gguf), device="cpu", dtype="float32", kv_cache_tokens=1024, tensor_parallel_size=2) as two:
        assert outputs(two, greedy()) == expected


def preempt_then_abort(llm: LLM, expected: list[list[int]]) -> None:
    """Four greedy requests through a pool too small for them all (preemption by recompute) decode
    `expected`, then a request aborted mid-answer: every rank's blocks are free after each."""
    preempted = []
    ids = [llm.core.text.encode_prompt(p) for p in PROMPTS]
    for i, (prompt, p) in enumerate(zip(ids, greedy(), strict=True)):
        llm.core.add_request(f"r{i}", prompt, p)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(ids))}
    for turn in llm.core.run():
        preempted += turn.plan.preempted
        for out in turn.outputs:
            got[out.request_id] += out.token_ids
    assert preempted, "the pool was large enough not to preempt"
    assert list(got.values()) == expected
    assert_free(llm)
    llm.core.add_request("gone", ids[0], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    for _ in range(3):
        llm.core.step()
    assert llm.core.scheduler.blocks.num_free < llm.core.scheduler.blocks.total
    llm.core.abort("gone")
    while llm.core.has_work:
        llm.core.step()
    assert_free(llm)


def test_preemption_and_abort_at_two_ranks_free_every_block(tiny_model_dir, single):
    expected = outputs(single, greedy())
    # 3 blocks of 16 tokens cannot hold four requests at once: preemption by recompute.
    with LLM(str(tiny_model_dir), device="cpu", dtype="float32", kv_cache_tokens=48, tensor_parallel_size=2) as llm:
        preempt_then_abort(llm, expected)


def test_a_follower_killed_mid_generation_ends_the_engine_with_an_error_naming_it(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu", dtype="float32", kv_cache_tokens=1024, tensor_parallel_size=2)
    try:
        follower = llm.core.rt.group.procs[0]
        llm.core.add_request("r", llm.core.text.encode_prompt(PROMPTS[0]),
                             SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        llm.core.step()
        os.kill(follower.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RankLost, match="rank 1 exited"):
            while llm.core.has_work:
                llm.core.step()
        assert time.monotonic() - t0 < 30, "the engine waited on the lost rank"
    finally:
        llm.close()


def test_a_follower_exit_seen_by_the_monitor_and_a_failed_collective_at_once_is_named():
    # Both reap the exited follower. Two threads in waitpid at once leave one with ECHILD and no exit
    # code, which must not become a bare collective failure; unserialised, a few rounds in 1,000 do.
    fork = multiprocessing.get_context("fork")
    for _ in range(1000):
        group = TensorGroup(2, CPU, timeout_s=60.0)
        follower = fork.Process(target=time.sleep, args=(60,), daemon=True)
        follower.start()
        group.procs.append(follower)
        monitor = threading.Thread(target=group._monitor)
        failed_collective = threading.Thread(target=group.diagnose, args=(RuntimeError("connection reset"),))
        monitor.start()
        failed_collective.start()
        os.kill(follower.pid, signal.SIGKILL)
        monitor.join(timeout=30)
        failed_collective.join(timeout=30)
        assert group.lost is not None and "rank 1 exited (exit code -9)" in str(group.lost)


def test_the_synthetic_proposer_is_refused_with_tensor_parallelism_and_eagle_is_not():
    from streamsd.config import EngineConfig, SpecConfig

    EngineConfig(model="m", spec=SpecConfig(method="eagle", draft_model="head"), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="'synthetic' is a benchmark proposer over preset models"):
        EngineConfig(model="m", spec=SpecConfig(method="synthetic"), tensor_parallel_size=2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpus_decode_greedily_as_one(tiny_model_dir):
    with LLM(str(tiny_model_dir), device="cuda", dtype="float32", kv_cache_tokens=1024) as one:
        expected = outputs(one, greedy())
    with LLM(str(tiny_model_dir), device="cuda", dtype="float32", kv_cache_tokens=1024, tensor_parallel_size=2) as two:
        assert outputs(two, greedy()) == expected
        assert_free(two)


def test_a_follower_that_dies_before_joining_the_group_fails_the_start_naming_it(tiny_model_dir):
    # torch refuses 0 threads: the follower dies at its first line, before it joins the group.
    t0 = time.monotonic()
    with pytest.raises(RankLost, match="rank 1 exited"):
        TensorGroup.start(tiny_model_dir, 2, CPU, torch.float32, threads=0, timeout_s=60)
    assert time.monotonic() - t0 < 40, "the start waited for the group's timeout"


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="the host has the GPUs")
def test_more_ranks_than_gpus_is_refused_at_start(tiny_model_dir):
    with pytest.raises(ModelLoadError, match="tensor_parallel_size 2 runs one rank a GPU; this host has"):
        LLM(str(tiny_model_dir), device="cuda", tensor_parallel_size=2)


def test_a_follower_that_stops_answering_fails_the_step_after_the_groups_timeout(tiny_model_dir):
    group, shard = TensorGroup.start(tiny_model_dir, 2, CPU, torch.float32, threads=1, timeout_s=4)
    follower = group.procs[0]
    try:
        group.share_blocks(4)
        cache = PagedKVCache(shard.layer_args, 4, 16, torch.float32, CPU)
        layout = BatchLayout.build([0], [5], [[1]], 16, CPU)
        os.kill(follower.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RankLost, match="collective failed"):
            shard(torch.arange(5), layout, cache, torch.arange(5))
        assert time.monotonic() - t0 < 30
        with pytest.raises(RankLost):  # the group stays lost: no step waits for the timeout again
            shard(torch.arange(5), layout, cache, torch.arange(5))
    finally:
        os.kill(follower.pid, signal.SIGKILL)
        group.close()
    assert not follower.is_alive()


def test_a_forward_announces_the_rows_its_lm_head_computes(tiny_model_dir):
    """The fast path's every-row forward computes the logits of every row, in order: the other ranks
    are told all of them; the reference forward computes the rows asked for, whatever every_row says."""
    from datetime import timedelta

    from streamsd.model.arch import ModelArgs
    from streamsd.model.llama import ForwardOutput, Transformer
    from streamsd.model.loader import load_config, weight_files
    from streamsd.model.parallel import Comm, TensorShard, load_shard

    class Announced(Exception):
        pass

    announced = []

    def announce(ids, layout, rows):
        announced.append(rows.tolist())
        raise Announced  # the collectives that follow need the other rank

    args = ModelArgs.from_config(load_config(tiny_model_dir))
    shard = TensorShard(0, 2, args.vocab_size, Comm(None, None, 0, 2, timedelta(seconds=1)), announce=announce)
    model = Transformer.build(args, load_shard(weight_files(tiny_model_dir), args, 0, 2, torch.float32, CPU), CPU,
                              torch.float32, tp=shard)
    cache = PagedKVCache(model.layer_args, 2, 16, torch.float32, CPU)
    layout = BatchLayout.build([0], [3], [[1]], 16, CPU)
    for every_row in (True, False):
        with pytest.raises(Announced):
            model(torch.arange(3), layout, cache, torch.tensor([2]), every_row=every_row)
    model.fast = lambda *step: ForwardOutput(torch.zeros(3, args.vocab_size), None)
    for every_row in (True, False):
        with pytest.raises(Announced):
            model(torch.arange(3), layout, cache, torch.tensor([2]), every_row=every_row)
    assert announced == [[2], [2], [0, 1, 2], [2]]
