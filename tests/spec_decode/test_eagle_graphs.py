"""The EAGLE head's graphs (spec_decode/eagle/graphs.py): the eager head's drafts, captured up front."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamsd import LLM, SamplingParams
from streamsd.spec_decode.eagle.checkpoint import load_head
from tests.engine.engine_helpers import MAX_TOKENS, PROMPTS, assert_free, greedy_params
from tests.spec_decode.eagle_helpers import CPU, tiny_target


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["eagle3", "eagle1", "eagle3_norm_first"])
def test_cuda_eagle_graph_drafts_equal_eager_drafts(tiny_model_dir, heads, kind):
    """A propose call as one replay (catch-up + greedy draft chain, spec_decode/eagle/graphs.py) drafts what the
    eager head drafts: the same drafted and accepted counts at every depth, for every request, and
    the plain output. Near the end of an answer k is capped by the tokens left, so rows that want
    fewer drafts than the graph makes run too (their surplus steps write to the scratch block)."""
    plain = LLM(str(tiny_model_dir), device="cuda", dtype="float32", kv_cache_tokens=8192)
    want = [r.outputs[0].token_ids for r in plain.generate(PROMPTS, greedy_params())]
    stats = {}
    for graphs in (True, False):
        llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads[kind]), device="cuda",
                  dtype="float32", kv_cache_tokens=8192)
        proposer = llm.core.rt.worker.proposer
        assert proposer.graphs is not None
        if not graphs:
            proposer.graphs = None
        res = llm.generate(PROMPTS, greedy_params())
        assert [r.outputs[0].token_ids for r in res] == want
        stats[graphs] = [(r.spec_stats.drafted, r.spec_stats.accepted, list(r.spec_stats.accepted_per_pos))
                         for r in res]
        if graphs:  # the head on the fused kernels, mostly queued behind the verify (chained)
            assert proposer.graphs.chained > 0 and proposer.fast is not None
            assert len({k[1] for k in proposer.graphs.graphs}) > 1
        assert_free(llm)
    assert stats[True] == stats[False] and sum(s[1] for s in stats[True]) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_eagle_sampled_graph_drafts_equal_eager_drafts(tiny_model_dir, heads):
    """Sampled drafts inside the graph (each row warped at its own parameters, the keyed race, q into the
    request's pool slot) are the eager DraftPicker's: the same seeds give the same outputs and the same
    accepted counts with and without the graphs, in a batch mixing T = 1, top-k + top-p + min-p (the
    SORTED graph) and greedy requests. The rejection sampler reads those q: a wrong one would change
    which drafts pass."""
    from streamsd.spec_decode.eagle.graphs import GREEDY

    kinds = [dict(temperature=1.0), dict(temperature=0.9, top_k=20, top_p=0.8, min_p=0.05), dict(temperature=0.0)]
    params = [SamplingParams(max_tokens=n, seed=100 + i, ignore_eos=True, **kinds[i % 3])
              for i, n in enumerate(MAX_TOKENS)]
    runs = {}
    for graphs in (True, False):
        llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads["eagle3"]), device="cuda",
                  dtype="float32", kv_cache_tokens=8192)
        proposer = llm.core.rt.worker.proposer
        if not graphs:
            proposer.graphs = None
        res = llm.generate(PROMPTS, params)
        runs[graphs] = [(r.outputs[0].token_ids, r.spec_stats.drafted, r.spec_stats.accepted) for r in res]
        if graphs:
            assert any(mode != GREEDY for _, _, mode in proposer.graphs.graphs) and proposer.graphs.chained > 0
        assert_free(llm)
    assert runs[True] == runs[False]
    assert sum(r[2] for r in runs[True]) > 0 and sum(r[1] - r[2] for r in runs[True]) > 0


def test_graph_chain_steps_write_only_where_a_draft_is_wanted(tiny_model_dir, heads):
    """The chain layouts the graph works out on the device: step j of a row that wants more than
    j + 1 drafts writes its head slot at (first draft's position - 1 + j) in its own blocks, shifted by
    the accepted count a chained call leaves on the device; a row that wants fewer writes to the
    scratch block (its KV past its reservation is not its own), and so do the bucket's padding rows."""
    from streamsd.spec_decode.eagle.graphs import GREEDY, EagleGraphs

    head = load_head(heads["eagle3"], tiny_target(tiny_model_dir), CPU, torch.float32)
    graphs = EagleGraphs(head, None, 16, scratch=9, max_blocks=8, width=5, stream_dtype=torch.float32, device=CPU)
    g = graphs._load((4, 4, GREEDY), [1, 2, 3], [17, 5], [2, 1], [[3, 4], [5]], np.array([1, 2]), [20, 7],
                     [4, 1], None)
    for accepted in (0, 2):
        g.accepted[:2] = torch.tensor([accepted, 0])
        layouts = graphs.chain_layouts(g)  # [J, 3, B]
        assert layouts.shape == (3, 3, 4)
        for j in range(3):
            pos0 = 19 + accepted + j
            positions, slots, ctx = layouts[j].tolist()
            assert positions[0] == pos0 and slots[0] == 4 * 16 + pos0 % 16 and ctx[0] == pos0 + 1
            assert slots[1] // 16 == 9 and all(s // 16 == 9 for s in slots[2:])  # row 1 wants 1 draft: no chain
            assert positions[1:] == [0, 0, 0] and ctx[1:] == [1, 1, 1]  # they attend to a first slot only


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_are_captured_before_the_first_request(tiny_model_dir, heads):
    """A fixed-k EAGLE engine (no start-up profile) has every graph it will replay captured and every
    kernel compiled when it is built: requests at batch 1 and 3, greedy and sampled, running into their
    max_tokens (drafts cut step by step) capture and compile nothing. On an H200 the first such request
    captured graphs and compiled inside its last steps, 1.3-1.5 s each."""
    from streamsd.kernels.warmup import compiled_variants

    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads["eagle3"]), device="cuda",
              dtype="float32", kv_cache_tokens=4096, max_num_seqs=4, speculation_policy="fixed")
    worker = llm.core.rt.worker

    def counts() -> tuple[int, int, int]:
        return len(worker.graphs.graphs), len(worker.proposer.graphs.graphs), compiled_variants()

    before = counts()
    kinds = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.9, top_k=20, top_p=0.8)]
    for i, kw in enumerate(kinds):
        llm.generate(PROMPTS[i], SamplingParams(max_tokens=13 + i, seed=i, ignore_eos=True, **kw))
        llm.generate(PROMPTS[:3], [SamplingParams(max_tokens=9 + j, seed=j, ignore_eos=True, **kw) for j in range(3)])
    assert counts() == before
    assert_free(llm)
