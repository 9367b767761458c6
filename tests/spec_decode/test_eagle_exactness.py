"""EAGLE speculation end to end: the target's greedy answers and distribution, drafts as trained."""

from __future__ import annotations

import pytest
import torch

from streamsd import LLM, SamplingParams
from streamsd.policy.policy import AdaptivePolicy, FixedPolicy
from streamsd.train.data import Sample, attach_streams
from streamsd.train.loop import ttt_outputs
from tests.engine.engine_helpers import PROMPTS, assert_free, assert_pairs_follow_target, greedy_params
from tests.spec_decode.eagle_helpers import chained_engine


@pytest.mark.parametrize("kind,k", [("eagle3", 1), ("eagle3", 4), ("eagle1", 4), ("eagle3_norm_first", 4)])
def test_greedy_eagle_is_token_identical(tiny_model_dir, heads, reference, kind, k):
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads[kind]), num_speculative_tokens=k)
    res = llm.generate(PROMPTS, greedy_params())
    assert [r.outputs[0].token_ids for r in res] == reference
    stats = [r.spec_stats for r in res]
    assert sum(s.accepted for s in stats) > 0 and sum(s.drafted - s.accepted for s in stats) > 0
    assert_free(llm)


@pytest.mark.parametrize("kind", ["eagle3", "eagle1", "eagle3_norm_first"])
def test_engine_drafts_are_what_training_time_test_predicts(tiny_model_dir, heads, kind):
    """Train and inference see the same thing: each draft the engine makes (catch-up then k steps)
    equals the head's prediction at that slot in `ttt_outputs` over the finished greedy answer,
    at every depth whose earlier drafts were right (training feeds the true tokens)."""
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads[kind]), num_speculative_tokens=4)
    proposer = llm.core.rt.worker.proposer
    calls: list[tuple[str, int, list[int]]] = []  # (request, its tokens when drafting, drafts)
    loop = proposer._draft_loop

    def recording(items, h):
        drafts = loop(items, h)
        calls.extend((it.request.request_id, len(it.tokens), row[: it.k]) for it, row in zip(items, drafts.tolist(), strict=True))
        return drafts

    proposer._draft_loop = recording
    res = {r.request_id: r for r in llm.generate(PROMPTS, greedy_params())}
    checked = _check_drafts_against_ttt(llm, res, calls)
    assert checked[0] > 20 and checked[1] > 0, checked


def _check_drafts_against_ttt(llm: LLM, res: dict, calls: list[tuple[str, int, list[int]]]) -> list[int]:
    """Asserts that 97 % of the drafts checkable (earlier ones right) at each depth equal the head's
    training-time prediction at their slot over the finished answers; returns how many were checked."""
    proposer = llm.core.rt.worker.proposer
    head, target = proposer.head, llm.core.rt.worker.target
    preds = {}
    for rid, r in res.items():
        s = Sample(r.prompt_token_ids + r.outputs[0].token_ids, len(r.prompt_token_ids))
        attach_streams(target, [s], head.input_layers, dtype=torch.float32)
        with torch.no_grad():
            outs = ttt_outputs(head, torch.tensor([s.ids], device=s.streams.device), s.streams[None], 4)
        preds[rid] = (s.ids, [head.target_logits(o[0]).argmax(-1).tolist() for o in outs])  # row p -> token p + 2
    same, checked = [0] * 4, [0] * 4
    for rid, n, drafts in calls:
        ids, pred = preds[rid]
        anchor = n - 2  # the last caught-up slot: the target's h and the last token
        for j, d in enumerate(drafts[:4]):
            if anchor + j + 2 >= len(ids) or (j and drafts[j - 1] != ids[anchor + j + 1]):
                break
            checked[j] += 1
            same[j] += pred[j][anchor + j] == d
    assert all(s >= 0.97 * c for s, c in zip(same, checked, strict=True)), (same, checked)
    return checked


class _Alternating(FixedPolicy):
    """`plain` steps at k = 0 for every request, then `spec` steps at the request's k, and again."""

    def __init__(self, plain: int, spec: int):
        super().__init__()
        self.plain, self.spec, self.steps = plain, spec, 0

    def choose(self, decoding, prefill_tokens, backlog):
        decision = super().choose(decoding, prefill_tokens, backlog)
        self.steps += 1
        self.speculating = (self.steps - 1) % (self.plain + self.spec) >= self.plain  # FixedPolicy.default_k reads it
        return decision


@pytest.mark.parametrize("engine", [
    "eager", "graph_body",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
])
def test_a_head_resuming_after_plain_steps_catches_up_from_the_stream_store(tiny_model_dir, heads, reference,
                                                                            engine):
    """Plain stretches of an EAGLE engine are the plain engine's steps: queued ahead, no propose call,
    the target's streams kept in the stream store. A head resuming after one catches up on every
    position it skipped (more than a graph's width: eagerly, then the graph body) and drafts what the
    head's training-time test predicts at that slot, as if it had followed every step; greedy output
    equal to the target's; nothing leaked."""
    graph_body = engine == "graph_body"  # on CUDA: real graphs, the store written inside the target's
    make = chained_engine if graph_body else (lambda d, h, **kw: LLM(
        str(d), speculative_method="eagle", draft_model=str(h), num_speculative_tokens=4, **kw))
    cuda = dict(device="cuda", dtype="float32", kv_cache_tokens=4096) if engine == "cuda" else {}
    llm = make(tiny_model_dir, heads["eagle3"], pipeline=True, **cuda)
    llm.core.scheduler.policy = _Alternating(plain=6, spec=2)
    worker = llm.core.rt.worker
    proposer = worker.proposer
    resumed: list[tuple[str, int, list[int]]] = []  # drafts made right after a catch-up over skipped positions
    propose = proposer.propose

    def recording(items):
        out = propose(items)
        resumed.extend((it.request.request_id, len(it.tokens), p.draft_ids) for it, p in zip(items, out, strict=True)
                       if it.k > 0 and it.upto - it.draft_computed >= 6)
        return out

    proposer.propose = recording
    out = llm.generate(PROMPTS, greedy_params())
    assert [r.outputs[0].token_ids for r in out] == reference
    assert worker.lookahead.taken > 0  # plain steps were queued ahead
    if proposer.graphs is not None:
        assert proposer.graphs.width < 6  # so each resume took the eager catch-up, then the graph
    checked = _check_drafts_against_ttt(llm, {r.request_id: r for r in out}, resumed)
    assert checked[0] >= 4 and checked[1] > 0, checked
    assert_free(llm)


def test_eagle_under_preemption_and_mixed_batch(tiny_model_dir, heads, reference):
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads["eagle3"]), kv_cache_tokens=96)
    sampled = [SamplingParams(temperature=1.0, max_tokens=20, seed=i, ignore_eos=True) for i in range(len(PROMPTS))]
    res = llm.generate(PROMPTS * 2, greedy_params() + sampled)
    assert [r.outputs[0].token_ids for r in res[: len(PROMPTS)]] == reference
    assert sum(r.spec_stats.accepted for r in res) > 0
    assert_free(llm)


@pytest.mark.parametrize("temperature", [1.0, 0.5])  # dense q above the greedy threshold, one-hot below
def test_end_to_end_eagle_sampling_matches_target_distribution(tiny_model_dir, heads, temperature):
    n = 3000
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads["eagle3"]),
              num_speculative_tokens=3, max_num_seqs=n, kv_cache_tokens=n * 48, max_num_batched_tokens=16384)
    prompt = llm.core.text.encode_prompt("Once upon a time")
    params = [SamplingParams(temperature=temperature, max_tokens=4, seed=s, ignore_eos=True) for s in range(n)]
    res = llm.generate([prompt] * n, params)
    assert sum(r.spec_stats.accepted for r in res) > 0 and sum(r.spec_stats.drafted for r in res) > 0
    assert_pairs_follow_target(tiny_model_dir, prompt, res, (temperature, 0, 1.0, 0.0))
    assert_free(llm)


def test_adaptive_k_keeps_eagle_exact(tiny_model_dir, heads, reference):
    # k changes per step (0 included): the head still catches up on every verified token.
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads["eagle3"]),
              speculation_policy="adaptive")
    res = llm.generate(PROMPTS, greedy_params())
    assert [r.outputs[0].token_ids for r in res] == reference
    assert_free(llm)


def test_adaptive_k_keeping_no_streams_while_plain_stays_exact(tiny_model_dir, heads, reference):
    """The adaptive policy's plain steps write no streams at all (keep_streams_steps 0): every head
    resuming has the target recompute what it skipped, and greedy answers stay the target's."""
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads["eagle3"]),
              speculation_policy="adaptive")
    policy = llm.core.scheduler.policy
    assert isinstance(policy, AdaptivePolicy)
    policy.keep_streams_steps = 0
    restore, restored = llm.core.rt.worker.restore_streams, []

    def counting(work):
        restored.extend(it.request.request_id for _, it in work if it.request.streams_missing_from is not None)
        restore(work)

    llm.core.rt.worker.restore_streams = counting
    res = llm.generate(PROMPTS, greedy_params())
    assert [r.outputs[0].token_ids for r in res] == reference
    print(f"{len(restored)} catch-ups over unkept streams")
    assert_free(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_eagle_greedy_is_exact_through_graphs(tiny_model_dir, heads):
    """On CUDA the target's verify steps replay graphs that also return the head's streams (and the
    fast forward computes them in eager steps): greedy eagle still equals plain decoding."""
    # A small KV cache each: a CUDA engine's default takes most of the free memory, four would not fit.
    plain = LLM(str(tiny_model_dir), device="cuda", dtype="float32", kv_cache_tokens=4096)
    want = [r.outputs[0].token_ids for r in plain.generate(PROMPTS, greedy_params())]
    for kind in ("eagle3", "eagle1", "eagle3_norm_first"):
        llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads[kind]), device="cuda",
                  dtype="float32", kv_cache_tokens=4096)
        assert [r.outputs[0].token_ids for r in llm.generate(PROMPTS, greedy_params())] == want
        worker = llm.core.rt.worker
        assert worker.graphs.hidden_layers == worker.proposer.hidden_layers and worker.graphs.replays > 0
        assert worker.target.fast is not None
        assert worker.verifier.graph_greedy > 10  # verified by the graph itself (sample/greedy.py)
        assert_free(llm)
