"""Tree speculation end to end: exact greedy and sampled answers, penalties, gating, aborts, the CLI."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamsd import LLM, SamplingParams
from streamsd.config import SpecConfig, TreeShape
from streamsd.model.tree_layout import ROOT
from tests.engine.engine_helpers import (
    MAX_TOKENS,
    PROMPTS,
    assert_free,
    assert_pairs_follow_target,
    greedy_params,
)
from tests.spec_decode.eagle_helpers import chained_engine


def test_a_chain_shaped_tree_drafts_the_chain(tiny_model_dir, head):
    """A tree of frontier 1 and branch 1 is EAGLE's greedy chain: same drafts, parents 0, 1, ..."""
    k = 4
    chain = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), num_speculative_tokens=k)
    tree = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head),
               speculative_tree=TreeShape(k, 1, 1, k))
    seen = {}
    for name, llm in (("chain", chain), ("tree", tree)):
        drafts = []
        original = llm.core.scheduler.update

        def update(plan, results, original=original, drafts=drafts):
            drafts.extend((r.draft_ids, r.draft_parents) for r in results if r.draft_ids)
            return original(plan, results)

        llm.core.scheduler.update = update  # type: ignore[method-assign]
        llm.generate(PROMPTS[:3], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 3)
        seen[name] = drafts
    # Near max_tokens a chain is cut to what can still be emitted, a tree stays whole.
    assert len(seen["tree"]) == len(seen["chain"])
    assert all(c == t[: len(c)] for (t, _), (c, _) in zip(seen["tree"], seen["chain"], strict=True))
    assert all(p == [ROOT, 0, 1, 2] for _, p in seen["tree"])


@pytest.mark.parametrize("shape", ["4,1,1,4", "3,2,2,6", "4,3,3,10", "5,4,5,16"])
def test_greedy_tree_speculation_is_token_identical(tiny_model_dir, head, reference, shape):
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree=shape)
    res = llm.generate(PROMPTS, greedy_params())
    assert [r.outputs[0].token_ids for r in res] == reference
    stats = [r.spec_stats for r in res]
    assert sum(s.accepted for s in stats) > 0 and sum(s.drafted - s.accepted for s in stats) > 0
    assert_free(llm)


def test_trees_beat_a_chain_of_their_depth(tiny_model_dir, head):
    """More candidates per depth: more tokens per verify step on the same head (greedy)."""
    taus = {}
    for shape in ("4,1,1,4", "4,4,4,16"):
        llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree=shape)
        res = llm.generate(PROMPTS * 2, greedy_params() * 2)
        steps, emitted = sum(r.spec_stats.steps for r in res), sum(r.spec_stats.emitted for r in res)
        taus[shape] = emitted / steps
    assert taus["4,4,4,16"] > taus["4,1,1,4"] * 1.05, taus


def test_seeded_tree_sampling_is_plain_sampling_token_for_token(tiny_model_dir, head):
    """The walk draws each token as a plain step does: seeded, the same text, top-k/top-p/min-p too."""
    plain = LLM(str(tiny_model_dir))
    tree = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree="4,3,3,10")
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, max_tokens=24, seed=s, ignore_eos=True)
              for s, (t, k, p, m) in enumerate([(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (0.8, 5, 1.0, 0.0),
                                                (1.0, 0, 0.8, 0.0), (1.2, 0, 1.0, 0.1), (0.0, 0, 1.0, 0.0)])]
    a, b = plain.generate(PROMPTS, params), tree.generate(PROMPTS, params)
    assert [r.outputs[0].token_ids for r in a] == [r.outputs[0].token_ids for r in b]
    assert sum(r.spec_stats.accepted for r in b) > 0
    assert_free(tree)


def test_penalised_trees_and_chains_are_plain_decoding_token_for_token(tiny_model_dir, head):
    """Logit bias and penalties through an EAGLE head's trees (each row counting the drafts on its own
    path) and its chain: greedy answers are plain decoding's, and a tree's seeded sampled ones too; the
    chain's steps queued ahead (pipeline) serve the unpenalised requests of the same batch."""
    from tests.engine.test_penalties import BIAS

    # Penalties that reward repeating: what a row counts (its own path's drafts) moves its argmax.
    penalties = dict(frequency_penalty=-1.0, presence_penalty=-0.5, repetition_penalty=0.8, logit_bias=BIAS)
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **penalties) for n in MAX_TOKENS]
    sampled = [SamplingParams(temperature=t, top_k=k, max_tokens=24, seed=s, ignore_eos=True, **penalties)
               for s, (t, k) in enumerate([(1.0, 0), (0.7, 0), (0.8, 5), (1.2, 0), (0.5, 0), (1.0, 0)])]
    plain = LLM(str(tiny_model_dir))
    want = [r.outputs[0].token_ids for r in plain.generate(PROMPTS * 2, greedy + sampled)]
    assert want[:6] != [r.outputs[0].token_ids for r in plain.generate(PROMPTS, greedy_params())]
    tree = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree="4,3,3,10")
    res = tree.generate(PROMPTS * 2, greedy + sampled)
    assert [r.outputs[0].token_ids for r in res] == want
    assert sum(r.spec_stats.accepted for r in res) > 0
    assert_free(tree)
    longer = [SamplingParams(temperature=0.0, max_tokens=n + 24, ignore_eos=True) for n in MAX_TOKENS]
    unpenalised = [r.outputs[0].token_ids for r in plain.generate(PROMPTS, longer)]
    chain = chained_engine(tiny_model_dir, head, pipeline=True)  # the head queued behind the verify, as on CUDA
    res = chain.generate(PROMPTS * 2, greedy + longer)
    assert [r.outputs[0].token_ids for r in res] == want[:6] + unpenalised
    assert sum(r.spec_stats.accepted for r in res[:6]) > 0
    assert chain.core.rt.worker.lookahead.taken > 0  # once the penalised requests are done
    assert_free(chain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_penalised_requests_verify_eagerly_beside_graphs(tiny_model_dir, head):
    """On CUDA a penalised request's steps leave the graphs' greedy verify and tree steps and the steps
    queued ahead: its answers are plain decoding's, through the Triton samplers over its float32
    penalised logits, and the unpenalised requests of the batch keep the graphs."""
    from tests.engine.test_penalties import BIAS

    kw = dict(device="cuda", dtype="float32", kv_cache_tokens=8192)
    penalties = dict(frequency_penalty=-1.0, presence_penalty=-0.5, repetition_penalty=0.8, logit_bias=BIAS)
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **penalties) for n in MAX_TOKENS]
    sampled = [SamplingParams(temperature=t, max_tokens=20, seed=s, ignore_eos=True, **penalties)
               for s, t in enumerate([1.0, 0.7, 1.2])]
    longer = [SamplingParams(temperature=0.0, max_tokens=n + 24, ignore_eos=True) for n in MAX_TOKENS]
    plain = LLM(str(tiny_model_dir), **kw)
    want = [r.outputs[0].token_ids for r in plain.generate(PROMPTS * 2 + PROMPTS[:3], greedy + longer + sampled)]
    tree = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree="4,3,3,10", **kw)
    assert [r.outputs[0].token_ids for r in tree.generate(PROMPTS * 2 + PROMPTS[:3], greedy + longer + sampled)] == want
    assert tree.core.rt.worker.tree_graphs.replays > 0
    assert_free(tree)
    chain = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), num_speculative_tokens=4, **kw)
    assert [r.outputs[0].token_ids for r in chain.generate(PROMPTS * 2, greedy + longer)] == want[:12]
    assert chain.core.rt.worker.lookahead.taken > 0 and chain.core.rt.worker.verifier.graph_greedy > 0
    assert_free(chain)


def test_end_to_end_tree_sampling_matches_target_distribution(tiny_model_dir, head):
    n, temperature = 2000, 1.0
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree="3,3,3,8",
              max_num_seqs=n, kv_cache_tokens=n * 48, max_num_batched_tokens=16384)
    prompt = llm.core.text.encode_prompt("Once upon a time")
    params = [SamplingParams(temperature=temperature, max_tokens=3, seed=s + 10_000, ignore_eos=True) for s in range(n)]
    res = llm.generate([prompt] * n, params)
    assert sum(r.spec_stats.accepted for r in res) > 0
    assert_pairs_follow_target(tiny_model_dir, prompt, res, (temperature, 0, 1.0, 0.0))
    assert_free(llm)


def test_trees_under_preemption_stops_and_logprobs(tiny_model_dir, head, reference):
    """A pool too small for every request (preemption by recompute), min_tokens, stop ids and
    log-probabilities through tree steps: exact, and nothing leaks."""
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree="4,3,3,10",
              kv_cache_tokens=160)
    sched = llm.core.scheduler
    preempted = []
    original = sched._preempt
    sched._preempt = lambda r: (preempted.append(list(r.draft_parents)), original(r))  # type: ignore[method-assign]
    res = llm.generate(PROMPTS, greedy_params())
    assert [r.outputs[0].token_ids for r in res] == reference
    assert preempted and any(preempted), "no request was preempted holding a tree"
    plain = LLM(str(tiny_model_dir))
    eos = llm.core.rt.eos_ids
    params = [SamplingParams(temperature=0.9, max_tokens=16, min_tokens=10, seed=4, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[reference[0][5]], logprobs=1)]
    a, b = plain.generate(PROMPTS[:2], params), llm.generate(PROMPTS[:2], params)
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert len(y.outputs[0].logprobs) == len(y.outputs[0].token_ids)
        assert np.allclose(x.outputs[0].logprobs, y.outputs[0].logprobs, atol=1e-4)
    assert not set(b[0].outputs[0].token_ids[:10]) & set(eos)
    assert_free(llm)


CUDA_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize(("device", "pipeline"), [("cpu", False), ("cpu", True),
                                                  pytest.param("cuda", None, marks=CUDA_ONLY)])
def test_trees_gated_by_the_batch_switch_with_plain_steps_exactly(tiny_model_dir, head, device, pipeline):
    """speculative_max_batch=2: six requests decode plain steps (their first trees are dropped), then the
    last two catch their heads up from the stream store and draft trees. Greedy and seeded answers equal
    plain decoding's; with steps queued ahead (pipeline; on CUDA with tree graphs) the switches take the
    held step; nothing leaks."""
    kw = dict(device=device, pipeline=pipeline, dtype="float32", kv_cache_tokens=8192)
    plain = LLM(str(tiny_model_dir), **kw)
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree="4,3,3,10",
              speculative_max_batch=2, **kw)
    if device == "cuda":  # graphs for the buckets a tree step can fill, no more
        assert sorted({b for b, _ in llm.core.rt.worker.tree_graphs.graphs}) == [1, 2]
    policy = llm.core.scheduler.policy
    gates: list[bool] = []
    choose = policy.choose

    def record(*args):
        decision = choose(*args)
        gates.append(policy.speculating)
        return decision

    policy.choose = record  # type: ignore[method-assign]
    sampled = [SamplingParams(temperature=0.9, max_tokens=n, seed=7 + n, ignore_eos=True) for n in MAX_TOKENS]
    for params in (greedy_params(), sampled):
        gates.clear()
        a, b = plain.generate(PROMPTS, params), llm.generate(PROMPTS, params)
        assert [r.outputs[0].token_ids for r in a] == [r.outputs[0].token_ids for r in b]
        plain_then_tree = [i for i in range(1, len(gates)) if gates[i] and not gates[i - 1]]
        assert False in gates and plain_then_tree, gates
        longest = [r for r, n in zip(b, MAX_TOKENS, strict=True) if n >= 24]
        assert all(r.spec_stats.drafted > 0 for r in longest) and sum(r.spec_stats.accepted for r in longest) > 0
        # answers that end while three or more decode verify no drafts: their trees were dropped
        assert all(r.spec_stats.drafted == 0 for r, n in zip(b, MAX_TOKENS, strict=True) if n <= 17)
    if device == "cuda":
        assert llm.core.rt.worker.tree_graphs.replays > 0
    assert_free(llm)
    with pytest.raises(ValueError, match="adaptive"):
        SpecConfig(method="eagle", max_batch=2, policy="adaptive")


def test_gated_trees_under_aborts_free_everything(tiny_model_dir, head):
    """Aborts in both regimes of a gated tree engine with steps queued ahead: among eight decoding plain
    steps, then down to two drafting trees, then one of those two mid-tree. The survivor's seeded answer
    is plain decoding's; every block, q slot and tracker is freed."""
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree="4,3,3,10",
              speculative_max_batch=2, pipeline=True, kv_cache_tokens=2048)
    core, ids = llm.core, [f"r{i}" for i in range(12)]
    params = [SamplingParams(temperature=1.0, max_tokens=40, seed=i, ignore_eos=True) for i in range(12)]
    for rid, prompt, sp in zip(ids, PROMPTS * 2, params, strict=True):
        core.add_request(rid, core.text.encode_prompt(prompt), sp)
    aborts = {3: ids[:4], 10: ids[4:10], 16: ids[10:11]}
    finished: dict[str, str] = {}
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    steps, gates = 0, []
    while core.has_work:
        steps += 1
        for rid in aborts.get(steps, []):
            core.abort(rid)
        for out in core.step():
            tokens[out.request_id].extend(out.token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason or ""
        gates.append(core.scheduler.policy.speculating)
    assert sorted(finished) == sorted(ids)
    assert {finished[r] for r in ids[:11]} == {"cancelled"} and finished["r11"] == "length"
    assert False in gates[:10] and all(gates[12:16]), gates
    plain = LLM(str(tiny_model_dir)).generate([PROMPTS[5]], [params[11]])[0]
    assert tokens["r11"] == plain.outputs[0].token_ids
    assert_free(llm)


def test_cli_generates_with_a_tree_and_refuses_a_bad_one(tiny_model_dir, head, reference, capsys):
    from streamsd.cli import main

    args = ["generate", "--model", str(tiny_model_dir), "--draft-model", str(head), "--speculative-method", "eagle",
            "--max-tokens", str(MAX_TOKENS[0]), "--prompt", PROMPTS[0]]
    # The fixed policy: a tree every step. (The default, the step chooser, decides by this CPU's costs.)
    assert main([*args, "--speculative-tree", "4,3,3,10", "--speculation-policy", "fixed"]) == 0
    tree = capsys.readouterr().out
    assert main([*args, "--speculative-tree", "4,3,3,10"]) == 0
    chosen = capsys.readouterr().out
    assert main(["generate", "--model", str(tiny_model_dir), "--max-tokens", str(MAX_TOKENS[0]),
                 "--prompt", PROMPTS[0]]) == 0
    plain = capsys.readouterr().out
    assert "(eagle)" in tree and "mean accepted length" in tree
    # greedy: the same text as plain decoding, whichever steps the chooser took
    assert tree.splitlines()[0] == chosen.splitlines()[0] == plain.splitlines()[0]
    assert main([*args, "--speculative-tree", "4,3,3,70"]) == 2
    assert "nodes" in capsys.readouterr().err
    assert main([*args[:6], "ngram", *args[7:], "--speculative-tree", "4,3,3,10"]) == 2
    assert "EAGLE" in capsys.readouterr().err


def test_constrained_requests_take_plain_steps_beside_trees_with_plain_decodings_answers(tiny_model_dir, head):
    """A grammar's mask would need each tree node's own path state: a constrained request is decoded
    one token a step (no drafts) while the others of its batch keep their trees; its answers, greedy
    and seeded, are plain constrained decoding's."""
    from streamsd.request import Constraint

    pattern = Constraint("regex", "(The|Once|[a-z ]{1,12})[ a-z0-9.,]{0,40}", "guided_regex")
    params = [SamplingParams(temperature=0.0, max_tokens=30, constraint=pattern),
              SamplingParams(temperature=1.0, max_tokens=30, seed=5, constraint=pattern),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    plain = LLM(str(tiny_model_dir))
    want = [r.outputs[0].token_ids for r in plain.generate(PROMPTS[:3], params)]
    tree = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree="4,3,3,10")
    res = tree.generate(PROMPTS[:3], params)
    assert [r.outputs[0].token_ids for r in res] == want
    assert [r.spec_stats.drafted for r in res][:2] == [0, 0] and res[2].spec_stats.drafted > 0
    assert_free(tree)
