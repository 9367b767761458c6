"""The EAGLE head queued behind the verify, and verifies queued ahead: the same drafts, tokens and counts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from streamsd import LLM, SamplingParams
from tests.engine.engine_helpers import MAX_TOKENS, PROMPTS, assert_free, greedy_params
from tests.spec_decode.eagle_helpers import chained_engine


@pytest.mark.parametrize("kind,policy", [("eagle3", "fixed"), ("eagle1", "fixed"), ("eagle3", "adaptive")])
def test_chained_drafts_equal_drafts_proposed_after_the_read(tiny_model_dir, heads, reference, kind, policy):
    """The head queued straight behind the verify (catching up on every verified row, rejected ones
    included, and drafting from the row the device's accepted count picks; rows with fewer drafts
    than others packed like the target's streams) drafts what the head proposing after the host read
    drafts, eagerly or through the graph body (`run`): the same output, drafted and accepted counts at
    every depth, for every request; greedy output equal to the target's; nothing leaked. The adaptive
    policy gives steps whose requests verify different numbers of drafts (its k follow timings, so
    there only the output and the cleanup are compared)."""
    eager = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads[kind]),
                speculation_policy=policy)
    after_read = chained_engine(tiny_model_dir, heads[kind], speculation_policy=policy)
    after_read.core.rt.worker._chain = lambda entries, hidden: None  # every propose call through `run`
    chained = chained_engine(tiny_model_dir, heads[kind], speculation_policy=policy)
    counts = []
    graphs = chained.core.rt.worker.proposer.graphs
    run_chained = graphs.run_chained
    graphs.run_chained = lambda *a, **kw: counts.append(a[5]) or run_chained(*a, **kw)
    runs = []
    for llm in (eager, after_read, chained):
        res = llm.generate(PROMPTS, greedy_params())
        assert [r.outputs[0].token_ids for r in res] == reference
        runs.append([(r.spec_stats.drafted, r.spec_stats.accepted, list(r.spec_stats.accepted_per_pos)) for r in res])
        assert_free(llm)
    assert after_read.core.rt.worker.proposer.graphs.replays > 0 and graphs.chained == len(counts) > 0
    assert any(len(set(c)) > 1 for c in counts)  # some steps verified different numbers of drafts per request
    if policy == "fixed":
        assert runs[0] == runs[1] == runs[2]
        assert sum(r[1] for r in runs[0]) > 0 and sum(r[0] - r[1] for r in runs[0]) > 0


def test_chained_sampled_drafts_equal_drafts_proposed_after_the_read(tiny_model_dir, heads):
    """Sampled drafts behind the verify: their noise is keyed by positions the device's accepted count
    sets, their q goes to the pool the next verify reads; the same seeds give the same outputs and
    counts as proposing after the read, in a batch mixing T = 1, top-k + top-p + min-p and greedy."""
    kinds = [dict(temperature=1.0), dict(temperature=0.9, top_k=20, top_p=0.8, min_p=0.05), dict(temperature=0.0)]
    params = [SamplingParams(max_tokens=n, seed=100 + i, ignore_eos=True, **kinds[i % 3])
              for i, n in enumerate(MAX_TOKENS)]
    runs = []
    for llm in (LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads["eagle3"])),
                chained_engine(tiny_model_dir, heads["eagle3"])):
        res = llm.generate(PROMPTS, params)
        runs.append([(r.outputs[0].token_ids, r.spec_stats.drafted, r.spec_stats.accepted) for r in res])
        assert_free(llm)
    assert runs[0] == runs[1]
    assert sum(r[2] for r in runs[0]) > 0 and sum(r[1] - r[2] for r in runs[0]) > 0


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_chained_steps_queued_ahead_change_nothing(tiny_model_dir, heads, reference, kind):
    """An EAGLE verify queued before the step before it is read (worker/lookahead.py: its ids, starts,
    noise positions and drafts all from the device): greedy output equal to the target's; greedy and
    sampled drafts (T = 1, top-k + top-p + min-p, min_tokens, EOS allowed) give the same tokens and
    per-request drafted / accepted counts as the engine that reads each step first; queued steps
    were really taken; nothing leaked."""
    ahead = chained_engine(tiny_model_dir, heads[kind], pipeline=True)
    cfg = ahead.core.scheduler.cfg
    assert (cfg.drafting_reserve, cfg.drafting_keep) == (5, 15)  # k = 4: the verify queued behind, its reach
    la = ahead.core.rt.worker.lookahead
    taken = la.taken  # by the start-up's warm-up requests
    assert [r.outputs[0].token_ids for r in ahead.generate(PROMPTS[:1], greedy_params()[:1])] == reference[:1]
    assert la.taken >= taken + 1, (la.taken, la.dropped)
    kinds = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.9, top_k=20, top_p=0.8, min_p=0.05)]
    runs = []
    for llm in (chained_engine(tiny_model_dir, heads[kind], past_max_tokens=True), ahead):
        out = []
        for i, kw in enumerate(kinds):  # batch 1: every step of the answer can be queued ahead
            p = SamplingParams(max_tokens=60, seed=100 + i, min_tokens=3 * i, **kw)
            out += [(r.outputs[0].token_ids, r.outputs[0].finish_reason, r.spec_stats.drafted, r.spec_stats.accepted)
                    for r in llm.generate(PROMPTS[i:i + 1], p)]
        res = llm.generate(PROMPTS * 2, [SamplingParams(max_tokens=40, seed=i, **kinds[i % 3]) for i in range(12)])
        runs.append(out + [(r.outputs[0].token_ids, r.spec_stats.drafted, r.spec_stats.accepted) for r in res])
        assert_free(llm)
    assert runs[0] == runs[1]
    assert la.taken >= taken + 15 and sum(r[-1] for r in runs[0]) > 0, (la.taken, la.dropped)


def test_chained_steps_stay_queued_up_to_max_tokens(tiny_model_dir, heads, reference):
    """Where chained steps queue ahead, a request near max_tokens keeps the batch's k
    (SchedulerConfig.drafts_past_max_tokens): its drafts past the end are free in a graph padded to the
    widest request, and what they accept past it is cut. So its last steps are queued ones too, where
    otherwise none is from 2(k + 1) tokens before its end. The answers stay the target's, the queued
    step left behind by the last request is dropped, nothing leaks (test_lookahead.py has the
    scheduler's side: the k kept, the drafts counted)."""

    counts: dict[bool, tuple[int, int]] = {}

    def run(past: bool) -> tuple[LLM, list]:
        llm = chained_engine(tiny_model_dir, heads["eagle3"], pipeline=True)
        sched, la = llm.core.scheduler, llm.core.rt.worker.lookahead
        counts[past] = la.taken, la.dropped  # the start-up's warm-up requests'
        assert sched.cfg.drafts_past_max_tokens and la.past_max_tokens_within == sched.cfg.max_model_len
        if not past:
            sched.cfg = dataclasses.replace(sched.cfg, drafts_past_max_tokens=False)
            la.past_max_tokens_within = None
        out = []
        for prompt, params in zip(PROMPTS, greedy_params(), strict=True):  # batch 1: every step may queue
            out += llm.generate([prompt], params)
        assert la.queued is None
        assert_free(llm)
        return llm, out

    (on, got), (off, want) = run(True), run(False)
    assert [r.outputs[0].token_ids for r in got] == reference == [r.outputs[0].token_ids for r in want]
    la_on, la_off = on.core.rt.worker.lookahead, off.core.rt.worker.lookahead
    steps = sum(r.spec_stats.steps for r in got)
    # Every step of each answer but its first two (its prompt, then the first verify: nothing queued
    # before them) was a queued one, to its last; the step queued behind each answer's last one was
    # dropped (forget_finished).
    taken_on, dropped_on = la_on.taken - counts[True][0], la_on.dropped - counts[True][1]
    assert (taken_on, dropped_on) == (steps - 2 * len(PROMPTS), len(PROMPTS)), (steps, taken_on)
    assert la_off.taken - counts[False][0] < taken_on - len(PROMPTS), (la_off.taken, taken_on)
    assert [r.spec_stats.emitted for r in got] == MAX_TOKENS


def test_dropped_queued_chains_leave_the_next_verify_intact(tiny_model_dir, heads):
    """Requests joining mid-answer drop the verify queued ahead (its plan no longer fits): the
    dropped step's drafts and their q (sampled drafts, T = 1) must not reach the verify that
    replaces it; the output and counts equal the engine that never queues ahead."""

    def drive(llm: LLM) -> tuple[dict, int]:
        core, got = llm.core, {}
        core.add_request("a", core.text.encode_prompt(PROMPTS[0]), SamplingParams(temperature=1.0, max_tokens=80, seed=3))
        for n, turn in enumerate(core.run()):
            if n in (6, 12, 20):
                core.add_request(f"j{n}", core.text.encode_prompt(PROMPTS[n % 6]),
                                 SamplingParams(temperature=1.0, max_tokens=30, seed=n))
            for o in turn.outputs:
                got.setdefault(o.request_id, []).extend(o.token_ids)
        assert_free(llm)
        return got, core.totals.accepted

    ahead = chained_engine(tiny_model_dir, heads["eagle3"], pipeline=True)
    assert drive(ahead) == drive(chained_engine(tiny_model_dir, heads["eagle3"], past_max_tokens=True))
    la = ahead.core.rt.worker.lookahead
    assert la.dropped >= 3 and la.taken >= 5, (la.taken, la.dropped)
    # Directly: the replacing verify reads the q rows the queued one read (the last read step's).
    core, worker = ahead.core, ahead.core.rt.worker
    a = core.add_request("q", core.text.encode_prompt(PROMPTS[1]), SamplingParams(temperature=1.0, max_tokens=60, seed=9))
    seen: list[tuple[bool, torch.Tensor]] = []
    launch = worker.verifier.launch

    def spy(entries, *args, **kw):
        if a.q_slot is not None:
            seen.append(("positions" in kw, worker.verifier.q_pool[a.q_slot].clone()))  # before its chain drafts
        return launch(entries, *args, **kw)

    worker.verifier.launch = spy
    while la.queued is None:
        core.step()
    core.add_request("late", core.text.encode_prompt(PROMPTS[2]), SamplingParams(temperature=1.0, max_tokens=5, seed=1))
    core.step()  # a prompt chunk joins: the queued verify is dropped, the real one launches
    worker.verifier.launch = launch
    assert la.queued is None and seen[-2][0] and not seen[-1][0]
    assert torch.equal(seen[-1][1], seen[-2][1])
    while core.has_work:
        core.step()
    assert_free(ahead)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_chained_steps_queued_ahead_change_nothing(tiny_model_dir, heads):
    """On CUDA a verify queued ahead is built on the device (graphs.restart: positions, slots and
    context lengths from starts the host does not know yet): greedy and sampled answers, drafted and
    accepted counts equal the engine that reads each step before queueing the next."""
    kinds = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.9, top_k=20, top_p=0.8, min_p=0.05)]
    runs = []
    for pipeline in (False, True):
        llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads["eagle3"]), device="cuda",
                  dtype="float32", kv_cache_tokens=8192, pipeline=pipeline)
        out = []
        for i, kw in enumerate(kinds):
            res = llm.generate(PROMPTS[i], SamplingParams(max_tokens=80, seed=i, **kw))
            res += llm.generate(PROMPTS, [SamplingParams(max_tokens=50, seed=j, **kw) for j in range(len(PROMPTS))])
            out += [(r.outputs[0].token_ids, r.spec_stats.drafted, r.spec_stats.accepted) for r in res]
        runs.append(out)
        la = llm.core.rt.worker.lookahead
        assert (la.taken > 20) == pipeline, (la.taken, la.dropped)
        assert_free(llm)
    assert runs[0] == runs[1]


def test_drafts_are_counted_alike_pipelined_or_not(tiny_model_dir, heads):
    """A pipelined EAGLE engine verifies whole chains up to max_tokens (drafts_past_max_tokens); one that
    reads each step first cuts them. Drafts that could never be emitted, or only where the bonus token
    would have been anyway, count for neither: the same drafted and accepted counts, request by request."""
    runs = []
    for pipeline in (False, True):
        llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads["eagle3"]), device="cpu",
                  dtype="float32", kv_cache_tokens=8192, pipeline=pipeline)
        assert llm.core.rt.scheduler_config.drafts_past_max_tokens == pipeline
        res = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=n, seed=0, temperature=0.0) for n in (80, 37)])
        runs.append([(r.outputs[0].token_ids, r.spec_stats.drafted, r.spec_stats.accepted) for r in res])
    assert runs[0] == runs[1]
