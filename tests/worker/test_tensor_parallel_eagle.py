"""EAGLE speculation with the target split over two CPU ranks (rank 0 here, one gloo follower): the
head runs on rank 0 from its complete residual streams and its own whole copies of the embedding and
lm_head, and the engine answers as one rank does."""

from __future__ import annotations

import pytest
import torch

from streamsd.engine.llm import LLM
from streamsd.model.kv_cache import BatchLayout, PagedKVCache
from streamsd.model.loader import load_model
from streamsd.model.stream_store import StreamStore
from streamsd.request import SamplingParams
from streamsd.spec_decode.eagle.checkpoint import load_head
from streamsd.worker.tp import TensorGroup
from tests.engine.engine_helpers import assert_free
from tests.spec_decode.eagle_helpers import train_tiny_head
from tests.worker.test_tensor_parallel import (
    MAX_TOKENS,
    greedy,
    outputs,
    preempt_then_abort,
)

CPU = torch.device("cpu")
ENGINE = {"device": "cpu", "dtype": "float32", "kv_cache_tokens": 1024, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def heads(tiny_model_dir, tmp_path_factory):
    """EAGLE-3 with its own draft-vocabulary lm_head (it borrows the embedding), EAGLE-1 (it borrows
    the embedding and the lm_head)."""
    return {kind: train_tiny_head(tiny_model_dir, tmp_path_factory.mktemp(kind), kind, epochs=10)
            for kind in ("eagle3", "eagle1")}


@pytest.fixture(scope="module")
def plain(tiny_model_dir) -> list[list[int]]:
    """One rank's greedy outputs without speculation."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, speculative=False) for n in MAX_TOKENS]
    with LLM(str(tiny_model_dir), **ENGINE) as llm:
        return outputs(llm, params)


def test_two_ranks_capture_the_streams_and_verify_the_trees_of_one(tiny_model_dir):
    """Rank 0's captured streams (returned or written to a stream store) are the whole residual
    stream, a forward over draft-tree windows computes one rank's logits, and moving the accepted
    nodes' K/V to their positions moves every rank's."""
    full, _ = load_model(str(tiny_model_dir), CPU, torch.float32)
    group, shard = TensorGroup.start(tiny_model_dir, 2, CPU, torch.float32, threads=1)
    try:
        blocks, layers = 8, (0, 1, 2)
        whole = PagedKVCache(full.layer_args, blocks, 16, torch.float32, CPU)
        split = group.kv_cache(shard.layer_args, blocks, 16, torch.float32)
        gen = torch.Generator().manual_seed(0)
        tables = [[1, 2], [5]]
        ids = torch.randint(0, full.args.vocab_size, (27,), generator=gen)
        prefill = BatchLayout.build([0, 0], [20, 7], tables, 16, CPU)
        rows, every = torch.tensor([19, 26]), torch.arange(27)
        a = full(ids, prefill, whole, rows, hidden_layers=layers, hidden_rows=every)
        b = shard(ids, prefill, split, rows, hidden_layers=layers, hidden_rows=every)
        assert b.hidden is not None and a.hidden is not None
        assert [h.shape for h in b.hidden] == [(27, full.args.hidden_size)] * 3
        for got, want in zip(b.hidden, a.hidden, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
        # Sequence 0 verifies a tree after its pending token: the root, its children 1 and 2, 1's child 3.
        trees = [([0, 1, 1, 2], [0b1, 0b11, 0b101, 0b1011]), None]
        verify = BatchLayout.build([20, 7], [4, 1], tables, 16, CPU, trees)
        step = torch.randint(0, full.args.vocab_size, (5,), generator=gen)
        stores = [StreamStore(layers, full.args.hidden_size, blocks * 16, torch.float32, CPU) for _ in range(2)]
        a = full(step, verify, whole, torch.arange(5), hidden_layers=layers, streams_into=stores[0].data)
        b = shard(step, verify, split, torch.arange(5), hidden_layers=layers, streams_into=stores[1].data)
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
        slots = verify.slot_mapping
        assert stores[1].gather(slots).abs().sum() > 0
        torch.testing.assert_close(stores[1].gather(slots), stores[0].gather(slots), rtol=1e-5, atol=1e-5)
        # Node 2 (window row 2, slot 38) is accepted: its K/V moves to position 21's slot (37), then the
        # sequence decodes on from position 22 over it.
        for cache in (whole, split):
            cache.move(torch.tensor([38]), torch.tensor([37]))
        decode = BatchLayout.build([22, 8], [1, 1], tables, 16, CPU)
        step = torch.randint(0, full.args.vocab_size, (2,), generator=gen)
        torch.testing.assert_close(shard(step, decode, split, torch.arange(2)).logits,
                                   full(step, decode, whole, torch.arange(2)).logits, rtol=1e-5, atol=1e-5)
    finally:
        group.close()
    assert all(not p.is_alive() for p in group.procs)


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_a_head_of_a_split_target_holds_the_whole_embedding_and_lm_head_it_borrows(tiny_model_dir, heads, kind):
    full, _ = load_model(str(tiny_model_dir), CPU, torch.float32)
    group, shard = TensorGroup.start(tiny_model_dir, 2, CPU, torch.float32, threads=1)
    try:
        one = load_head(heads[kind], full, CPU, torch.float32)
        two = load_head(heads[kind], shard, CPU, torch.float32, tiny_model_dir)
    finally:
        group.close()
    assert two.shared is not None and one.shared is not None
    assert shard.model.embed_tokens.weight.shape[0] < full.args.vocab_size  # the target's own rows are split
    assert two.shared.embed is not None and one.shared.embed is not None
    assert torch.equal(two.shared.embed.weight, one.shared.embed.weight)
    if kind == "eagle1":
        assert two.shared.lm_head is not None and one.shared.lm_head is not None
        assert torch.equal(two.shared.lm_head.weight, one.shared.lm_head.weight)
    else:  # its own lm_head over its draft vocabulary: the target's is not read
        assert two.shared.lm_head is None
    out = torch.randn(3, full.args.hidden_size, generator=torch.Generator().manual_seed(1))
    assert torch.equal(two.target_logits(out), one.target_logits(out))


@pytest.mark.parametrize("kind,pipeline", [("eagle3", False), ("eagle1", False), ("eagle3", True)])
def test_greedy_eagle_chains_at_two_ranks_are_plain_decoding_at_one(tiny_model_dir, heads, plain, kind, pipeline):
    """pipeline: the engine set up to queue its steps one ahead (worker/lookahead.py), as on CUDA."""
    with LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads[kind]), num_speculative_tokens=3,
             tensor_parallel_size=2, pipeline=pipeline, **ENGINE) as llm:
        assert outputs(llm, greedy()) == plain
        assert llm.core.totals.drafted > 0 and llm.core.totals.accepted > 0
        assert_free(llm)


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_greedy_eagle_trees_at_two_ranks_are_plain_decoding_at_one(tiny_model_dir, heads, plain, policy):
    """fixed: a tree every step; adaptive: tree or plain steps as the chooser prices them, after it
    has profiled whole tree steps (every-row forwards writing a stream store)."""
    with LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads["eagle3"]),
             speculative_tree="4,3,3,10", speculation_policy=policy, tensor_parallel_size=2, **ENGINE) as llm:
        assert outputs(llm, greedy()) == plain
        if policy == "fixed":  # the chooser's picks follow the measured costs
            assert llm.core.totals.drafted > 0 and llm.core.totals.accepted > 0
        assert_free(llm)


@pytest.mark.parametrize("tree", [None, "4,3,3,10"])
def test_seeded_eagle_sampling_at_two_ranks_draws_what_one_rank_draws(tiny_model_dir, heads, tree):
    params = [SamplingParams(temperature=t, max_tokens=n, seed=7 + i, ignore_eos=True)
              for i, (t, n) in enumerate(zip([1.0, 0.7, 1.0, 0.4], MAX_TOKENS, strict=True))]
    kw = {"speculative_method": "eagle", "draft_model": str(heads["eagle3"]), "num_speculative_tokens": 3,
          "speculative_tree": tree, "speculation_policy": "fixed", **ENGINE}
    with LLM(str(tiny_model_dir), **kw) as one:
        expected = outputs(one, params)
    with LLM(str(tiny_model_dir), tensor_parallel_size=2, **kw) as two:
        assert outputs(two, params) == expected
        assert two.core.totals.drafted > 0
        assert_free(two)


def test_preemption_and_abort_with_eagle_at_two_ranks_free_every_block(tiny_model_dir, heads, plain):
    # 3 blocks of 16 tokens cannot hold four requests at once: preemption by recompute.
    with LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads["eagle3"]),
             num_speculative_tokens=3, device="cpu", dtype="float32", kv_cache_tokens=48,
             tensor_parallel_size=2) as llm:
        preempt_then_abort(llm, plain)


def test_the_default_model_on_cuda_keeps_its_eagle_head_at_two_ranks_drafting_chains():
    """Split over GPUs the default model drafts with its shipped head, in chains: a tree step's
    start-up profile replays CUDA graphs, which the follower ranks cannot follow."""
    from streamsd.cli import build_parser
    from streamsd.engine.args import engine_config

    cfg = engine_config(build_parser().parse_args(["serve", "--device", "cuda", "--tensor-parallel-size", "2"]))
    assert cfg.spec.method == "eagle" and cfg.spec.tree is None and cfg.tensor_parallel_size == 2


def test_draft_trees_on_gpus_with_tensor_parallelism_are_refused_at_start(tiny_model_dir, heads):
    with pytest.raises(ValueError, match="draft trees with tensor parallelism run on CPUs"):
        LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads["eagle3"]),
            speculative_tree="4,3,3,10", device="cuda", tensor_parallel_size=2)
