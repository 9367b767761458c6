"""Pipelined plain steps (streamsd/worker/lookahead.py): the next plain decode step is queued before this
one is read. On the CPU the queued step runs at once, which is enough to check that it changes no
output, no KV accounting, and that the engine really takes queued steps."""

from __future__ import annotations

import pytest
import torch

from streamsd import LLM, SamplingParams
from tests.engine.engine_helpers import MAX_TOKENS, PROMPTS, assert_free, greedy_params, hf_greedy
from tests.scripted_policy import ScriptedPolicy


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return hf_greedy(tiny_model_dir, PROMPTS, MAX_TOKENS)


def _ids(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


def _mixed_params() -> list[SamplingParams]:
    """Greedy and sampled (seeded, warped) requests, min_tokens, EOS allowed, stop ids: requests end
    at different steps, several by a token the host cannot foresee."""
    out = []
    for i, n in enumerate(MAX_TOKENS * 2):
        kw = dict(max_tokens=n + 6, seed=100 + i)
        if i % 3 == 0:
            out.append(SamplingParams(temperature=0.0, **kw))
        elif i % 3 == 1:
            out.append(SamplingParams(temperature=1.0, top_k=40, top_p=0.9, min_tokens=4, **kw))
        else:
            out.append(SamplingParams(temperature=0.8, min_p=0.02, stop_token_ids=[7, 11, 13], **kw))
    return out


def test_greedy_pipelined_plain_is_token_identical_to_hf(tiny_model_dir, reference):
    llm = LLM(str(tiny_model_dir), pipeline=True)
    la = llm.core.rt.worker.lookahead
    assert _ids(llm.generate(PROMPTS, greedy_params())) == reference
    # Steps were really served by queued ones, and requests ending at different lengths dropped out
    # of them (subset plans) rather than dropping every queued step.
    assert la.taken >= max(MAX_TOKENS) - 2, (la.taken, la.dropped)
    assert la.queued is None or la.queued.requests  # nothing else left behind
    assert_free(llm)


def test_sampled_stops_and_min_tokens_match_unpipelined(tiny_model_dir):
    prompts = PROMPTS * 2
    on = LLM(str(tiny_model_dir), pipeline=True)
    off = LLM(str(tiny_model_dir), pipeline=False)
    got = on.generate(prompts, _mixed_params())
    want = off.generate(prompts, _mixed_params())
    assert _ids(got) == _ids(want)
    assert [r.outputs[0].finish_reason for r in got] == [r.outputs[0].finish_reason for r in want]
    assert {r.outputs[0].finish_reason for r in want} == {"stop", "length"}  # both kinds of end happened
    assert on.core.rt.worker.lookahead.taken > 10
    assert off.core.rt.worker.lookahead.taken == 0
    assert_free(on)


def test_arrivals_aborts_and_stop_strings_under_the_engine_loop(tiny_model_dir):
    """EngineCore.run (the server's loop shape): requests join and are aborted mid-run, a stop string
    ends one under a running step; every output equals the unpipelined engine's."""

    def drive(llm: LLM) -> dict[str, tuple[list[int], str | None]]:
        core = llm.core
        got: dict[str, tuple[list[int], str | None]] = {}
        params = _mixed_params()
        core.add_request("a0", core.text.encode_prompt(PROMPTS[0]), params[0])
        core.add_request("a1", core.text.encode_prompt(PROMPTS[1]), SamplingParams(temperature=0, max_tokens=30,
                                                                              stop=[" t"], ignore_eos=True))
        for n, turn in enumerate(core.run()):
            if n in (5, 9, 14):  # joins while steps are queued ahead
                i = n % len(PROMPTS)
                core.add_request(f"j{n}", core.text.encode_prompt(PROMPTS[i]), params[i + 1])
            if n == 11:
                core.abort("j5")
            for o in turn.outputs:
                ids, _ = got.setdefault(o.request_id, ([], None))
                ids.extend(o.token_ids)
                if o.finished:
                    got[o.request_id] = (ids, o.finish_reason)
        assert_free(llm)
        return got

    on, off = LLM(str(tiny_model_dir), pipeline=True), LLM(str(tiny_model_dir), pipeline=False)
    got, want = drive(on), drive(off)
    assert got == want
    assert got["j5"][1] == "cancelled" and len(got) == 5
    la = on.core.rt.worker.lookahead
    assert la.taken > 10 and la.dropped >= 3, (la.taken, la.dropped)  # joins and the abort dropped some


@pytest.mark.parametrize("kw", [{"speculative_method": "ngram"}, {"draft_model": "close"}], ids=["ngram", "draft"])
def test_adaptive_speculation_with_pipelined_plain_steps_stays_exact(tiny_model_dir, close_draft_dir, reference, kw):
    if kw.get("draft_model") == "close":
        kw = {"draft_model": str(close_draft_dir)}
    llm = LLM(str(tiny_model_dir), speculation_policy="adaptive", pipeline=True, **kw)
    assert _ids(llm.generate(PROMPTS, greedy_params())) == reference
    assert_free(llm)


def test_tiny_pool_preempts_and_stays_exact(tiny_model_dir, reference):
    """6 blocks of 16 tokens for six requests: preemption by recompute, blocks handed from request to
    request while steps are queued ahead of them."""
    llm = LLM(str(tiny_model_dir), kv_cache_tokens=96, pipeline=True)
    sched = llm.core.scheduler
    preempted: list[str] = []
    original = sched._preempt

    def spy(r):
        preempted.append(r.request_id)
        original(r)

    sched._preempt = spy
    assert _ids(llm.generate(PROMPTS, greedy_params())) == reference
    la = llm.core.rt.worker.lookahead
    assert len(preempted) >= 2 and la.taken > 10, (preempted, la.taken)
    assert_free(llm)


def test_a_failing_step_drops_the_queued_one(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), pipeline=True)
    core, worker = llm.core, llm.core.rt.worker
    core.add_request("x", core.text.encode_prompt(PROMPTS[0]), SamplingParams(temperature=0, max_tokens=20))
    core.step()  # prompt
    core.step()  # plain: the next one is queued
    assert worker.lookahead.queued is not None
    real = worker.verifier._race
    worker.verifier._race = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    core.add_request("y", core.text.encode_prompt(PROMPTS[1]), SamplingParams(temperature=0, max_tokens=5))
    outs = core.step()  # a prompt chunk joins: the queued step is dropped, the step fails
    worker.verifier._race = real
    assert worker.lookahead.queued is None
    assert {o.request_id for o in outs if o.finished} <= {"x", "y"}
    while core.has_work:
        core.step()
    assert_free(llm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pipelined_steps_match_unpipelined(tiny_model_dir):
    prompts = PROMPTS * 2
    on = LLM(str(tiny_model_dir), device="cuda", dtype="float32", pipeline=True, kv_cache_tokens=8192)
    off = LLM(str(tiny_model_dir), device="cuda", dtype="float32", pipeline=False, kv_cache_tokens=8192)
    assert _ids(on.generate(prompts, _mixed_params())) == _ids(off.generate(prompts, _mixed_params()))
    assert on.core.rt.worker.lookahead.taken > 10
    assert_free(on)


def test_switches_take_the_step_queued_ahead(tiny_model_dir):
    """Leaving speculation, drafting shallower and entering it take the step queued ahead instead of
    dropping it (its GPU time is spent): the queued speculative step's drafts are cut, the queued
    plain step runs and the drafting starts behind it. Only deeper drafts drop it. Greedy output
    equals plain decoding's; no KV block is left held."""
    import dataclasses

    from streamsd.bench import offline_run
    from streamsd.config import EngineConfig, SpecConfig
    from streamsd.engine.builder import build_runtime
    from streamsd.engine.core import EngineCore
    from streamsd.spec_decode.synthetic import SyntheticProposer
    from streamsd.worker.lookahead import kv_margin

    prompts = [[3 + i, 40 + 7 * i, 11, 90 - i, 5] for i in range(4)]
    rt = build_runtime(EngineConfig(model=str(tiny_model_dir), spec=SpecConfig(method=None, num_tokens=4),
                                    device="cpu", max_num_seqs=4, pipeline=True))
    plain = offline_run.engine_pass(rt, SpecConfig(method=None, num_tokens=4), prompts, 60, 4, speculative=False)
    oracle = {tuple(p): o for p, o in zip(prompts, plain.outputs, strict=True)}
    rt.worker.use_proposer(SyntheticProposer(oracle, 0.7, rt.args.vocab_size))
    la = rt.worker.lookahead
    la.chained = True
    script = [0, 0, 0, 4, 4, 4, 0, 0, 0, 3, 3, 3, 1, 1, 1, 0, 0, 0, 2, 2, 2, 4, 4, 4, 0, 0, 0] * 3
    policy = ScriptedPolicy(script)
    margin = kv_margin(4)
    rt = dataclasses.replace(rt, policy=policy,
                             scheduler_config=dataclasses.replace(rt.scheduler_config, drafting_reserve=margin.reserve,
                                                                  drafting_keep=margin.keep))
    core = EngineCore(rt, SpecConfig(method="synthetic", num_tokens=4, policy="fixed"))
    for i, p in enumerate(prompts):
        core.add_request(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, seed=i + 1))
    taken, dropped = la.taken, la.dropped
    outputs: dict[str, list[int]] = {}
    for turn in core.run():
        for o in turn.outputs:
            outputs.setdefault(o.request_id, []).extend(o.token_ids)
    assert [outputs[f"p{i}"] for i in range(len(prompts))] == plain.outputs and core.totals.drafted > 50
    deeper = sum(b > a > 0 for a, b in zip(script, script[1:], strict=False))
    # Each kind of switch was built: steps verifying the queued step's drafts and proposing none / fewer.
    assert any(w > 0 and d == 0 for w, d in policy.built) and any(0 < d < w for w, d in policy.built)
    follows = sum(d < w for w, d in policy.built)  # steps that verified a queued step's drafts, proposing fewer
    assert follows >= 4 and la.taken - taken >= follows, (la.taken - taken, follows)
    assert la.dropped - dropped <= deeper, (la.dropped - dropped, deeper)
    assert core.scheduler.blocks.num_free == core.scheduler.blocks.total


@pytest.mark.parametrize("past", [True, False])
def test_near_max_tokens_a_request_keeps_the_chains_k_where_drafts_run_past_it(past):
    """SchedulerConfig.drafts_past_max_tokens (set where chained steps queue ahead): a request with 2
    tokens left still verifies the 4 drafts it holds and proposes 4 more beside one far from its end,
    so the step stays one chain of k = 4 (Lookahead.chains) that the worker can queue behind. What it
    accepts past max_tokens is cut, and only the drafts a plan without it would have verified count as drafted.
    Without it the request verifies 1 draft and proposes none."""
    from streamsd.config import SchedulerConfig
    from streamsd.request import FinishReason, Request
    from streamsd.sched.plan import EntryResult
    from streamsd.sched.scheduler import Scheduler
    from streamsd.worker.lookahead import Lookahead

    sched = Scheduler(SchedulerConfig(num_blocks=64, max_model_len=512, drafts_past_max_tokens=past))
    near, far = (Request(rid, [1, 2, 3], SamplingParams(max_tokens=n), seed=0, arrival=0.0, spec_k=4)
                 for rid, n in (("near", 12), ("far", 50)))
    near.output_ids = [5] * 6  # recomputed after a preemption: its first step emits its 7th token
    for r in (near, far):
        sched.add(r)
    plan, _ = sched.schedule()
    assert [e.k_next for e in plan.entries] == [4, 4]
    sched.update(plan, [EntryResult([5], 0, [7] * 4, e.start + e.num_tokens) for e in plan.entries])
    plan, _ = sched.schedule()  # "near" accepts 2 of its 4 drafts: 2 tokens left after this step
    assert [e.k_next for e in plan.entries] == ([4, 4] if past else [3, 4])
    sched.update(plan, [EntryResult([7, 7, 6] if e.request is near else [7], 2 if e.request is near else 0,
                                    [7] * e.k_next, e.start + 5) for e in plan.entries])
    assert near.remaining_tokens == 2
    plan, _ = sched.schedule()
    got = [(e.request.request_id, e.num_drafts, e.k_next) for e in plan.entries]
    if not past:
        assert got == [("near", 1, 0), ("far", 4, 4)] and not Lookahead.chains(plan.entries)
        return
    assert got == [("near", 4, 4), ("far", 4, 4)] and Lookahead.chains(plan.entries)
    # All four drafts accepted and a bonus token: two are kept, the request ends. One draft counts, as
    # without drafts past max_tokens (above): the second kept token takes the place of a bonus token.
    out = sched.update(plan, [EntryResult([7, 7, 7, 7, 9], 4, [8] * 4, 12) if e.request is near
                              else EntryResult([7, 2], 1, [8] * 4, 8) for e in plan.entries])
    assert near.output_ids[-2:] == [7, 7] and near.finish_reason is FinishReason.LENGTH
    assert [(e.request.request_id, drafted) for e, _, _, drafted in out] == [("near", 1), ("far", 4)]
    assert (near.stats.drafted, near.stats.accepted, near.stats.emitted) == (4 + 1, 2 + 1, 1 + 3 + 2)
    assert near.blocks == []  # freed at its end, the KV past max_tokens with it


def test_following_the_queued_step_pins_switches_and_holds_back_the_next_queue():
    """Lookahead.follow, the scheduler's pins: a queued speculative step's requests that the k would
    draft shallower verify its drafts and propose that k; a queued plain step's requests that the k
    would start drafting take it plainly, and nothing is queued behind that step; finished requests,
    and those the k leaves as they are, are not pinned."""
    from streamsd.request import Request, Status
    from streamsd.worker.lookahead import Lookahead, Queued

    la = Lookahead(block_size=16, enabled=True)
    a, b, gone = (Request(i, [1, 2, 3], SamplingParams(max_tokens=40), seed=0, arrival=0.0, spec_k=4,
                          status=Status.RUNNING) for i in ("a", "b", "gone"))
    gone.status = Status.FINISHED
    asked: list[str] = []

    def k_of(ks):
        return lambda r: asked.append(r.request_id) or ks[r.request_id]

    assert la.follow(k_of({})) == {} and asked == [] and la.take_queue_next()
    la.queued = Queued([a, b, gone], [5, 5, 5], [0, 0, 0], [[1], [2], [3]], 3, torch.zeros(3, 4))
    assert la.follow(k_of({"a": 1, "b": 3})) == {id(a): (3, 1)} and asked == ["a", "b"]
    assert la.take_queue_next()
    la.queued = Queued([a, b, gone], [5, 5, 5], [0, 0, 0], [[1], [2], [3]], 0, torch.zeros(3))
    assert la.follow(k_of({"a": 2, "b": 0})) == {id(a): (0, 0)}
    assert not la.take_queue_next() and la.take_queue_next()  # the one step after it only
    assert la.follow(k_of({"a": 0, "b": 0})) == {} and la.take_queue_next()
