"""Tree steps through graphs (worker/tree_graphs.py, eagle/grow_graphs.py): the eager engine's answers."""

from __future__ import annotations

import pytest
import torch

from streamsd import LLM, SamplingParams
from tests.engine.engine_helpers import PROMPTS, assert_free


@pytest.mark.parametrize(("temperature", "shape", "cut"), [(0.0, "4,3,3,10", {}), (0.9, "4,3,3,10", {}),
                                                           (0.9, "3,8,8,24", {}),
                                                           (0.9, "4,3,3,10", dict(top_p=0.8, top_k=20))])
def test_tree_graph_steps_queued_ahead_change_nothing(tiny_model_dir, head, temperature, shape, cut):
    """The work of a tree graph (worker/tree_graphs.py: verify, walk, moves, catch-up, growth, the next
    replay's inputs), run eagerly on the CPU with steps queued ahead: the same text as plain decoding,
    and steps queued ahead are taken; requests cut by top-k/top-p replay the race's graph with their cut."""
    from streamsd.worker.tree_graphs import SAMPLED, tree_graphs_for

    plain = LLM(str(tiny_model_dir))
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree=shape,
              pipeline=True)
    rt, w = llm.core.rt, llm.core.rt.worker
    w.tree_graphs = tree_graphs_for(w, w.proposer, rt.scheduler_config.num_blocks, rt.scheduler_config.max_model_len)
    params = [SamplingParams(temperature=temperature, max_tokens=40, seed=s, ignore_eos=True, **cut) for s in range(4)]
    a, b = plain.generate(PROMPTS[:4], params), llm.generate(PROMPTS[:4], params)
    assert [r.outputs[0].token_ids for r in a] == [r.outputs[0].token_ids for r in b]
    # One request of the batch stops early (a stop id its plain answer reaches at token 12): the
    # queued step then lost a row, and the rows after it must still be their own requests'.
    stop = a[1].outputs[0].token_ids[12]
    params[1] = SamplingParams(temperature=temperature, max_tokens=40, seed=1, ignore_eos=True, stop_token_ids=[stop],
                               **cut)
    a, b = plain.generate(PROMPTS[:4], params), llm.generate(PROMPTS[:4], params)
    assert len(a[1].outputs[0].token_ids) <= 13
    assert [r.outputs[0].token_ids for r in a] == [r.outputs[0].token_ids for r in b]
    if temperature > 0:  # the last steps ran 3 requests in bucket 4: the padding row is greedy, never raced
        assert {m for _, m in w.tree_graphs.graphs} == {SAMPLED}
        g, width = w.tree_graphs.graphs[(4, SAMPLED)], w.tree_graphs.width
        assert g.draws[0, 3].item() == 1 and bool((g.row_ints[0, 3 * width :] == 1).all())
        assert g.warp_f[0, 3].item() == 1.0
        if cut:  # the requests' cut on their rows, none on the padding row's
            assert bool((g.row_top_p[: 3 * width] == 0.8).all()) and bool((g.row_top_k[: 3 * width] == 20).all())
            assert bool((g.row_top_p[3 * width :] == 1.0).all()) and bool((g.row_top_k[3 * width :] == 0).all())
    assert w.tree_graphs.replays > 0 and w.lookahead.taken > 0
    assert sum(r.spec_stats.accepted for r in b) > 0
    assert_free(llm)


def _staggered(llm: LLM, temperature: float) -> tuple[list[list[int]], list[SamplingParams], list[list[int]]]:
    """Five requests joining one engine at different steps (one with speculation off): their prompts,
    params and answers."""
    core = llm.core
    params = [SamplingParams(temperature=temperature, max_tokens=30, seed=s, ignore_eos=True) for s in range(5)]
    params[3] = SamplingParams(temperature=temperature, max_tokens=30, seed=3, ignore_eos=True, speculative=False)
    prompts = [core.text.encode_prompt(p) for p in PROMPTS[:5]]
    reqs = {}
    joins = {0: [0, 1], 4: [2], 6: [3], 9: [4]}  # step -> requests added before it
    step = 0
    while step <= max(joins) or core.has_work:
        for i in joins.get(step, []):
            reqs[i] = core.add_request(f"r{i}-{temperature}", prompts[i], params[i])
        core.step()
        step += 1
    return prompts, params, [reqs[i].output_ids for i in range(5)]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_requests_joining_beside_tree_graph_steps_change_nothing(tiny_model_dir, head, temperature):
    """Requests join (their prompts) and one decodes plain (speculation off) while others verify whole
    trees: the trees take the graph's step, the rest their own beside it; every answer is plain
    decoding's, and nothing is left held."""
    from streamsd.worker.tree_graphs import tree_graphs_for

    plain = LLM(str(tiny_model_dir))
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree="4,3,3,10",
              pipeline=True)
    rt, w = llm.core.rt, llm.core.rt.worker
    w.tree_graphs = tree_graphs_for(w, w.proposer, rt.scheduler_config.num_blocks, rt.scheduler_config.max_model_len)
    prompts, params, got = _staggered(llm, temperature)
    assert got == [r.outputs[0].token_ids for r in plain.generate(prompts, params)]
    assert w.trees.beside >= 3, w.trees.beside
    assert_free(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_requests_joining_beside_tree_graphs_equal_plain_decoding(tiny_model_dir, head):
    """On CUDA the trees replay their graph and the joining prompts (or plain rows) run their own step
    after it, a prompt graph where one fits: greedy and seeded answers are plain decoding's."""
    plain = LLM(str(tiny_model_dir), device="cuda", dtype="float32", kv_cache_tokens=8192)
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), device="cuda",
              dtype="float32", kv_cache_tokens=8192, max_num_seqs=8, speculative_tree="4,6,6,24")
    w = llm.core.rt.worker
    assert w.tree_graphs is not None
    for temperature in (0.0, 1.0):
        prompts, params, got = _staggered(llm, temperature)
        assert got == [r.outputs[0].token_ids for r in plain.generate(prompts, params)], temperature
    assert w.trees.beside >= 3 and w.tree_graphs.replays > 0, (w.trees.beside, w.tree_graphs.replays)
    assert_free(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", ["4,3,3,10", "3,8,8,24", "4,6,6,24"])
def test_cuda_tree_steps_through_graphs_equal_the_eager_engine(tiny_model_dir, head, shape):
    """On CUDA whole tree steps are graph replays queued one ahead (worker/tree_graphs.py): greedy and
    seeded answers (top-k/top-p ones racing over their cut inside the graph) equal plain decoding's, batch 1 and
    4, and nothing is captured or compiled once the engine is built."""
    from streamsd.kernels.warmup import compiled_by_kernel

    plain = LLM(str(tiny_model_dir), device="cuda", dtype="float32", kv_cache_tokens=8192)
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), device="cuda",
              dtype="float32", kv_cache_tokens=8192, max_num_seqs=4, speculative_tree=shape)
    w = llm.core.rt.worker
    assert w.tree_graphs is not None and w.tree_graphs.graphs
    before = (len(w.tree_graphs.graphs), compiled_by_kernel())
    kinds = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, min_p=0.05),
             dict(temperature=0.9, top_k=20, top_p=0.8)]
    for i, kw in enumerate(kinds):
        params = [SamplingParams(max_tokens=60, seed=10 * i + j, ignore_eos=True, **kw) for j in range(4)]
        for batch in (PROMPTS[i : i + 1], PROMPTS[:4]):
            a, b = plain.generate(batch, params[: len(batch)]), llm.generate(batch, params[: len(batch)])
            assert [r.outputs[0].token_ids for r in a] == [r.outputs[0].token_ids for r in b], kw
    assert w.tree_graphs.replays > 20 and w.lookahead.taken > 10, (w.tree_graphs.replays, w.lookahead.taken)
    # A model's generation config gives top-k/top-p to requests that leave them out: an argmax ignores them.
    replays, cut = w.tree_graphs.replays, [SamplingParams(max_tokens=60, temperature=0.0, top_p=0.9, top_k=40)] * 2
    a, b = plain.generate(PROMPTS[:2], cut), llm.generate(PROMPTS[:2], cut)
    assert [r.outputs[0].token_ids for r in a] == [r.outputs[0].token_ids for r in b]
    assert w.tree_graphs.replays > replays + 10
    graphs, compiled = before
    after = compiled_by_kernel()
    assert len(w.tree_graphs.graphs) == graphs
    assert after == compiled, {k: after[k] - compiled[k] for k in after if after[k] != compiled[k]}
    assert_free(llm)


def test_tree_graph_modes_follow_the_batch_sampling():
    """Greedy batches replay the argmax graph whatever their top-k/top-p (a cut changes nothing of an
    argmax); sampled ones the race, cut or not; penalised requests take the eager path."""
    from streamsd.worker.tree_graphs import GREEDY, SAMPLED, mode_for, replayable

    greedy_cut = SamplingParams(temperature=0.0, top_p=0.9, top_k=40)
    uncut, cut_p, cut_k = (SamplingParams(temperature=1.0, min_p=0.05), SamplingParams(temperature=1.0, top_p=0.9),
                           SamplingParams(temperature=0.7, top_k=20))
    assert all(replayable(p) for p in (greedy_cut, uncut, cut_p, cut_k))
    assert not replayable(SamplingParams(temperature=0.0, repetition_penalty=1.2))
    assert mode_for([greedy_cut, greedy_cut]) == GREEDY
    assert mode_for([greedy_cut, uncut]) == SAMPLED
    assert mode_for([uncut, cut_p]) == mode_for([cut_k]) == mode_for([greedy_cut, cut_k]) == SAMPLED


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_trees_grown_through_grow_graphs_equal_eager_ones(tiny_model_dir, head, temperature):
    """The growths the proposer runs itself (a request's first tree, after its prompt) through the grow
    graphs' static buffers (spec_decode/eagle/grow_graphs.py; captured on CUDA, run as is on a CPU): at batch 1 the
    prompt's catch-up too. The same trees as eager catch-ups and growths, so the same drafts accepted
    step by step, at batch 1 and 3 (a padded bucket)."""
    from streamsd.spec_decode.eagle.grow_graphs import GrowGraphs

    cuda = torch.cuda.is_available()
    engines = [LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree="4,3,3,10",
                   device="cuda" if cuda else "cpu", dtype="float32", max_num_seqs=4, kv_cache_tokens=4096)
               for _ in range(2)]
    engines[0].core.rt.worker.proposer.grow_graphs = None  # eager growths
    p = engines[1].core.rt.worker.proposer
    if cuda:  # captured with the engine
        assert p.grow_graphs is not None and p.grow_graphs.graphs
        p.grow_graphs.graphs.clear()  # captured again on first use: the keys this test replays
    else:
        p.grow_graphs = GrowGraphs(p.head, p._run, p.tree, p.cache.block_size, 16, engines[1].core.rt
                                   .scheduler_config.num_blocks, torch.float32, p.device, p.store, (32, 64))
    for batch in (PROMPTS[:1], PROMPTS[1:4]):
        params = [SamplingParams(temperature=temperature, max_tokens=24, seed=s, ignore_eos=True) for s in range(3)]
        a, b = (llm.generate(batch, params[: len(batch)]) for llm in engines)
        assert [r.outputs[0].token_ids for r in a] == [r.outputs[0].token_ids for r in b]
        assert [(r.spec_stats.steps, r.spec_stats.accepted) for r in a] == \
            [(r.spec_stats.steps, r.spec_stats.accepted) for r in b]
    keys = set(p.grow_graphs.graphs)
    # batch 1: a catch-up (the prompt's, on a CPU every step's) and its growth in one replay; batch 3: growths
    assert p.grow_graphs.replays >= 2 and {(1, temperature > 0, 32), (4, temperature > 0, 0)} <= keys
    assert all(sampled == (temperature > 0) for _, sampled, _ in keys)
    assert_free(engines[1])
