"""A tree engine whose steps the step chooser picks (policy/chooser.py): built from the CPU's own profile,
and switching between plain steps and trees in the middle of requests with answers identical to plain
decoding."""

from __future__ import annotations

import logging

import pytest

from streamsd import LLM, SamplingParams
from streamsd.policy.adaptive import CostTable
from streamsd.policy.adaptive.cost import StepTable
from streamsd.policy.chooser import TreeChooser
from streamsd.policy.policy import Decision
from tests.engine.engine_helpers import PROMPTS, assert_free
from tests.spec_decode.eagle_helpers import train_tiny_head

SHAPE = "4,3,3,10"


@pytest.fixture(scope="module")
def head(tiny_model_dir, tmp_path_factory):
    return train_tiny_head(tiny_model_dir, tmp_path_factory.mktemp("chooser_head"), "eagle3_norm_first")


class _Priced(TreeChooser):
    """The chooser over a given table that it keeps (the switches are the table's, not this machine's
    timings), recording per step whether it chose trees."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.picked: list[tuple[int, bool]] = []

    def choose(self, decoding, prefill_tokens, backlog) -> Decision:
        decision = super().choose(decoding, prefill_tokens, backlog)
        self.picked.append((len(decoding), self.speculating))
        return decision

    def _learn_cost(self, shape, seconds) -> None:
        pass


def _priced() -> _Priced:
    """Plain steps 1 ms; tree steps 0.5 ms up to 4 requests, 100 ms above: trees while at most four
    requests decode, plain steps above, whatever the head accepts. The head's streams are kept for two
    plain steps only."""
    cost = CostTable.from_samples({b: 1e-3 for b in (1, 2, 4, 8, 16)})
    cost.tree = StepTable.from_samples({1: 0.5e-3, 2: 0.5e-3, 4: 0.5e-3, 8: 0.1, 16: 0.2})
    return _Priced(cost, depth=4, keep_streams_steps=2)


@pytest.mark.parametrize("pipeline", [False, True])
def test_trees_chosen_by_cost_switch_with_plain_steps_mid_request_exactly(tiny_model_dir, head, pipeline):
    """Two long requests draft trees; four short ones join (six decode: plain steps, most of them keeping
    no streams for the head), end, and the two long ones draft trees again. Greedy and seeded sampled
    answers are plain decoding's; nothing leaks."""
    kw = dict(pipeline=pipeline, dtype="float32", kv_cache_tokens=8192)
    plain = LLM(str(tiny_model_dir), **kw)
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree=SHAPE, **kw)
    core = llm.core
    for temperature in (0.0, 0.8):
        chooser = core.scheduler.policy = _priced()
        params = [SamplingParams(temperature=temperature, max_tokens=48 if i < 2 else 10, seed=i, ignore_eos=True)
                  for i in range(6)]
        want = [r.outputs[0].token_ids for r in plain.generate(PROMPTS[:6], params)]
        ids = [f"{temperature}-{i}" for i in range(6)]
        got: dict[str, list[int]] = {rid: [] for rid in ids}
        steps = unkept = 0
        for i in range(2):
            core.add_request(ids[i], core.text.encode_prompt(PROMPTS[i]), params[i])
        while core.has_work:
            steps += 1
            if steps == 6:
                for i in range(2, 6):
                    core.add_request(ids[i], core.text.encode_prompt(PROMPTS[i]), params[i])
            for out in core.step():
                got[out.request_id].extend(out.token_ids)
            unkept += any(r.streams_missing_from is not None for r in core.scheduler.running)
        assert [got[rid] for rid in ids] == want
        assert unkept > 0  # plain steps wrote no streams, and the trees after them drafted from recomputed ones
        runs = [trees for i, (_, trees) in enumerate(chooser.picked) if i == 0 or trees != chooser.picked[i - 1][1]]
        assert runs[runs.index(True):][:3] == [True, False, True], chooser.picked  # trees, plain, trees again
        assert all(b <= 4 for b, trees in chooser.picked if trees)
        assert all(b > 4 for b, trees in chooser.picked if not trees and b)
        summary = chooser.summary()
        assert summary["tree_steps"] > 0 and summary["plain_steps"] > 0 and summary["switches"] >= 2
    assert_free(llm)


def test_a_tree_engine_with_the_adaptive_policy_profiles_its_tree_steps_on_the_cpu(tiny_model_dir, head, caplog):
    """`speculation_policy="adaptive"` with trees: the step chooser over the CPU's own profile, a tree step
    timed per batch bucket, its switch points logged at start-up; greedy answers are plain decoding's."""
    caplog.set_level(logging.INFO, logger="streamsd")
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) for _ in range(3)]
    want = [r.outputs[0].token_ids for r in LLM(str(tiny_model_dir)).generate(PROMPTS[:3], params)]
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree=SHAPE,
              speculation_policy="adaptive", max_num_seqs=8)
    chooser = llm.core.scheduler.policy
    assert isinstance(chooser, TreeChooser)
    assert chooser.cost.tree.keys == (1, 2, 4, 8) and all(t > 0 for t in chooser.cost.tree.values)
    assert set(chooser.switch_points()) == {1, 2, 4, 8}
    logged = [r.getMessage() for r in caplog.records if "trees pay where" in r.getMessage()]
    assert len(logged) == 1 and str(chooser.switch_points()) in logged[0], logged
    print(logged[0])
    assert [r.outputs[0].token_ids for r in llm.generate(PROMPTS[:3], params)] == want
    assert_free(llm)
