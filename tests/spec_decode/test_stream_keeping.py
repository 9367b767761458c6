"""A batch that decodes plain for a while stops writing its EAGLE head's streams (Decision.streams), and a
head that drafts again has the streams of the positions it skipped recomputed (worker/stream_catchup.py):
answers, drafts and the target's KV are those of an engine that kept the streams all along."""

from __future__ import annotations

import pytest
import torch

from streamsd import LLM, SamplingParams
from streamsd.policy.policy import Decision, FixedPolicy
from streamsd.worker.stream_catchup import Span, recompute_streams
from tests.engine.engine_helpers import PROMPTS, assert_free
from tests.spec_decode.eagle_helpers import train_tiny_head

SHAPE = "4,3,3,10"


@pytest.fixture(scope="module")
def head(tiny_model_dir, tmp_path_factory):
    return train_tiny_head(tiny_model_dir, tmp_path_factory.mktemp("keep_head"), "eagle3_norm_first")


class _Stretches(FixedPolicy):
    """`spec` speculative steps, then `plain` plain ones, again and again; the streams are kept for the
    first `keep` plain steps of each stretch (None: always)."""

    def __init__(self, spec: int, plain: int, keep: int | None):
        super().__init__()
        self.spec, self.plain, self.keep, self.steps = spec, plain, keep, 0

    def choose(self, decoding, prefill_tokens, backlog):
        decision = super().choose(decoding, prefill_tokens, backlog)
        phase = self.steps % (self.spec + self.plain)
        self.steps += 1
        self.speculating = phase < self.spec  # FixedPolicy.default_k reads it
        decision.streams = self.keep is None or self.speculating or phase - self.spec < self.keep
        return decision


def _engine(model_dir, head_dir, tree: bool, pipeline: bool, keep: int | None, **kw) -> LLM:
    spec = dict(speculative_tree=SHAPE) if tree else dict(num_speculative_tokens=4)
    llm = LLM(str(model_dir), speculative_method="eagle", draft_model=str(head_dir), pipeline=pipeline,
              dtype="float32", kv_cache_tokens=4096, **spec, **kw)
    llm.core.scheduler.policy = _Stretches(spec=3, plain=7, keep=keep)
    return llm


def _slots(r, lo: int, hi: int, block_size: int) -> torch.Tensor:
    return torch.tensor([r.blocks[p // block_size] * block_size + p % block_size for p in range(lo, hi)],
                        dtype=torch.int64)


@pytest.mark.parametrize("tree,pipeline", [(False, False), (False, True), (True, False), (True, True)])
def test_streams_skipped_by_plain_steps_are_recomputed_exactly_when_the_head_resumes(tiny_model_dir, head, tree,
                                                                                     pipeline):
    """Two engines in lockstep, speculating (chains or trees), then decoding plain, then speculating again;
    one keeps the head's streams all along, the other writes none after two plain steps (a request
    joining meanwhile: but those of the steps with its prompt). After every step the second one's store holds, wherever its
    head may read, the first one's streams (recomputed ones to a few float32 ulps), and the target's KV
    cache is the first one's byte for byte; each
    catch-up leaves the target's cache as it found it. Greedy answers are plain decoding's, seeded sampled
    ones the keeping engine's; nothing leaks."""
    plain = LLM(str(tiny_model_dir), dtype="float32")
    kept = _engine(tiny_model_dir, head, tree, pipeline, keep=None)
    skipping = _engine(tiny_model_dir, head, tree, pipeline, keep=2)
    worker = skipping.core.rt.worker
    store_a, store_b = kept.core.rt.worker.store, worker.store
    cache_a, cache_b = kept.core.rt.worker.cache, worker.cache
    scratch, bs = worker.scratch_block, worker.cache.block_size
    assert scratch == cache_b.num_blocks - 1

    recomputed: list[int] = []
    restore = worker.restore_streams

    def checked_restore(work):
        before = cache_b.data.clone()
        recomputed.append(sum(1 for _, it in work
                              if it.request.streams_missing_from is not None and it.upto > it.draft_computed))
        restore(work)
        # The catch-up writes K/V into the scratch block only.
        assert torch.equal(cache_b.data[:, :, :scratch], before[:, :, :scratch])

    worker.restore_streams = checked_restore
    for temperature in (0.0, 0.8):
        params = [SamplingParams(temperature=temperature, max_tokens=40, seed=i, ignore_eos=True) for i in range(4)]
        ids = [f"{temperature}-{i}" for i in range(4)]
        got_a: dict[str, list[int]] = {rid: [] for rid in ids}
        got_b: dict[str, list[int]] = {rid: [] for rid in ids}
        for llm in (kept, skipping):
            for i in range(3):
                llm.core.add_request(ids[i], llm.core.text.encode_prompt(PROMPTS[i]), params[i])
        steps = compared = missing_seen = 0
        while kept.core.has_work or skipping.core.has_work:
            steps += 1
            if steps == 6:  # a plain stretch that writes no streams: the prompt's are skipped too
                for llm in (kept, skipping):
                    llm.core.add_request(ids[3], llm.core.text.encode_prompt(PROMPTS[3]), params[3])
            for llm, got in ((kept, got_a), (skipping, got_b)):
                for out in llm.core.step():
                    got[out.request_id].extend(out.token_ids)
            assert torch.equal(cache_a.data[:, :, :scratch], cache_b.data[:, :, :scratch]), steps
            running_a = {r.request_id: r for r in kept.core.scheduler.running}
            for r in skipping.core.scheduler.running:
                ra = running_a[r.request_id]
                assert ra.blocks[: len(r.blocks)] == r.blocks[: len(ra.blocks)]
                missing_seen += r.streams_missing_from is not None
                hi = r.computed if r.streams_missing_from is None else min(r.streams_missing_from, r.computed)
                if hi > r.draft_computed:  # to a few ulps where recomputed (another query shape)
                    slots = _slots(r, r.draft_computed, hi, bs)
                    torch.testing.assert_close(store_b.data[slots], store_a.data[slots], rtol=1e-5, atol=1e-4)
                    compared += hi - r.draft_computed
        assert got_b == got_a
        if temperature == 0.0:
            want = [r.outputs[0].token_ids for r in plain.generate(PROMPTS[:4], params)]
            assert [got_b[rid] for rid in ids] == want
        assert missing_seen > 0 and compared > 0
    assert sum(recomputed) > 0  # heads resumed over skipped positions
    for llm in (kept, skipping):
        assert_free(llm)


def test_recomputed_streams_are_the_kept_ones_and_leave_the_target_cache_alone(tiny_model_dir, head):
    """Mid-answer, the streams an engine kept at a request's positions are cleared, then recomputed over
    the real block table with the K/V writes sent to the scratch block. A span of the shape that wrote
    them (the prompt, one chunk) brings the same bits back; the whole answer so far, in pieces of five
    positions, the same values to a few float32 ulps (another query shape than the 1 + k verify windows
    that wrote them takes another attention path, which sums in another order). No byte of the target's
    cache outside the scratch block changes."""
    llm = _engine(tiny_model_dir, head, tree=False, pipeline=False, keep=None)
    core, worker = llm.core, llm.core.rt.worker
    core.add_request("a", core.text.encode_prompt(PROMPTS[1]), SamplingParams(temperature=0.0, max_tokens=30,
                                                                          ignore_eos=True))
    for _ in range(12):
        core.step()
    (r,) = core.scheduler.running
    store, cache, bs = worker.store, worker.cache, worker.cache.block_size
    slots = _slots(r, 0, r.computed, bs)
    kept = store.data[slots].clone()
    before = cache.data.clone()
    scratch, n = worker.scratch_block, len(r.prompt_ids)
    assert r.computed > n + 8  # decode positions too
    store.data[slots] = 0
    recompute_streams(worker.target, cache, store, scratch, [Span(r.all_ids, r.blocks, 0, n)], worker.device)
    assert torch.equal(store.data[slots[:n]], kept[:n])
    assert not store.data[slots[n:]].any()  # only the span's positions
    recompute_streams(worker.target, cache, store, scratch, [Span(r.all_ids, r.blocks, 0, r.computed)], worker.device,
                      max_tokens=5)
    torch.testing.assert_close(store.data[slots], kept, rtol=1e-5, atol=1e-4)
    assert torch.equal(cache.data[:, :, :scratch], before[:, :, :scratch])
    while core.has_work:
        core.step()
    assert_free(llm)


def test_prompts_reach_the_prefix_cache_while_plain_steps_keep_no_streams(tiny_model_dir, head):
    """Steps with a prompt chunk write the head's streams even when plain steps keep none, and the head
    catches up on a long prompt's chunks there: their blocks reach the prefix cache (which takes a block
    once the head has it too) as in an engine that keeps every stream; the same prompt again finds them."""
    prompt = " ".join(PROMPTS)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    cached, answers = [], []
    for keep in (None, 0):
        llm = _engine(tiny_model_dir, head, tree=False, pipeline=False, keep=keep, max_num_batched_tokens=32)
        llm.core.scheduler.policy = _Stretches(spec=0, plain=1, keep=keep)  # plain steps only
        first = llm.generate([prompt], params)[0]
        again = llm.generate([prompt], params)[0]
        cached.append(again.num_cached_tokens)
        answers.append([first.outputs[0].token_ids, again.outputs[0].token_ids])
        assert_free(llm)
    assert cached[0] > 16 and cached[1] == cached[0]
    assert answers[0] == answers[1]


class _OneDrafts(FixedPolicy):
    """Three speculative steps, seven plain ones that keep no streams after the second, then five in
    which only request `lead` drafts (the others stay at k = 0), again and again."""

    def __init__(self, lead: str):
        super().__init__()
        self.lead, self.steps = lead, 0

    def choose(self, decoding, prefill_tokens, backlog):
        phase = self.steps % 15
        self.steps += 1
        self.speculating = phase < 3 or phase >= 10
        ks = {r.request_id: 0 for r in decoding if r.request_id != self.lead} if phase >= 10 else {}
        return Decision(ks, streams=self.speculating or phase < 5)


def test_a_head_catches_up_only_requests_with_their_streams_kept_when_another_drafts(tiny_model_dir, head):
    """A step in which one request drafts catches the others' heads up too, but only where the store
    holds their streams: a request that skipped them while the batch decoded plain keeps them missing
    (no target pass over its skipped positions in a step that priced none) until it drafts again.
    Greedy answers are plain decoding's; nothing leaks."""
    plain = LLM(str(tiny_model_dir), dtype="float32")
    llm = _engine(tiny_model_dir, head, tree=False, pipeline=False, keep=None)
    llm.core.scheduler.policy = _OneDrafts(lead="r0")
    worker = llm.core.rt.worker
    restore = worker.restore_streams
    recomputed: list[str] = []

    def recording_restore(work):
        recomputed.extend(it.request.request_id for _, it in work
                          if it.request.streams_missing_from is not None and it.upto > it.draft_computed)
        restore(work)

    worker.restore_streams = recording_restore
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(3):
        llm.core.add_request(f"r{i}", llm.core.text.encode_prompt(PROMPTS[i]), params)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    lone_steps = 0
    while llm.core.has_work:
        phase = llm.core.scheduler.policy.steps % 15
        recomputed.clear()
        for out in llm.core.step():
            got[out.request_id].extend(out.token_ids)
        if phase >= 10 and llm.core.scheduler.running:
            lone_steps += 1
            assert set(recomputed) <= {"r0"}, recomputed
            others = [r for r in llm.core.scheduler.running if r.request_id != "r0"]
            assert all(r.streams_missing_from is not None for r in others)
    assert lone_steps > 0
    want = [r.outputs[0].token_ids for r in plain.generate(PROMPTS[:3], [params] * 3)]
    assert [got[f"r{i}"] for i in range(3)] == want
    assert_free(llm)
